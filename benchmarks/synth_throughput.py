"""Throughput of the synthetic stream: tables/s and cells/s through a DataLoader.

Runs the default prior with 0 (main process), 1 and 2 DataLoader workers, prints a
table and writes JSON. `--profile` adds a cProfile breakdown of one process's
generation time (prior vs episodes vs packing) and the prior's hottest functions,
to show which part to speed up when the 1M cells/s/core target is missed.

    python benchmarks/synth_throughput.py [--batches 24] [--workers 0,1,2] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tabfm.synth.dataset import SynthDataset, SynthLoader  # noqa: E402
from tabfm.synth.stream import StreamConfig, SynthStream  # noqa: E402

TARGET_CELLS_PER_S_PER_CORE = 1_000_000


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(cfg: StreamConfig, seed: int, batches: int, workers: int) -> dict:
    """Generate `batches` batches through a DataLoader; time the first batch (start-up) apart.

    Wall-clock rates depend on what else the machine runs; cells per CPU second
    (all processes, start-up included) is the per-core rate that does not.
    """
    cpu0 = cpu_seconds()
    loader = SynthLoader(SynthDataset(cfg, seed=seed, num_batches=batches), num_workers=workers)
    t0 = time.perf_counter()
    first = None
    tables = cells = 0
    steady_tables = steady_cells = 0
    for i, batch in enumerate(loader):
        if i == 0:
            first = time.perf_counter()
        else:
            steady_tables += len(batch)
            steady_cells += batch.num_cells
        tables += len(batch)
        cells += batch.num_cells
    end = time.perf_counter()
    del loader  # workers are joined when the iterator ends; their CPU time is now counted
    cpu = cpu_seconds() - cpu0
    total, steady = end - t0, max(end - first, 1e-9)
    cores = max(1, min(workers, os.cpu_count() or 1))
    return {
        "workers": workers,
        "batches": batches,
        "tables": tables,
        "cells": cells,
        "seconds": total,
        "startup_s": first - t0,
        "tables_per_s": steady_tables / steady,
        "cells_per_s": steady_cells / steady,
        "cells_per_s_per_core": steady_cells / steady / cores,
        "cpu_s": cpu,
        "cells_per_cpu_s": cells / max(cpu, 1e-9),
    }


def profile(cfg: StreamConfig, seed: int, batches: int, top: int = 12) -> dict:
    """Where one process spends its generation time (cumulative seconds per part)."""
    stream = SynthStream(cfg, seed=seed)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for p in range(batches):
        stream.batch_at(p)
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    by_name: dict[str, float] = {}
    rows = []
    for (file, _, func), (_, _, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{Path(file).name}:{func}"
        by_name[key] = max(by_name.get(key, 0.0), cumtime)
        if "/synth/" in file.replace(os.sep, "/"):
            rows.append((cumtime, tottime, key))
    parts = {
        "sample_table (prior)": by_name.get("prior.py:sample_table", 0.0),
        "episodes": by_name.get("episodes.py:prediction_episode", 0.0) + by_name.get("episodes.py:imputation_episode", 0.0),
        "pack (to TableBatch)": by_name.get("episodes.py:pack", 0.0),
        "shape draw (bucket_at)": by_name.get("stream.py:bucket_at", 0.0),
        "table seeding (table_rng)": by_name.get("stream.py:table_rng", 0.0),
    }
    rows.sort(reverse=True)
    return {
        "wall_s": wall,
        "parts_s": parts,
        "hottest_synth_functions": [{"function": k, "cumulative_s": c, "own_s": t} for c, t, k in rows[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=32, help="batches per run (default 32)")
    ap.add_argument("--workers", default="0,1,2", help="comma-separated worker counts (default 0,1,2)")
    ap.add_argument("--profile", action="store_true", help="add a cProfile breakdown of generation")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "synth_throughput.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = StreamConfig.preset(args.preset)
    results = [measure(cfg, args.seed, args.batches, int(w)) for w in args.workers.split(",")]

    print(f"synth throughput: preset={args.preset} batches={args.batches} cells/batch={cfg.cells_per_batch} "
          f"cpus={os.cpu_count()} (first batch excluded from rates)")
    print(f"{'workers':>7} {'tables/s':>10} {'cells/s':>12} {'cells/s/core':>13} {'cells/cpu-s':>12} {'start-up s':>11} {'total s':>8}")
    for r in results:
        print(f"{r['workers']:>7} {r['tables_per_s']:>10,.1f} {r['cells_per_s']:>12,.0f} "
              f"{r['cells_per_s_per_core']:>13,.0f} {r['cells_per_cpu_s']:>12,.0f} {r['startup_s']:>11.2f} {r['seconds']:>8.2f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.2f} on {os.cpu_count()} cpus (wall rates shrink when the machine is shared)")
    best = max(r["cells_per_cpu_s"] for r in results)
    verdict = "meets" if best >= TARGET_CELLS_PER_S_PER_CORE else "MISSES"
    print(f"best {best:,.0f} cells per CPU second {verdict} the target of {TARGET_CELLS_PER_S_PER_CORE:,} cells/s per core")

    out = {
        "preset": args.preset,
        "seed": args.seed,
        "cells_per_batch": cfg.cells_per_batch,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "target_cells_per_s_per_core": TARGET_CELLS_PER_S_PER_CORE,
        "results": results,
    }
    if args.profile:
        prof = profile(cfg, args.seed, args.batches)
        out["profile"] = prof
        print(f"\nprofile of {args.batches} batches in one process ({prof['wall_s']:.2f} s wall):")
        for name, secs in prof["parts_s"].items():
            print(f"  {name:<28} {secs:>7.2f} s  {100 * secs / prof['wall_s']:>5.1f}%")
        print("  hottest synth/ functions (cumulative s, own s):")
        for row in prof["hottest_synth_functions"]:
            print(f"    {row['function']:<45} {row['cumulative_s']:>7.2f} {row['own_s']:>7.2f}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
