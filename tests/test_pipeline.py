"""Pipeline stages (HybridParallelPlugin(pp_size=...)) against the single-process model.

The stages composed in one process equal `TabFM.forward` bit for bit. Then one spawn per world
size: 2 ranks (pp=2 in eval and train mode, a checkpoint, bad layouts) and 4 ranks (pp=2 × dp=2
replicated and with ZeRO-2 and a checkpoint; pp=2 × tp=2; pp=2 × sp=2). Each compares the last
stage's outputs, the loss, every stage's gradients, the clipped-gradient norms and the AdamW
parameters after a few steps with a plain TabFM run in this process that accumulates gradients
over the same micro-batches (fp32: to 1e-5).
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tabfm.parallel import Booster, SingleProcessPlugin, load_exported
from tabfm.parallel.pipeline import check_pp_layout, local_stages, merge_modules, split_stages
from tabfm.parallel.plugins.hybrid import _check_layout
from tabfm.parallel.sharded_checkpoint import load_full_model_state
from tabfm.model import masked_cell_loss
from tests.dist_utils import run_distributed
from tests.test_hybrid import (B, CLIP, GRAD_TOL, LOSS_TOL, LR, OUT_TOL, PARAM_TOL, STEPS, R, _close, _get, cells,
                               full, make_batch, make_model, micro_batches)

M = 2  # micro-batches per batch


# --- without processes -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_stages_in_sequence_equal_the_model(n):
    model = make_model(0, n_layers=4).eval()
    batch = make_batch(0)
    want = model(batch)
    plan = model.parallel_plan().pipeline
    stages = split_stages(model, plan, n)
    acts = ()
    for stage in stages:
        acts = stage.eval()(*acts, **plan.batch_tensors(batch))
    got = plan.output(acts)
    for field in ("index", "cat_logits", "num_logits", "mean", "std", "kind", "cardinality"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    if n == 4:  # interleaved on 2 ranks: rank 0 holds stages 0 and 2, under the model's names
        merged = merge_modules(local_stages(stages, 0, 2))
        assert list(merged.state_dict()) == [k for k in model.state_dict() if k in keys[0] | keys[2]]


def test_pipeline_layout_checks_without_processes():
    assert _check_layout(4, 1, 1, 2, 0) == (1, 1, 2, 0)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp × sp × pp = 1 × 1 × 4 = 4"):
        _check_layout(6, 1, 1, 4, 0)
    assert _check_layout(4, 2, 1, 2, 0) == (2, 1, 2, 0)  # pp × tp
    assert _check_layout(8, 1, 2, 2, 2) == (1, 2, 2, 2)  # pp × sp × ZeRO-2
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by tp × sp × pp = 2 × 2 × 2 = 8"):
        _check_layout(4, 2, 2, 2, 0)
    with pytest.raises(ValueError, match=r"3 layers into pp=2 stages .* 3 % 2 = 1"):
        check_pp_layout(3, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches=1 < pp=2"):
        check_pp_layout(2, 2, 1)
    with pytest.raises(ValueError, match=r"pp × stages_per_rank = 2 × 2 = 4 stages .* 6 % 4 = 2"):
        check_pp_layout(6, 2, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches=3 is not a multiple of 2"):
        check_pp_layout(4, 2, 3, 2)
    model = make_model(0)
    plan = model.parallel_plan().pipeline
    bad = type(plan)(n_layers=2, build_stage=lambda k, n: model.blocks[k], batch_tensors=plan.batch_tensors)
    with pytest.raises(ValueError, match="names the model's parameter"):
        split_stages(model, bad, 2)
    packed = make_model(0, cells_per_token=2)
    with pytest.raises(ValueError, match="pipeline stages need one token per cell"):
        split_stages(packed, packed.parallel_plan().pipeline, 2)


# --- the distributed scenarios -----------------------------------------------------------------

def _scenario(rank, world, mode="eval", steps=STEPS, ckpt_root=None, layers=2, per_rank=1, tp=1, sp=1, zero=0):
    from tabfm.parallel import HybridParallelPlugin

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=M, stages_per_rank=per_rank, tp_size=tp, sp_size=sp,
                                  zero_stage=zero)
    booster = Booster(plugin)
    module = make_model(seed=rank, n_layers=layers)  # differs per rank: rank 0's must win
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.train(mode == "train")
    stage = model.unwrap()
    dp, dp_rank = plugin.dp_world_size, plugin.dp_rank
    res = {"coords": (dp_rank, plugin.pp_rank, plugin.sp_rank, plugin.tp_rank), "losses": [], "norms": []}
    if zero:
        try:
            with booster.no_sync(model, opt):
                pass
            res["no_sync"] = None
        except RuntimeError as e:
            res["no_sync"] = str(e)
    for step in range(steps):
        mine = micro_batches(make_batch(step), dp, dp_rank, 1)[0]
        torch.manual_seed(100 + step)
        out = booster.execute_pipeline(iter([mine]), model, crit, opt, return_outputs=step == 0)
        res["losses"].append(float(out["loss"]))
        if step == 0:
            res["grads"] = {n: full(p.grad) for n, p in stage.named_parameters()}
            res["cells"] = {}
            per = B // dp // M
            for i, output in enumerate(out["outputs"] or []):
                res["cells"].update(cells(output, dp_rank * (B // dp) + i * per, plugin.sp_rank * (R // sp)))
            res["metrics"] = out["metrics"]
        res["norms"].append(float(booster.clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
        if ckpt_root is not None and step == steps - 2:
            res["ckpt"] = str(booster.save_checkpoint(Path(ckpt_root) / "step_000002", model=model, optimizer=opt))
            res["at_save"] = {n: full(p) for n, p in stage.named_parameters()}
    res["params"] = {n: full(p) for n, p in stage.named_parameters()}
    res["local_numel"] = {n: (p.to_local() if hasattr(p, "to_local") else p).numel()
                          for n, p in stage.named_parameters()}
    if ckpt_root is not None:
        res["export"] = str(booster.export(model, Path(ckpt_root) / "export", {"model": module.config.to_dict()}))
        res["resumed"] = _resume_in_pipeline(res["ckpt"], steps)
    return res


def _resume_in_pipeline(ckpt: str, steps: int) -> dict:
    """A fresh pp=2 run (replicated over whatever dp the world leaves, whatever layout saved the
    checkpoint) loads the checkpoint (each stage its part, optimizer included) and takes the
    last step again: it must land where the uninterrupted run did."""
    from tabfm.parallel import HybridParallelPlugin

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=M)
    booster = Booster(plugin)
    module = make_model(seed=11)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    booster.load_checkpoint(ckpt, model=model, optimizer=opt, restore_rng=False)
    model.eval()
    mine = micro_batches(make_batch(steps - 1), plugin.dp_world_size, plugin.dp_rank, 1)[0]
    booster.execute_pipeline(iter([mine]), model, crit, opt)
    booster.clip_grad_norm_(opt, CLIP)
    opt.step()
    return {n: full(p) for n, p in model.unwrap().named_parameters()}


SHAPES = [dict(), dict(r=12)]  # two batch signatures: the second makes the pipeline infer shapes again


def _accumulate_across_shapes(rank, world):
    """ZeRO-2 under pp: gradients of two execute_pipeline calls add up, although the second
    batch has a new shape (torch's shape inference clears FSDP gradients; the runner keeps them)."""
    from tabfm.parallel import HybridParallelPlugin

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=M, zero_stage=2)
    booster = Booster(plugin)
    module = make_model(0)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.eval()
    for shape in SHAPES:
        mine = micro_batches(make_batch(0, **shape), plugin.dp_world_size, plugin.dp_rank, 1)[0]
        booster.execute_pipeline(iter([mine]), model, crit, opt)
    return {"grads": {n: full(p.grad) for n, p in model.unwrap().named_parameters()}}


