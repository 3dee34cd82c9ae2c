"""A 2-rank Gemini run (torchrun, gloo) SIGKILLed in the middle of a step resumes from its last
checkpoint and ends where the uninterrupted single-process reference ends.

The training script is written to a temporary file and launched twice with torchrun: the first
launch kills rank 0 with SIGKILL after the backward of step KILL_STEP (gradients reduce-scattered,
optimizer not yet stepped, disk-tier state files open); torchrun then takes rank 1 down. The
second launch finds the newest complete checkpoint, resumes, and finishes. Its final checkpoint
is compared with `SingleProcessPlugin` trained for all steps in this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tabfm.parallel import latest_checkpoint
from tabfm.parallel.sharded_checkpoint import load_full_model_state
from tests.dist_utils import free_port
from tests.test_gemini import reference

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY, KILL_STEP = 6, 2, 5

SCRIPT = """
import json, os, signal, sys
from pathlib import Path
import torch
from torch import nn
torch.set_num_threads(1)
from tabfm.parallel import Booster, GeminiPlugin, checkpoint_dir, latest_checkpoint, launch
from tests.test_gemini import CONFIGS, data, make_model, make_opt

out, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kill_step = int(os.environ.get("TEST_KILL_STEP", "-1"))
info = launch(backend="gloo", timeout_s=60)
rank, world = info.rank, info.world_size
plugin = GeminiPlugin(chunk_size=2048, disk_dir=out / "disk", **CONFIGS["mix"])
booster = Booster(plugin)
m = make_model()
model, opt, *_ = booster.boost(m, make_opt(m))
start = 0
ckpt = latest_checkpoint(out / "checkpoints")
if ckpt is not None:
    start = booster.load_checkpoint(ckpt, model=model, optimizer=opt)["step"]
x, y = data()
n = x.shape[0] // world
log = []
for s in range(start, steps):
    xs, ys = x.roll(s, 0)[rank * n:(rank + 1) * n], y.roll(s, 0)[rank * n:(rank + 1) * n]
    loss = nn.functional.mse_loss(model(xs), ys)
    booster.backward(loss, opt)
    booster.clip_grad_norm_(opt, 0.5)
    if s + 1 == kill_step and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: gradients reduced, optimizer not stepped
    opt.step()
    opt.zero_grad()
    g = loss.detach().clone()
    torch.distributed.all_reduce(g)
    log.append({"step": s + 1, "loss": float(g) / world})
    if (s + 1) % every == 0:
        booster.save_checkpoint(checkpoint_dir(out / "checkpoints", s + 1), model=model, optimizer=opt,
                                extra={"step": s + 1})
if rank == 0:
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps({"resumed_from": start, "log": log}) + "\\n")
plugin.close()
"""


def torchrun(script: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(out), str(STEPS), str(EVERY)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_sigkilled_two_rank_gemini_run_resumes_to_the_reference(tmp_path):
    script = tmp_path / "train_gemini.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

    killed = torchrun(script, out, {**env, "TEST_KILL_STEP": str(KILL_STEP)})
    assert killed.returncode != 0, f"the run was meant to die at step {KILL_STEP}:\n{killed.stderr[-3000:]}"
    assert latest_checkpoint(out / "checkpoints").name == f"step_{(KILL_STEP - 1) // EVERY * EVERY:06d}"
    assert "exitcode  : -9" in killed.stderr  # rank 0 died of SIGKILL, not of an error
    assert not (out / "runs.jsonl").exists()  # it never finished
    stale = list((out / "disk").iterdir())  # the killed rank's disk tier: no exit-time cleanup ran
    assert stale

    resumed = torchrun(script, out, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    ref_losses, _, ref_state = reference(steps=STEPS)
    start = run["resumed_from"]
    assert start == (KILL_STEP - 1) // EVERY * EVERY
    assert [r["step"] for r in run["log"]] == list(range(start + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in run["log"]]), torch.tensor(ref_losses[start:]),
                               atol=2e-6, rtol=0)
    assert not any(d.exists() for d in stale) and not list((out / "disk").iterdir())  # removed, never reused
    final = load_full_model_state(latest_checkpoint(out / "checkpoints"))
    assert latest_checkpoint(out / "checkpoints").name == f"step_{STEPS:06d}"
    assert final.keys() == ref_state.keys()
    for k, v in final.items():
        torch.testing.assert_close(v, ref_state[k], atol=2e-6, rtol=0, msg=k)
