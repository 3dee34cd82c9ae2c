"""ShardedCheckpointIO: pickle-free DCP checkpoints that reshard across world sizes and layouts.

Quick tests run in this process (no process group). The slow ones spawn once per world size:
2 ranks train FSDP2 / DDP / ZeRO-1 models, save, cross-load, and exercise failures mid-save;
4 ranks load those checkpoints into FSDP2 and ZeRO-1; this process loads them into a plain model.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import tabfm.parallel.sharded_checkpoint as sc
from tabfm.parallel.state_io import file_sha256, load_state
from tabfm.parallel.checkpoint import CheckpointMeta, checkpoint_dir, latest_checkpoint, list_checkpoints
from tabfm.parallel.export import load_exported
from tabfm.parallel.sharded_checkpoint import DCP_DIR, ShardedCheckpointIO, load_full_model_state
from tests.dist_utils import run_distributed
from tests.legacy_checkpoint import save_general_checkpoint

GLOBAL_BATCH, LR = 8, 1e-2


# --- model, data, training (shared by every layout) -----------------------------------------

class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.out = nn.Linear(d_out, d_out)
        self.register_buffer("gain", torch.full((d_out,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.fc(x))) * self.gain


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Block(4, 12), Block(12, 10), nn.Linear(10, 1))


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def build(kind: str, seed: int = 0):
    """(module whose names are the FQNs, module to call and checkpoint, optimizer, scheduler)."""
    net = make_model(seed)
    model = net
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in list(net)[:2]:
            fully_shard(block)
        fully_shard(net)
    elif kind in ("ddp", "zero"):
        model = DDP(net)
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return net, model, opt, sched


def train_step(model, opt, sched, step: int, rank: int = 0, world: int = 1) -> None:
    x, y = batch(step, rank, world)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(net: nn.Module, opt, sched) -> dict:
    """Full parameters, buffers, optimizer state (by name), lr and scheduler epoch (collective)."""
    names = {id(p): n for n, p in net.named_parameters()}
    if isinstance(opt, ZeroRedundancyOptimizer):
        local = {f"{names[id(p)]}/{k}": v.clone() for p, st in opt.optim.state.items() for k, v in st.items()}
        parts = [local]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, local)
        optim = {k: v for part in parts for k, v in part.items()}
    else:
        optim = {f"{names[id(p)]}/{k}": _full(v) for p, st in opt.state.items() for k, v in st.items()}
    return {"params": {n: _full(p) for n, p in net.named_parameters()},
            "buffers": {n: _full(b) for n, b in net.named_buffers()},
            "optim": optim, "lr": opt.param_groups[0]["lr"], "epoch": sched.last_epoch}


def params(net: nn.Module) -> dict:
    return {n: _full(p) for n, p in net.named_parameters()}


def meta(step: int, kind: str = "single", world: int = 1) -> CheckpointMeta:
    return CheckpointMeta(step=step, plugin=kind, layout={"world_size": world, "dp": world, "tp": 1, "sp": 1, "pp": 1})


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k)


def assert_close(a: dict, b: dict, what: str, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (what, k, (a[k] - b[k]).abs().max())


def assert_snapshot(loaded: dict, saved: dict, what: str) -> None:
    for part in ("params", "buffers", "optim"):
        assert_equal(loaded[part], saved[part], f"{what}: {part}")
    assert loaded["lr"] == pytest.approx(saved["lr"]) and loaded["epoch"] == saved["epoch"], what


# --- quick, single process ------------------------------------------------------------------

def _train_and_save(root: Path, step: int = 2, keep_last=None):
    net, model, opt, sched = build("single")
    for s in range(step):
        train_step(model, opt, sched, s)
    torch.manual_seed(77)
    path = ShardedCheckpointIO().save_checkpoint(checkpoint_dir(root, step), meta(step), model=model, optimizer=opt,
                                                 lr_scheduler=sched, extra={"step": step, "data": {"pos": 3}},
                                                 keep_last=keep_last)
    return path, (net, model, opt, sched), torch.rand(3)


def _refuse(*args, **kwargs):
    raise AssertionError("something tried to unpickle")


class _RefusingUnpickler(pickle.Unpickler):
    load = _refuse


def _forbid_unpickling(monkeypatch) -> None:
    for mod, attr in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, attr, _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _RefusingUnpickler)


def test_round_trip_single_process_is_bitwise_and_pickle_free(tmp_path, monkeypatch):
    path, (net, model, opt, sched), rng_after_save = _train_and_save(tmp_path)
    saved = snapshot(net, opt, sched)
    _forbid_unpickling(monkeypatch)
    net2, model2, opt2, sched2 = build("single", seed=5)
    extra = ShardedCheckpointIO().load_checkpoint(path, model=model2, optimizer=opt2, lr_scheduler=sched2)
    assert extra == {"step": 2, "data": {"pos": 3}}
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored
    assert_snapshot(snapshot(net2, opt2, sched2), saved, "single")
    train_step(model, opt, sched, 2)
    train_step(model2, opt2, sched2, 2)
    assert_equal(params(net2), params(net), "continued")
    full = load_full_model_state(path)
    assert_equal(full, {**saved["params"], **saved["buffers"]}, "load_full_model_state")



def test_a_checkpoint_before_the_first_step_changes_nothing(tmp_path):
    """Saving a never-stepped AdamW, and resuming from that checkpoint, trains exactly as a run that never
    saved: no state appears (torch's reader would create one with a zero-lr step, which AdamW counts)."""
    ref_net, ref_model, ref_opt, ref_sched = build("single")
    net, model, opt, sched = build("single")
    path = ShardedCheckpointIO().save_checkpoint(checkpoint_dir(tmp_path, 0), meta(0), model=model, optimizer=opt,
                                                 lr_scheduler=sched)
    assert not opt.state and load_state(path / "optimizer")["state"] == {}
    net2, model2, opt2, sched2 = build("single", seed=5)
    ShardedCheckpointIO().load_checkpoint(path, model=model2, optimizer=opt2, lr_scheduler=sched2)
    assert not opt2.state and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for s in range(3):
        for m, o, sc_ in ((ref_model, ref_opt, ref_sched), (model, opt, sched), (model2, opt2, sched2)):
            train_step(m, o, sc_, s)
    assert_equal(params(net), params(ref_net), "saved at step 0, went on")
    assert_equal(params(net2), params(ref_net), "resumed from step 0")

def test_checkpoint_files_are_safetensors_and_json_only(tmp_path):
    path, _, _ = _train_and_save(tmp_path)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    assert {p.relative_to(path).as_posix() for p in files} == {
        "manifest.json", "optimizer.json", "scheduler.json", "extra.json", "extra.safetensors",
        f"{DCP_DIR}/shard-00001-model-00001-of-00001.safetensors"}
    for p in files:
        assert not p.name.startswith(".") and p.suffix in (".json", ".safetensors"), p
        assert not p.read_bytes().startswith(b"\x80"), f"{p} looks like a pickle"
        if p.suffix == ".json":
            json.loads(p.read_text())
        else:
            with safe_open(str(p), framework="pt") as f:
                f.keys()
    with safe_open(str(path / DCP_DIR / "shard-00001-model-00001-of-00001.safetensors"), framework="pt") as f:
        assert "DCP_SHARDING_INFO" in f.metadata()
        assert "model/0.fc.weight" in f.keys() and "optim/0.fc.weight/exp_avg" in f.keys()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["checkpoint_io"] == "sharded" and manifest["step"] == 2
    assert f"{DCP_DIR}/shard-00001-model-00001-of-00001.safetensors" in manifest["files"]


def test_keep_last_prunes_and_latest_sees_only_complete(tmp_path):
    for step in (1, 2, 3):
        _train_and_save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    (tmp_path / "step_000003" / "manifest.json").unlink()  # an incomplete one is invisible
    assert latest_checkpoint(tmp_path).name == "step_000002"
    torch.manual_seed(3)
    bare = ShardedCheckpointIO().save_checkpoint(tmp_path / "step_000004", meta(4), extra={"step": 4})
    assert not (bare / DCP_DIR).exists() and latest_checkpoint(tmp_path) == bare
    assert ShardedCheckpointIO().load_checkpoint(bare, restore_rng=False) == {"step": 4}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_tied_weights_and_loss_scaler_round_trip(tmp_path):
    from tabfm.parallel.precision import DynamicLossScaler
    from tabfm.parallel.wrappers import OptimizerWrapper

    def setup(seed: int):
        torch.manual_seed(seed)
        model = Tied()
        return model, OptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=LR), scaler=DynamicLossScaler())

    model, opt = setup(0)
    model(torch.randn(3, 4)).sum().backward()
    opt.optim.step()
    opt.scaler.scale, opt.scaler.good_steps = 128.0, 3
    io = ShardedCheckpointIO()
    path = io.save_checkpoint(checkpoint_dir(tmp_path, 1), meta(1), model=model, optimizer=opt)
    model2, opt2 = setup(1)
    io.load_checkpoint(path, model=model2, optimizer=opt2)
    assert model2.b.weight is model2.a.weight
    assert_equal(model2.state_dict(), model.state_dict(), "tied")
    assert (opt2.scaler.scale, opt2.scaler.good_steps) == (128.0, 3)
    assert_equal(snapshot(model2, opt2.optim, torch.optim.lr_scheduler.StepLR(opt2.optim, 1))["optim"],
                 snapshot(model, opt.optim, torch.optim.lr_scheduler.StepLR(opt.optim, 1))["optim"], "tied optim")


