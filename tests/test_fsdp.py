"""FSDP2 plugin (ZeRO-3) and fp16 over sharded gradients, against the single-process reference.

One spawn per world size runs every scenario (2 ranks: FSDP fp32/bf16/fp16, ZeRO-2 fp16, CPU
offload, agreed fp16 overflow, checkpoint -> DDP; 4 ranks: FSDP fp32 and resuming the 2-rank
checkpoint); the tests compare the results with SingleProcessPlugin runs in this process on the
same global batches. Every training run clips (binding on some steps) and most accumulate two
micro-batches under `no_sync`. fp32 runs use AdamW and must match to 1e-5; bf16/fp16 runs use
SGD with momentum (Adam turns rounding-level gradient differences into +-lr steps) and are
compared with the single-process run at the same precision.
"""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tabfm.parallel import Booster, MixedPrecision, ParallelPlan, SingleProcessPlugin
from tests.dist_utils import run_distributed
from tests.legacy_checkpoint import save_general_checkpoint

N, GLOBAL_BATCH, STEPS, ACCUM, CLIP = 32, 16, 5, 2, 1.3  # CLIP binds on some steps, not all
# per precision: (params atol, loss atol, grad-norm rtol). Measured gaps to the single-process
# run at the same precision: fp32 ~6e-8; bf16 ~1.7e-3 params, ~1e-3 loss, ~1e-3 norm; fp16
# ~1.2e-4 params, ~1.7e-4 loss, ~7e-4 norm. The parameters travel ~1e-1 in these steps.
TOL = {"fp32": (1e-5, 1e-5, 1e-5), "bf16": (5e-3, 5e-3, 5e-3), "fp16": (5e-4, 1e-3, 2e-3)}


class Block(nn.Module):
    """Pre-norm residual MLP: a separate FSDP unit when the plan names it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class PlannedNet(nn.Module):
    """Input layer, two blocks, head; declares its blocks through `parallel_plan()`."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=[f"blocks.{i}" for i in range(len(self.blocks))])


def make_net(seed: int = 0) -> PlannedNet:
    torch.manual_seed(seed)
    return PlannedNet()


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(N, 1, generator=g)).sin()
    return TensorDataset(x, y)


def precision_of(dtype: str) -> MixedPrecision:
    # fp16: 2**24 overflows fp16 gradients on the first step; one backoff lands on 2**16
    if dtype == "fp16":
        return MixedPrecision("fp16", init_scale=2.0**24, backoff_factor=2.0**-8)
    return MixedPrecision(dtype)


def batches(loader: DataLoader, steps: int) -> list:
    out, epoch = [], 0
    while len(out) < steps:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        out += list(loader)[: steps - len(out)]
        epoch += 1
    return out


def setup(plugin, dtype: str = "fp32", seed: int = 0):
    booster = Booster(plugin=plugin, precision=precision_of(dtype))
    model = make_net(seed)
    if dtype == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, crit, _, _ = booster.boost(model, opt, nn.functional.mse_loss)
    return booster, model, opt, crit


def train(booster, model, opt, crit, data, accum: int = 1) -> dict:
    losses, norms, skipped, synced = [], [], [], []
    for x, y in data:
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            last = i == accum - 1
            with booster.no_sync(model, opt) if not last else contextlib.nullcontext():
                loss = crit(model(xm), ym) / accum
                booster.backward(loss, opt)
            total += loss.detach()
            if not last:  # FSDP2 leaves the sharded grad unset until the reduce-scatter
                synced.append(model.unwrap().blocks[0].fc1.weight.grad is not None)
        norms.append(float(booster.clip_grad_norm_(opt, CLIP)))
        opt.step()
        skipped.append(opt.last_step_skipped)
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return {"losses": losses, "norms": norms, "skipped": skipped, "synced_in_no_sync": synced,
            "scale": opt.loss_scale}


def params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for p in model.unwrap().parameters()]


def single_run(dtype: str, steps: int = STEPS, resume: Path | None = None, skip: int = 0) -> dict:
    booster, model, opt, crit = setup(SingleProcessPlugin(device="cpu"), dtype)
    if resume is not None:
        booster.load_checkpoint(resume, model=model, optimizer=opt)
    data = batches(DataLoader(make_dataset(), batch_size=GLOBAL_BATCH), skip + steps)[skip:]
    return {**train(booster, model, opt, crit, data), "params": params(model)}


# --- the distributed workers ---------------------------------------------------------------