def _bf16(rank, world):
    """One bf16-autocast step (eval mode): the loss and every stage's gradients."""
    from tabfm.parallel import HybridParallelPlugin

    booster = Booster(HybridParallelPlugin(pp_size=2, num_microbatches=M), precision="bf16")
    module = make_model(0)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.eval()
    out = booster.execute_pipeline(iter([make_batch(0)]), model, crit, opt)
    return {"loss": float(out["loss"]), "grads": {n: full(p.grad) for n, p in model.unwrap().named_parameters()}}


def _errors(rank, world):
    from tabfm.parallel import HybridParallelPlugin

    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError, RuntimeError) as e:
            out[name] = str(e)

    catch("microbatches", lambda: HybridParallelPlugin(pp_size=2, num_microbatches=1))
    catch("world", lambda: HybridParallelPlugin(pp_size=4))
    catch("with_tp", lambda: HybridParallelPlugin(pp_size=2, tp_size=2))
    catch("fp16", lambda: Booster(HybridParallelPlugin(pp_size=2), precision="fp16").boost(make_model()))
    catch("layers", lambda: Booster(HybridParallelPlugin(pp_size=2)).boost(make_model(n_layers=3)))
    booster = Booster(HybridParallelPlugin(pp_size=2, num_microbatches=2))
    model, _, crit, _, _ = booster.boost(make_model(), criterion=masked_cell_loss)
    catch("call", lambda: model(make_batch(0)))
    catch("items", lambda: booster.execute_pipeline(iter([make_batch(0, b=3)]), model, crit))
    return out


