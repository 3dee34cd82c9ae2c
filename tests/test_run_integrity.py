"""Faults a long run meets, made the way they happen: a truncated, garbled or overwritten
checkpoint, a kill mid-save, flipped bytes in an export, NaN losses. Each is met with a resume
from the newest intact checkpoint (with a warning), a refusal that names the file, or a skipped
step, never a silent restart from step 0 or a NaN model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tabfm.cli import main
from tabfm.parallel import load_exported
from tabfm.parallel.checkpoint import verify_checkpoint
from tabfm.parallel.sharded_checkpoint import load_full_model_state
from tabfm.parallel.state_io import file_sha256, save_weights
from tabfm.train.metrics_log import read_metrics

FLAGS = ["--preset", "smoke", "--steps", "4", "--ckpt-every", "2", "--log-every", "1", "--eval-batches", "0",
         "--quiet", "--threads", "1"]


def train(out: Path, *extra: str) -> int:
    return main(["pretrain", *FLAGS, "--out", str(out), *extra])


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def flip(path: Path, offset: int = 4096, count: int = 64) -> None:
    """Overwrite `count` bytes in the middle of a file (same size: only a hash can tell)."""
    data = bytearray(path.read_bytes())
    start = min(offset, len(data) - count)
    data[start:start + count] = bytes(255 - b for b in data[start:start + count])
    path.write_bytes(bytes(data))

SHARD = "dcp/shard-00001-model-00001-of-00001.safetensors"  # a one-process checkpoint's tensors (DCP)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "run"
    assert train(out) == 0
    return out


def test_manifest_records_every_file_with_its_sha256(uninterrupted):
    ckpt = uninterrupted / "checkpoints" / "step_000004"
    doc = verify_checkpoint(ckpt)
    assert {SHARD, "optimizer.json", "extra.json"} <= doc["files"].keys()
    for name, entry in doc["files"].items():
        assert entry == {"bytes": (ckpt / name).stat().st_size, "sha256": file_sha256(ckpt / name)}
    config = json.loads((uninterrupted / "export" / "config.json").read_text())
    assert config["weights_sha256"] == file_sha256(uninterrupted / "export" / "model.safetensors")


def test_damaged_newest_checkpoint_resumes_from_the_one_before(uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "export")
    flip(out / "checkpoints" / "step_000004" / SHARD)  # same size: bytes changed
    (out / "checkpoints" / ".tmp-step_000006-123").mkdir()  # what a kill mid-save leaves
    with pytest.warns(UserWarning, match=r"step_000004: .*dcp/shard-00001-model-00001-of-00001.safetensors does not match the sha256"):
        assert train(out, "--steps", "5") == 0
    assert not (out / "checkpoints" / ".tmp-step_000006-123").exists()
    assert train_steps(out) == [1, 2, 3, 4, 5]  # steps 3, 4 redone from step 2 and logged once
    assert [r["checkpoint"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "resume"] == ["step_000002"]


@pytest.mark.parametrize("damage", ["truncate", "no-manifest", "garbled-manifest"])
def test_only_checkpoint_damaged_is_refused_and_restart_starts_over(uninterrupted, tmp_path, capsys, damage):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    for old in ("step_000002",):
        shutil.rmtree(out / "checkpoints" / old)
    ckpt = out / "checkpoints" / "step_000004"
    if damage == "truncate":
        weights = ckpt / SHARD
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "no-manifest":
        (ckpt / "manifest.json").unlink()
    else:
        (ckpt / "manifest.json").write_text("{not json")
    before = (out / "metrics.jsonl").read_text()
    assert train(out, "--steps", "6") == 2
    err = capsys.readouterr().err
    assert "none is intact" in err and "step_000004" in err and "--restart" in err
    assert (out / "metrics.jsonl").read_text() == before  # nothing trained, nothing logged
    assert train(out, "--restart") == 0
    assert train_steps(out) == [1, 2, 3, 4]
    for k, v in load_file(uninterrupted / "export" / "model.safetensors").items():
        assert torch.equal(load_file(out / "export" / "model.safetensors")[k], v), k


def test_export_with_changed_bytes_is_refused_by_name(uninterrupted, tmp_path):
    from tabfm.estimators import TabFMClassifier

    export = tmp_path / "export"
    shutil.copytree(uninterrupted / "export", export)
    flip(export / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors is damaged or was replaced"):
        load_exported(export)
    X, y = np.random.default_rng(0).normal(size=(30, 3)), np.arange(30) % 2
    with pytest.raises(ValueError, match="damaged"):
        TabFMClassifier(model=str(export)).fit(X[:20], y[:20]).predict(X[20:])


def test_shipped_weights_carry_and_pass_their_sha256():
    from tabfm.weights import SHIPPED_MODELS, resolve_model_path

    for name in SHIPPED_MODELS:
        path = resolve_model_path(name)
        assert json.loads((path / "config.json").read_text())["weights_sha256"] == file_sha256(path / "model.safetensors")
        load_exported(path)


def test_non_finite_weights_are_never_exported_nor_loaded(uninterrupted, tmp_path):
    from tabfm.parallel import export_model

    state, config = load_exported(uninterrupted / "export")
    poisoned = {k: v.clone() for k, v in state.items()}
    key = next(k for k, v in poisoned.items() if v.is_floating_point() and v.numel())
    poisoned[key].view(-1)[0] = float("nan")
    holder = torch.nn.Module()
    holder.state_dict = lambda: poisoned  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=f"NaN or infinity.*{key}"):
        export_model(holder, tmp_path / "nan-export", config)
    assert not (tmp_path / "nan-export").exists()
    # a bundle someone else wrote with NaN inside (and a matching hash) is refused on load
    bundle = tmp_path / "foreign"
    bundle.mkdir()
    save_weights(poisoned, bundle / "model.safetensors")
    (bundle / "config.json").write_text(json.dumps({**config, "weights_sha256": file_sha256(bundle / "model.safetensors")}))
    with pytest.raises(ValueError, match="NaN or infinity"):
        load_exported(bundle)


def _nan_loss_at(monkeypatch, bad_calls: set[int] | None):
    """Make the training criterion return NaN on the given calls (None: every call)."""
    import tabfm.train.pretrain as pretrain_module

    real = pretrain_module.masked_cell_loss
    calls = {"n": 0}

    def loss(output, batch):
        calls["n"] += 1
        value, metrics = real(output, batch)
        if bad_calls is None or calls["n"] in bad_calls:
            value = value * float("nan")
        return value, metrics

    monkeypatch.setattr(pretrain_module, "masked_cell_loss", loss)


def test_a_nan_step_is_skipped_counted_and_logged(tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, {2})
    out = tmp_path / "run"
    assert train(out) == 0
    records = read_metrics(out / "metrics.jsonl")
    skipped = [r for r in records if r["kind"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 1 and skipped[0]["loss"] is None
    assert train_steps(out) == [1, 2, 3, 4]  # the step was redone on the next batch
    state, _ = load_exported(out / "export")
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_diverged_run_stops_with_a_checkpoint_from_before(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2") == 0  # two good steps, checkpoint at step 2
    good = load_full_model_state(out / "checkpoints" / "step_000002")
    _nan_loss_at(monkeypatch, None)
    assert train(out, "--max-bad-steps", "3") == 1
    err = capsys.readouterr().err
    assert "3 steps in a row had a non-finite loss" in err and "step_000002" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "skipped"] == [2, 2, 2]
    after = load_full_model_state(out / "checkpoints" / "step_000002")
    for k, v in good.items():
        assert torch.equal(after[k], v), k


def test_estimators_refuse_non_finite_model_outputs():
    from tabfm.estimators import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
    from tabfm.weights import load_model

    import copy

    model = copy.deepcopy(load_model("tabfm-tiny"))  # load_model's instance is shared: poison a copy
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 3)), np.arange(40) % 2
    with pytest.raises(ValueError, match="gave NaN or infinity for .* class probabilities"):
        TabFMClassifier(model=model, n_estimators=1).fit(X[:30], y[:30]).predict_proba(X[30:])
    with pytest.raises(ValueError, match="gave NaN or infinity for .* predictions"):
        TabFMRegressor(model=model, n_estimators=1).fit(X[:30], X[:30, 0]).predict(X[30:])
    with pytest.raises(ValueError, match="gave NaN or infinity for .* anomaly scores"):
        TabFMAnomalyDetector(model=model, n_estimators=1).fit(X[:30]).score_samples(X[30:])
    holes = X.copy()
    holes[[1, 5], [0, 2]] = np.nan
    with pytest.raises(ValueError, match="gave NaN or infinity for .* imputed cells"):
        TabFMImputer(model=model, n_estimators=1, strategy="joint").fit(X[:30]).transform(holes)
    with pytest.raises(ValueError, match="gave NaN or infinity for .* predictions"):  # a column's regressor refuses
        TabFMImputer(model=model, n_estimators=1).fit(X[:30]).transform(holes)


def test_long_estimator_calls_draw_a_progress_bar_unless_told_not_to(capsys):
    from tabfm.estimators import TabFMClassifier

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(60, 3)), np.arange(60) % 3
    TabFMClassifier(n_estimators=3, progress=True).fit(X, y).predict_proba(X[:5])
    err = capsys.readouterr().err
    assert "TabFMClassifier.predict_proba" in err and "/3 [" in err  # 3 members x 1 pass ("auto": one 3-way pass)
    TabFMClassifier(n_estimators=3, progress=False).fit(X, y).predict_proba(X[:5])
    TabFMClassifier(n_estimators=3).fit(X, y).predict_proba(X[:5])  # default: stderr is no terminal here
    assert "predict_proba" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress must be None, True or False"):
        TabFMClassifier(progress="yes").fit(X, y)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_estimator_on_a_missing_cuda_device_says_so():
    from tabfm.estimators import TabFMClassifier

    X, y = np.random.default_rng(0).normal(size=(20, 2)), np.arange(20) % 2
    with pytest.raises(ValueError, match="device='cuda'.*has no CUDA device"):
        TabFMClassifier(device="cuda", n_estimators=1).fit(X, y).predict(X)


def test_corrupt_train_config_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text('{"model": "tiny", ')
    assert train(out) == 2
    assert f"{out / 'train_config.json'}: invalid JSON" in capsys.readouterr().err


def test_a_continuous_looking_target_is_refused_by_the_classifier_with_a_hint(tmp_path, capsys):
    import pandas as pd

    from tabfm.estimators import TabFMClassifier

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    y = rng.integers(0, 187, size=300)  # 187 "classes": a count, not a label
    with pytest.raises(ValueError, match=r"distinct numeric values, more than max_classes=100.*TabFMRegressor"):
        TabFMClassifier(n_estimators=1).fit(X, y)
    with pytest.warns(UserWarning, match=r"multiclass='ovr' runs \d+ passes per ensemble member"):
        TabFMClassifier(n_estimators=1, max_classes=200, multiclass="ovr").fit(X, y)
    frame = pd.DataFrame(X, columns=["a", "b"]).assign(y=y)
    frame.to_csv(tmp_path / "t.csv", index=False)
    assert main(["predict", "--train", str(tmp_path / "t.csv"), "--test", str(tmp_path / "t.csv"), "--target", "y",
                 "--task", "classification"]) == 2
    assert "--task regression" in capsys.readouterr().err



def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    """Killed after logging step 1 but before any checkpoint: the rerun starts at step 0 and its
    metrics log drops the killed attempt's steps (the soak test met this at random)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train", "loss": 1.0}) + "\n")
    assert train(out) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]

