"""Distributed plugins (2 gloo processes) against the single-process reference.

One spawn runs every training scenario (DDP, ZeRO-1: plain steps, accumulation with no_sync,
checkpoints) and the tests compare its results with SingleProcessPlugin runs in this process.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tabfm.parallel.state_io import file_sha256
from tabfm.parallel import Booster, SingleProcessPlugin
from tabfm.parallel.export import load_exported
from tabfm.parallel.launch import launch, seed_for_rank
from tabfm.parallel.mesh import build_mesh, resolve_mesh_spec
from tests.dist_utils import DistributedError, run_distributed

WORLD = 2
N, GLOBAL_BATCH, STEPS, CLIP, ATOL = 32, 16, 5, 0.3, 1e-5  # CLIP binds on some steps
LOW_PRECISION = [("ddp", "bf16"), ("ddp", "fp16"), ("zero", "bf16"), ("zero", "fp16"), ("zero2", "bf16")]
# (params, loss) tolerance against the single-process run at the same precision
LOW_TOL = {"bf16": (5e-3, 5e-3), "fp16": (5e-4, 1e-3)}


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(N, 1, generator=g)).sin()
    return TensorDataset(x, y)


def batches(loader: DataLoader, steps: int):
    """`steps` batches, cycling over epochs (set_epoch keeps DistributedSampler honest)."""
    epoch, done = 0, 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for b in loader:
            if done == steps:
                return
            yield b
            done += 1
        epoch += 1


def make_plugin(kind: str):
    from tabfm.parallel.plugins.ddp import TorchDDPPlugin
    from tabfm.parallel.plugins.zero import LowLevelZeroPlugin

    return {"ddp": TorchDDPPlugin, "zero": lambda: LowLevelZeroPlugin(stage=1),
            "zero2": lambda: LowLevelZeroPlugin(stage=2)}[kind]()


def setup(plugin, model_seed: int = 0, precision: str = "fp32"):
    """fp32 runs use AdamW; bf16/fp16 runs SGD with momentum (Adam turns rounding-level gradient
    differences into full +-lr steps, which would hide real disagreements in noise)."""
    booster = Booster(plugin=plugin, precision=precision)
    model = make_mlp(model_seed)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if precision == "fp32"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model, opt, crit, _, _ = booster.boost(model, opt, nn.functional.mse_loss)
    return booster, model, opt, crit


def train(booster, model, opt, crit, data, accum: int = 1):
    losses, norms, skipped_sync = [], [], []
    for x, y in data:
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            last = i == accum - 1
            ctx = booster.no_sync(model, opt) if not last else _null()
            with ctx:
                loss = crit(model(xm), ym) / accum
                booster.backward(loss, opt)
            total += loss.detach()
            if not last and dist.is_initialized():  # did no_sync really skip the allreduce?
                g = model.unwrap()[0].weight.grad
                if g is None or hasattr(g, "full_tensor"):  # FSDP2: a sharded grad only comes from a reduce-scatter
                    skipped_sync.append(g is None)
                    continue
                g = g.detach().clone()
                gs = [torch.empty_like(g) for _ in range(dist.get_world_size())]
                dist.all_gather(gs, g)
                skipped_sync.append(not torch.allclose(gs[0], gs[1]))
        norms.append(float(booster.clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses, norms, skipped_sync


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.unwrap().parameters()]


def single_run(steps: int, accum: int = 1, resume: Path | None = None, skip: int = 0, precision: str = "fp32"):
    booster, model, opt, crit = setup(SingleProcessPlugin(device="cpu"), precision=precision)
    if resume is not None:
        booster.load_checkpoint(resume, model=model, optimizer=opt)
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH)
    data = list(batches(loader, skip + steps))[skip:]
    losses, norms, _ = train(booster, model, opt, crit, data, accum)
    return {"params": params(model), "losses": losses, "norms": norms}


# --- the distributed worker ----------------------------------------------------------------

def _scenario_train(rank, kind, accum, precision="fp32"):
    # each rank builds a different initial model: DDP must broadcast rank 0's
    booster, model, opt, crit = setup(make_plugin(kind), model_seed=rank, precision=precision)
    loader = booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // WORLD)
    losses, norms, skipped = train(booster, model, opt, crit, batches(loader, STEPS), accum)
    return {"params": params(model), "losses": losses, "norms": norms, "skipped_sync": skipped,
            "is_main": booster.plugin.is_main_process, "dp": (booster.plugin.dp_rank, booster.plugin.dp_world_size)}


def _scenario_ckpt(rank, kind, root):
    booster, model, opt, crit = setup(make_plugin(kind))
    loader = booster.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // WORLD)
    data = batches(loader, 5)
    train(booster, model, opt, crit, [next(data) for _ in range(3)])
    torch.manual_seed(seed_for_rank(0, rank))
    path = booster.save_checkpoint(Path(root) / kind / "step_000003", model=model, optimizer=opt,
                                   extra={"step": 3})
    draw = torch.rand(3)  # what each rank's RNG gives right after the save
    train(booster, model, opt, crit, data)
    exported = booster.export(model, Path(root) / kind / "export", {"kind": kind})
    # resume the same checkpoint on 2 ranks into a differently initialised model (ZeRO re-shards)
    booster2, model2, opt2, crit2 = setup(make_plugin(kind), model_seed=5)
    extra = booster2.load_checkpoint(path, model=model2, optimizer=opt2)
    redraw = torch.rand(3)
    loader2 = booster2.prepare_dataloader(make_dataset(), batch_size=GLOBAL_BATCH // WORLD)
    train(booster2, model2, opt2, crit2, list(batches(loader2, 5))[3:])
    return {"params": params(model), "path": str(path), "resumed": params(model2), "extra": extra,
            "draw": draw, "redraw": redraw, "export": str(exported)}


def _scenario_mesh(rank):
    mesh = build_mesh(WORLD, dp_shard=2)
    try:
        build_mesh(WORLD, dp_shard=3)
        wrong = None
    except ValueError as e:
        wrong = str(e)
    from tabfm.parallel.plugins.zero import LowLevelZeroPlugin

    refused = []
    for kwargs in ({"stage": 3},):
        try:
            LowLevelZeroPlugin(**kwargs)
        except ValueError as e:
            refused.append(str(e))
    return {"names": mesh.mesh_dim_names, "shape": tuple(mesh.shape), "wrong": wrong,
            "seed": seed_for_rank(7, rank), "refused": refused}


def scenario_worker(rank, world, root):
    out = {}
    scenarios = {
        "ddp": lambda: _scenario_train(rank, "ddp", 1),
        "zero": lambda: _scenario_train(rank, "zero", 1),
        "ddp_accum": lambda: _scenario_train(rank, "ddp", 2),
        "zero_accum": lambda: _scenario_train(rank, "zero", 2),
        "ddp_ckpt": lambda: _scenario_ckpt(rank, "ddp", root),
        "zero_ckpt": lambda: _scenario_ckpt(rank, "zero", root),
        "zero2": lambda: _scenario_train(rank, "zero2", 1),
        "zero2_accum": lambda: _scenario_train(rank, "zero2", 2),
        "zero2_ckpt": lambda: _scenario_ckpt(rank, "zero2", root),
        "mesh": lambda: _scenario_mesh(rank),
        **{f"{kind}_{prec}": (lambda kind=kind, prec=prec: _scenario_train(rank, kind, 2, prec))
           for kind, prec in LOW_PRECISION},
    }
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return run_distributed(scenario_worker, world_size=WORLD, args=(str(root),), timeout_s=300)


def _get(results, name):
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank} scenario {name}:\n{r[name]['error']}"
    return [r[name] for r in results]


def _assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero", "zero2"])
def test_matches_single_process(dist_results, kind):
    ref = single_run(STEPS)
    ranks = _get(dist_results, kind)
    for r in ranks:
        _assert_close(r["params"], ref["params"])
        assert r["losses"] == pytest.approx(ref["losses"], abs=ATOL)
        assert r["norms"] == pytest.approx(ref["norms"], abs=ATOL)  # clipping saw the global norm
    assert [r["is_main"] for r in ranks] == [True, False]
    assert [r["dp"] for r in ranks] == [(0, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,precision", LOW_PRECISION)
def test_low_precision_matches_single_process_at_that_precision(dist_results, kind, precision):
    ref = single_run(STEPS, accum=2, precision=precision)
    p_tol, l_tol = LOW_TOL[precision]
    moved = max(float((a - b).abs().max()) for a, b in zip(ref["params"], single_run(0)["params"]))
    assert moved > 10 * p_tol  # the tolerance is far below how far training moved the parameters
    for r in _get(dist_results, f"{kind}_{precision}"):
        for a, b in zip(r["params"], ref["params"]):
            torch.testing.assert_close(a, b, atol=p_tol, rtol=0)
        assert r["losses"] == pytest.approx(ref["losses"], abs=l_tol)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero", "zero2"])
def test_accumulation_with_no_sync_equals_big_batch(dist_results, kind):
    ref = single_run(STEPS)  # one big batch per step
    ranks = _get(dist_results, f"{kind}_accum")
    for r in ranks:
        _assert_close(r["params"], ref["params"])
        assert r["losses"] == pytest.approx(ref["losses"], abs=ATOL)
        assert r["skipped_sync"] and all(r["skipped_sync"])  # grads differed across ranks inside no_sync


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero", "zero2"])
def test_checkpoint_from_two_ranks_resumes_in_one_process_and_on_two(dist_results, kind):
    ranks = _get(dist_results, f"{kind}_ckpt")
    _assert_close(ranks[0]["params"], ranks[1]["params"])
    resumed = single_run(2, resume=Path(ranks[0]["path"]), skip=3)
    _assert_close(resumed["params"], ranks[0]["params"])
    for r in ranks:  # the same checkpoint resumed on 2 ranks, each rank with its own RNG stream
        _assert_close(r["resumed"], ranks[0]["params"])
        assert r["extra"] == {"step": 3}
        torch.testing.assert_close(r["redraw"], r["draw"], atol=0, rtol=0)
    assert not torch.equal(ranks[0]["draw"], ranks[1]["draw"])
    weights, config = load_exported(ranks[0]["export"])  # written once, gathered full tensors
    assert config == {"kind": kind, "weights_sha256": file_sha256(Path(ranks[0]["export"]) / "model.safetensors")}
    _assert_close([weights[k] for k, _ in make_mlp().named_parameters()], ranks[0]["params"])


@pytest.mark.slow
def test_mesh_named_dims(dist_results):
    ranks = _get(dist_results, "mesh")
    for r in ranks:
        assert r["names"] == ("dp_shard",) and r["shape"] == (2,)
        assert "dp_shard=3" in r["wrong"] and "= 3 does not equal world size 2" in r["wrong"]
    assert ranks[0]["seed"] != ranks[1]["seed"]
    assert len(ranks[0]["refused"]) == 1 and "stage must be 1 or 2" in ranks[0]["refused"][0]


def test_wrong_mesh_raises_before_any_collective():
    with pytest.raises(ValueError, match=r"dp_shard=3 × ep=1 × tp=1 × sp=1 × pp=1 = 3 does not equal world size 2"):
        build_mesh(2, dp_shard=3)
    with pytest.raises(ValueError, match=r"tp=3 .* does not divide world size 4"):
        build_mesh(4, tp=3)
    assert not dist.is_initialized()
    assert build_mesh(1) is None
    spec = resolve_mesh_spec(8, dp_replicate=2, tp=2)
    assert (spec.dp_shard, spec.dp, spec.layout()["world_size"]) == (2, 4, 8)


def test_launch_without_torchrun_is_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    info = launch()
    assert (info.rank, info.world_size, info.initialized) == (0, 1, False)
    assert not dist.is_initialized()
    seeds = {seed_for_rank(0, r) for r in range(8)}
    assert len(seeds) == 8 and seed_for_rank(0, 1) == seed_for_rank(0, 1)


def test_distributed_plugins_need_a_process_group():
    from tabfm.parallel.plugins.ddp import TorchDDPPlugin

    with pytest.raises(RuntimeError, match="launch"):
        TorchDDPPlugin()


def _raising_worker(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits for a peer that is gone
    return float(t)


def _stalled_peer_worker(rank, world):
    if rank == 1:
        time.sleep(60)  # alive but never joins the collective
        return None
    dist.all_reduce(torch.ones(1))
    return "unreachable"


@pytest.mark.slow
def test_raising_rank_is_reported_not_hung():
    # a hang would be the harness's TimeoutError after 120 s, not this DistributedError
    with pytest.raises(DistributedError, match="boom on rank 1") as e:
        run_distributed(_raising_worker, world_size=2, timeout_s=120)
    assert 1 in e.value.errors


@pytest.mark.slow
def test_collective_timeout_turns_stalled_peer_into_error():
    # a hang would be the harness's TimeoutError after 120 s; the 3 s collective timeout makes rank
    # 0's all_reduce raise a DistributedError instead (no wall-clock assert: a loaded CI machine
    # takes tens of seconds just to start two torch processes)
    with pytest.raises(DistributedError) as e:
        run_distributed(_stalled_peer_worker, world_size=2, timeout_s=120, pg_timeout_s=3)
    assert 0 in e.value.errors  # rank 0's all_reduce raised instead of waiting forever
