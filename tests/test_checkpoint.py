"""Checkpoint IO, state_io and export: round trips, bitwise resume, atomicity, validation."""
from __future__ import annotations

import json
import math
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import tabfm.parallel.sharded_checkpoint as sharded_mod
from tabfm.parallel.state_io import file_sha256, read_json, write_json
from tabfm.parallel import (
    Booster,
    SingleProcessPlugin,
    checkpoint_dir,
    export_model,
    latest_checkpoint,
    list_checkpoints,
    load_exported,
    load_state,
    save_state,
)
from tests.legacy_checkpoint import save_general_checkpoint

# --- state_io ------------------------------------------------------------------------------


def nested_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2, generator=g)},
            1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, generator=g, dtype=torch.float64)},
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None, "name": "all"}],
        "dtypes": [
            torch.randn(4, generator=g).to(torch.bfloat16),
            torch.randn(2, 2, generator=g).half(),
            torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor([-3, 7], dtype=torch.int8),
            torch.tensor([True, False]),
            torch.arange(256, dtype=torch.uint8),
            torch.zeros(0, 4),
            torch.randn(4, 4, generator=g).t(),  # non-contiguous
        ],
        "floats": [float("nan"), float("inf"), -float("inf"), 0.1, 1.0, -0.0],
        "ints": [0, -5, 2**70],
        (1, "a"): ["tuple", "key"],
        "nested": {"__tensor__": "not a marker", "empty": {}, "t": (), "none": None, "bool": True},
    }


def assert_same(a, b, path="/"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}{k}/")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}{i}/")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), path


def test_state_io_round_trip(tmp_path):
    state = nested_state()
    files = save_state(state, tmp_path / "opt")
    assert sorted(f.name for f in files) == ["opt.json", "opt.safetensors"]
    assert_same(load_state(tmp_path / "opt"), state)
    json.loads((tmp_path / "opt.json").read_text())  # strict JSON (NaN encoded, not emitted)
    assert "NaN" not in (tmp_path / "opt.json").read_text()


def test_state_io_without_tensors_writes_json_only(tmp_path):
    state = {"last_epoch": 3, "_last_lr": [0.1, 0.2], "lr_lambdas": [None]}
    assert [f.name for f in save_state(state, tmp_path / "sched")] == ["sched.json"]
    assert load_state(tmp_path / "sched") == state


def test_state_io_rejects_unsupported_types(tmp_path):
    with pytest.raises(TypeError, match="a/b"):
        save_state({"a": {"b": object()}}, tmp_path / "x")


def _tamper_json(tmp_path, fn):
    doc = json.loads((tmp_path / "s.json").read_text())
    fn(doc)
    (tmp_path / "s.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("case", ["shape", "dtype", "unknown_key", "missing_key", "missing_file",
                                  "corrupt_bytes", "bad_json", "missing_json", "wrong_format"])
def test_state_io_tampered_files_raise_value_error(tmp_path, case):
    save_state({"w": torch.ones(2, 3), "n": 1}, tmp_path / "s")
    st = tmp_path / "s.safetensors"
    if case == "shape":
        _tamper_json(tmp_path, lambda d: d["tensors"]["w"].update(shape=[3, 2]))
        match = "'w'.*shape"
    elif case == "dtype":
        _tamper_json(tmp_path, lambda d: d["tensors"]["w"].update(dtype="float16"))
        match = "'w'.*dtype"
    elif case == "unknown_key":
        save_file({"w": torch.ones(2, 3), "evil": torch.zeros(1)}, str(st))
        match = "unknown tensor key 'evil'"
    elif case == "missing_key":
        save_file({"v": torch.ones(2, 3)}, str(st))
        match = "unknown tensor key 'v'|missing tensor key 'w'"
    elif case == "missing_file":
        st.unlink()
        match = "missing file"
    elif case == "corrupt_bytes":
        st.write_bytes(b"\xff" * 40 + st.read_bytes()[40:])
        match = "unreadable safetensors"
    elif case == "bad_json":
        (tmp_path / "s.json").write_text("{not json")
        match = "invalid JSON"
    elif case == "missing_json":
        (tmp_path / "s.json").unlink()
        match = "missing file"
    else:
        _tamper_json(tmp_path, lambda d: d.update(format="pickle"))
        match = "not a tabfm-state"
    with pytest.raises(ValueError, match=match) as err:
        load_state(tmp_path / "s")
    assert "s.json" in str(err.value) or "s.safetensors" in str(err.value)


# --- training checkpoints ------------------------------------------------------------------


