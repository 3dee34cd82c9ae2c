"""`tabfm pretrain --plugin gemini`: the pretraining run under a Gemini device budget equals the
same run with `--plugin single` (loss trajectory and final weights), resumes from its own
checkpoints, and its flag errors name the flag (under torchrun: tests/test_pretrain_matrix.py).

The reference is SingleProcessPlugin (plain torch AdamW on whole tensors); Gemini steps chunked
fp32 masters in the tier the placement chose, so agreement is to float rounding (measured:
bitwise on these runs; tolerance 1e-6).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tabfm.cli import main
from tabfm.train import PretrainConfig
from tabfm.train.metrics_log import read_metrics
from tabfm.train.pretrain import build_plugin, pretrain

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
TOL = dict(atol=1e-6, rtol=0)
FLAGS = ["--preset", "smoke", "--steps", str(STEPS), "--ckpt-every", "3", "--log-every", "1", "--eval-batches", "0",
         "--no-sklearn-eval", "--quiet", "--threads", "1", "--precision", "fp32"]
# auto under a budget that forces both: parameters cached (evictions) and only part of the
# optimizer state on device, the rest on disk (measured on the smoke model: activations ~21 MiB,
# parameter cache ~1 MiB, 34 chunks of 0.2 MiB each)
GEMINI = ["--plugin", "gemini", "--gemini-budget-mib", "26", "--gemini-placement", "auto"]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def assert_same_run(out: Path, ref: Path) -> None:
    got, want = losses(out), losses(ref)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([l for _, l in got]), torch.tensor([l for _, l in want]), **TOL)
    a, b = load_file(out / "export" / "model.safetensors"), load_file(ref / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=k)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "single"
    assert main(["pretrain", *FLAGS, "--plugin", "single", "--out", str(out)]) == 0
    return out


def first_half(flags: list[str]) -> list[str]:
    """The same run's flags stopped at step 3 (a shorter --steps also shortens the lr schedule,
    so the resumed reference is interrupted the same way)."""
    return [a if a != str(STEPS) else "3" for a in flags]


@pytest.fixture(scope="module")
def single_resumed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "single-resumed"
    assert main(["pretrain", *first_half(FLAGS), "--plugin", "single", "--out", str(out)]) == 0
    assert main(["pretrain", *FLAGS, "--plugin", "single", "--out", str(out)]) == 0
    return out


def test_gemini_auto_run_equals_single_process_run(single_run, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = PretrainConfig.preset("smoke", steps=STEPS, ckpt_every=3, log_every=1, eval_batches=0, threads=1,
                                precision="fp32", plugin="gemini", gemini_budget_mib=26, gemini_placement="auto",
                                gemini_disk_dir=str(tmp_path / "disk"))
    plugin = build_plugin(cfg)
    out = tmp_path / "gemini"
    pretrain(cfg, out, plugin=plugin, progress=False)
    assert_same_run(out, single_run)
    rep = plugin.memory_report()
    assert rep["device_peak_bytes"] <= 26 << 20
    assert rep["evictions"] > 0 and rep["param_tiers"] == ["host"] * rep["n_chunks"]  # parameters really cached
    tiers = set(rep["optim_tiers"])
    assert tiers == {"device", "disk"}, rep["optim_tiers"]  # the budget held part of the optimizer state
    assert json.loads((out / "train_config.json").read_text())["gemini_placement"] == "auto"
    plugin.close()


def test_gemini_cli_run_resumes_from_its_checkpoint(single_resumed, tmp_path, monkeypatch):
    """Static placement with optimizer state on disk, through the command line: 3 steps, stop,
    rerun to 6 (resumes from step 3) == the single-process run interrupted and resumed alike."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "gemini"
    flags = ["--plugin", "gemini", "--gemini-budget-mib", "64", "--gemini-offload-optim", "0.5",
             "--gemini-disk-dir", str(tmp_path / "disk")]
    assert main(["pretrain", *first_half(FLAGS), *flags, "--out", str(out)]) == 0
    assert [s for s, _ in losses(out)] == [1, 2, 3]
    assert main(["pretrain", *FLAGS, *flags, "--out", str(out)]) == 0
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [3]
    assert_same_run(out, single_resumed)
    assert not any((tmp_path / "disk").rglob("*.bin"))  # the disk tier's files are gone after the run


@pytest.mark.parametrize("flags, message", [
    (["--gemini-budget-mib", "0"], "--gemini-budget-mib must be a number of MiB > 0"),
    (["--gemini-offload-optim", "1.5"], "--gemini-offload-optim must be a fraction in [0, 1]"),
    (["--gemini-placement", "auto", "--gemini-offload-optim", "0.5"], "--gemini-offload-optim is for"),
    (["--gemini-disk-dir", "/tmp/x"], "--gemini-disk-dir holds the optimizer state moved off device"),
    (["--optimizer", "muon"], "--optimizer adamw"),
    (["--gemini-budget-mib", "0.01"], "device budget"),  # too small for one module: the plugin's own message
    pytest.param(["--gemini-device", "cuda"], "has no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
])
def test_gemini_flag_errors_name_the_flag(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["pretrain", "--preset", "smoke", "--steps", "1", "--quiet", "--no-sklearn-eval", "--eval-batches", "0",
            "--plugin", "gemini", "--out", str(tmp_path / "r")]
    assert main([*args, *flags]) == 2
    assert message in capsys.readouterr().err


def test_gemini_flags_need_the_gemini_plugin(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["pretrain", "--preset", "smoke", "--steps", "1", "--quiet", "--out", str(tmp_path / "r"),
                 "--gemini-budget-mib", "64"]) == 2
    assert "--gemini-budget-mib configures --plugin gemini, not --plugin single" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        main(["pretrain", "--plugin", "gemini", "--gemini-placement", "fastest"])
    assert "--gemini-placement" in capsys.readouterr().err
