"""Every engine layout through the command a user runs: `torchrun --nproc_per_node 2 -m tabfm.cli
pretrain` with the smoke preset's defaults (its end-of-run held-out evaluation and export
included), then `tabfm export` of the run's last checkpoint in one process, then a
`TabFMClassifier(model=export)` prediction.

The reference is one process (`--plugin single`) over the same global batch: a run's tables and
random column identities depend only on (seed, step, global micro-batch index), so 2 data-parallel
ranks draw what one process with `--grad-accum 2` draws, tensor / row-sequence parallel ranks
(which split one table) what one process draws, and a pipeline's `--microbatches M` what one
process with `--microbatches M` draws and computes. pp x dp, pp x tp and pp x sp run 4 processes. Losses of every step, the held-out evaluation and
the exported parameters must agree: fp32 to float rounding (1e-4),
bf16 to bf16 rounding (5e-2 on losses and parameters, which start at scale ~1).

CI runs the rows below (fp32 for every layout but the 4-process pp x tp and Gemini's auto and disk
tiers, which tests/test_pretrain_gemini.py checks in one process; Muon and bf16 on FSDP and the
pipeline). TABFM_TEST_FULL_MATRIX=1 runs every layout with both optimizers and both precisions
(this stop: these rows, and zero1 / tp with Muon, gemini / tp in bf16, gemini auto / disk and
pp x tp in fp32, passed; the full product was not run to the end).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tabfm.cli import main
from tabfm.train.metrics_log import read_metrics
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
RUN_TIMEOUT_S = 300  # compiling rows: 3x (inductor compiles every block on each rank)
FLAGS = ["--preset", "smoke", "--steps", str(STEPS), "--log-every", "1", "--quiet", "--threads", "1"]
TOL = {"fp32": 1e-4, "bf16": 5e-2}

PP = ["--plugin", "hybrid", "--pp", "2", "--microbatches", "2"]
# layout -> (plugin flags, processes, data-parallel ranks); --microbatches is shared with the reference
# (--activation-checkpointing changes no number: rows with it match the reference without it)
LAYOUTS: dict[str, tuple[list[str], int, int]] = {
    "ddp": (["--plugin", "ddp", "--activation-checkpointing"], 2, 2),
    "zero1": (["--plugin", "zero", "--zero-stage", "1"], 2, 2),
    "zero2": (["--plugin", "zero", "--zero-stage", "2", "--activation-checkpointing"], 2, 2),
    "fsdp": (["--plugin", "fsdp"], 2, 2),
    "gemini": (["--plugin", "gemini"], 2, 2),
    # a budget that forces parameter evictions and part of the optimizer state off the device
    "gemini-auto": (["--plugin", "gemini", "--gemini-budget-mib", "26", "--gemini-placement", "auto"], 2, 2),
    "gemini-disk": (["--plugin", "gemini", "--gemini-offload-optim", "1.0", "--gemini-disk-dir", "{tmp}/spill"], 2, 2),
    "tp": (["--plugin", "hybrid", "--tp", "2"], 2, 1),
    "sp": (["--plugin", "hybrid", "--sp", "2", "--activation-checkpointing", "--zero-stage", "3"], 2, 1),
    "pp": (PP, 2, 1),
    "pp-dp": ([*PP, "--activation-checkpointing", "--zero-stage", "2"], 4, 2),
    "pp-tp": ([*PP, "--tp", "2"], 4, 1),
    "pp-sp": ([*PP, "--sp", "2"], 4, 1),
    # experts over the 2 data-parallel ranks; the reference is the same mixture-of-experts model
    # in one process (its micro-batches route as each rank's batch does, capacity included)
    "ep": (["--plugin", "hybrid", "--ep", "2", "--moe-experts", "4", "--moe-top-k", "2"], 2, 2),
    "tp-moe": (["--plugin", "hybrid", "--tp", "2", "--moe-experts", "4", "--moe-top-k", "2"], 2, 1),  # expert width over tp
    # every block compiled by inductor under the sharded layouts (the reference runs eager); full
    # matrix only: compiling costs minutes per run on the CI machine (tests/test_compile.py runs one process)
    "fsdp-compile": (["--plugin", "fsdp", "--compile"], 2, 2),
    "sp-compile": (["--plugin", "hybrid", "--sp", "2", "--compile"], 2, 1),
}
MODEL_FLAGS = ("--moe-experts", "--moe-top-k")  # layout flags that change the model: the reference takes them too
MUON_REFUSED = {"gemini", "gemini-auto", "gemini-disk"}  # Gemini steps AdamW on its chunks
CI_ROWS = [  # the suite's budget: gemini auto/disk run one process against --plugin single in test_pretrain_gemini
    *[(layout, "adamw", "fp32") for layout in LAYOUTS
      if layout not in ("pp-tp", "gemini-auto", "gemini-disk", "tp-moe", "fsdp-compile", "sp-compile")],
    ("fsdp", "muon", "fp32"), ("pp", "muon", "fp32"),
    ("fsdp", "adamw", "bf16"),
]
FULL_ROWS = [(layout, opt, prec) for layout in LAYOUTS for opt in ("adamw", "muon") for prec in ("fp32", "bf16")
             if not (opt == "muon" and layout in MUON_REFUSED)]
ROWS = FULL_ROWS if os.environ.get("TABFM_TEST_FULL_MATRIX") == "1" else CI_ROWS


def run_flags(optimizer: str, precision: str) -> list[str]:
    return [*FLAGS, "--optimizer", optimizer, "--precision", precision]


def torchrun_pretrain(out: Path, flags: list[str], nproc: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           "-m", "tabfm.cli", "pretrain", *flags, "--out", str(out)]
    timeout = RUN_TIMEOUT_S * (3 if "--compile" in flags else 1)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"


def metrics(out: Path) -> tuple[list[float], dict[str, float]]:
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals, f"{out}: no end-of-run evaluation was recorded"
    return [r["loss"] for r in train], {k: v for k, v in evals[-1].items() if k not in ("step", "kind")}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs, made on first use: (data-parallel ranks, micro-batches, optimizer, precision,
    model flags) -> run dir."""
    made: dict[tuple[int, str, str, str, tuple[str, ...]], Path] = {}

    def get(dp: int, microbatches: str, optimizer: str, precision: str, model: tuple[str, ...] = ()) -> Path:
        key = (dp, microbatches, optimizer, precision, model)
        if key not in made:
            out = tmp_path_factory.mktemp("single") / f"dp{dp}-m{microbatches}-{optimizer}-{precision}"
            assert main(["pretrain", *run_flags(optimizer, precision), "--plugin", "single", "--grad-accum", str(dp),
                         "--microbatches", microbatches, *model, "--out", str(out)]) == 0
            made[key] = out
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout, optimizer, precision", ROWS, ids=["-".join(r) for r in ROWS])
def test_layout_trains_evaluates_and_exports_like_one_process(layout, optimizer, precision, references, tmp_path):
    from tabfm.estimators import TabFMClassifier

    plugin, nproc, dp = LAYOUTS[layout]
    out = tmp_path / "run"
    torchrun_pretrain(out, run_flags(optimizer, precision) + [a.replace("{tmp}", str(tmp_path)) for a in plugin], nproc)
    microbatches = plugin[plugin.index("--microbatches") + 1] if "--microbatches" in plugin else "1"
    model = tuple(a for i, a in enumerate(plugin) for flag in MODEL_FLAGS
                  if a == flag or (i and plugin[i - 1] == flag))
    ref = references(dp, microbatches, optimizer, precision, model)
    tol = TOL[precision]

    losses, evals = metrics(out)
    ref_losses, ref_evals = metrics(ref)
    np.testing.assert_allclose(losses, ref_losses, atol=tol, rtol=0, err_msg="training loss by step")
    assert evals.keys() == ref_evals.keys()
    np.testing.assert_allclose([evals[k] for k in ref_evals], list(ref_evals.values()), atol=tol, rtol=0,
                               err_msg=f"held-out evaluation {list(ref_evals)}")

    got, want = load_file(out / "export" / "model.safetensors"), load_file(ref / "export" / "model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=tol, rtol=0, msg=k)
    assert json.loads((out / "export" / "config.json").read_text())["model"] == \
        json.loads((ref / "export" / "config.json").read_text())["model"]

    # the run's checkpoint exports in one process to the same weights, and the export predicts
    exported = tmp_path / "exported"
    assert main(["export", str(out), str(exported)]) == 0
    again = load_file(exported / "model.safetensors")
    for k in got:
        assert torch.equal(again[k], got[k]), k
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4))
    y = (X[:, 0] + 0.3 * rng.normal(size=60) > 0).astype(int)
    proba = TabFMClassifier(model=str(exported)).fit(X[:40], y[:40]).predict_proba(X[40:])
    assert proba.shape == (20, 2) and np.allclose(proba.sum(1), 1.0)


