"""Reproduce shared/data/BASELINES.md: run the library baselines on the public suites and compare.

    nice -n 19 python benchmarks/baselines_public.py                       # all three tasks
    nice -n 19 python benchmarks/baselines_public.py --tasks anomaly
    nice -n 19 python benchmarks/baselines_public.py --tasks imputation --methods mean_mode,knn

Builds the public suites (once) under ``--suite-dir`` (default: the CLI's public-suite directory,
``$TABFM_PUBLIC_SUITES`` or ~/.cache/tabfm/public_suites), evaluates with the result cache under
``--cache`` (default: runs/eval-cache, git-ignored; reruns only compute new pairs), and writes under
``--out`` (default: benchmarks/results/):

* ``<task>/report.{md,json,csv}`` and ``<task>/results.json`` — our tables;
* ``<task>/comparison.{md,json}`` — our means / mean ranks next to BASELINES.md's, with differences;
* ``baselines_public.md`` — all comparisons in one page.

Single-threaded by design (``--threads 1``): the numbers do not depend on it, the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / sklearn load their thread pools

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tabfm.eval.metrics import RANKED_METRICS  # noqa: E402
from tabfm.eval.runner import baseline_methods, evaluate  # noqa: E402
from tabfm.eval.suites import PUBLIC_TASKS, build_public, default_public_dir, shared_data_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# BASELINES.md column header -> our metric name, per task
COLUMNS = {
    "classification": {"ROC-AUC": "roc_auc", "accuracy": "accuracy", "log-loss": "log_loss"},
    "imputation": {"RMSE": "rmse", "MCAR": "rmse_mcar", "MAR": "rmse_mar", "MNAR": "rmse_mnar", "cat. accuracy": "cat_accuracy"},
    "anomaly": {"AUROC": "auroc", "AUPRC": "auprc"},
}
SECTION = {"classification": "## Classification", "imputation": "## Imputation", "anomaly": "## Anomaly detection"}


def _tables(text: str) -> list[list[list[str]]]:
    tables, cur = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    if cur:
        tables.append(cur)
    return tables


def parse_baselines_md(path: Path, task: str) -> dict:
    """{"aggregate": {model: {metric: (mean, rank|None)}}, "per_dataset": {dataset: {model: value}}}."""
    text = path.read_text()
    start = text.index(SECTION[task])
    nxt = [text.find(s, start + 1) for s in SECTION.values()]
    nxt = [i for i in nxt if i > start]
    section = text[start: min(nxt) if nxt else len(text)]
    tables = _tables(section)
    agg = {}
    header = tables[0][0]
    for row in tables[0][1:]:
        agg[row[0]] = {}
        for h, cell in zip(header[1:], row[1:]):
            m = re.fullmatch(r"([-\d.]+)(?: \(([\d.]+)\))?", cell)
            if m and h in COLUMNS[task]:
                agg[row[0]][COLUMNS[task][h]] = (float(m.group(1)), float(m.group(2)) if m.group(2) else None)
    per = {}
    if len(tables) > 1:
        header = tables[1][0]
        for row in tables[1][1:]:
            per[row[0]] = {h: float(c) for h, c in zip(header[1:], row[1:])}
    return {"aggregate": agg, "per_dataset": per}


def compare(report, ref: dict, task: str) -> tuple[str, dict]:
    agg = report.aggregate()
    metrics = list(COLUMNS[task].values())
    ranked = RANKED_METRICS[task]
    lines = [f"## {task}: ours vs BASELINES.md", "",
             "Each cell: ours / reference (difference ours − reference); mean rank in brackets.", ""]
    lines.append("| model | " + " | ".join(metrics) + " |")
    lines.append("|---|" + "---|" * len(metrics))
    data = {}
    max_diff = {}
    for model in report.order():
        r = ref["aggregate"].get(model, {})
        cells, data[model] = [], {}
        for metric in metrics:
            ours = agg[model].get(metric)
            our_rank = agg[model].get(f"{metric}_rank")
            ref_mean, ref_rank = r.get(metric, (None, None))
            d = None if ref_mean is None or ours is None else ours - ref_mean
            data[model][metric] = {"ours": ours, "ours_rank": our_rank, "ref": ref_mean, "ref_rank": ref_rank, "diff": d}
            if d is not None:
                max_diff[metric] = max(max_diff.get(metric, 0.0), abs(d))
            cell = f"{ours:.4f}" if ours is not None else "—"
            if metric in ranked and our_rank is not None:
                cell += f" ({our_rank:.1f})"
            if ref_mean is not None:
                cell += f" / {ref_mean:.4f}" + (f" ({ref_rank:.1f})" if ref_rank is not None else "") + f" ({d:+.4f})"
            cells.append(cell)
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "Largest |difference| of the means: " + ", ".join(f"{k} {v:.4f}" for k, v in max_diff.items())]
    if ref["per_dataset"] and task == "classification":
        lines += ["", "Per-dataset ROC-AUC cells that differ from BASELINES.md after rounding to 3 decimals:", ""]
        n = bad = 0
        for ds, row in ref["per_dataset"].items():
            for model, refv in row.items():
                ours = report.scores.get(ds, {}).get(model, {}).get("roc_auc")
                if ours is None:
                    continue
                n += 1
                if abs(round(ours, 3) - refv) > 1e-9:
                    bad += 1
                    lines.append(f"- {ds} / {model}: ours {ours:.4f}, reference {refv:.3f}")
        lines.append(f"\n{n - bad} of {n} per-dataset cells match to 3 decimals.")
        data["_per_dataset_matches"] = {"cells": n, "differ": bad}
    return "\n".join(lines) + "\n", data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(PUBLIC_TASKS), help="comma-separated: classification,imputation,anomaly")
    ap.add_argument("--methods", default=None, help="comma-separated baseline names (default: all available)")
    ap.add_argument("--datasets", default=None, help="comma-separated dataset names (default: all)")
    ap.add_argument("--suite-dir", default=str(default_public_dir()))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--cache", default=str(ROOT / "runs" / "eval-cache"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    baselines_md = shared_data_dir() / "BASELINES.md"
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    suite_dir = Path(args.suite_dir)
    missing = [t for t in tasks if not (suite_dir / t).is_dir()]
    if missing:
        print(f"building public suites {missing} into {suite_dir}")
        build_public(suite_dir, tasks=missing)
    out = Path(args.out)
    for task in tasks:
        names = args.methods.split(",") if args.methods else None
        if names is not None:
            from tabfm.eval.baselines import BASELINE_NAMES

            names = [n for n in names if n in BASELINE_NAMES[task]]
        methods = baseline_methods(task, names=names, n_jobs=args.threads)
        datasets = args.datasets.split(",") if args.datasets else None
        report = evaluate(task, suite_dir, methods, out / task, cache_dir=args.cache, datasets=datasets,
                          progress=not args.no_progress, n_threads=args.threads, verbose=True)
        if baselines_md.exists():
            ref = parse_baselines_md(baselines_md, task)
            md, data = compare(report, ref, task)
            (out / task / "comparison.md").write_text(md)
            (out / task / "comparison.json").write_text(json.dumps(data, indent=2) + "\n")
            print(md)
        else:
            warnings.warn(f"{baselines_md} not found: no comparison")
    # one page with every task compared so far (also those of earlier runs)
    pages = [(out / t / "comparison.md").read_text() for t in PUBLIC_TASKS if (out / t / "comparison.md").exists()]
    if pages:
        (out / "baselines_public.md").write_text("# Public baselines reproduced\n\n"
                                                 "Written by benchmarks/baselines_public.py; full tables in <task>/report.md.\n\n"
                                                 + "\n".join(pages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
