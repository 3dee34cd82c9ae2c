"""Expert parallelism (2 and 4 gloo processes) against one process holding every expert.

- The MoE layer alone: each rank routes its own tokens; under ep = 2 its outputs, dropped
  counts and router gradient equal a full local copy's on the same tokens, and each expert's
  gradient equals the sum over ranks of the full copies' gradients (the tokens of every peer
  reach it).
- Training through HybridParallelPlugin(ep_size=...): losses, dropped counts, gradients and every
  parameter after AdamW steps equal one process accumulating the ranks' batches, and the same
  layout without ep (ep_size=1: every rank holds all experts,
  which test_hybrid checks against one process), with gradient accumulation, under ZeRO-2, and
  with dp 2, tp 2 or sp 2 beside ep 2 (4 processes).
- Checkpoints reshard: saved at ep 2, loaded in one process (whole experts), at ep 1 × dp 2
  and at ep 4 (one expert per rank).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.model.moe import MoEMLP
from tabfm.parallel import Booster, ParallelPlan, SingleProcessPlugin
from tabfm.parallel.expert_parallel import check_expert_layout, parallelize_experts
from tests.dist_utils import run_distributed
from tests.test_hybrid import _get, _null, _run_all, full, make_batch, micro_batches

MOE = dict(d_model=16, n_layers=2, n_heads=4, mlp_ratio=2.0, n_bins=16, id_dim=8, max_categories=4,
           n_thinking_rows=2, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0)
B, STEPS, LR, CLIP = 4, 3, 3e-3, 0.58
# fp32 gaps between layouts are summation order only (~1e-7); the tolerances leave room for that
OUT_TOL, LOSS_TOL, PARAM_TOL = 1e-5, 1e-6, 1e-5


def make_model(seed: int = 0, **overrides) -> TabFM:
    torch.manual_seed(seed)
    return TabFM(ModelConfig(**{**MOE, **overrides}))


class _Holder(torch.nn.Module):
    """A MoE layer under a name, with a plan naming its experts (what a model declares)."""

    def __init__(self, moe: MoEMLP) -> None:
        super().__init__()
        self.moe = moe

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(experts=["moe.experts"])


# --- the distributed scenarios ---------------------------------------------------------------

def _module(rank, world):
    """One MoE layer, ep = world, against a full copy on this rank's tokens (train mode, drops)."""
    torch.manual_seed(0)
    full_moe = MoEMLP(8, 16, n_experts=4, top_k=2, capacity_factor=1.0)
    holder = _Holder(MoEMLP(8, 16, n_experts=4, top_k=2, capacity_factor=1.0))
    holder.moe.load_state_dict(full_moe.state_dict())
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_experts(holder, mesh["ep"], holder.parallel_plan())
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(13 if rank == 0 else 6, 8, generator=g)  # different slot counts per rank
    weight = torch.randn(x.shape[0], 8, generator=g)
    out = {}
    for name, moe in (("full", full_moe), ("ep", holder.moe)):
        y = moe(x)
        (y * weight).sum().backward()
        out[name] = {"y": y.detach(), "dropped": moe.stats.dropped, "router": moe.router.weight.grad.clone(),
                     "w1": moe.experts.w1.grad.to_local().clone() if name == "ep" else moe.experts.w1.grad.clone(),
                     "w2": moe.experts.w2.grad.to_local().clone() if name == "ep" else moe.experts.w2.grad.clone()}
    for key in ("w1", "w2"):  # the expert gradients of all ranks' tokens
        dist.all_reduce(out["full"][key])
    holder.eval()
    with torch.no_grad():
        out["eval"] = (holder.moe(x), full_moe.eval()(x))
    return out


