"""`tabfm pretrain` under torchrun (2 gloo ranks) and `tabfm export`.

Every torchrun test runs the real command line in subprocesses and compares final exports
with one uninterrupted 2-rank DDP run (the module fixture): a SIGKILLed run and a run killed
while writing a checkpoint both resume to them. (Every layout against one process:
tests/test_pretrain_matrix.py.) The
single-process tests cover `tabfm export`, resuming a 2-rank checkpoint in one process,
and the command's errors.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tabfm.parallel import latest_checkpoint
from tabfm.parallel.state_io import load_state
from tabfm.synth.stream import StreamConfig, SynthStream
from tabfm.cli import main
from tabfm.train import PretrainConfig
from tabfm.train.metrics_log import read_metrics
from tabfm.train.pretrain import pretrain
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
WORLD, STEPS, CKPT_EVERY = 2, 10, 4
RUN_TIMEOUT_S = 240  # one torchrun launch, on a loaded 2-core machine
FLAGS = ["--preset", "smoke", "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--log-every", "1",
         "--eval-batches", "0", "--no-sklearn-eval", "--quiet", "--threads", "1", "--precision", "fp32"]

# Test harness only: this rank SIGKILLs itself while writing checkpoint KILL_STEP, after the
# weights and state files are in `.tmp-step_*` but before the manifest that completes it.
KILL_IN_SAVE = """
import os, signal, sys
import tabfm.parallel, tabfm.parallel.checkpoint
KILL_STEP = int(os.environ["TEST_KILL_STEP"])
write_manifest = tabfm.parallel.checkpoint.write_manifest

def dying_write_manifest(ckpt, meta, checkpoint_io):
    if meta.step == KILL_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return write_manifest(ckpt, meta, checkpoint_io)

for name, module in list(sys.modules.items()):  # every checkpoint IO that imported it by name
    if name.startswith("tabfm.parallel") and getattr(module, "write_manifest", None) is write_manifest:
        module.write_manifest = dying_write_manifest
from tabfm.cli import main
sys.exit(main())
"""


# --------------------------------------------------------------------------- torchrun helpers

def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def torchrun(out: Path, *args: str, script: Path | None = None, env: dict[str, str] | None = None,
             plugin: tuple[str, ...] = ("--plugin", "ddp"), nproc: int = WORLD) -> subprocess.Popen:
    """Start `torchrun --nproc_per_node 2 -m tabfm.cli pretrain ...` in its own process group;
    its output goes to out.parent / (out.name + ".log")."""
    target = [str(script)] if script is not None else ["-m", "tabfm.cli"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *target, "pretrain", *FLAGS, *plugin, "--out", str(out), *args]
    log = open(_log(out), "a")
    try:
        return subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


def _log(out: Path) -> Path:
    return out.parent / f"{out.name}.log"


def _tail(out: Path, n: int = 40) -> str:
    lines = _log(out).read_text(errors="replace").splitlines() if _log(out).exists() else []
    return "\n".join(lines[-n:])


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank it started, all at once (a crash, not a shutdown), and
    wait until they are gone."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids[1:]):
        assert time.monotonic() < deadline, f"processes {pids} survived SIGKILL"
        time.sleep(0.05)


def wait(proc: subprocess.Popen, out: Path, expect_ok: bool = True) -> int:
    """The exit code of a launch; a launch that outlives RUN_TIMEOUT_S is killed and fails the test."""
    try:
        rc = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"torchrun for {out} did not finish in {RUN_TIMEOUT_S} s:\n{_tail(out)}")
    if expect_ok:
        assert rc == 0, f"torchrun for {out} exited with {rc}:\n{_tail(out)}"
    return rc


def run_to_end(out: Path, *args: str, **kw) -> Path:
    wait(torchrun(out, *args, **kw), out)
    return out


# --------------------------------------------------------------------------- checks

def export_params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "export" / "model.safetensors"))


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def logged_so_far(out: Path) -> list[int]:
    """Train steps logged by a run that is still writing (a half-written last line is not read)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def resumes(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "resume"]


def checkpoint_trainer_state(ckpt: Path) -> dict:
    return load_state(ckpt / "extra")["trainer"]


