"""Mixture of experts against the dense table transformer at equal active parameters per cell.

    python benchmarks/moe_vs_dense.py                          # all three parts, tiny, 1 thread
    python benchmarks/moe_vs_dense.py --parts step,ep --steps 4 --out runs/moe.json   # quick

Variants (tiny preset, every block's MLP): dense (hidden 2 d); E experts with top-1 routing of
hidden 2 d each (one expert per token: the dense MLP's active size); E experts with top-2 routing
of hidden d each (two half-size experts per token: again the dense active size). E = 4, 8.

Parts:
    step   one process: parameters (total, and active per token), AdamW state bytes, and the
           train step's CPU time (`time.process_time`, 1 thread: the work the step needed on a
           core, not what a loaded machine's scheduler gave it) and cells/s on the same
           `pretrain-mixed` batches (of `--step-cells` padded cells: the ratios, cheaper).
    ep     2 gloo processes (HybridParallelPlugin, the same batches on each rank pair): dense,
           and each MoE variant at ep = 1 (every rank holds every expert) and ep = 2 (half the
           experts each; tokens cross by all_to_all): parameter and AdamW bytes per rank, step
           CPU time per rank.
    learn  from scratch, each variant trained for the same CPU budget (`--budget-cpu-s` of train
           steps: forward, backward, AdamW; the stream's table generation is not counted),
           then its held-out loss on the same 32 held-out batches (`benchmarks/heldout_loss.py`'s).

Prints a table per part and writes JSON (`--out`). The machine is shared: compare the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from benchmarks.common import machine_info  # noqa: E402
from tabfm.model import ModelConfig, TabFM, masked_cell_loss  # noqa: E402
from tabfm.synth.stream import StreamConfig, SynthStream  # noqa: E402
from tabfm.train.evaluate import batch_metrics, heldout_batches  # noqa: E402
from tabfm.train.optim import build_optimizer  # noqa: E402

STREAM = "pretrain-mixed"
# name -> ModelConfig overrides of the tiny preset (mlp_ratio 2: the dense hidden is 2 d)
VARIANTS = {
    "dense": {},
    "E4-top1": dict(moe_experts=4, moe_top_k=1),
    "E8-top1": dict(moe_experts=8, moe_top_k=1),
    "E4-top2": dict(moe_experts=4, moe_top_k=2, mlp_ratio=1.0),
    "E8-top2": dict(moe_experts=8, moe_top_k=2, mlp_ratio=1.0),
}


def make_model(name: str, seed: int = 0) -> TabFM:
    torch.manual_seed(seed)
    return TabFM(ModelConfig.preset("tiny", **VARIANTS[name]))


def active_parameters(model: TabFM) -> int:
    """Parameters one token's forward uses: all but the experts it is not routed to."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    if not cfg.moe_experts:
        return total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total - experts + experts * cfg.moe_top_k // cfg.moe_experts


def nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def adam_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())