def make_run(seed: int = 0, precision: str = "fp32"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    warmup, total = 3, 12

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    booster = Booster(SingleProcessPlugin("cpu"), precision=precision)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def shard_file(ckpt):
    """The one DCP shard a single-process checkpoint writes (weights and optimizer tensors)."""
    (shard,) = (ckpt / "dcp").glob("*.safetensors")
    return shard


def train_steps(model, opt, sched, booster, steps: int) -> None:
    """Batches come from torch, numpy and python RNGs, so a resume must restore all three."""
    for _ in range(steps):
        x = torch.randn(8, 4) + float(np.random.randn()) + random.random()
        loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
        booster.backward(loss, opt)
        booster.clip_grad_norm_(opt, 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_resume_is_bitwise_identical(tmp_path):
    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 8)
    reference = [p.detach().clone() for p in model.parameters()]

    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 4)
    path = booster.save_checkpoint(checkpoint_dir(tmp_path, 4), model=model, optimizer=opt,
                                   lr_scheduler=sched, extra={"step": 4, "data": {"cursor": 32, "epoch": (0, 1)}})
    seed_all(999)  # a restarted process starts from other RNG states
    booster, model, opt, sched = make_run(seed=7)
    extra = booster.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched)
    assert extra == {"step": 4, "data": {"cursor": 32, "epoch": (0, 1)}}
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    train_steps(model, opt, sched, booster, 4)
    for a, b in zip(model.parameters(), reference):
        assert torch.equal(a, b)


def test_a_general_checkpoint_of_an_earlier_version_resumes_bitwise(tmp_path):
    """Single-process runs wrote full tensors ("general") before every plugin went through DCP;
    such a run still resumes, through the fallback reader, exactly where it left off."""
    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 8)
    reference = [p.detach().clone() for p in model.parameters()]
    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 4)
    path = save_general_checkpoint(checkpoint_dir(tmp_path, 4), 4, model=model, optimizer=opt, lr_scheduler=sched,
                                   extra={"step": 4})
    assert (path / "model.safetensors").is_file() and not (path / "dcp").exists()
    seed_all(999)
    booster, model, opt, sched = make_run(seed=7)
    assert booster.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched) == {"step": 4}
    train_steps(model, opt, sched, booster, 4)
    for a, b in zip(model.parameters(), reference):
        assert torch.equal(a, b)


def test_resume_without_rng_restore_differs(tmp_path):
    """Guards the test above: it would notice if RNG states were not restored."""
    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 8)
    reference = [p.detach().clone() for p in model.parameters()]
    seed_all(123)
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 4)
    path = booster.save_checkpoint(tmp_path / "step_000004", model=model, optimizer=opt, lr_scheduler=sched)
    seed_all(999)
    booster.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched, restore_rng=False)
    train_steps(model, opt, sched, booster, 4)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), reference))


def test_checkpoint_layout_and_manifest(tmp_path):
    booster, model, opt, sched = make_run(precision="fp16")
    train_steps(model, opt, sched, booster, 2)
    path = booster.save_checkpoint(tmp_path / "step_000002", model=model, optimizer=opt, lr_scheduler=sched,
                                   extra={"step": 2})
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert names == ["dcp/shard-00001-model-00001-of-00001.safetensors", "extra.json", "extra.safetensors",
                     "manifest.json", "optimizer.json", "scheduler.json"]  # one DCP shard: weights + moments
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["plugin"] == "single" and manifest["precision"] == "fp16"
    assert manifest["layout"] == {"world_size": 1, "dp": 1, "tp": 1, "sp": 1, "pp": 1}
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["format_version"] == 1
    from tabfm.parallel.state_io import file_sha256

    assert manifest["files"] == {n: {"bytes": (path / n).stat().st_size, "sha256": file_sha256(path / n)}
                                 for n in names if n != "manifest.json"}
    rng = load_file(str(path / "extra.safetensors"))
    assert rng["rng/torch"].dtype == torch.uint8
    assert json.loads((path / "optimizer.json").read_text())["state"]["loss_scaler"]["scale"] == 2.0**16
    assert not list(tmp_path.glob(".tmp-*"))


def test_load_never_unpickles(tmp_path, monkeypatch):
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 1)
    path = booster.save_checkpoint(tmp_path / "step_000001", model=model, optimizer=opt, lr_scheduler=sched)

    def forbidden(*a, **k):
        raise AssertionError("unpickling is forbidden")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    booster.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    booster, model, opt, sched = make_run()
    train_steps(model, opt, sched, booster, 1)
    good = booster.save_checkpoint(checkpoint_dir(tmp_path, 1), model=model, optimizer=opt, lr_scheduler=sched)
    good_bytes = {p: p.read_bytes() for p in good.rglob("*") if p.is_file()}
    train_steps(model, opt, sched, booster, 1)

    def crash(*a, **k):  # the DCP shard is already written when this runs
        raise OSError("disk full")

    monkeypatch.setattr(sharded_mod, "save_state", crash)
    with pytest.raises(OSError, match="disk full"):
        booster.save_checkpoint(checkpoint_dir(tmp_path, 2), model=model, optimizer=opt, lr_scheduler=sched)
    monkeypatch.undo()
    assert not checkpoint_dir(tmp_path, 2).exists()
    assert {p: p.read_bytes() for p in good.rglob("*") if p.is_file()} == good_bytes
    assert latest_checkpoint(tmp_path) == good

    # a hard kill leaves debris behind: a tmp dir, and (from some other tool) a dir without manifest
    debris = tmp_path / ".tmp-step_000003-4242"
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == good
    booster.load_checkpoint(latest_checkpoint(tmp_path), model=model, optimizer=opt, lr_scheduler=sched)
    with pytest.raises(ValueError, match="missing manifest.json"):
        booster.load_checkpoint(tmp_path / "step_000004", model=model)


