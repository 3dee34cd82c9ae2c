"""Cached-context inference vs one forward per chunk of query rows, side by side.

A prediction table is context rows + query rows. Without a cache every chunk of `chunk_size`
query rows is run together with the whole context (what `predict_rows` did before
`ContextPredictor`); with it the context runs once and each chunk costs its own rows. Both
paths give the same answers (max |difference| is printed). Prints a table, writes JSON.

    python benchmarks/inference_cache.py            # ~2 min on one CPU core
    python benchmarks/inference_cache.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.inference import ContextPredictor, forward_eval, query_batch
from tabfm.model.predict import cell_nll
from tabfm.weights import DEFAULT_MODEL, load_model

from common import machine_info


def uncached(model, ctx, qx, mask, kind, card, chunk) -> np.ndarray:
    parts = []
    for s in range(0, len(qx), chunk):
        batch = query_batch(ctx, qx[s:s + chunk], mask[s:s + chunk], kind, card)
        parts.append(cell_nll(forward_eval(model, batch), batch.x[batch.query]).numpy())
    return np.concatenate(parts)


def cached(model, ctx, qx, mask, kind, card, chunk) -> np.ndarray:
    return ContextPredictor(model, ctx, kind, card).predict(qx, mask, cell_nll, chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--cols", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="query rows per forward (the estimators' chunk_size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/inference_cache.json", help="where to write the JSON record")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(DEFAULT_MODEL, "cpu")
    cases = [(64, 64, 16)] if args.quick else [(512, 4096, args.chunk), (2048, 4096, args.chunk), (2048, 1024, args.chunk)]
    rng = np.random.default_rng(0)
    kind, card = np.ones(args.cols, np.int8), np.zeros(args.cols, np.int64)
    rows = []
    for n_ctx, n_q, chunk in cases:
        ctx = rng.normal(size=(n_ctx, args.cols)).astype(np.float32)
        qx = rng.normal(size=(n_q, args.cols)).astype(np.float32)
        mask = np.zeros(qx.shape, bool)
        mask[:, -1] = True  # one target cell per query row, as a classifier/regressor asks
        times = {"uncached": [], "cached": []}
        outs = {}
        for _ in range(1 if args.quick else args.repeats):
            for name, fn in (("uncached", uncached), ("cached", cached)):  # side by side, same round
                t = time.perf_counter()
                outs[name] = fn(model, ctx, qx, mask, kind, card, chunk)
                times[name].append(time.perf_counter() - t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        rows.append({"context_rows": n_ctx, "query_rows": n_q, "chunk": chunk, "cols": args.cols,
                     "uncached_s": med["uncached"], "cached_s": med["cached"],
                     "speedup": med["uncached"] / med["cached"],
                     "max_abs_diff": float(np.abs(outs["uncached"] - outs["cached"]).max())})
    print("| context rows | query rows | chunk | uncached s | cached s | speed-up | max |diff| |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context_rows']} | {r['query_rows']} | {r['chunk']} | {r['uncached_s']:.2f} | {r['cached_s']:.2f} "
              f"| {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "model": str(DEFAULT_MODEL), "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