def train_step(model, opt, batch) -> float:
    loss, _ = masked_cell_loss(model(batch), batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# ----------------------------------------------------------------------------------- step
def part_step(steps: int, seed: int, cells: int) -> list[dict]:
    stream = SynthStream(StreamConfig.preset(STREAM, cells_per_batch=cells), seed=seed)
    batches = [stream.batch_at(p) for p in range(steps + 2)]
    rows = []
    for name in VARIANTS:
        model = make_model(name).train()
        opt = build_optimizer(model, "adamw", lr=1e-3)
        cpu, cells = 0.0, 0
        for i, batch in enumerate(batches):
            c0 = time.process_time()
            train_step(model, opt, batch)
            if i >= 2:  # two warm-up steps (optimizer state allocated)
                cpu += time.process_time() - c0
                cells += int(batch.query.sum())
        rows.append({"variant": name, "parameters": sum(p.numel() for p in model.parameters()),
                     "active_parameters": active_parameters(model), "adam_bytes": adam_bytes(opt),
                     "step_cpu_ms": 1e3 * cpu / steps, "cells_per_cpu_s": cells / cpu})
        print(f"[moe_vs_dense] step {name}: {rows[-1]['step_cpu_ms']:.0f} ms", file=sys.stderr, flush=True)
    dense = rows[0]["cells_per_cpu_s"]
    for r in rows:
        r["speed_vs_dense"] = r["cells_per_cpu_s"] / dense
    return rows


# ------------------------------------------------------------------------------------- ep
def ep_worker(rank: int, world: int, steps: int, seed: int, cells: int) -> list[dict]:
    import torch.distributed as dist

    from tabfm.parallel import Booster, HybridParallelPlugin

    stream = SynthStream(StreamConfig.preset(STREAM, cells_per_batch=cells), seed=seed, rank=rank, world_size=world)
    batches = [stream.batch_at(p) for p in range(steps + 2)]
    layouts = [("dense", 1)] + [(n, ep) for n in VARIANTS if n != "dense" for ep in (1, 2)]
    rows = []
    for name, ep in layouts:
        booster = Booster(HybridParallelPlugin(ep_size=ep))
        module = make_model(name)
        model, opt, crit, _, _ = booster.boost(module, build_optimizer(module, "adamw", lr=1e-3), masked_cell_loss)
        model.train()
        cpu = 0.0
        for i, batch in enumerate(batches):
            dist.barrier()
            c0 = time.process_time()
            loss, _ = crit(model(batch), batch)
            booster.backward(loss, opt)
            booster.clip_grad_norm_(opt, 1.0)
            opt.step()
            opt.zero_grad()
            if i >= 2:
                cpu += time.process_time() - c0
        rows.append({"variant": name, "ep": ep, "param_bytes": sum(nbytes(p) for p in module.parameters()),
                     "adam_bytes": adam_bytes(opt.unwrap() if hasattr(opt, "unwrap") else opt),
                     "step_cpu_ms": 1e3 * cpu / steps})
        del booster, model, opt
    return rows


def part_ep(steps: int, seed: int, cells: int) -> list[dict]:
    from tests.dist_utils import run_distributed

    per_rank = run_distributed(ep_worker, world_size=2, args=(steps, seed, cells), timeout_s=3600)
    rows = []
    for r0, r1 in zip(*per_rank):
        rows.append({**r0, "param_bytes": max(r0["param_bytes"], r1["param_bytes"]),
                     "adam_bytes": max(r0["adam_bytes"], r1["adam_bytes"]),
                     "step_cpu_ms": (r0["step_cpu_ms"] + r1["step_cpu_ms"]) / 2})
    return rows


# ---------------------------------------------------------------------------------- learn
def part_learn(budget_cpu_s: float, seed: int, heldout: int) -> list[dict]:
    held = heldout_batches(StreamConfig.preset(STREAM), seed, heldout)
    rows = []
    for name in VARIANTS:
        model = make_model(name, seed).train()
        opt = build_optimizer(model, "adamw", lr=1e-3)
        stream = SynthStream(StreamConfig.preset(STREAM), seed=seed)
        cpu, steps, cells, position = 0.0, 0, 0, 0
        while cpu < budget_cpu_s:
            batch = stream.batch_at(position)
            position += 1
            c0 = time.process_time()
            for g in opt.param_groups:  # linear warm-up over 20 steps, then constant
                g["lr"] = 1e-3 * min(1.0, (steps + 1) / 20)
            train_step(model, opt, batch)
            cpu += time.process_time() - c0
            steps += 1
            cells += int(batch.query.sum())
        model.eval()
        metrics = batch_metrics(model, held)
        rows.append({"variant": name, "train_cpu_s": cpu, "steps": steps, "cells": cells, **metrics})
        print(f"[moe_vs_dense] learn {name}: {steps} steps, held-out loss {metrics['loss']:.4f}",
              file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------------- report
def print_tables(out: dict) -> None:
    if "step" in out:
        print(f"\none process, train step on the same batches of {out['args']['step_cells']:,} padded cells "
              "(CPU time, 1 thread)\n")
        print("| variant | parameters | active / token | AdamW state | step CPU ms | cells / CPU s | vs dense |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in out["step"]:
            print(f"| {r['variant']} | {r['parameters']:,} | {r['active_parameters']:,} | "
                  f"{r['adam_bytes'] / 2**20:.2f} MiB | {r['step_cpu_ms']:.0f} | {r['cells_per_cpu_s']:,.0f} | "
                  f"{r['speed_vs_dense']:.2f}x |")
    if "ep" in out:
        print("\n2 processes (HybridParallelPlugin), per rank (step CPU time: the mean of the ranks)\n")
        print("| variant | ep | parameter bytes | AdamW state | step CPU ms |")
        print("|---|---:|---:|---:|---:|")
        for r in out["ep"]:
            print(f"| {r['variant']} | {r['ep']} | {r['param_bytes'] / 2**20:.2f} MiB | "
                  f"{r['adam_bytes'] / 2**20:.2f} MiB | {r['step_cpu_ms']:.0f} |")
    if "learn" in out:
        print(f"\nfrom scratch, {out['args']['budget_cpu_s']:.0f} CPU s of train steps each, then "
              f"{out['args']['heldout']} held-out {STREAM} batches\n")
        print("| variant | steps | cells | held-out loss | cat NLL | cat acc | num NLL |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in out["learn"]:
            print(f"| {r['variant']} | {r['steps']} | {r['cells']:,} | {r['loss']:.4f} | {r['cat_nll']:.4f} | "
                  f"{r['cat_acc']:.4f} | {r['num_nll']:.4f} |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="step,ep,learn")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (step, ep)")
    p.add_argument("--step-cells", dest="step_cells", type=int, default=16384,
                   help="step, ep: padded cells per batch (per rank; at least the stream's max_cells, 16,384)")
    p.add_argument("--budget-cpu-s", dest="budget_cpu_s", type=float, default=240.0,
                   help="learn: CPU seconds of train steps per variant")
    p.add_argument("--heldout", type=int, default=32, help="learn: held-out batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/moe_vs_dense.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    out: dict = {"args": vars(args), "machine": machine_info()}
    if "step" in parts:
        out["step"] = part_step(args.steps, args.seed, args.step_cells)
    if "ep" in parts:
        out["ep"] = part_ep(args.steps, args.seed, args.step_cells)
    if "learn" in parts:
        out["learn"] = part_learn(args.budget_cpu_s, args.seed, args.heldout)
    print_tables(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    main()