def _plugin(kind: str, **kwargs):
    from tabfm.parallel import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    return {"fsdp": TorchFSDPPlugin, "zero2": lambda **kw: LowLevelZeroPlugin(stage=2, **kw),
            "ddp": TorchDDPPlugin}[kind](**kwargs)


def _units(booster, model) -> dict:
    """Which modules are FSDP units, and how many parameters each unit itself manages."""
    from torch.distributed.fsdp import FSDPModule

    module = model.unwrap()
    own = {}
    for name in booster.plugin.fsdp_units:
        unit = module.get_submodule(name)
        group = unit._get_fsdp_state()._fsdp_param_group
        own[name] = len(group.fsdp_params) if group is not None else 0
    return {"units": booster.plugin.fsdp_units, "own_params": own,
            "fsdp_modules": sorted(n for n, m in module.named_modules() if isinstance(m, FSDPModule))}


def _scenario_train(rank, world, kind, dtype, accum, seed_by_rank=True, **plugin_kwargs):
    # each rank starts from a different model: the plugin must broadcast rank 0's
    booster, model, opt, crit = setup(_plugin(kind, **plugin_kwargs), dtype, seed=rank if seed_by_rank else 0)
    loader = booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world)
    out = train(booster, model, opt, crit, batches(loader, STEPS), accum)
    units = _units(booster, model) if kind == "fsdp" else {}
    return {**out, **units, "params": params(model)}


def _scenario_found_inf(rank, world):
    """An inf in rank 1's gradient shard only: both ranks must skip the step and back off."""
    booster, model, opt, crit = setup(_plugin("fsdp"), "fp16")
    loader = booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world)
    opt.scaler.scale = 2.0**10  # no real overflow
    (x, y), = batches(loader, 1)
    before = params(model)
    booster.backward(crit(model(x), y), opt)
    grad = model.unwrap().blocks[1].fc1.weight.grad.to_local()
    if rank == 1:
        grad[0, 0] = float("inf")
    opt.step()  # no clipping: only the agreed flag can tell rank 0
    skipped, scale = opt.last_step_skipped, opt.loss_scale
    opt.zero_grad()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, params(model)))
    booster.backward(crit(model(x), y), opt)
    opt.step()
    return {"skipped": skipped, "scale": scale, "unchanged": unchanged, "then_skipped": opt.last_step_skipped}


def _scenario_ckpt(rank, world, root):
    booster, model, opt, crit = setup(_plugin("fsdp"))
    data = batches(booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world), 5)
    train(booster, model, opt, crit, data[:3])
    path = booster.save_checkpoint(Path(root) / "fsdp" / "step_000003", model=model, optimizer=opt,
                                   extra={"step": 3})
    at_save = params(model)
    train(booster, model, opt, crit, data[3:])
    # the FSDP checkpoint resumed by DDP (full replicas) on the same ranks
    booster2, model2, opt2, crit2 = setup(_plugin("ddp"), seed=5)
    extra = booster2.load_checkpoint(path, model=model2, optimizer=opt2)
    ddp_loaded = params(model2)
    data2 = batches(booster2.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world), 5)
    train(booster2, model2, opt2, crit2, data2[3:])
    return {"path": str(path), "at_save": at_save, "final": params(model), "extra": extra,
            "ddp_loaded": ddp_loaded, "ddp_final": params(model2)}


def _scenario_resume(rank, world, path):
    """A checkpoint written by 2 FSDP ranks, resumed by FSDP at this world size."""
    booster, model, opt, crit = setup(_plugin("fsdp"), seed=5)
    booster.load_checkpoint(path, model=model, optimizer=opt)
    loaded = params(model)
    data = batches(booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world), 5)
    train(booster, model, opt, crit, data[3:])
    return {"loaded": loaded, "final": params(model)}


