"""TabFMRegressor settings side by side on the offline regression suite, scored as `tabfm eval` scores them.

Each setting is a name and a JSON dict of TabFMRegressor parameters (on top of random_state=0 and
the defaults). Every setting sees the regression protocol's folds (tabfm.eval.protocols.
regression_splits: shuffled 5-fold, seed 0) of every table; R^2 per table is the mean over its
folds, as in the eval report. Prints a table (a column per setting, the mean last) and writes JSON
with the per-table R^2 and seconds.

    python benchmarks/regression_suite.py runs/regression-suite      # the suite, once
    nice -n 5 python benchmarks/regression_variants.py \\
        --settings 'default={}' 'alone={"linear_residual": false}' 'raw={"numeric": "raw"}'
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.estimators import TabFMRegressor
from tabfm.eval.protocols import run_regression
from tabfm.eval.suites import load_suite

from common import machine_info

ROOT = Path(__file__).resolve().parents[1]


def parse_setting(text: str) -> tuple[str, dict]:
    """'name={json}' -> (name, params)."""
    name, sep, params = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--settings: {text!r} is not NAME={{JSON parameters}}")
    try:
        value = json.loads(params)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--settings {name}: {params!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--settings {name}: parameters must be a JSON object, got {params!r}")
    return name, value


def r2_per_table(ds, params: dict) -> tuple[float, float]:
    """Mean R^2 over the protocol's folds of one table (tabfm eval's run_regression), and the seconds it took."""
    t0 = time.perf_counter()
    result = run_regression(ds, lambda: TabFMRegressor(**{"random_state": 0, "progress": False, **params}))
    return float(result["metrics"]["r2"]), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=str(ROOT / "runs" / "regression-suite"))
    ap.add_argument("--datasets", default="all", help="comma-separated names, or 'all'")
    ap.add_argument("--settings", nargs="+", default=["default={}"], help="NAME={JSON TabFMRegressor parameters}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "regression_variants.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(parse_setting(s) for s in args.settings)
    names = None if args.datasets == "all" else args.datasets.split(",")
    suite = load_suite(args.suite, "regression", datasets=names)
    r2: dict[str, dict[str, float]] = {s: {} for s in settings}
    seconds: dict[str, dict[str, float]] = {s: {} for s in settings}
    print("| table | " + " | ".join(settings) + " |")
    print("|---|" + "---:|" * len(settings))
    for ds in suite:
        for s, params in settings.items():
            r2[s][ds.name], seconds[s][ds.name] = r2_per_table(ds, params)
        print(f"| {ds.name} | " + " | ".join(f"{r2[s][ds.name]:.4f}" for s in settings) + " |", flush=True)
    means = {s: float(np.mean(list(r2[s].values()))) for s in settings}
    print("| **mean R²** | " + " | ".join(f"**{means[s]:.4f}**" for s in settings) + " |")
    print("| s / table | " + " | ".join(f"{np.mean(list(seconds[s].values())):.1f}" for s in settings) + " |")
    out = {"benchmark": "regression_variants", "suite": args.suite, "settings": settings, "r2": r2,
           "mean_r2": means, "seconds": seconds, "threads": args.threads, "machine": machine_info()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