def _run_all(scenarios: dict) -> dict:
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def worker_2(rank, world, root):
    return _run_all({
        "pp2": lambda: _scenario(rank, world, ckpt_root=root),
        "pp2_train": lambda: _scenario(rank, world, mode="train", steps=1),
        "pp2_bf16": lambda: _bf16(rank, world),
        "pp2_interleaved": lambda: _scenario(rank, world, layers=4, per_rank=2),
        "errors": lambda: _errors(rank, world),
    })


def worker_4(rank, world, root):
    return _run_all({
        "pp2dp2": lambda: _scenario(rank, world),
        "pp2dp2_zero2": lambda: _scenario(rank, world, zero=2, ckpt_root=root),
        "pp2tp2": lambda: _scenario(rank, world, tp=2),
        "pp2tp2_train": lambda: _scenario(rank, world, tp=2, mode="train", steps=1),
        "pp2sp2": lambda: _scenario(rank, world, sp=2),
        "pp2sp2_zero3": lambda: _scenario(rank, world, sp=2, zero=3),
        "pp2dp2_zero2_shapes": lambda: _accumulate_across_shapes(rank, world),
        "pp2dp2_zero2_interleaved": lambda: _scenario(rank, world, zero=2, layers=4, per_rank=2, steps=2),
    })


def worker_8(rank, world):
    return _run_all({
        "pp2dp2tp2_zero2": lambda: _scenario(rank, world, tp=2, zero=2),
        "pp2sp2tp2": lambda: _scenario(rank, world, tp=2, sp=2),
    })


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_distributed(worker_2, world_size=2, args=(str(tmp_path_factory.mktemp("pipeline")),), timeout_s=150)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_distributed(worker_4, world_size=4, args=(str(tmp_path_factory.mktemp("pipeline4")),),
                           timeout_s=300)


# --- the single-process reference --------------------------------------------------------------

_refs: dict = {}


