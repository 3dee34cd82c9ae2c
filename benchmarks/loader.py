"""Bucketed loading of real tables: loader throughput and the data-parallel straggler effect.

(a) Throughput: a store of random mixed-type tables (log-uniform sizes) is read, encoded and
    batched through `BucketedTableLoader` with 0, 1 and 2 DataLoader workers; cells/s is set
    against what training consumes (tabfm-tiny, ~12.7k cells/s on one core, BENCHMARKS.md).
(b) Straggler simulation: per-step max/mean rank cost (padded cells) at 2, 4 and 8 ranks for a
    wide store-like size distribution (log-uniform rows 5..5000, columns 2..300), bucketed
    (`BucketedTableSampler`) vs naive (shuffled tables dealt to ranks, chunks of B padded to
    the largest table).

    python benchmarks/loader.py [--quick] [--tables 120] [--sim-tables 10000] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tabfm.data import encode_frame  # noqa: E402
from tabfm.data.bucketing import BucketedTableLoader, BucketedTableSampler, encoded_cols, step_balance  # noqa: E402

try:
    from tabfm.data import store  # noqa: E402
except ImportError:  # the store lands separately; (b) needs only sizes
    store = None

TRAIN_CELLS_PER_S = 12_700  # tabfm-tiny pretraining, one thread (BENCHMARKS.md, "Shipped weights")


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def wide_sizes(n: int, seed: int, rows=(5, 5000), cols=(2, 300)) -> list[tuple[int, int]]:
    """Log-uniform rows and columns, rounded down."""
    rng = np.random.default_rng(seed)
    r = np.exp(rng.uniform(np.log(rows[0]), np.log(rows[1] + 1), n)).astype(int)
    c = np.exp(rng.uniform(np.log(cols[0]), np.log(cols[1] + 1), n)).astype(int)
    return list(zip(r.tolist(), c.tolist()))


def random_frame(rows: int, cols: int, rng: np.random.Generator) -> pd.DataFrame:
    """A mixed table: ~70 % float columns (5 % missing), 15 % string categories, 10 % ints, 5 % booleans."""
    kinds = rng.choice(4, size=cols, p=[0.70, 0.15, 0.10, 0.05])
    data = {}
    for j, k in enumerate(kinds):
        if k == 0:
            v = rng.normal(size=rows)
            v[rng.random(rows) < 0.05] = np.nan
        elif k == 1:
            v = rng.choice(np.array([f"v{u}" for u in range(int(rng.integers(2, 12)))]), size=rows)
        elif k == 2:
            v = rng.integers(0, 1000, size=rows)
        else:
            v = rng.random(rows) < 0.3
        data[f"c{j}"] = v
    return pd.DataFrame(data)


class StoreTables:
    """load(i): read table i of the store and encode it (what a DataLoader worker runs)."""

    def __init__(self, headers):
        self.headers = headers

    def __call__(self, i: int):
        return encode_frame(store.read_table(self.headers[i]))[0]


# ------------------------------------------------------------------ (a) throughput
def build_store(path: Path, sizes: list[tuple[int, int]], seed: int) -> list:
    rng = np.random.default_rng(seed)
    for i, (r, c) in enumerate(sizes):
        store.write_table(path, f"t{i:05d}", random_frame(r, c, rng))
    return store.list_store(path)


def measure_loader(headers, workers: int, cells_per_batch: int, max_batch: int, seed: int) -> dict:
    """One epoch through BucketedTableLoader; the first batch (start-up) timed apart.

    cells = real cells delivered in TableBatches (oversize tables are row-subsampled to the
    budget after being read and encoded whole); source_cells = cells of the tables read.
    """
    sizes = [(h.n_rows, encoded_cols(h)) for h in headers]
    sampler = BucketedTableSampler(sizes, cells_per_batch=cells_per_batch, max_batch=max_batch, seed=seed)
    loader = BucketedTableLoader(sampler, StoreTables(headers), return_plans=True, num_workers=workers)
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    first = None
    cells = padded = batches = steady_cells = source = 0
    for i, (plan, batch) in enumerate(loader):
        n = batch.num_cells
        source += sum(headers[k].n_rows * headers[k].n_cols for k in plan.indices)
        if i == 0:
            first = time.perf_counter()
        else:
            steady_cells += n
        cells += n
        padded += batch.x.numel()
        batches += 1
    end = time.perf_counter()
    del loader
    cpu = cpu_seconds() - cpu0
    steady = max(end - first, 1e-9)
    return {
        "workers": workers, "batches": batches, "cells": cells, "padded_cells": padded,
        "padding": 1 - cells / max(padded, 1), "seconds": end - t0, "startup_s": first - t0,
        "cells_per_s": steady_cells / steady, "cells_per_cpu_s": cells / max(cpu, 1e-9), "cpu_s": cpu,
        "source_cells": source, "source_cells_per_cpu_s": source / max(cpu, 1e-9),
        "vs_training": steady_cells / steady / TRAIN_CELLS_PER_S,
    }


# ------------------------------------------------------------------ (b) stragglers
def naive_costs(sizes, world_size: int, per_batch: int, cells_per_batch: int, seed: int) -> np.ndarray:
    """Shuffled tables, rank r takes every world_size-th; chunks of per_batch padded to the largest.

    Oversize tables are cut to cells_per_batch // cols rows, as the sampler does, so the
    comparison is about batching only. Returns per-step, per-rank padded cells.
    """
    rows = np.array([min(r, cells_per_batch // c) for r, c in sizes])
    cols = np.array([c for _, c in sizes])
    order = np.random.default_rng(seed).permutation(len(sizes))
    steps = len(order) // (world_size * per_batch)
    costs = np.zeros((steps, world_size))
    for r in range(world_size):
        mine = order[r::world_size][: steps * per_batch].reshape(steps, per_batch)
        costs[:, r] = per_batch * rows[mine].max(1) * cols[mine].max(1)
    real = sum(rows[i] * cols[i] for i in order[: steps * per_batch * world_size])
    return costs, real


def straggler_sim(sizes, ranks: list[int], cells_per_batch: int, max_batch: int, seed: int) -> list[dict]:
    out = []
    for w in ranks:
        s = BucketedTableSampler(sizes, cells_per_batch=cells_per_batch, max_batch=max_batch, world_size=w, seed=seed)
        steps = s.steps(0)
        costs = np.array([[p.cost for p in step] for step in steps])
        cells = sum(p.cells for step in steps for p in step)
        per_batch = float(np.mean([len(p.indices) for step in steps for p in step]))
        out.append({"ranks": w, "method": "bucketed", "tables_per_batch": per_batch,
                    "padding": 1 - cells / costs.sum(), "dropped_tables": len(s.dropped(0)),
                    "mean_step_cost": float(costs.max(1).mean()), **step_balance(costs)})
        for b in sorted({1, 8}):
            nc, real = naive_costs(sizes, w, b, cells_per_batch, seed)
            out.append({"ranks": w, "method": f"naive B={b}", "tables_per_batch": float(b),
                        "padding": 1 - real / nc.sum(), "dropped_tables": len(sizes) - nc.shape[0] * w * b,
                        "mean_step_cost": float(nc.max(1).mean()), **step_balance(nc)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small store and simulation (seconds; the smoke run)")
    ap.add_argument("--tables", type=int, default=None, help="tables in the throughput store (default 120, quick 24)")
    ap.add_argument("--sim-tables", type=int, default=None, help="tables in the straggler simulation (default 10000, quick 2000)")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--cells-per-batch", type=int, default=2**18)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "loader.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n_tables = args.tables or (24 if args.quick else 120)
    n_sim = args.sim_tables or (2000 if args.quick else 10000)
    store_rows, store_cols = ((5, 1000), (2, 60)) if args.quick else ((5, 5000), (2, 300))
    out = {"quick": args.quick, "seed": args.seed, "cells_per_batch": args.cells_per_batch, "max_batch": args.max_batch,
           "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
           "train_cells_per_s": TRAIN_CELLS_PER_S}

    # (a)
    if store is None:
        print("data/store.py not available: skipping (a) loader throughput")
        out["throughput"] = None
    else:
        sizes = wide_sizes(n_tables, args.seed + 1, store_rows, store_cols)
        tmp = Path(tempfile.mkdtemp(prefix="tabfm-loader-"))
        try:
            t0 = time.perf_counter()
            headers = build_store(tmp, sizes, args.seed)
            build_s = time.perf_counter() - t0
            results = [measure_loader(headers, int(w), args.cells_per_batch, args.max_batch, args.seed)
                       for w in args.workers.split(",")]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        total = sum(r * c for r, c in sizes)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        out["throughput"] = {"tables": n_tables, "rows": store_rows, "cols": store_cols, "source_cells": total,
                             "store_build_s": build_s, "load_average": load, "results": results}
        print(f"(a) store -> read -> encode -> bucketed TableBatch: {n_tables} tables, {total:,} cells "
              f"(rows {store_rows[0]}..{store_rows[1]}, cols {store_cols[0]}..{store_cols[1]} log-uniform), "
              f"cells/batch <= {args.cells_per_batch:,}, load {load:.2f} on {os.cpu_count()} cpus")
        print(f"{'workers':>7} {'batches':>7} {'cells/s':>11} {'cells/cpu-s':>12} {'read cells/cpu-s':>16} "
              f"{'padding':>8} {'start-up s':>10} {'total s':>8} {'x training':>10}")
        for r in results:
            print(f"{r['workers']:>7} {r['batches']:>7} {r['cells_per_s']:>11,.0f} {r['cells_per_cpu_s']:>12,.0f} "
                  f"{r['source_cells_per_cpu_s']:>16,.0f} {r['padding']:>8.3f} {r['startup_s']:>10.2f} "
                  f"{r['seconds']:>8.2f} {r['vs_training']:>10.0f}")
        print(f"cells = real cells delivered (first batch excluded from cells/s); read cells = cells of the tables "
              f"read and encoded; 'x training' = cells/s over the {TRAIN_CELLS_PER_S:,} cells/s tabfm-tiny "
              f"consumes on one core")

    # (b)
    sizes = wide_sizes(n_sim, args.seed)
    sim = straggler_sim(sizes, [2, 4, 8], args.cells_per_batch, args.max_batch, args.seed)
    out["straggler"] = {"tables": n_sim, "rows": [5, 5000], "cols": [2, 300], "results": sim}
    print(f"\n(b) per-step rank cost (padded cells), {n_sim} tables, rows 5..5000 x cols 2..300 log-uniform, "
          f"cells/batch <= {args.cells_per_batch:,}, max_batch {args.max_batch}")
    print(f"{'ranks':>5} {'method':<11} {'steps':>6} {'tables/b':>8} {'max/mean':>9} {'p95':>7} {'worst':>7} "
          f"{'efficiency':>10} {'padding':>8} {'dropped':>7}")
    for r in sim:
        print(f"{r['ranks']:>5} {r['method']:<11} {r['steps']:>6} {r['tables_per_batch']:>8.1f} "
              f"{r['max_over_mean_mean']:>9.3f} {r['max_over_mean_p95']:>7.3f} {r['max_over_mean_worst']:>7.2f} "
              f"{r['efficiency']:>10.3f} {r['padding']:>8.3f} {r['dropped_tables']:>7}")
    print("max/mean: per-step max over mean rank cost (mean over steps); efficiency: sum(mean)/sum(max), the share "
          "of rank time not spent waiting")

    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