def test_errors_name_the_problem(tmp_path):
    path, (net, model, opt, sched), _ = _train_and_save(tmp_path)
    io = ShardedCheckpointIO()
    with pytest.raises(ValueError, match="needs model="):
        io.load_checkpoint(path, optimizer=opt)
    wide = nn.Sequential(Block(4, 12), Block(12, 11), nn.Linear(11, 1))
    with pytest.raises(ValueError, match=r"key '1\.[a-z.]+' has shape"):
        io.load_checkpoint(path, model=wide)
    with pytest.raises(ValueError, match="unexpected keys"):
        io.load_checkpoint(path, model=nn.Sequential(Block(4, 12)))
    io.load_checkpoint(path, model=nn.Sequential(Block(4, 12)), strict=False)  # a prefix of the model loads
    general = save_general_checkpoint(tmp_path / "g" / "step_000001", 1, model=model)
    with pytest.raises(ValueError, match="'general'"):
        io.load_checkpoint(general, model=model)
    assert_equal(load_full_model_state(general), net.state_dict(), "general via load_full_model_state")
    (path / DCP_DIR / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="has 4 bytes|unreadable"):
        load_full_model_state(path)


# --- slow: 2 ranks save, 4 ranks and this process load --------------------------------------

KINDS = ("fsdp2", "ddp", "zero")


