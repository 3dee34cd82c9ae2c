"""What padding every query pass to `chunk_size` rows costs, per chunk size, side by side.

`ContextPredictor.predict` runs query rows `chunk_size` at a time and pads the last pass to
exactly `chunk_size` rows, so a row's answer does not depend on the rows predicted with it
(sklearn's subset invariance, bit for bit). This measures, for one encoded context, the time
of a predict call of Q query rows at several chunk sizes, with the padding and without it
(passes of the rows there are), in the same round; and checks that the padded answers of one
row predicted alone equal its answer in the big call. Prints a table, writes JSON.

    python benchmarks/query_chunks.py            # ~3 min on one CPU core
    python benchmarks/query_chunks.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.inference import ContextPredictor, _inference, query_batch
from tabfm.model.predict import cell_nll
from tabfm.weights import DEFAULT_MODEL, load_model

from common import machine_info


def unpadded(predictor: ContextPredictor, qx: np.ndarray, mask: np.ndarray, chunk: int) -> np.ndarray:
    """The passes without padding (what predict did before): the last pass holds what is left."""
    empty = np.zeros((0, qx.shape[1]), dtype=np.float32)
    parts = []
    for s in range(0, len(qx), chunk):
        batch = query_batch(empty, qx[s:s + chunk], mask[s:s + chunk], predictor.kind, predictor.cardinality)
        with _inference(predictor.model, predictor.device, None):
            out = predictor.model.forward_queries(batch, predictor.cache)
            parts.append(cell_nll(out, batch.x[batch.query]).double().numpy())
    return np.concatenate(parts)


def timed(fn) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--context", type=int, default=2048, help="context rows")
    ap.add_argument("--cols", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/query_chunks.json", help="where to write the JSON record")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(DEFAULT_MODEL, "cpu")
    n_ctx = 64 if args.quick else args.context
    queries = [1, 40] if args.quick else [1, 100, 1000, 4000]
    chunks = [16, 64] if args.quick else [64, 256, 1024]
    rng = np.random.default_rng(0)
    kind, card = np.ones(args.cols, np.int8), np.zeros(args.cols, np.int64)
    ctx = rng.normal(size=(n_ctx, args.cols)).astype(np.float32)
    builds = [timed(lambda: ContextPredictor(model, ctx, kind, card)) for _ in range(args.repeats)]
    encode_s, predictor = float(np.median([t for t, _ in builds])), builds[-1][1]
    rows = []
    for n_q in queries:
        qx = rng.normal(size=(n_q, args.cols)).astype(np.float32)
        mask = np.zeros(qx.shape, bool)
        mask[:, -1] = True  # one target cell per query row, as a classifier/regressor asks
        for chunk in chunks:
            t_pad, t_raw = [], []
            for _ in range(args.repeats):
                s, full = timed(lambda: predictor.predict(qx, mask, cell_nll, chunk))
                t_pad.append(s)
                s, _ = timed(lambda: unpadded(predictor, qx, mask, chunk))
                t_raw.append(s)
            alone = predictor.predict(qx[-1:], mask[-1:], cell_nll, chunk)
            rows.append({"context_rows": n_ctx, "query_rows": n_q, "chunk_size": chunk,
                         "padded_s": float(np.median(t_pad)), "unpadded_s": float(np.median(t_raw)),
                         "ratio": float(np.median(t_pad) / np.median(t_raw)),
                         "last_row_alone_equal": bool(np.array_equal(alone, full[-1:]))})
    print(f"context {n_ctx} rows x {args.cols} columns, shipped {DEFAULT_MODEL}, fp32, 1 thread, "
          f"median of {args.repeats}; encoding the context once: {encode_s:.3f} s")
    print(f"{'query rows':>10} {'chunk':>6} {'padded s':>9} {'unpadded s':>11} {'ratio':>6} {'row alone == in batch':>22}")
    for r in rows:
        print(f"{r['query_rows']:>10} {r['chunk_size']:>6} {r['padded_s']:>9.3f} {r['unpadded_s']:>11.3f} "
              f"{r['ratio']:>6.2f} {str(r['last_row_alone_equal']):>22}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "context_encode_s": encode_s, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