@pytest.mark.slow
def test_soak_ten_kills_end_on_the_uninterrupted_weights(tmp_path):
    """`tabfm pretrain` SIGKILLed at 10 random moments in a row (startup, mid-step, mid-save), then
    run to the end: the weights of one uninterrupted run, every step logged once.

    The uninterrupted run is the same command in a process of its own, started first and left
    alone: it trains while this process waits for the moments to kill (the killed runs use one
    core)."""
    import os
    import signal
    import subprocess
    import sys

    flags = ["--preset", "smoke", "--steps", "24", "--ckpt-every", "1", "--log-every", "1", "--eval-batches", "0",
             "--quiet", "--threads", "1"]
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tabfm.cli", "pretrain", *flags, "--out", str(tmp_path / "killed")]
    with open(tmp_path / "whole.log", "w") as log:
        whole = subprocess.Popen([*cmd[:-1], str(tmp_path / "whole")], cwd=repo, env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        rng = np.random.default_rng(7)
        kills = 0
        for _ in range(10):
            proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:  # a run that ends by itself before its moment is not waited for
                proc.wait(float(rng.uniform(2.0, 6.0)))
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
            proc.wait(60)
        assert kills >= 5, "the runs finished before most kills: lengthen the run"
        assert subprocess.run(cmd, cwd=repo, env=env, capture_output=True, timeout=300).returncode == 0
        assert whole.wait(300) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    finally:
        if whole.poll() is None:
            whole.kill()
            whole.wait(60)
    assert train_steps(tmp_path / "whole") == list(range(1, 25))
    assert train_steps(tmp_path / "killed") == list(range(1, 25))
    want = load_file(tmp_path / "whole" / "export" / "model.safetensors")
    got = load_file(tmp_path / "killed" / "export" / "model.safetensors")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