def reference(dp: int = 1, mode: str = "eval", steps: int = STEPS, layers: int = 2) -> dict:
    """Plain TabFM, gradients accumulated over each dp rank's M micro-batches (loss / (M × dp));
    in train mode each dp rank's stream of random identities starts from seed 100 + step."""
    key = (dp, mode, steps, layers)
    if key in _refs:
        return _refs[key]
    module = make_model(0, n_layers=layers)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    module.train(mode == "train")
    res = {"losses": [], "norms": [], "cells": {}, "params_by_step": []}
    for step in range(steps):
        per_rank = []
        for r in range(dp):
            torch.manual_seed(100 + step)
            total = 0.0
            for i, micro in enumerate(micro_batches(make_batch(step), dp, r, M)):
                output = module(micro)
                loss, _ = masked_cell_loss(output, micro)
                (loss / (M * dp)).backward()
                total += float(loss.detach()) / M
                if step == 0:
                    res["cells"].update(cells(output, r * (B // dp) + i * (B // dp // M)))
            per_rank.append(total)
        if step == 0:
            res["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
        res["losses"].append(per_rank)
        res["norms"].append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        res["params_by_step"].append({n: p.detach().clone() for n, p in module.named_parameters()})
    res["params"] = res["params_by_step"][-1]
    _refs[key] = res
    return res


def _subset(full_dict: dict, keys) -> dict:
    return {k: full_dict[k] for k in keys}


def check(ranks: list[dict], ref: dict, dp: int) -> None:
    """Every stage's gradients and parameters against the reference's (restricted to the
    stage); the last stages' outputs cover every query cell of the batch once (sp ranks each
    their rows; tp peers the same cells, which must agree)."""
    merged: dict = {}
    for r in ranks:
        for k, v in r["cells"].items():
            if k in merged:
                torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=1e-6)
            merged[k] = v
        dp_rank = r["coords"][0]
        _close(r["grads"], _subset(ref["grads"], r["grads"]), GRAD_TOL, "grad")
        assert r["losses"] == pytest.approx([step[dp_rank] for step in ref["losses"]], abs=LOSS_TOL)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        _close(r["params"], _subset(ref["params"], r["params"]), PARAM_TOL, "param")
    _close(merged, ref["cells"], OUT_TOL, "output")
    for d in range(dp):  # the stages of each dp replica hold every parameter once (tp / sp peers alike)
        names = [n for r in ranks if r["coords"][0] == d and r["coords"][2:] == (0, 0) for n in r["params"]]
        assert sorted(names) == sorted(ref["params"])


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("pp2", "eval"), ("pp2_train", "train")])
def test_pp2_matches_single_process(results_2, name, mode):
    ranks = _get(results_2, name)
    assert sorted(r["coords"] for r in ranks) == [(0, 0, 0, 0), (0, 1, 0, 0)]
    check(ranks, reference(mode=mode, steps=STEPS if mode == "eval" else 1), dp=1)
    assert ranks[0]["metrics"]["loss"] == pytest.approx(ranks[0]["losses"][0])  # every stage gets the metrics


@pytest.mark.slow
def test_interleaved_stages_match_single_process(results_2):
    """pp=2 ranks × 2 stages each (ScheduleInterleaved1F1B): rank 0 holds the encoder with
    block 0 and block 2, rank 1 blocks 1 and 3 with the heads."""
    ranks = _get(results_2, "pp2_interleaved")
    assert sorted(ranks[0]["params"]) == sorted(n for n in reference(layers=4)["params"]
                                                if n.startswith(("encoder.", "blocks.0.", "blocks.2.")))
    check(ranks, reference(layers=4), dp=1)


LAYOUTS_4 = {  # scenario -> (dp, pp, sp, tp) sizes
    "pp2dp2": (2, 2, 1, 1), "pp2dp2_zero2": (2, 2, 1, 1), "pp2tp2": (1, 2, 1, 2), "pp2tp2_train": (1, 2, 1, 2),
    "pp2sp2": (1, 2, 2, 1), "pp2sp2_zero3": (1, 2, 2, 1),
}


def _coords(dp: int, pp: int, sp: int, tp: int) -> list[tuple[int, int, int, int]]:
    return sorted((d, p, s, t) for d in range(dp) for p in range(pp) for s in range(sp) for t in range(tp))


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("pp2dp2", "eval"), ("pp2dp2_zero2", "eval"), ("pp2tp2", "eval"),
                                       ("pp2tp2_train", "train"), ("pp2sp2", "eval"), ("pp2sp2_zero3", "eval")])
