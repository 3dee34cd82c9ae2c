"""`tabfm pretrain --compile` on vs off: train-step time on the stream's batches, side by side.

Each preset trains twice from the same initial weights on the same stream batches (seed 0):
eager, and with every block compiled (`tabfm.parallel.compile_blocks`: `nn.Module.compile`
with dynamic shapes, what `--compile` does). The stream's tables vary in shape from batch to
batch, so the compiled run recompiles until its shape guards cover them: reported are the
total time of the first `--warmup` steps (compiling included) and the median step of the
`--steps` after them, for both runs, and the largest loss difference over the steps (compiled
kernels reorder float sums). Prints a table, writes JSON.

    python benchmarks/compile_step.py                 # tiny and small, ~10 min on one core
    python benchmarks/compile_step.py --quick         # smoke preset, a few steps

`--layouts fsdp,sp` measures the sharded layouts instead, through the real command
(`torchrun --nproc_per_node 2 -m tabfm.cli pretrain --plugin fsdp | hybrid --sp 2`, with and
without `--compile`, same seed and stream): the same columns from each run's metrics.jsonl.
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.parallel import compile_blocks
from tabfm.synth import StreamConfig
from tabfm.synth.dataset import SynthDataset

from common import machine_info


def run(model: TabFM, batches: list, warmup: int) -> tuple[float, list[float], list[float]]:
    """(seconds of the first `warmup` steps, per-step seconds after them, losses) of AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for batch in batches:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, _ = masked_cell_loss(model(batch), batch)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return sum(times[:warmup]), times[warmup:], losses


LAYOUTS = {"ddp": ["--plugin", "ddp"], "fsdp": ["--plugin", "fsdp"], "sp": ["--plugin", "hybrid", "--sp", "2"],
           "zero2": ["--plugin", "zero", "--zero-stage", "2"]}


def run_command(preset: str, layout: str, compiled: bool, warmup: int, steps: int, threads: int) -> dict:
    """One 2-rank `tabfm pretrain` run; (warm-up seconds, timed-step seconds, losses) from its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tabfm.cli", "pretrain",
               "--preset", preset, "--steps", str(warmup + steps), "--log-every", "1", "--eval-batches", "0",
               "--no-sklearn-eval", "--ckpt-every", str(10 * (warmup + steps)), "--threads", str(threads),
               "--seed", "0", "--quiet", "--out", f"{tmp}/run", *LAYOUTS[layout], *(["--compile"] if compiled else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        recs = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    train = [r for r in recs if r.get("kind") == "train"]
    elapsed = [r["elapsed_s"] for r in train]
    times = list(np.diff(elapsed[warmup - 1:]))
    return {"warm": elapsed[warmup - 1], "times": times, "losses": [r["loss"] for r in train],
            "cells": sum(r["cells"] for r in train[warmup:])}


def command_rows(args: argparse.Namespace, presets: list[str], warmup: int, steps: int) -> list[dict]:
    rows = []
    for layout in args.layouts.split(","):
        for name in presets:
            e = run_command(name, layout, False, warmup, steps, args.threads)
            c = run_command(name, layout, True, warmup, steps, args.threads)
            rows.append({"preset": f"{name} {layout}", "eager_warmup_s": e["warm"], "compiled_warmup_s": c["warm"],
                         "eager_step_s": float(np.median(e["times"])), "compiled_step_s": float(np.median(c["times"])),
                         "eager_cells_per_s": e["cells"] / sum(e["times"]),
                         "compiled_cells_per_s": c["cells"] / sum(c["times"]),
                         "speedup": sum(e["times"]) / sum(c["times"]),
                         "max_loss_diff": float(np.max(np.abs(np.subtract(e["losses"], c["losses"]))))})
    return rows


def single_rows(args: argparse.Namespace, presets: list[str], stream: str, warmup: int, steps: int) -> list[dict]:
    it = iter(SynthDataset(StreamConfig.preset(stream), seed=0))
    batches = [next(it) for _ in range(warmup + steps)]
    cells = [int(b.x.numel()) for b in batches]
    rows = []
    for name in presets:
        cfg = ModelConfig.preset(name, **({"n_layers": 1, "d_model": 32, "n_heads": 2} if args.quick else {}))
        torch.manual_seed(0)
        eager = TabFM(cfg)
        compiled = copy.deepcopy(eager)
        compile_blocks(compiled, compiled.parallel_plan())
        torch.manual_seed(1)
        e_warm, e_times, e_loss = run(eager, batches, warmup)
        torch.manual_seed(1)
        c_warm, c_times, c_loss = run(compiled, batches, warmup)
        timed_cells = sum(cells[warmup:])
        rows.append({"preset": name, "eager_warmup_s": e_warm, "compiled_warmup_s": c_warm,
                     "eager_step_s": float(np.median(e_times)), "compiled_step_s": float(np.median(c_times)),
                     "eager_cells_per_s": timed_cells / sum(e_times), "compiled_cells_per_s": timed_cells / sum(c_times),
                     "speedup": sum(e_times) / sum(c_times),
                     "max_loss_diff": float(np.max(np.abs(np.subtract(e_loss, c_loss))))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke preset, tiny stream, few steps")
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--stream", default="pretrain")
    ap.add_argument("--warmup", type=int, default=10, help="steps counted as warm-up (compiling)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--layouts", default="single",
                    help=f"single (in one process, the stream's batches) or a comma list of {', '.join(LAYOUTS)} "
                         "(2 ranks through the real command)")
    ap.add_argument("--json", default=None, help="where to write the JSON record (default "
                    "benchmarks/results/compile_step.json, or compile_layouts.json with --layouts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    presets = ["tiny"] if args.quick else args.presets.split(",")
    stream = "tiny" if args.quick else args.stream
    warmup, steps = (2, 2) if args.quick else (args.warmup, args.steps)
    if args.layouts != "single":
        presets = ["smoke"] if args.quick else presets
        stream = "the presets' own (2 ranks)"
        rows = command_rows(args, presets, warmup, steps)
    else:
        rows = single_rows(args, presets, stream, warmup, steps)
    print(f"stream {stream}, {warmup} warm-up + {steps} timed steps, AdamW, fp32, {args.threads} thread(s)")
    print(f"{'preset':>12} {'warm-up eager s':>16} {'warm-up compiled s':>19} {'step eager s':>13} "
          f"{'step compiled s':>16} {'cells/s eager':>14} {'cells/s compiled':>17} {'speed-up':>9} {'max |dloss|':>12}")
    for r in rows:
        print(f"{r['preset']:>12} {r['eager_warmup_s']:>16.1f} {r['compiled_warmup_s']:>19.1f} {r['eager_step_s']:>13.3f} "
              f"{r['compiled_step_s']:>16.3f} {r['eager_cells_per_s']:>14.0f} {r['compiled_cells_per_s']:>17.0f} "
              f"{r['speedup']:>9.2f} {r['max_loss_diff']:>12.2e}")
    args.json = args.json or f"benchmarks/results/compile_{'step' if args.layouts == 'single' else 'layouts'}.json"
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "stream": stream, "warmup": warmup,
                                           "steps": steps, "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
