"""HybridParallelPlugin (tensor × row-sequence × data parallel) against the single-process model
(pipeline stages: tests/test_pipeline.py).

One spawn per world size runs every scenario: 2 ranks (tp=2; sp=2 with and without thinking
rows; train-mode forwards that draw random column identities; bad layouts; the pretraining loop
crashed and resumed), 4 ranks
(tp=2 × sp=2 with a checkpoint; tp=2 × dp=2 and sp=2 × dp=2, replicated and FSDP2, with
gradient accumulation under no_sync). The tests compare each rank's outputs, loss, gradients,
clipped-gradient norms and AdamW parameters after a few steps with a plain TabFM run in this
process on the same batches (fp32: to 1e-5). Under dp the reference loss is the mean of the
dp ranks' losses (DDP semantics); under sp it is the unsharded loss itself.
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tabfm.data.batch import TableBatch
from tabfm.parallel import Booster, ParallelPlan, SingleProcessPlugin, load_exported
from tabfm.parallel.plugins.hybrid import _check_layout
from tabfm.parallel.sequence_parallel import shard_rows
from tabfm.parallel.sharded_checkpoint import load_full_model_state
from tabfm.parallel.tensor_parallel import check_tp_layout, resolve_tp_plan
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tests.dist_utils import run_distributed

CFG = dict(d_model=16, n_layers=2, n_heads=4, mlp_ratio=2.0, n_bins=16, id_dim=8, max_categories=4,
           n_thinking_rows=2)
B, R, C = 4, 16, 5
STEPS, LR, CLIP = 3, 3e-3, 0.58  # CLIP binds on steps 1 and 2, not 0
# fp32 gaps measured against the single-process run (summation order only): outputs and
# gradients ~1e-6, losses ~1e-7, parameters after 3 AdamW steps ~1e-7
OUT_TOL, GRAD_TOL, LOSS_TOL, PARAM_TOL = 1e-5, 1e-5, 1e-6, 1e-5


# --- model and data ------------------------------------------------------------------------

def make_model(seed: int = 0, **overrides) -> TabFM:
    torch.manual_seed(seed)
    return TabFM(ModelConfig(**{**CFG, **overrides}))


def make_batch(step: int, b: int = B, r: int = R, c: int = C) -> TableBatch:
    """Mixed tables with scattered context rows. Table 0 keeps its context in its first 5 rows
    (so under sp some ranks hold none of its keys); the last table has 6 padding rows and a
    padding column. Queries: column 0 of non-context rows plus ~15% random cells."""
    g = torch.Generator().manual_seed(1000 + step)
    kind = torch.where(torch.rand(b, c, generator=g) < 0.4, 2, 1).to(torch.int8)
    kind[:, 0], kind[:, 1] = 1, 2
    card = torch.where(kind == 2, torch.randint(2, 5, (b, c), generator=g), 0)
    x = torch.randn(b, r, c, generator=g) * 3 + 1
    x = torch.where(kind[:, None, :] == 2, (torch.rand(b, r, c, generator=g) * card[:, None, :]).floor(), x)
    x[torch.rand(b, r, c, generator=g) < 0.1] = float("nan")
    row_valid = torch.ones(b, r, dtype=torch.bool)
    row_valid[-1, r - 6:] = False
    col_valid = torch.ones(b, c, dtype=torch.bool)
    col_valid[-1, -1], kind[-1, -1], card[-1, -1] = False, 0, 0
    context = torch.rand(b, r, generator=g) < 0.6
    context[0] = torch.arange(r) < 5
    context[:, 1] = True
    context &= row_valid
    query = torch.zeros(b, r, c, dtype=torch.bool)
    query[:, :, 0] = ~context
    query |= torch.rand(b, r, c, generator=g) < 0.15
    query &= row_valid[:, :, None] & col_valid[:, None, :]
    return TableBatch(x, kind, card.long(), row_valid, col_valid, context, query).validate()


def micro_batches(batch: TableBatch, dp: int, dp_rank: int, accum: int) -> list[TableBatch]:
    """This dp rank's tables, cut into `accum` micro-batches."""
    per = batch.shape[0] // dp
    mine = batch[dp_rank * per:(dp_rank + 1) * per]
    step = per // accum
    return [mine[i * step:(i + 1) * step] for i in range(accum)]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def cells(output, table_offset: int = 0, row_offset: int = 0) -> dict:
    """{(table, row, column): (cat_logits, num_logits, mean, std)} in global coordinates."""
    out = {}
    for n, (b, r, c) in enumerate(output.index.tolist()):
        out[(b + table_offset, r + row_offset, c)] = torch.cat(
            [output.cat_logits[n].detach(), output.num_logits[n].detach(),
             torch.stack([output.mean[n], output.std[n]]).float()])
    return out