def test_activation_checkpointing_on_gemini_is_refused_before_training(tmp_path, capsys):
    assert main(["pretrain", *run_flags("adamw", "fp32"), "--plugin", "gemini", "--activation-checkpointing",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--activation-checkpointing" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_muon_on_gemini_is_refused_before_training(tmp_path, capsys):
    assert main(["pretrain", *run_flags("muon", "fp32"), "--plugin", "gemini", "--out", str(tmp_path / "r")]) == 2
    assert "--optimizer adamw" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_in_one_process(tmp_path):
    """A --pp 2 run stopped at step 2 resumes in one process and ends on the weights of the same
    interruption made in one process (a shorter --steps also shortens the schedule, so the
    reference is interrupted the same way)."""
    flags = [*run_flags("adamw", "fp32"), "--microbatches", "2"]
    first = [a if a != str(STEPS) else "2" for a in flags]
    torchrun_pretrain(tmp_path / "pp", first + PP[:-2], 2)
    assert main(["pretrain", *flags, "--plugin", "single", "--out", str(tmp_path / "pp")]) == 0
    assert main(["pretrain", *first, "--plugin", "single", "--out", str(tmp_path / "one")]) == 0
    assert main(["pretrain", *flags, "--plugin", "single", "--out", str(tmp_path / "one")]) == 0
    resumed = [r for r in read_metrics(tmp_path / "pp" / "metrics.jsonl") if r["kind"] == "resume"]
    assert [r["checkpoint"] for r in resumed] == ["step_000002"]
    got, want = (load_file(tmp_path / n / "export" / "model.safetensors") for n in ("pp", "one"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