def test_pp2_with_four_ranks_matches_single_process(results_4, name, mode):
    """pp=2 composed with dp=2 (replicated; ZeRO-2: FSDP2 over dp on each stage, gradients
    reduce-scattered once after the micro-batches), tp=2 (each stage's layers split, in train
    mode with random identities too) and sp=2 (each stage on half of every table's rows; also
    under ZeRO-3 over the sp ranks)."""
    ranks = _get(results_4, name)
    dp = LAYOUTS_4[name][0]
    assert sorted(r["coords"] for r in ranks) == _coords(*LAYOUTS_4[name])
    check(ranks, reference(dp=dp, mode=mode, steps=STEPS if mode == "eval" else 1), dp=dp)
    for r in ranks:  # the parameters are really split: this rank holds part of each sharded one
        split = {n for n, k in r["local_numel"].items() if k < r["params"][n].numel()}
        if "zero" in name:  # FSDP2: every parameter with more than one row
            assert split == {n for n, p in r["params"].items() if p.shape[0] > 1}, name
        elif "tp" in name:  # the weights of the layers the tp plan names (colwise: their biases too)
            planned = {n for n in r["params"] if n.startswith("blocks.")
                       and n.endswith(("attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight"))}
            assert len(planned) == 6 and planned <= split, name
        else:
            assert not split, name


@pytest.mark.slow
def test_interleaved_stages_with_zero2_match_single_process(results_4):
    """Two FSDP-sharded stages per rank (ScheduleInterleaved1F1B): each is its own FSDP root,
    reduced after its last micro-batch."""
    ranks = _get(results_4, "pp2dp2_zero2_interleaved")
    assert sorted(r["coords"] for r in ranks) == _coords(2, 2, 1, 1)
    check(ranks, reference(dp=2, steps=2, layers=4), dp=2)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TABFM_TEST_8_RANKS") != "1",
                    reason="8 processes (about 90 s on 2 cores): set TABFM_TEST_8_RANKS=1 to run")
def test_three_dimensions_on_eight_ranks_match_single_process():
    """pp=2 × dp=2 × tp=2 with ZeRO-2 (FSDP2 over dp of tensor-parallel DTensors, per stage)
    and pp=2 × sp=2 × tp=2."""
    results = run_distributed(worker_8, world_size=8, timeout_s=900, pg_timeout_s=300)
    for name, layout in (("pp2dp2tp2_zero2", (2, 2, 1, 2)), ("pp2sp2tp2", (1, 2, 2, 2))):
        ranks = _get(results, name)
        assert sorted(r["coords"] for r in ranks) == _coords(*layout)
        check(ranks, reference(dp=layout[0]), dp=layout[0])


@pytest.mark.slow
def test_pp2_dp2_zero2_refuses_no_sync(results_4):
    for r in _get(results_4, "pp2dp2_zero2"):
        assert "no_sync() under pp_size > 1 with zero_stage 2/3 is not supported" in r["no_sync"]


@pytest.mark.slow
def test_pp2_dp2_zero2_accumulates_across_batch_shapes(results_4):
    module = make_model(0).eval()
    for shape in SHAPES:
        for r in range(2):
            for micro in micro_batches(make_batch(0, **shape), 2, r, M):
                loss, _ = masked_cell_loss(module(micro), micro)
                (loss / (M * 2)).backward()
    want = {n: p.grad for n, p in module.named_parameters()}
    for r in _get(results_4, "pp2dp2_zero2_shapes"):
        _close(r["grads"], _subset(want, r["grads"]), GRAD_TOL, "accumulated grad")