def _save_worker(rank: int, world: int, root: str) -> dict:
    root_p, io, out = Path(root), ShardedCheckpointIO(), {}
    for kind in KINDS:
        net, model, opt, sched = build(kind)
        for s in range(2):
            train_step(model, opt, sched, s, rank, world)
        torch.manual_seed(1000 + rank)  # per-rank RNG, to see it restored per rank
        io.save_checkpoint(checkpoint_dir(root_p / kind, 2), meta(2, kind, world), model=model, optimizer=opt,
                           lr_scheduler=sched, extra={"step": 2, "data": {"rank": rank}})
        out[kind] = {"rng": torch.rand(3), "saved": snapshot(net, opt, sched)}
        if kind == "fsdp2":
            io.export(model, root_p / "export", {"kind": kind})
        train_step(model, opt, sched, 2, rank, world)
        out[kind]["after"] = params(net)

    # FSDP2 at 2 ranks -> DDP at 2 ranks (same world: each rank gets its own extra and RNG back)
    net, model, opt, sched = build("ddp", seed=123)
    extra = io.load_checkpoint(checkpoint_dir(root_p / "fsdp2", 2), model=model, optimizer=opt, lr_scheduler=sched)
    out["fsdp2_to_ddp"] = {"extra": extra, "rng": torch.rand(3), "loaded": snapshot(net, opt, sched)}
    train_step(model, opt, sched, 2, rank, world)
    out["fsdp2_to_ddp"]["after"] = params(net)

    # failures mid-save: the previous checkpoint stays the latest, every rank raises, no tmp dirs
    fail_root = root_p / "fail"
    net, model, opt, sched = build("fsdp2")
    io.save_checkpoint(checkpoint_dir(fail_root, 1), meta(1, "fsdp2", world), model=model, optimizer=opt)
    out["fail"] = {}
    for case in ("writer_on_rank1", "manifest_on_rank0"):
        def boom(*args, **kwargs):
            raise OSError(f"injected failure ({case})")

        target = (sc.HuggingFaceStorageWriter, "write_data") if case == "writer_on_rank1" else (sc, "write_manifest")
        original = getattr(*target)
        if rank == (1 if case == "writer_on_rank1" else 0):
            setattr(*target, boom)
        try:
            io.save_checkpoint(checkpoint_dir(fail_root, 2), meta(2, "fsdp2", world), model=model, optimizer=opt)
            raised = None
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
        finally:
            setattr(*target, original)
        dist.barrier()
        out["fail"][case] = {"raised": raised, "latest": latest_checkpoint(fail_root).name,
                             "entries": sorted(os.listdir(fail_root))}
    return out


def _load_worker(rank: int, world: int, root: str) -> dict:
    root_p, io, out = Path(root), ShardedCheckpointIO(), {}
    for src, kind in (("fsdp2", "fsdp2"), ("ddp", "fsdp2"), ("zero", "zero"), ("fsdp2", "zero"), ("zero", "ddp")):
        net, model, opt, sched = build(kind, seed=123)
        extra = io.load_checkpoint(checkpoint_dir(root_p / src, 2), model=model, optimizer=opt, lr_scheduler=sched)
        case = out[f"{src}_to_{kind}"] = {"extra": extra, "rng": torch.rand(3), "loaded": snapshot(net, opt, sched)}
        train_step(model, opt, sched, 2, rank, world)
        case["after"] = params(net)
    return out


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, run_distributed(_save_worker, world_size=2, args=(str(root),), timeout_s=150)


