"""Anomaly detection: AUROC against seconds, TabFMAnomalyDetector settings beside IsolationForest and COPOD.

The issue's bar: mean AUROC above IsolationForest and COPOD at no more than 100x IsolationForest's
seconds per dataset. Each setting is the detector with `--tabfm-params`-style parameters, run under
the public protocol (`tabfm eval --task anomaly`: 3 seeds of a stratified 70/30 split, fit on the
training rows, score the test rows; seconds = fit + score of the 3 seeds, one thread) through the
evaluation cache, so settings `tabfm eval` already ran are read, not rerun (same weights, code and
parameters). Prints per dataset AUROC, seconds and seconds / IsolationForest's, then a summary per
setting (mean AUROC, datasets over the ratio, the ratio of mean seconds); writes JSON.

    python benchmarks/anomaly_cost.py --settings "n_estimators=4" "n_estimators=1,max_context_rows=512"
    python benchmarks/anomaly_cost.py --datasets 14_glass,18_Ionosphere --settings "n_estimators=1"
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tabfm.commands.eval import parse_params, tabfm_methods
from tabfm.eval.runner import baseline_methods, evaluate
from tabfm.eval.suites import default_public_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("iforest", "copod")
BAR = 100.0  # the limit: seconds per dataset over IsolationForest's


def run(settings: list[str], datasets: list[str] | None, cache: Path, model: str | None) -> dict:
    """{dataset: {method: {"auroc", "seconds"}}}; one evaluation per setting, its method named "tabfm" as in
    `tabfm eval` (the cache key holds the method's name), relabelled "tabfm[SETTING]" here."""
    out: dict = {}
    for s in settings:
        methods = {**baseline_methods("anomaly", names=list(BASELINES)),
                   "tabfm": tabfm_methods(model, parse_params(s), ("anomaly",))["anomaly"]["tabfm"]}
        report = evaluate("anomaly", default_public_dir(), methods, None, cache_dir=cache, datasets=datasets,
                          progress=False, n_threads=1, verbose=False, plots=False)
        if report.errors:
            raise SystemExit(f"failed: {report.errors}")
        for ds, per in report.results.items():
            for name, r in per.items():
                out.setdefault(ds, {})[f"tabfm[{s}]" if name == "tabfm" else name] = {
                    "auroc": r["metrics"]["auroc"], "seconds": r["seconds"]}
    return out


def summarise(table: dict, names: list[str]) -> dict:
    summary = {}
    for name in names:
        auroc = [table[d][name]["auroc"] for d in table]
        secs = [table[d][name]["seconds"] for d in table]
        ratio = [table[d][name]["seconds"] / table[d]["iforest"]["seconds"] for d in table]
        summary[name] = {"auroc": float(np.mean(auroc)), "seconds_mean": float(np.mean(secs)),
                         "ratio_of_means": float(np.mean(secs) / np.mean([table[d]["iforest"]["seconds"] for d in table])),
                         "ratio_max": float(np.max(ratio)), "over_bar": int(sum(r > BAR for r in ratio))}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", required=True, help="detector parameters per setting, K=V,...")
    ap.add_argument("--datasets", default=None, help="comma-separated (default: the whole public anomaly suite)")
    ap.add_argument("--model", default=None, help="weights (default: the detector's own)")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "eval-cache"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "anomaly_cost.json"))
    args = ap.parse_args()
    datasets = args.datasets.split(",") if args.datasets else None
    table = run(args.settings, datasets, Path(args.cache), args.model)
    names = [*BASELINES, *(f"tabfm[{s}]" for s in args.settings)]
    print(f"{'dataset':15s}" + "".join(f"{n[:34]:>36s}" for n in names))
    for ds in sorted(table):
        cells = []
        for n in names:
            r = table[ds][n]
            ratio = r["seconds"] / table[ds]["iforest"]["seconds"]
            cells.append(f"{r['auroc']:.3f} {r['seconds']:8.1f}s {ratio:6.0f}x")
        print(f"{ds:15s}" + "".join(f"{c:>36s}" for c in cells))
    summary = summarise(table, names)
    print(f"\n{'method':50s} {'AUROC':>7s} {'s/dataset':>10s} {'ratio of means':>15s} {'max ratio':>10s} "
          f"{'over ' + str(int(BAR)) + 'x':>9s}")
    for n, s in summary.items():
        print(f"{n:50s} {s['auroc']:7.4f} {s['seconds_mean']:10.1f} {s['ratio_of_means']:14.0f}x "
              f"{s['ratio_max']:9.0f}x {s['over_bar']:>5d}/{len(table)}")
    result = {"benchmark": "anomaly_cost", "settings": args.settings, "model": args.model, "bar": BAR,
              "per_dataset": table, "summary": summary, "machine": machine_info(), "threads": 1}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
