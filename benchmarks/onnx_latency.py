"""Latency of the exported ONNX graph in onnxruntime beside torch, on one thread.

Two measurements, shipped `tabfm-tiny`, fp32, both backends side by side in every round:
- forward: one pass of the model over one table (context rows + query rows, one target cell per
  query row): `model(batch)` in torch against `OnnxModel(batch)` (tabfm.model.onnx_export);
- predict_proba: `TabFMClassifier` (its defaults: 4 members, neighbour and linear features,
  chunk_size 256) fitted on a 500 x 10 table and asked for 500 rows (and a small request: 100
  rows, 10 asked for), with backend="torch" (the context encoded once per member, its keys/values
  cached for every chunk) and backend="onnx" (no cache: every pass runs the context rows with its
  chunk of query rows).
Also the export itself (once). Prints a table, writes JSON.

    python benchmarks/onnx_latency.py               # ~3 min on one CPU core (the export ~1 min of it)
    python benchmarks/onnx_latency.py --quick       # smoke run
    python benchmarks/onnx_latency.py --onnx tabfm-tiny.onnx   # reuse a `tabfm export --onnx` file
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tabfm import TabFMClassifier
from tabfm.inference import forward_eval, query_batch
from tabfm.model.onnx_export import ATOL, RTOL, OnnxModel, export_onnx
from tabfm.weights import DEFAULT_MODEL, load_model

from common import machine_info


def onnx_backend(est: TabFMClassifier) -> TabFMClassifier:
    """backend="onnx" (set directly where the estimator's __init__ does not list the parameter yet)."""
    if "backend" in est.get_params():
        return est.set_params(backend="onnx")
    est.backend = "onnx"
    return est


def forward_case(model, session: OnnxModel, n_ctx: int, n_q: int, cols: int, repeats: int, rng) -> dict:
    x = rng.normal(size=(n_ctx + n_q, cols)).astype(np.float32)
    x[:, -1] = (x[:, 0] > 0).astype(np.float32)  # a binary target (hidden on the query rows)
    kind, card = np.ones(cols, np.int8), np.zeros(cols, np.int64)
    kind[-1], card[-1] = 2, 2
    mask = np.zeros((n_q, cols), bool)
    mask[:, -1] = True
    batch = query_batch(x[:n_ctx], x[n_ctx:], mask, kind, card)
    times = {"torch": [], "onnx": []}
    for _ in range(repeats):
        t = time.perf_counter()
        ref = forward_eval(model, batch)
        times["torch"].append(time.perf_counter() - t)
        t = time.perf_counter()
        got = session(batch)
        times["onnx"].append(time.perf_counter() - t)
    diff = max(float((ref.cat_logits[:, :2] - got.cat_logits[:, :2]).abs().max()),
               float((ref.num_logits - got.num_logits).abs().max()))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"what": "forward", "rows": n_ctx + n_q, "context_rows": n_ctx, "query_rows": n_q, "cols": cols,
            "torch_s": med["torch"], "onnx_s": med["onnx"], "onnx_over_torch": med["onnx"] / med["torch"],
            "max_abs_diff": diff}


def proba_case(model, onnx_path: Path, n_train: int, n_test: int, cols: int, repeats: int, n_estimators: int,
               rng) -> dict:
    X = rng.normal(size=(n_train + n_test, cols))
    y = (X[:, 0] + 0.5 * X[:, 1] ** 2 + 0.3 * rng.normal(size=len(X)) > 0.5).astype(int)
    torch_clf = TabFMClassifier(model=model, n_estimators=n_estimators, progress=False).fit(X[:n_train], y[:n_train])
    onnx_clf = onnx_backend(TabFMClassifier(model=str(onnx_path), n_estimators=n_estimators, progress=False))
    onnx_clf.fit(X[:n_train], y[:n_train])
    onnx_clf.predict_proba(X[n_train:n_train + 1])  # the session opens outside the timing
    times = {"torch": [], "onnx": []}
    for _ in range(repeats):
        t = time.perf_counter()
        p_torch = torch_clf.predict_proba(X[n_train:])
        times["torch"].append(time.perf_counter() - t)
        t = time.perf_counter()
        p_onnx = onnx_clf.predict_proba(X[n_train:])
        times["onnx"].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"what": "predict_proba", "rows": n_train, "context_rows": n_train, "query_rows": n_test, "cols": cols,
            "n_estimators": n_estimators, "torch_s": med["torch"], "onnx_s": med["onnx"],
            "onnx_over_torch": med["onnx"] / med["torch"], "max_abs_diff": float(np.abs(p_torch - p_onnx).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    ap.add_argument("--onnx", default=None, help="a .onnx file of the model to time (default: export it here)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per case (median reported)")
    ap.add_argument("--json", default="benchmarks/results/onnx_latency.json", help="where to write the JSON record")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(DEFAULT_MODEL, "cpu")
    export_s = None
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.onnx) if args.onnx else Path(tmp.name) / "model.onnx"
    if args.onnx is None:
        t = time.perf_counter()
        export_onnx(model, path, check=True)
        export_s = time.perf_counter() - t
    session = OnnxModel(path, threads=1)
    repeats = 1 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    forward_shapes = [(40, 16, 5)] if args.quick else [(50, 16, 5), (500, 256, 11), (2000, 256, 11)]
    rows = [forward_case(model, session, *s, repeats=repeats, rng=rng) for s in forward_shapes]
    probas = [(60, 20, 4, 1)] if args.quick else [(500, 500, 10, 4), (100, 10, 10, 4)]
    for n_train, n_test, cols, members in probas:
        rows.append(proba_case(model, path, n_train, n_test, cols, repeats=repeats, n_estimators=members, rng=rng))
    print("| call | context rows | query rows | features | torch s | onnxruntime s | onnx / torch | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        what = r["what"] + (f" ({r['n_estimators']} members)" if "n_estimators" in r else "")
        print(f"| {what} | {r['context_rows']} | {r['query_rows']} | {r['cols'] - (r['what'] == 'forward')} "
              f"| {r['torch_s']:.3f} | {r['onnx_s']:.3f} | {r['onnx_over_torch']:.2f} | {r['max_abs_diff']:.1e} |")
    if export_s is not None:
        print(f"export (torch.onnx dynamo + the check against torch): {export_s:.1f} s")
    import onnxruntime

    info = machine_info()
    info.pop("backend", None)
    info.update(threads=1, onnxruntime=onnxruntime.__version__)
    record = {"machine": info, "model": str(DEFAULT_MODEL), "precision": "fp32", "export_s": export_s,
              "tolerance": {"atol": ATOL, "rtol": RTOL}, "rows": rows, "quick": bool(args.quick)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