@pytest.fixture(scope="module")
def loaded_at_4(saved_at_2):
    root, _ = saved_at_2
    return run_distributed(_load_worker, world_size=4, args=(str(root),), timeout_s=150)


@pytest.mark.slow
def test_saves_at_2_ranks_are_sharded_per_rank(saved_at_2):
    root, _ = saved_at_2
    for kind in KINDS:
        shards = sorted(p.name for p in (checkpoint_dir(root / kind, 2) / DCP_DIR).iterdir())
        assert shards == ["shard-00001-model-00001-of-00001.safetensors",
                          "shard-00002-model-00001-of-00001.safetensors"], kind
    with safe_open(str(checkpoint_dir(root / "fsdp2", 2) / DCP_DIR / shards[1]), framework="pt") as f:
        assert f.get_slice("model/0.fc.weight").get_shape() == [6, 4]  # rank 1's half of the FSDP2 shard
    assert not any(p.suffix in (".metadata", ".pt", ".pkl", ".bin") or p.name.startswith(".")
                   for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
def test_fsdp2_to_ddp_at_same_world_size(saved_at_2):
    _, results = saved_at_2
    for rank, out in enumerate(results):
        case = out["fsdp2_to_ddp"]
        assert_snapshot(case["loaded"], results[0]["fsdp2"]["saved"], "fsdp2->ddp")
        assert case["extra"] == {"step": 2, "data": {"rank": rank}}  # each rank its own
        assert torch.equal(case["rng"], out["fsdp2"]["rng"])
        assert_close(case["after"], out["fsdp2"]["after"], "fsdp2->ddp continued")


@pytest.mark.slow
def test_layouts_agree_before_save(saved_at_2):
    _, results = saved_at_2
    for kind in KINDS[1:]:  # DDP and ZeRO-1 trained the same model as FSDP2
        assert_close(results[0][kind]["saved"]["params"], results[0]["fsdp2"]["saved"]["params"], kind)
        assert_close(results[0][kind]["saved"]["optim"], results[0]["fsdp2"]["saved"]["optim"], kind)


@pytest.mark.slow
def test_resharding_to_4_ranks(saved_at_2, loaded_at_4):
    _, saved = saved_at_2
    for rank, out in enumerate(loaded_at_4):
        for case, result in out.items():
            src = case.split("_to_")[0]
            assert_snapshot(result["loaded"], saved[0][src]["saved"], case)
            assert result["extra"] == {"step": 2, "data": {"rank": 0}}  # new world size: rank 0's
            assert torch.equal(result["rng"], saved[0][src]["rng"])
            assert_close(result["after"], saved[0][src]["after"], f"{case} continued")


@pytest.mark.slow
@pytest.mark.parametrize("src", KINDS)
def test_resharding_to_one_process(saved_at_2, src, monkeypatch):
    root, saved = saved_at_2
    _forbid_unpickling(monkeypatch)
    net, model, opt, sched = build("single", seed=123)
    extra = ShardedCheckpointIO().load_checkpoint(checkpoint_dir(root / src, 2), model=model, optimizer=opt,
                                                  lr_scheduler=sched)
    assert extra == {"step": 2, "data": {"rank": 0}}
    assert torch.equal(torch.rand(3), saved[0][src]["rng"])
    assert_snapshot(snapshot(net, opt, sched), saved[0][src]["saved"], f"{src}->single")
    train_step(model, opt, sched, 2)
    assert_close(params(net), saved[0][src]["after"], f"{src}->single continued")
    full = load_full_model_state(checkpoint_dir(root / src, 2))
    assert_equal(full, {**saved[0][src]["saved"]["params"], **saved[0][src]["saved"]["buffers"]}, src)


@pytest.mark.slow
def test_export_from_fsdp2_writes_full_weights(saved_at_2):
    root, saved = saved_at_2
    weights, config = load_exported(root / "export")
    assert config == {"kind": "fsdp2", "weights_sha256": file_sha256(root / "export" / "model.safetensors")}
    assert_equal(weights, {**saved[0]["fsdp2"]["saved"]["params"], **saved[0]["fsdp2"]["saved"]["buffers"]}, "export")


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint_on_every_rank(saved_at_2):
    _, results = saved_at_2
    for rank, out in enumerate(results):
        for case, fail in out["fail"].items():
            assert fail["raised"] is not None, (case, rank)
            assert "injected failure" in fail["raised"], (case, rank, fail["raised"])
            assert fail["latest"] == "step_000001", (case, rank)
            assert fail["entries"] == ["step_000001"], (case, rank, fail["entries"])