def _scenario_from_general(rank, world, path, kind):
    """A "general" checkpoint (full tensors, written by one process) resumed by a sharded or
    replicated run: through the sharded IO's fallback reader."""
    booster, model, opt, crit = setup(_plugin(kind), seed=5)
    extra = booster.load_checkpoint(path, model=model, optimizer=opt)
    loaded = params(model)
    data = batches(booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // world), 5)
    train(booster, model, opt, crit, data[3:])
    return {"loaded": loaded, "final": params(model), "extra": extra}


def _run_all(rank, scenarios: dict) -> dict:
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def worker_2(rank, world, root):
    return _run_all(rank, {
        "fsdp_fp32": lambda: _scenario_train(rank, world, "fsdp", "fp32", ACCUM),
        "fsdp_bf16": lambda: _scenario_train(rank, world, "fsdp", "bf16", ACCUM),
        "fsdp_fp16": lambda: _scenario_train(rank, world, "fsdp", "fp16", ACCUM),
        "zero2_fp16": lambda: _scenario_train(rank, world, "zero2", "fp16", ACCUM),
        "fsdp_offload": lambda: _scenario_train(rank, world, "fsdp", "fp32", 1, cpu_offload=True,
                                                blocks=["blocks.1"], reshard_after_forward=False),
        "found_inf": lambda: _scenario_found_inf(rank, world),
        "ckpt": lambda: _scenario_ckpt(rank, world, root),
    })


def worker_4(rank, world, ckpt_path, general_path):
    return _run_all(rank, {
        "fsdp_fp32": lambda: _scenario_train(rank, world, "fsdp", "fp32", ACCUM),
        "resume": lambda: _scenario_resume(rank, world, ckpt_path),
        "general_fsdp": lambda: _scenario_from_general(rank, world, general_path, "fsdp"),
        "general_ddp": lambda: _scenario_from_general(rank, world, general_path, "ddp"),
    })


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    return run_distributed(worker_2, world_size=2, args=(str(root),), timeout_s=120)


def single_checkpoint(root: Path) -> tuple[Path, dict]:
    """Three single-process fp32 steps saved as a "general" checkpoint, and that run continued 2 steps."""
    booster, model, opt, crit = setup(SingleProcessPlugin(device="cpu"), "fp32")
    data = batches(DataLoader(make_dataset(), batch_size=GLOBAL_BATCH), 5)
    train(booster, model, opt, crit, data[:3])
    path = save_general_checkpoint(root / "single" / "step_000003", 3, model=model, optimizer=opt, extra={"step": 3})
    at_save = params(model)
    train(booster, model, opt, crit, data[3:])
    return path, {"at_save": at_save, "final": params(model)}


_general: dict = {}


@pytest.fixture(scope="module")
def results_4(results_2, tmp_path_factory):
    path = _get(results_2, "ckpt")[0]["path"]
    general_path, _general["expected"] = single_checkpoint(tmp_path_factory.mktemp("general"))
    return run_distributed(worker_4, world_size=4, args=(path, str(general_path)), timeout_s=150)


_single_cache: dict[str, dict] = {}


def reference(dtype: str) -> dict:
    if dtype not in _single_cache:
        _single_cache[dtype] = single_run(dtype)
    return _single_cache[dtype]


def _get(results, name):
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank} scenario {name}:\n{r[name]['error']}"
    return [r[name] for r in results]


def _assert_params(got, want, atol):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


def _assert_matches(ranks, ref, dtype):
    p_tol, l_tol, n_tol = TOL[dtype]
    for r in ranks:
        _assert_params(r["params"], ref["params"], p_tol)
        assert r["losses"] == pytest.approx(ref["losses"], abs=l_tol)
        finite = [i for i, n in enumerate(ref["norms"]) if not ref["skipped"][i]]  # a skipped step's norm is inf/nan
        assert [r["norms"][i] for i in finite] == pytest.approx([ref["norms"][i] for i in finite], rel=n_tol)
        assert r["skipped"] == ref["skipped"] and r["scale"] == ref["scale"]
    assert any(n > CLIP for n in ref["norms"]) and any(n < CLIP for n in ref["norms"][1:])


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("fsdp_fp32", "fp32"), ("fsdp_bf16", "bf16"), ("fsdp_fp16", "fp16"),
                                        ("zero2_fp16", "fp16")])
def test_two_ranks_match_single_process(results_2, name, dtype):
    ranks = _get(results_2, name)
    _assert_matches(ranks, reference(dtype), dtype)
    for r in ranks:  # accumulation really skipped the reduce-scatter inside no_sync
        assert r["synced_in_no_sync"] and not any(r["synced_in_no_sync"])
    if dtype == "fp16":  # the first step overflowed on every rank, then the scale settled
        assert ranks[0]["skipped"] == [True] + [False] * (STEPS - 1) and ranks[0]["scale"] == 2.0**16


def test_low_precision_tolerances_are_meaningful():
    """The bf16/fp16 tolerances are far below how far the parameters travel in the run."""
    init = [p.detach().clone() for p in make_net(0).parameters()]
    for dtype in ("bf16", "fp16"):
        moved = max(float((a - b).abs().max()) for a, b in zip(reference(dtype)["params"], init))
        assert moved > 10 * TOL[dtype][0], (dtype, moved)