def _check_checkpoint(ranks: list[dict], dp: int) -> None:
    """The checkpoint saved before the last step holds the weights of that moment; one process
    resumes model and optimizer (param groups of both stages) and takes the last step over the
    same micro-batches; so does a pp=2 run (replicated over dp); the export holds the final weights."""
    path = Path(ranks[0]["ckpt"])
    at_save = {k: v for r in ranks for k, v in r["at_save"].items()}
    state = load_full_model_state(path)
    _close(state, at_save, 0.0, "checkpoint weight")
    _close(state, reference(dp=dp)["params_by_step"][-2], PARAM_TOL, "checkpoint vs reference")
    final = {k: v for r in ranks for k, v in r["params"].items()}
    booster = Booster(SingleProcessPlugin(device="cpu"))
    module = make_model(7)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(module, opt)
    booster.load_checkpoint(path, model=model, optimizer=opt, restore_rng=False)
    model.eval()
    for r in range(dp):
        for micro in micro_batches(make_batch(STEPS - 1), dp, r, M):
            loss, _ = masked_cell_loss(model(micro), micro)
            booster.backward(loss / (M * dp), opt)
    booster.clip_grad_norm_(opt, CLIP)
    opt.step()
    _close({n: p.detach() for n, p in module.named_parameters()}, final, PARAM_TOL, "resumed in one process")
    resumed = {k: v for r in ranks for k, v in r["resumed"].items()}
    _close(resumed, final, PARAM_TOL, "resumed in the pipeline")
    weights, _ = load_exported(ranks[0]["export"])
    _close(weights, final, 0.0, "exported weight")


@pytest.mark.slow
def test_pp2_checkpoint_loads_in_one_process_and_in_the_pipeline(results_2):
    _check_checkpoint(_get(results_2, "pp2"), dp=1)


@pytest.mark.slow
def test_pp2_dp2_zero2_checkpoint_loads_in_one_process_and_replicated(results_4):
    """Each stage's FSDP shards (dp=2) go into one DCP checkpoint that one process reads whole
    and a replicated pp=2 × dp=2 run resumes; the export gathers the shards of both stages."""
    _check_checkpoint(_get(results_4, "pp2dp2_zero2"), dp=2)


@pytest.mark.slow
def test_pp2_bf16_tracks_single_process_bf16(results_2):
    """bf16 autocast inside the stages: within bf16 rounding of one process accumulating the
    same micro-batches under bf16 autocast (the residual stream between stages stays fp32)."""
    booster = Booster(SingleProcessPlugin(device="cpu"), precision="bf16")
    module = make_model(0)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    model, opt, _, _, _ = booster.boost(module, opt)
    model.eval()
    total = 0.0
    for micro in micro_batches(make_batch(0), 1, 0, M):
        loss, _ = masked_cell_loss(model(micro), micro)
        booster.backward(loss / M, opt)
        total += float(loss.detach()) / M
    for r in _get(results_2, "pp2_bf16"):
        assert abs(r["loss"] - total) < 2e-3
        for n, g in r["grads"].items():
            want = module.get_parameter(n).grad
            assert float((g - want).abs().max()) <= 3e-2 * float(want.abs().max()) + 1e-6, n


@pytest.mark.slow
def test_bad_pipeline_layouts_give_clear_errors(results_2):
    for errors in _get(results_2, "errors"):
        assert "num_microbatches=1 < pp_size=2" in errors["microbatches"]
        assert "world size 2 is not divisible by tp × sp × pp = 1 × 1 × 4 = 4" in errors["world"]
        assert "world size 2 is not divisible by tp × sp × pp = 2 × 1 × 2 = 4" in errors["with_tp"]
        assert "fp16 loss scaling inside the pipeline schedule is not implemented" in errors["fp16"]
        assert "3 layers into pp=2 stages" in errors["layers"] and "3 % 2 = 1" in errors["layers"]
        assert "execute_pipeline" in errors["call"]
        assert "3 items (3 % 2 = 1)" in errors["items"]