def _train(rank, world, ep=1, zero=0, accum=1, ckpt_root=None, load=None, steps=STEPS, tp=1, sp=1, one=False,
           tables=None):
    from tabfm.parallel import HybridParallelPlugin

    plugin = SingleProcessPlugin(device="cpu") if one else HybridParallelPlugin(ep_size=ep, zero_stage=zero,
                                                                                tp_size=tp, sp_size=sp)
    booster = Booster(plugin)
    module = make_model(seed=rank)  # differs per rank: rank 0's must win
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    res = {"dp_rank": plugin.dp_rank, "sp_rank": getattr(plugin, "sp_rank", 0), "layout": {"ep": 1, **plugin.layout()}}
    if load is not None:  # a checkpoint of another layout, loaded here: its weights come back
        booster.load_checkpoint(load, model=model, optimizer=opt, restore_rng=False)
        res["loaded"] = {n: full(p) for n, p in module.named_parameters()}
        return res
    model.train()
    dp, dp_rank = plugin.dp_world_size, plugin.dp_rank
    res.update(losses=[], dropped=[])
    for step in range(steps):
        total, dropped = 0.0, 0
        batch = make_batch(step, b=tables or B * dp // 2)
        for i, micro in enumerate(micro_batches(batch, dp, dp_rank, accum)):
            torch.manual_seed(100 + step + 10 * (dp_rank * accum + i))  # by global micro-batch
            with booster.no_sync(model, opt) if i < accum - 1 else _null():
                output = model(micro)
                loss, metrics = crit(output, micro)
                booster.backward(loss / accum, opt)
            total += float(loss.detach()) / accum
            dropped += output.moe.dropped
        res["losses"].append(total)
        res["dropped"].append(dropped)
        if step == 0:  # AdamW hides a gradient's scale from the parameters: compare the gradients too
            res["grads"] = {n: full(p.grad) for n, p in module.named_parameters() if p.grad is not None}
        booster.clip_grad_norm_(opt, CLIP)
        opt.step()
        opt.zero_grad()
        if ckpt_root is not None and step == steps - 1:
            res["ckpt"] = str(booster.save_checkpoint(Path(ckpt_root) / "step_000003", model=model, optimizer=opt))
    res["params"] = {n: full(p) for n, p in module.named_parameters()}
    w1 = module.blocks[0].mlp.experts.w1
    res["local_experts"] = tuple(w1.to_local().shape) if hasattr(w1, "to_local") else None
    if ckpt_root is not None:
        res["export"] = str(booster.export(model, Path(ckpt_root) / "export", {"model": module.config.to_dict()}))
    return res


def _errors(rank, world):
    from tabfm.parallel import HybridParallelPlugin

    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = str(e)

    catch("world", lambda: HybridParallelPlugin(ep_size=3))
    catch("tp", lambda: HybridParallelPlugin(tp_size=2, ep_size=2))
    catch("pp", lambda: HybridParallelPlugin(pp_size=2, ep_size=2))
    catch("dense", lambda: Booster(HybridParallelPlugin(ep_size=2)).boost(make_model(moe_experts=0, moe_top_k=1)))
    catch("experts", lambda: Booster(HybridParallelPlugin(ep_size=2)).boost(make_model(moe_experts=3)))
    return out


def worker_2(rank, world, root):
    return _run_all({
        "module": lambda: _module(rank, world),
        "ep2": lambda: _train(rank, world, ep=2, ckpt_root=root),
        "dp2": lambda: _train(rank, world),
        "ep2_accum": lambda: _train(rank, world, ep=2, accum=2),
        "dp2_accum": lambda: _train(rank, world, accum=2),
        "ep2_zero2": lambda: _train(rank, world, ep=2, zero=2),
        "ep2_to_dp2": lambda: _train(rank, world, load=str(Path(root) / "step_000003")),
        "tp2": lambda: _train(rank, world, tp=2),  # each expert's width over the 2 ranks
        "one": lambda: _train(rank, world, one=True),  # one process, every expert whole, the same tables
        "one_accum2": lambda: _train(rank, world, one=True, accum=2, tables=B),  # the 2 ranks' tables in turn
        "errors": lambda: _errors(rank, world),
    })


def worker_4(rank, world, ckpt):
    return _run_all({
        "ep2dp2": lambda: _train(rank, world, ep=2),
        "dp4": lambda: _train(rank, world),
        "ep2_to_ep4": lambda: _train(rank, world, ep=4, load=ckpt),
        "ep2tp2": lambda: _train(rank, world, ep=2, tp=2),
        "ep2sp2": lambda: _train(rank, world, ep=2, sp=2),
        "sp2dp2": lambda: _train(rank, world, sp=2),
    })


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep2")
    return run_distributed(worker_2, world_size=2, args=(str(root),), timeout_s=240)


def _close(a: dict, b: dict, tol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        gap = (a[k].float() - b[k].float()).abs().max().item()
        assert gap <= tol, f"{what} {k}: max gap {gap:.3g} > {tol:g}"


# --- tests -----------------------------------------------------------------------------------

def test_layout_checks_without_processes():
    model = make_model()
    plan = model.parallel_plan()
    assert check_expert_layout(model, plan, 2) == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    assert check_expert_layout(model, plan, 2, tp=4) == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    with pytest.raises(ValueError, match="has 4 experts, not divisible by ep=3"):
        check_expert_layout(model, plan, 3)
    with pytest.raises(ValueError, match=r"w1 has 32 on dim 1, not divisible by tp=3"):
        check_expert_layout(model, plan, 1, tp=3)
    with pytest.raises(ValueError, match="expert_tp gives blocks.0.mlp.experts.w1 no dim"):
        check_expert_layout(model, ParallelPlan(experts=plan.experts), 1, tp=2)
    dense = make_model(moe_experts=0, moe_top_k=1)
    with pytest.raises(ValueError, match="has none"):
        check_expert_layout(dense, dense.parallel_plan(), 2)
    with pytest.raises(ValueError, match="matches no submodule"):
        check_expert_layout(model, ParallelPlan(experts=["blocks.*.ffn"]), 2)


@pytest.mark.slow
def test_moe_layer_under_ep_equals_one_process_with_all_experts(results_2):
    for rank, r in enumerate(_get(results_2, "module")):
        full_, ep = r["full"], r["ep"]
        assert (ep["y"] - full_["y"]).abs().max() <= OUT_TOL
        assert ep["dropped"] == full_["dropped"]
        assert (ep["router"] - full_["router"]).abs().max() <= OUT_TOL
        for key in ("w1", "w2"):  # this rank's 2 experts: the gradient of both ranks' tokens
            assert ep[key].shape[0] == 2
            assert (ep[key] - full_[key][2 * rank:2 * rank + 2]).abs().max() <= OUT_TOL
        mine, ref = r["eval"]
        assert (mine - ref).abs().max() <= OUT_TOL
    assert sum(r["full"]["dropped"] for r in _get(results_2, "module")) > 0  # capacity bound somewhere


@pytest.mark.slow
@pytest.mark.parametrize("ep_name, ref_name", [("ep2", "dp2"), ("ep2_accum", "dp2_accum"), ("ep2_zero2", "dp2")])
def test_ep_training_equals_the_same_ranks_without_ep(results_2, ep_name, ref_name):
    ep, ref = _get(results_2, ep_name), _get(results_2, ref_name)
    assert ep[0]["layout"]["ep"] == 2 and ref[0]["layout"]["ep"] == 1
    assert [r["dp_rank"] for r in ep] == [0, 1]
    for a, b in zip(ep, ref):
        assert a["dropped"] == b["dropped"]
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= LOSS_TOL
        _close(a["grads"], b["grads"], OUT_TOL, f"{ep_name} vs {ref_name} gradients")
        _close(a["params"], b["params"], PARAM_TOL, f"{ep_name} vs {ref_name}")
    assert ep[0]["local_experts"] == (2, 32, 16)  # half of the 4 experts on each rank
    assert sum(ep[0]["dropped"]) > 0


@pytest.mark.slow
def test_ep2_training_equals_one_process_holding_every_expert(results_2):
    """ep 2 against one process accumulating the two ranks' batches (every expert whole)."""
    ep, one = _get(results_2, "ep2"), _get(results_2, "one_accum2")[0]
    assert [sum(d) for d in zip(*(r["dropped"] for r in ep))] == one["dropped"]
    for step, loss in enumerate(one["losses"]):
        assert abs((ep[0]["losses"][step] + ep[1]["losses"][step]) / 2 - loss) <= LOSS_TOL
    for r in ep:
        _close(r["grads"], one["grads"], OUT_TOL, "ep2 vs one process gradients")
        _close(r["params"], one["params"], PARAM_TOL, "ep2 vs one process")


@pytest.mark.slow
def test_tensor_parallel_experts_equal_one_process(results_2):
    """tp 2 on a MoE model: attention heads and each expert's hidden width split over 2 ranks."""
    tp, one = _get(results_2, "tp2"), _get(results_2, "one")
    assert tp[0]["local_experts"] == (4, 16, 16) and one[0]["local_experts"] is None
    for a in tp:
        assert a["dropped"] == one[0]["dropped"] and sum(a["dropped"]) > 0
        assert max(abs(x - y) for x, y in zip(a["losses"], one[0]["losses"])) <= LOSS_TOL
        _close(a["grads"], one[0]["grads"], OUT_TOL, "tp2 vs one process gradients")
        _close(a["params"], one[0]["params"], PARAM_TOL, "tp2 vs one process")


@pytest.mark.slow
def test_ep2_checkpoint_reshards_and_exports(results_2):
    ep = _get(results_2, "ep2")
    path = Path(ep[0]["ckpt"])
    for r in _get(results_2, "ep2_to_dp2"):  # ep 2 -> ep 1 x dp 2
        _close(r["loaded"], ep[0]["params"], 0.0, "loaded at dp 2")
    booster = Booster(SingleProcessPlugin(device="cpu"))  # ep 2 -> one process
    module = make_model(7)
    model, *_ = booster.boost(module)
    booster.load_checkpoint(path, model=model, restore_rng=False)
    _close({n: p.detach() for n, p in module.named_parameters()}, ep[0]["params"], 0.0, "loaded in one process")
    from tabfm.parallel.export import load_exported

    weights, _ = load_exported(ep[0]["export"])
    _close(weights, ep[0]["params"], 0.0, "exported")
    assert weights["blocks.0.mlp.experts.w1"].shape == (4, 32, 16)


@pytest.mark.slow
def test_layout_errors(results_2):
    err = _get(results_2, "errors")[0]
    assert "ep_size=3 must divide the data-parallel ranks dp" in err["world"]
    assert "dp = world / (tp × sp × pp) = 1" in err["tp"]
    assert err["pp"] is not None
    assert "has none" in err["dense"]
    assert "has 3 experts, not divisible by ep=2" in err["experts"]


@pytest.mark.slow
def test_ep2_with_dp_tp_sp_and_resharding_to_ep4(results_2, tmp_path):
    ckpt = _get(results_2, "ep2")[0]["ckpt"]
    results = run_distributed(worker_4, world_size=4, args=(ckpt,), timeout_s=300)
    ep, ref = _get(results, "ep2dp2"), _get(results, "dp4")
    assert ep[0]["layout"]["ep"] == 2 and ep[0]["layout"]["dp"] == 4
    assert sorted(r["dp_rank"] for r in ep) == [0, 1, 2, 3]
    for a, b in zip(sorted(ep, key=lambda r: r["dp_rank"]), sorted(ref, key=lambda r: r["dp_rank"])):
        assert a["dropped"] == b["dropped"]
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= LOSS_TOL
        _close(a["grads"], b["grads"], OUT_TOL, "ep2 x dp2 vs dp4 gradients")
        _close(a["params"], b["params"], PARAM_TOL, "ep2 x dp2 vs dp4")
    saved = _get(results_2, "ep2")[0]["params"]
    for r in _get(results, "ep2_to_ep4"):
        _close(r["loaded"], saved, 0.0, "loaded at ep 4")
    # ep 2 beside tp 2 (each expert's width split too): the 2 data-parallel ranks of the
    # 2-process dp run, whose experts are whole on every rank. Beside sp 2: the same 4 ranks
    # without ep (under sp a rank routes its own rows, with its own capacity, as without ep)
    dp2 = {r["dp_rank"]: r for r in _get(results_2, "dp2")}
    sp2 = {(r["dp_rank"], r["sp_rank"]): r for r in _get(results, "sp2dp2")}
    for name, ref in (("ep2tp2", lambda r: dp2[r["dp_rank"]]), ("ep2sp2", lambda r: sp2[r["dp_rank"], r["sp_rank"]])):
        for a in _get(results, name):
            b = ref(a)
            assert a["dropped"] == b["dropped"], name
            assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= LOSS_TOL, name
            _close(a["grads"], b["grads"], OUT_TOL, f"{name} gradients")
            _close(a["params"], b["params"], PARAM_TOL, name)
    assert _get(results, "ep2tp2")[0]["local_experts"] == (2, 16, 16)  # 2 of 4 experts, half of 32 wide