def step_of(ckpt: Path | None) -> int:
    return -1 if ckpt is None else int(ckpt.name.removeprefix("step_"))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank DDP reference run."""
    return run_to_end(tmp_path_factory.mktemp("ddp") / "run")


# --------------------------------------------------------------------------- torchrun tests

@pytest.mark.slow
def test_ddp_run_logs_once_with_global_counts_and_per_rank_streams(ddp_run):
    assert train_steps(ddp_run) == list(range(1, STEPS + 1))  # rank 0 alone writes metrics
    assert json.loads((ddp_run / "train_config.json").read_text())["plugin"] == "ddp"
    state = checkpoint_trainer_state(latest_checkpoint(ddp_run / "checkpoints"))
    assert state["step"] == STEPS
    assert state["data_ranks"] == [{"seed": 0, "position": STEPS}] * WORLD
    cfg = PretrainConfig.preset("smoke")
    streams = [SynthStream(StreamConfig.preset(cfg.stream), seed=cfg.seed, rank=r, world_size=WORLD) for r in range(WORLD)]
    assert state["cells"] == sum(s.batch_at(p).num_cells for s in streams for p in range(STEPS))  # global, not rank 0's


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_uninterrupted_result(ddp_run, tmp_path):
    out = tmp_path / "killed"
    proc = torchrun(out)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:  # until a checkpoint exists and training went on for two more steps
        ckpt = latest_checkpoint(out / "checkpoints")
        logged = logged_so_far(out)
        if ckpt is not None and logged and logged[-1] >= step_of(ckpt) + 2:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            pytest.fail(f"the run ended or stalled before it could be killed (rc {proc.returncode}):\n{_tail(out)}")
        time.sleep(0.02)
    kill_group(proc)
    killed_at = step_of(latest_checkpoint(out / "checkpoints"))
    assert train_steps(out)[-1] > killed_at, "the killed run logged steps after its last checkpoint"
    assert killed_at < STEPS and not (out / "export").exists(), "killed too late: the run had finished"

    run_to_end(out)
    assert [(r["step"], r["checkpoint"], r["checkpoint_world_size"]) for r in resumes(out)] == \
        [(killed_at, f"step_{killed_at:06d}", WORLD)]
    assert train_steps(out) == list(range(1, STEPS + 1))  # the steps redone after the checkpoint logged once
    assert_same_params(export_params(out), export_params(ddp_run), atol=1e-6)


@pytest.mark.slow
def test_kill_during_checkpoint_write_resumes_from_the_previous_one(ddp_run, tmp_path):
    out, kill_step = tmp_path / "killed-in-save", 2 * CKPT_EVERY
    script = tmp_path / "kill_in_save.py"
    script.write_text(KILL_IN_SAVE)
    rc = wait(torchrun(out, script=script, env=_env(TEST_KILL_STEP=str(kill_step))), out, expect_ok=False)
    assert rc != 0, f"the run was meant to die while writing step {kill_step}:\n{_tail(out)}"
    root = out / "checkpoints"
    partial = [d.name for d in root.iterdir() if d.name.startswith(f".tmp-step_{kill_step:06d}")]
    assert partial, f"no partial checkpoint left behind: {sorted(os.listdir(root))}"
    assert step_of(latest_checkpoint(root)) == CKPT_EVERY  # the partial one does not count

    run_to_end(out)
    assert [r["step"] for r in resumes(out)] == [CKPT_EVERY]
    assert_same_params(export_params(out), export_params(ddp_run), atol=1e-6)
    assert not [d for d in os.listdir(root) if d.startswith(".tmp-")]  # the stale write was cleaned up


@pytest.mark.slow
def test_two_rank_checkpoint_exports_in_one_process_and_resumes_at_another_world_size(ddp_run, tmp_path):
    # export in one process from the run directory = the run's own export
    assert main(["export", str(ddp_run), str(tmp_path / "exported")]) == 0
    assert_same_params(load_file(str(tmp_path / "exported" / "model.safetensors")), export_params(ddp_run))
    # resume the 2-rank step-4 checkpoint with 1 rank: the checkpoint reshards, the stream goes on
    run = tmp_path / "one-rank"
    ckpt = ddp_run / "checkpoints" / f"step_{CKPT_EVERY:06d}"
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    shutil.copy(ddp_run / "train_config.json", run / "train_config.json")
    run_to_end(run, "--steps", str(CKPT_EVERY + 1), nproc=1)
    assert [(r["step"], r["world_size"], r["checkpoint_world_size"]) for r in resumes(run)] == [(CKPT_EVERY, 1, WORLD)]
    state = checkpoint_trainer_state(latest_checkpoint(run / "checkpoints"))
    assert state["step"] == CKPT_EVERY + 1
    assert state["data_ranks"] == [{"seed": 0, "position": CKPT_EVERY + 1}]


# --------------------------------------------------------------------------- one process

@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    pretrain(PretrainConfig.preset("smoke", steps=4, ckpt_every=2, eval_batches=0, threads=1), out, progress=False)
    return out


def test_export_from_a_checkpoint_equals_the_runs_export(single_run, tmp_path, capsys):
    from tabfm.weights import load_model

    out = tmp_path / "exported"
    assert main(["export", str(single_run), str(out)]) == 0
    assert "step_000004" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    unsigned = lambda d: {k: v for k, v in d.items() if k != "weights_sha256"}  # noqa: E731  (tied names may reorder bytes)
    assert unsigned(json.loads((out / "config.json").read_text())) == \
        unsigned(json.loads((single_run / "export" / "config.json").read_text()))
    assert_same_params(load_file(str(out / "model.safetensors")), export_params(single_run))
    model = load_model(str(out))
    assert sum(p.numel() for p in model.parameters()) > 0
    # an older checkpoint, named directly, exports its own weights
    assert main(["export", str(single_run / "checkpoints" / "step_000002"), str(tmp_path / "older")]) == 0
    older = load_file(str(tmp_path / "older" / "model.safetensors"))
    assert any(not torch.equal(older[k], v) for k, v in export_params(single_run).items())


def test_export_errors_name_the_problem(single_run, tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
    lonely = tmp_path / "lonely"  # a checkpoint copied away from its run: no train_config.json
    shutil.copytree(single_run / "checkpoints" / "step_000004", lonely)
    assert main(["export", str(lonely), str(tmp_path / "y")]) == 2
    assert "--train-config" in capsys.readouterr().err
    assert main(["export", str(lonely), str(tmp_path / "y"), "--train-config", str(single_run / "train_config.json")]) == 0


@pytest.mark.slow
def test_single_process_resumes_a_two_rank_sharded_checkpoint(ddp_run, tmp_path):
    """--plugin single reads the DDP run's sharded (DCP) checkpoint: same weights as the 2-rank
    run at that step, then one more step in this process."""
    run = tmp_path / "single"
    ckpt = ddp_run / "checkpoints" / f"step_{CKPT_EVERY:06d}"
    assert json.loads((ckpt / "manifest.json").read_text())["checkpoint_io"] == "sharded"
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    shutil.copy(ddp_run / "train_config.json", run / "train_config.json")
    cfg = PretrainConfig.preset("smoke", steps=CKPT_EVERY + 1, ckpt_every=CKPT_EVERY, log_every=1, eval_batches=0,
                                eval_sklearn=False, threads=1, precision="fp32", plugin="single")
    result = pretrain(cfg, run, progress=False)
    assert result.step == CKPT_EVERY + 1
    assert [(r["step"], r["world_size"], r["checkpoint_world_size"]) for r in resumes(run)] == [(CKPT_EVERY, 1, WORLD)]
    assert train_steps(run) == [CKPT_EVERY + 1]


def test_plugin_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    args = ["pretrain", "--preset", "smoke", "--steps", "1", "--out", str(tmp_path / "r"), "--quiet"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*args, "--plugin", "ddp"]) == 2
    assert "torchrun --nproc_per_node N" in capsys.readouterr().err
    assert main([*args, "--plugin", "ddp", "--zero-stage", "2"]) == 2
    assert "--zero-stage applies to --plugin zero" in capsys.readouterr().err
    for plugin, stage in (("zero", "3"), ("hybrid", "1")):
        assert main([*args, "--plugin", plugin, "--zero-stage", stage]) == 2
        assert f"--zero-stage {stage} with --plugin {plugin}" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*args, "--plugin", "single"]) == 2
    assert "use --plugin ddp" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