@pytest.mark.slow
def test_each_planned_block_is_its_own_fsdp_unit(results_2):
    r = _get(results_2, "fsdp_fp32")[0]
    assert r["units"] == ["blocks.0", "blocks.1", ""]
    assert r["fsdp_modules"] == ["", "blocks.0", "blocks.1"]
    per_block = len(list(Block(16).parameters()))
    root_own = len(list(PlannedNet().parameters())) - 2 * per_block
    assert r["own_params"] == {"blocks.0": per_block, "blocks.1": per_block, "": root_own}


@pytest.mark.slow
def test_cpu_offload_and_explicit_blocks(results_2):
    ranks = _get(results_2, "fsdp_offload")
    assert ranks[0]["units"] == ["blocks.1", ""] and ranks[0]["fsdp_modules"] == ["", "blocks.1"]
    _assert_matches(ranks, reference("fp32"), "fp32")


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(results_2):
    ranks = _get(results_2, "found_inf")
    for r in ranks:
        assert r["skipped"] and r["unchanged"] and r["scale"] == 2.0**10 * 2.0**-8
        assert not r["then_skipped"]


@pytest.mark.slow
def test_fsdp_checkpoint_loads_into_single_process_and_ddp(results_2):
    ranks = _get(results_2, "ckpt")
    at_save, final = ranks[0]["at_save"], ranks[0]["final"]
    resumed = single_run("fp32", steps=2, resume=Path(ranks[0]["path"]), skip=3)
    _assert_params(resumed["params"], final, 1e-5)
    for r in ranks:
        assert r["extra"] == {"step": 3}
        _assert_params(r["ddp_loaded"], at_save, 0)
        _assert_params(r["ddp_final"], final, 1e-5)  # optimizer state came across too
    single = Booster(SingleProcessPlugin(device="cpu"))
    model, *_ = single.boost(make_net(7))
    single.load_checkpoint(ranks[0]["path"], model=model, restore_rng=False)
    _assert_params(params(model), at_save, 0)


@pytest.mark.slow
def test_four_ranks_match_single_process_and_resume_two_rank_checkpoint(results_2, results_4):
    _assert_matches(_get(results_4, "fsdp_fp32"), reference("fp32"), "fp32")
    ckpt = _get(results_2, "ckpt")[0]
    for r in _get(results_4, "resume"):
        _assert_params(r["loaded"], ckpt["at_save"], 0)
        _assert_params(r["final"], ckpt["final"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_four_ranks_resume_a_single_process_general_checkpoint(results_4, kind):
    expected = _general["expected"]
    for r in _get(results_4, f"general_{kind}"):
        assert r["extra"] == {"step": 3}
        _assert_params(r["loaded"], expected["at_save"], 0)
        _assert_params(r["final"], expected["final"], 1e-5)  # optimizer state came across too


def test_plan_blocks_and_bad_block_names():
    from tabfm.parallel.parallelize import resolve_blocks
    from tabfm.parallel.plan import plan_of

    assert plan_of(PlannedNet()).blocks == ["blocks.0", "blocks.1"]
    assert plan_of(nn.Linear(2, 2)).blocks == []
    with pytest.raises(ValueError, match=r"Linear declares no parallel_plan\(\): pipeline stages need one"):
        plan_of(nn.Linear(2, 2), "pipeline stages")
    with pytest.raises(ValueError, match="no submodule 'blocks.7'"):
        resolve_blocks(PlannedNet(), ["blocks.7"])
    assert [n for n, _ in resolve_blocks(PlannedNet(), ["blocks", "blocks.0"])] == ["blocks.0", "blocks"]

    class BadPlan(nn.Module):
        def parallel_plan(self):
            return {"blocks": []}

    with pytest.raises(TypeError, match="expected tabfm.parallel.plan.ParallelPlan"):
        plan_of(BadPlan())


def test_loss_scaler_unscales_dtensor_free_grads_and_reports_local_inf():
    from tabfm.parallel.precision import DynamicLossScaler

    scaler = DynamicLossScaler(scale=4.0)
    grads = [torch.full((3,), 8.0), torch.tensor([4.0, float("nan")])]
    found = scaler.unscale_(grads)
    assert float(found) == 1.0 and torch.equal(grads[0], torch.full((3,), 2.0))
    assert float(scaler.unscale_([torch.ones(2)])) == 0.0 and float(scaler.unscale_([])) == 0.0