def test_truncated_file_makes_checkpoint_incomplete(tmp_path):
    booster, model, opt, sched = make_run()
    first = booster.save_checkpoint(checkpoint_dir(tmp_path, 1), model=model, optimizer=opt)
    second = booster.save_checkpoint(checkpoint_dir(tmp_path, 2), model=model, optimizer=opt)
    shard = shard_file(second)
    shard.write_bytes(shard.read_bytes()[:-8])
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(ValueError, match=r"dcp/shard-00001-model-00001-of-00001.safetensors has"):
        booster.load_checkpoint(second, model=model)


def test_keep_last_and_overwrite(tmp_path):
    booster, model, opt, sched = make_run()
    for step in range(1, 6):
        booster.save_checkpoint(checkpoint_dir(tmp_path, step), model=model, extra={"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005"]
    # re-saving an existing step replaces it atomically
    booster.save_checkpoint(checkpoint_dir(tmp_path, 5), model=model, extra={"step": 5, "again": True})
    assert booster.load_checkpoint(latest_checkpoint(tmp_path)) == {"step": 5, "again": True}


def test_model_mismatch_raises_value_error(tmp_path):
    booster, model, opt, sched = make_run()
    path = booster.save_checkpoint(tmp_path / "step_000001", model=model)
    wider = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"step_000001: key '0.weight' has shape \[16, 4\], model expects \[8, 4\]"):
        booster.load_checkpoint(path, model=wider)
    deeper = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1), nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"missing keys \['3.bias', '3.weight'\]"):
        booster.load_checkpoint(path, model=deeper)
    with pytest.raises(ValueError, match="missing file .*optimizer.json"):
        booster.load_checkpoint(path, model=model, optimizer=opt)


def test_step_is_required(tmp_path):
    booster, model, *_ = make_run()
    with pytest.raises(ValueError, match="step"):
        booster.save_checkpoint(tmp_path / "final", model=model)
    assert json.loads((booster.save_checkpoint(tmp_path / "final", model=model, step=9) / "manifest.json")
                      .read_text())["step"] == 9


# --- export --------------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(idx))))


def test_export_round_trip_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    booster = Booster(SingleProcessPlugin("cpu"))
    model, *_ = booster.boost(TiedLM())
    config = {"d_model": 6, "vocab": 10, "name": "toy", "dropout": 0.0}
    out = booster.export(model, tmp_path / "bundle", config)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert len(load_file(str(out / "model.safetensors"))) == 3  # the tied matrix is stored once

    state, loaded_config = load_exported(out)
    assert loaded_config == {**config, "weights_sha256": file_sha256(out / "model.safetensors")}
    fresh = TiedLM()
    fresh.load_state_dict(state, strict=True)
    idx = torch.arange(10)
    assert torch.equal(fresh(idx), model.unwrap()(idx))
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()

    export_model(model, out, {**config, "name": "v2"})  # replacing an earlier export is fine
    assert load_exported(out)[1]["name"] == "v2"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to replace"):
        export_model(model, out, config)
    with pytest.raises(ValueError, match="JSON"):
        export_model(model, tmp_path / "other", {"bad": object()})
    assert not (tmp_path / "other").exists()


def test_write_json_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run's train_config.json is written atomically: a write that fails midway (here: a value JSON
    cannot hold, or a crash inside the rename) leaves the previous file intact and no temporary file;
    a truncated train_config.json once made a killed run unresumable (the soak test)."""
    path = tmp_path / "train_config.json"
    write_json(path, {"seed": 1, "steps": [1, 2]})
    assert read_json(path) == {"seed": 1, "steps": [1, 2]}
    with pytest.raises(TypeError):
        write_json(path, {"seed": 2, "bad": object()})
    assert read_json(path) == {"seed": 1, "steps": [1, 2]}

    def crash(src, dst):
        raise OSError("killed during the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_json(path, {"seed": 3})
    assert read_json(path) == {"seed": 1, "steps": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["train_config.json"]
    monkeypatch.undo()
    write_json(path, {"seed": 4})
    assert read_json(path) == {"seed": 4}