# --- the distributed scenarios ---------------------------------------------------------------

def _scenario(rank, world, tp=1, sp=1, zero=0, mode="eval", steps=STEPS, accum=1, thinking=2, ckpt_root=None,
              act_ckpt=False, **overrides):
    from tabfm.parallel import HybridParallelPlugin, checkpoint_blocks

    plugin = HybridParallelPlugin(tp_size=tp, sp_size=sp, zero_stage=zero)
    booster = Booster(plugin)
    module = make_model(seed=rank, n_thinking_rows=thinking, **overrides)  # differs per rank: rank 0's must win
    if act_ckpt:
        checkpoint_blocks(module, module.parallel_plan())
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.train(mode == "train")
    dp, dp_rank = plugin.dp_world_size, plugin.dp_rank
    res = {"coords": (dp_rank, plugin.sp_rank, plugin.tp_rank), "losses": [], "norms": []}
    for step in range(steps):
        total = 0.0
        for i, micro in enumerate(micro_batches(make_batch(step), dp, dp_rank, accum)):
            if mode == "train":
                torch.manual_seed(100 + step)
            last = i == accum - 1
            with booster.no_sync(model, opt) if not last else _null():
                output = model(micro)
                loss, metrics = crit(output, micro)
                booster.backward(loss / accum, opt)
            total += float(loss.detach()) / accum
            if step == 0 and i == 0:
                res["cells"] = cells(output, dp_rank * (B // dp), plugin.sp_rank * (R // sp))
        if step == 0:
            res["grads"] = {n: full(p.grad) for n, p in module.named_parameters()}
        res["losses"].append(total)
        res["norms"].append(float(booster.clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
        if ckpt_root is not None and step == steps - 2:
            res["ckpt"] = str(booster.save_checkpoint(Path(ckpt_root) / "step_000002", model=model, optimizer=opt))
            res["at_save"] = {n: full(p) for n, p in module.named_parameters()}
    res["params"] = {n: full(p) for n, p in module.named_parameters()}
    if ckpt_root is not None:
        res["export"] = str(booster.export(model, Path(ckpt_root) / "export", {"model": module.config.to_dict()}))
    res["metrics_loss"] = metrics["loss"]
    return res


def bf16_step(plugin) -> dict:
    """Loss and gradients of one bf16-autocast step on batch 0 (eval mode)."""
    booster = Booster(plugin, precision="bf16")
    module = make_model(0)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.eval()
    batch = make_batch(0)
    loss, _ = crit(model(batch), batch)
    booster.backward(loss, opt)
    return {"loss": float(loss.detach()), "grads": {n: full(p.grad) for n, p in module.named_parameters()}}


def _bf16(rank, world, **layout):
    from tabfm.parallel import HybridParallelPlugin

    return bf16_step(HybridParallelPlugin(**layout))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _errors(rank, world):
    """Bad layouts, each raised before any collective (or, for rows, at the forward)."""
    from tabfm.parallel import HybridParallelPlugin

    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = str(e)

    catch("world", lambda: HybridParallelPlugin(tp_size=2, sp_size=2))
    catch("pp", lambda: HybridParallelPlugin(pp_size=2, sp_size=2))
    catch("zero1", lambda: HybridParallelPlugin(sp_size=2, zero_stage=1))
    catch("zero1_tp", lambda: HybridParallelPlugin(tp_size=2, zero_stage=1))
    catch("zero_nothing", lambda: HybridParallelPlugin(tp_size=2, zero_stage=2))
    catch("heads", lambda: Booster(HybridParallelPlugin(tp_size=2)).boost(make_model(d_model=12, n_heads=3)))
    catch("mlp", lambda: Booster(HybridParallelPlugin(tp_size=2)).boost(make_model(mlp_ratio=1.5625)))
    booster = Booster(HybridParallelPlugin(sp_size=2))
    model, *_ = booster.boost(make_model())
    catch("rows", lambda: model(make_batch(0, r=15)))
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


def worker_2(rank, world):
    return _run_all({
        "tp2": lambda: _scenario(rank, world, tp=2),
        "tp2_train": lambda: _scenario(rank, world, tp=2, mode="train", steps=1),
        "sp2": lambda: _scenario(rank, world, sp=2),
        "sp2_train": lambda: _scenario(rank, world, sp=2, mode="train", steps=1),
        "sp2_no_thinking": lambda: _scenario(rank, world, sp=2, thinking=0, steps=1),
        "sp2_act_ckpt": lambda: _scenario(rank, world, sp=2, mode="train", steps=1, act_ckpt=True),
        "tp2_bf16": lambda: _bf16(rank, world, tp_size=2),
        "sp2_bf16": lambda: _bf16(rank, world, sp_size=2),
        "errors": lambda: _errors(rank, world),
    })


def worker_4(rank, world, root):
    return _run_all({
        "tp2sp2": lambda: _scenario(rank, world, tp=2, sp=2, ckpt_root=root),
        "tp2dp2": lambda: _scenario(rank, world, tp=2),
        "tp2dp2_zero2": lambda: _scenario(rank, world, tp=2, zero=2, accum=2),
        "sp2dp2": lambda: _scenario(rank, world, sp=2, accum=2),
        "sp2dp2_zero3": lambda: _scenario(rank, world, sp=2, zero=3),
    })


def spawn_2_worker(rank, world, root):
    """Every 2-rank scenario of this file, in one spawn: worker_2's and the pretraining loop's."""
    return {"scenarios": worker_2(rank, world), "pretrain": pretrain_worker(rank, world, root)}


@pytest.fixture(scope="module")
def spawn_2(tmp_path_factory):
    """(the pretraining runs' directory, each rank's results)."""
    root = tmp_path_factory.mktemp("hybrid2")
    return root, run_distributed(spawn_2_worker, world_size=2, args=(str(root),), timeout_s=350)


@pytest.fixture(scope="module")
def results_2(spawn_2):
    return [r["scenarios"] for r in spawn_2[1]]


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return run_distributed(worker_4, world_size=4, args=(str(root),), timeout_s=240)


# --- the single-process reference ------------------------------------------------------------

_refs: dict = {}


def reference(dp: int = 1, mode: str = "eval", steps: int = STEPS, accum: int = 1, thinking: int = 2) -> dict:
    key = (dp, mode, steps, accum, thinking)
    if key in _refs:
        return _refs[key]
    module = make_model(0, n_thinking_rows=thinking)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    module.train(mode == "train")
    res = {"losses": [], "norms": [], "cells": {}, "params_by_step": []}
    for step in range(steps):
        batch = make_batch(step)
        per_rank = []
        for r in range(dp):
            rank_loss = 0.0
            for i, micro in enumerate(micro_batches(batch, dp, r, accum)):
                if mode == "train":
                    torch.manual_seed(100 + step)
                output = module(micro)
                loss, _ = masked_cell_loss(output, micro)
                (loss / (accum * dp)).backward()
                rank_loss += float(loss.detach()) / accum
                if step == 0:
                    res["cells"].update(cells(output, r * (B // dp) + i * (B // dp // accum)))
            per_rank.append(rank_loss)
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


def _get(results, name):
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank} scenario {name}:\n{r[name]['error']}"
    return [r[name] for r in results]


def _close(got: dict, want: dict, atol: float, what: str) -> float:
    assert got.keys() == want.keys(), what
    worst = 0.0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=atol, msg=lambda m: f"{what} {k}: {m}")
        finite = torch.isfinite(want[k])
        worst = max(worst, float((got[k][finite] - want[k][finite]).abs().max()) if finite.any() else 0.0)
    return worst


def check(ranks: list[dict], ref: dict, dp: int, mode: str = "eval") -> dict:
    """Every rank against the reference; returns the worst gaps (for the record)."""
    gaps = {}
    # outputs: the sp ranks of a dp group together hold each of the group's query cells once
    # (tensor-parallel peers hold the same cells)
    merged: dict = {}
    for r in ranks:
        for k, v in r["cells"].items():
            if k in merged:
                torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=1e-6)
            merged[k] = v
    want = {k: v for k, v in ref["cells"].items() if k[0] in {key[0] for key in merged}}
    gaps["outputs"] = _close(merged, want, OUT_TOL, "output")
    for r in ranks:
        dp_rank = r["coords"][0]
        gaps["grads"] = max(gaps.get("grads", 0), _close(r["grads"], ref["grads"], GRAD_TOL, "grad"))
        losses = [step[dp_rank] for step in ref["losses"]]
        assert r["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        if len(ref["losses"]) > 1:
            gaps["params"] = max(gaps.get("params", 0), _close(r["params"], ref["params"], PARAM_TOL, "param"))
    return gaps


# --- tests -----------------------------------------------------------------------------------

def test_layout_checks_without_processes():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp × sp × pp = 2 × 2 × 1 = 4"):
        _check_layout(6, 2, 2, 1, 0)
    assert _check_layout(8, 1, 2, 2, 0) == (1, 2, 2, 0)  # pp × sp (tests/test_pipeline.py)
    with pytest.raises(ValueError, match="zero_stage must be 0 .* got 1: .* use zero_stage=2"):
        _check_layout(4, 2, 1, 1, 1)
    assert _check_layout(8, 2, 2, 1, 2) == (2, 2, 1, 2)
    assert _check_layout(4, 1, 1, 2, 0) == (1, 1, 2, 0)
    model = make_model()
    plan = model.parallel_plan()
    assert check_tp_layout(model, plan, 2)["blocks.1.mlp.fc2"] == "rowwise"
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tp=3"):
        check_tp_layout(model, plan, 3)
    with pytest.raises(ValueError, match="matches no submodule"):
        resolve_tp_plan(model, {"blocks.*.attn.qkv": "colwise"})
    with pytest.raises(ValueError, match="has 15 rows"):
        shard_rows(make_batch(0, r=15), 0, 2)
    # the slices of all ranks are the rows of the batch, in order
    batch = make_batch(0)
    parts = [shard_rows(batch, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p.x for p in parts], 1).nan_to_num(-7), batch.x.nan_to_num(-7))
    assert ParallelPlan(num_heads=4).num_heads == 4


def test_fused_qkv_is_head_major():
    """A colwise shard of the fused qkv holds whole heads: the attention output computed from
    the rows of the weight for heads [h0, h1) equals those heads' slice of the full one."""
    from tabfm.model.attention import ColumnAttention

    torch.manual_seed(0)
    attn = ColumnAttention(16, 4)
    x = torch.randn(2, 3, 5, 16)
    qkv = attn.qkv(x).view(6, 5, 4, 3, 4)
    full_q = qkv[..., 0, :]
    half = torch.nn.functional.linear(x, attn.qkv.weight[24:]).view(6, 5, -1, 3, 4)  # 2nd of tp=2 shards
    assert half.shape[2] == 2 and torch.equal(half[..., 0, :], full_q[:, :, 2:])


@pytest.mark.slow
@pytest.mark.parametrize("name,dp", [("tp2", 1), ("sp2", 1)])
def test_two_ranks_match_single_process(results_2, name, dp):
    check(_get(results_2, name), reference(dp), dp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_train", "sp2_train"])
def test_train_mode_random_identities_agree_across_ranks(results_2, name):
    check(_get(results_2, name), reference(mode="train", steps=1), 1, "train")


@pytest.mark.slow
def test_sp_without_thinking_rows_counts_keys_once(results_2):
    """No thinking rows: a rank holding no key row of table 0 must not invent one."""
    check(_get(results_2, "sp2_no_thinking"), reference(steps=1, thinking=0), 1)


@pytest.mark.slow
def test_sp_with_activation_checkpointing(results_2):
    """Recomputing a block in backward (train mode only) repeats its K/V all-gather on every rank alike."""
    check(_get(results_2, "sp2_act_ckpt"), reference(mode="train", steps=1), 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_bf16", "sp2_bf16"])
def test_bf16_tracks_single_process_bf16(results_2, name):
    """bf16 autocast: collectives in bf16 (tp all-reduces, sp K/V gathers) stay within bf16
    rounding of the single-process bf16 run (measured: loss ~1e-4, gradients < 1% of their max)."""
    ref = bf16_step(SingleProcessPlugin(device="cpu"))
    for r in _get(results_2, name):
        assert abs(r["loss"] - ref["loss"]) < 2e-3
        for n, g in ref["grads"].items():
            assert float((r["grads"][n] - g).abs().max()) <= 3e-2 * float(g.abs().max()) + 1e-6, n


@pytest.mark.slow
def test_bad_layouts_give_clear_errors(results_2):
    for errors in _get(results_2, "errors"):
        assert "world size 2 is not divisible by tp × sp × pp = 2 × 2 × 1 = 4" in errors["world"]
        assert "world size 2 is not divisible by tp × sp × pp = 1 × 2 × 2 = 4" in errors["pp"]
        assert "zero_stage must be 0" in errors["zero1"]
        assert "zero_stage must be 0" in errors["zero1_tp"] and "use zero_stage=2" in errors["zero1_tp"]
        assert "dp × sp = 1 × 1 = 1 rank" in errors["zero_nothing"]
        assert "num_heads=3 is not divisible by tp=2" in errors["heads"]
        assert "blocks.0.mlp.fc1 (colwise) has 25 output features, not divisible by tp=2" in errors["mlp"]
        assert "sp=2" in errors["rows"] and "15 rows" in errors["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("name,dp,accum", [("tp2sp2", 1, 1), ("tp2dp2", 2, 1), ("tp2dp2_zero2", 2, 2),
                                           ("sp2dp2", 2, 2), ("sp2dp2_zero3", 2, 1)])
def test_four_ranks_match_single_process(results_4, name, dp, accum):
    ranks = _get(results_4, name)
    assert sorted(r["coords"] for r in ranks) == sorted(
        {"tp2sp2": [(0, s, t) for s in (0, 1) for t in (0, 1)], "tp2dp2": [(d, 0, t) for d in (0, 1) for t in (0, 1)],
         "tp2dp2_zero2": [(d, 0, t) for d in (0, 1) for t in (0, 1)],
         "sp2dp2": [(d, s, 0) for d in (0, 1) for s in (0, 1)],
         "sp2dp2_zero3": [(d, s, 0) for d in (0, 1) for s in (0, 1)]}[name])
    check(ranks, reference(dp, accum=accum), dp)


@pytest.mark.slow
def test_tp2_sp2_checkpoint_loads_in_one_process(results_4):
    ranks = _get(results_4, "tp2sp2")
    path = Path(ranks[0]["ckpt"])
    ref = reference()
    state = load_full_model_state(path)
    _close(state, ranks[0]["at_save"], 0.0, "checkpoint weight")
    _close(state, ref["params_by_step"][-2], PARAM_TOL, "checkpoint vs reference")
    # a single process resumes model and optimizer and takes the last step like the 4 ranks did
    booster = Booster(SingleProcessPlugin(device="cpu"))
    module = make_model(7)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(module, opt)
    booster.load_checkpoint(path, model=model, optimizer=opt, restore_rng=False)
    model.eval()
    batch = make_batch(STEPS - 1)
    loss, _ = masked_cell_loss(model(batch), batch)
    booster.backward(loss, opt)
    booster.clip_grad_norm_(opt, CLIP)
    opt.step()
    _close({n: p.detach() for n, p in module.named_parameters()}, ranks[0]["params"], PARAM_TOL, "resumed")
    # the export gathers the tp shards into full weights, one file
    weights, config = load_exported(ranks[0]["export"])
    _close(weights, ranks[0]["params"], 0.0, "exported weight")
    assert ModelConfig.from_dict(config["model"]) == ModelConfig(**CFG)


# --- the training command's loop under tp / sp ---------------------------------------------------

PRETRAIN = dict(steps=6, ckpt_every=3, eval_every=3, eval_batches=2, threads=1)


class _Crash(Exception):
    pass


def _pretrain_crash_and_resume(root: str, tp: int, sp: int) -> dict:
    """`pretrain` under HybridParallelPlugin, killed right after its step-3 checkpoint, then run
    again on the same directory (it resumes there and finishes)."""
    from tabfm.parallel import HybridParallelPlugin
    from tabfm.train import PretrainConfig
    from tabfm.train.pretrain import pretrain
    from tabfm.train.trainer import Trainer

    cfg = PretrainConfig.preset("smoke", plugin="hybrid", tp=tp, sp=sp, **PRETRAIN)
    save = Trainer.save

    def crash_after_first_checkpoint(self):
        path = save(self)
        if self.step == 3:
            raise _Crash
        return path

    Trainer.save = crash_after_first_checkpoint
    try:
        pretrain(cfg, root, plugin=HybridParallelPlugin(tp_size=tp, sp_size=sp), progress=False)
        raise AssertionError("the run did not crash")
    except _Crash:
        pass
    finally:
        Trainer.save = save
    result = pretrain(cfg, root, plugin=HybridParallelPlugin(tp_size=tp, sp_size=sp), progress=False)
    return {"step": result.step, "cells": result.cells, "evals": result.evals, "loss": result.last["loss"]}


def pretrain_worker(rank, world, root):
    return _run_all({
        "sp2": lambda: _pretrain_crash_and_resume(str(Path(root) / "sp2"), 1, 2),
        "tp2": lambda: _pretrain_crash_and_resume(str(Path(root) / "tp2"), 2, 1),
    })


@pytest.mark.slow
def test_hybrid_pretraining_resumes_and_tracks_single_process(spawn_2, tmp_path):
    """tp=2 and sp=2 runs of the pretraining loop (crashed after a checkpoint and resumed) end
    where one uninterrupted single-process run does: same weights (to summation order), same
    global cell count (the ranks of a table count it once), same held-out evaluation."""
    from safetensors.torch import load_file

    from tabfm.train import PretrainConfig
    from tabfm.train.pretrain import pretrain

    runs, ranks = spawn_2[0], [r["pretrain"] for r in spawn_2[1]]
    single = pretrain(PretrainConfig.preset("smoke", **PRETRAIN), tmp_path / "single", progress=False)
    want = load_file(str(tmp_path / "single" / "export" / "model.safetensors"))
    for name in ("sp2", "tp2"):
        for r in _get(ranks, name):
            assert r["step"] == 6 and r["cells"] == single.cells
            assert r["loss"] == pytest.approx(single.last["loss"], abs=1e-4)
            for key, value in single.evals.items():
                assert r["evals"][key] == pytest.approx(value, abs=1e-4), key
        got = load_file(str(runs / name / "export" / "model.safetensors"))
        _close(got, want, 1e-4, f"{name} weight")
        records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["checkpoint"] for r in records if r["kind"] == "resume"] == ["step_000003"]


def test_pretrain_command_hybrid_flags_name_the_fix(tmp_path, monkeypatch, capsys):
    from tabfm.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["pretrain", "--preset", "smoke", "--out", str(tmp_path / "run"), "--quiet"]
    assert main([*args, "--tp", "2"]) == 2
    assert "--tp splits the model or its tables over ranks; it needs --plugin hybrid" in capsys.readouterr().err
    assert main([*args, "--plugin", "hybrid", "--pp", "2"]) == 2
    assert "--microbatches must be >= 2" in capsys.readouterr().err
    assert main([*args, "--plugin", "hybrid", "--pp", "2", "--microbatches", "2", "--grad-accum", "2"]) == 2
    assert "raise --microbatches instead of --grad-accum" in capsys.readouterr().err
    assert main([*args, "--microbatches", "2", "--data", str(tmp_path)]) == 2
    assert "not with --data" in capsys.readouterr().err
    assert main([*args, "--plugin", "hybrid", "--sp", "2"]) == 2
    assert "torchrun --nproc_per_node N -m tabfm.cli pretrain --plugin hybrid" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
