"""Small contexts: the shipped estimators on training sets of 8-64 rows, with the context features'
neighbourhoods capped at half the other rows (tabfm.data.context_features.neighbor_sizes_for, the
rule since 2026-12-06) beside the rule before it (every size up to all the other rows).

Why: with k >= n - 1 a context row's leave-one-out neighbour mean is (S - y_i) / (n - 1), which
falls as its own target rises, while a query row's does not; on contexts of a few dozen rows the
model then answered upside down. Tables: the public classification suite (ROC-AUC, macro
one-vs-rest over the classes present) and the offline regression suite (R^2). Per table, size n
and seed: a seeded random training set of n rows (classification: at least one row of each of two
classes, rows of classes absent from it dropped from the test rows) and at most 500 other rows as
the test set. Each rule runs on the same splits, default estimators (`tabfm-tiny-cf` for both
tasks here, so both use context features). Prints a table per task, writes JSON.

    nice -n 10 python benchmarks/small_contexts.py                     # n = 8,16,32,64; 3 seeds
    nice -n 10 python benchmarks/small_contexts.py --quick             # 3 tables per task, n = 16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import r2_score, roc_auc_score

import tabfm.data.context_features as cf
from tabfm.estimators import TabFMClassifier, TabFMRegressor
from tabfm.eval.suites import default_public_dir, load_suite

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

RULES = {"capped": cf.neighbor_sizes_for,
         "all-rows": lambda sizes, n_ctx: tuple(int(k) for k in sizes)}  # Neighbors caps at n_ctx - 1 itself


def split(n_rows: int, n: int, rng: np.random.Generator, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    for _ in range(100):
        perm = rng.permutation(n_rows)
        train, test = perm[:n], perm[n:n + 500]
        if y is None or len(np.unique(y[train])) >= 2:
            if y is not None:
                test = test[np.isin(y[test], np.unique(y[train]))]
            return train, test
    raise RuntimeError("no training set with two classes")


def score(task: str, est, X, y, train, test) -> float:
    est.fit(X.iloc[train], y[train])
    if task == "regression":
        return float(r2_score(y[test], est.predict(X.iloc[test])))
    proba = est.predict_proba(X.iloc[test])
    classes = list(est.classes_)
    if len(classes) == 2:
        return float(roc_auc_score(y[test] == classes[1], proba[:, 1]))
    return float(roc_auc_score(y[test], proba, multi_class="ovr", labels=classes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--model", default="tabfm-tiny-cf")
    ap.add_argument("--regression-suite", default="runs/regression-suite")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "small_contexts.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    sizes = [16] if args.quick else [int(s) for s in args.sizes.split(",")]
    suites = {"classification": load_suite(str(default_public_dir() / "classification"), "classification", None),
              "regression": load_suite(args.regression_suite, "regression", None)}
    runs, t_all = [], time.perf_counter()
    for task, suite in suites.items():
        for ds in suite[:3] if args.quick else suite:
            X, y = ds.frame.drop(columns=[ds.target]), ds.frame[ds.target].to_numpy()
            for n in sizes:
                for seed in range(1 if args.quick else args.seeds):
                    train, test = split(len(X), n, np.random.default_rng([seed, n]), None if task == "regression" else y)
                    row = {"task": task, "table": ds.name, "n": n, "seed": seed}
                    for rule, fn in RULES.items():
                        cf.neighbor_sizes_for = fn  # context_features reads it at call time
                        est = (TabFMRegressor if task == "regression" else TabFMClassifier)(model=args.model)
                        try:
                            row[rule] = score(task, est, X, y, train, test)
                        except Exception as err:  # a tiny split a metric cannot score: recorded, not hidden
                            row[rule], row["error"] = float("nan"), repr(err)
                    cf.neighbor_sizes_for = RULES["capped"]
                    runs.append(row)
                    print(f"{task:14s} {ds.name:18s} n={n:3d} s{seed}  capped {row['capped']:.4f}  "
                          f"all-rows {row['all-rows']:.4f}", flush=True)
    summary = {}
    for task in suites:
        print(f"\n{task} ({'ROC-AUC' if task == 'classification' else 'R^2'}), mean over tables and seeds")
        print("| n | capped | all rows | capped wins / ties / losses |\n|---:|---:|---:|---:|")
        for n in sizes:
            rs = [r for r in runs if r["task"] == task and r["n"] == n and np.isfinite(r["capped"]) and np.isfinite(r["all-rows"])]
            a, b = np.array([r["capped"] for r in rs]), np.array([r["all-rows"] for r in rs])
            w, t, l = int((a > b + 1e-9).sum()), int((np.abs(a - b) <= 1e-9).sum()), int((a < b - 1e-9).sum())
            summary[f"{task}/{n}"] = {"capped": float(a.mean()), "all_rows": float(b.mean()), "wins": w, "ties": t,
                                      "losses": l, "runs": len(rs)}
            print(f"| {n} | {a.mean():.4f} | {b.mean():.4f} | {w} / {t} / {l} |")
    record = {"benchmark": "small_contexts", "model": args.model, "sizes": sizes, "seeds": args.seeds,
              "command": " ".join(sys.argv), "summary": summary, "runs": runs,
              "wall_seconds": time.perf_counter() - t_all, "machine": machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
