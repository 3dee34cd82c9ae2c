"""Reports: per-dataset and aggregate tables (mean score, mean rank with ties averaged,
wins / ties / losses against each baseline), as Markdown, JSON and CSV.

``scores`` everywhere is ``{dataset: {method: {metric: value}}}`` (NaN / missing = no score).

Failures (``errors``: ``{dataset: {method: "Type: message"}}``, a method that raised on a dataset):
the method has no score there, so means are over the datasets it completed; for ranks a failure
counts as the **worst rank** on that dataset (every condition of it, when ranks are per dataset x
condition): failed methods share the bottom places, tied, after every method with a score
(3 methods, 1 failed: rank 3; 2 failed: both 2.5). Where no method has a score for a metric
(e.g. ``cat_accuracy`` on an all-numeric table) nobody is ranked. Wins / ties / losses count only
datasets both methods completed. The tables show such cells as ``failed``.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .metrics import RANKED_METRICS, TASK_METRICS, higher_is_better

Scores = dict[str, dict[str, dict[str, float]]]


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def average_ranks(values: dict[str, float], higher_better: bool, failed=()) -> dict[str, float]:
    """Rank methods on one dataset: 1 = best, tied values share the average of their ranks.
    Methods without a finite value are left out, except the ``failed`` ones: they take the worst
    places, tied (all of them get the mean of the bottom ranks), when at least one method has a
    finite value (otherwise nobody is ranked)."""
    items = [(m, float(v)) for m, v in values.items() if _ok(v)]
    items.sort(key=lambda mv: -mv[1] if higher_better else mv[1])
    ranks: dict[str, float] = {}
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1][1] == items[i][1]:
            j += 1
        avg = (i + 1 + j + 1) / 2.0
        for k in range(i, j + 1):
            ranks[items[k][0]] = avg
        i = j + 1
    bad = [m for m in dict.fromkeys(failed) if m not in ranks]
    if ranks and bad:
        n = len(ranks)
        worst = (n + 1 + n + len(bad)) / 2.0
        for m in bad:
            ranks[m] = worst
    return ranks


def metric_table(scores: Scores, metric: str) -> dict[str, dict[str, float]]:
    """{dataset: {method: value}} for one metric."""
    return {d: {m: r.get(metric, float("nan")) for m, r in per.items()} for d, per in scores.items()}


def mean_scores(scores: Scores, metric: str, methods: list[str]) -> dict[str, float]:
    table = metric_table(scores, metric)
    out = {}
    for m in methods:
        vals = [table[d][m] for d in table if m in table[d] and _ok(table[d][m])]
        out[m] = float(np.mean(vals)) if vals else float("nan")
    return out


def mean_ranks(scores: Scores, metric: str, methods: list[str], higher_better: bool | None = None,
               failed: dict[str, object] | None = None) -> dict[str, float]:
    """Mean over datasets of each method's rank among ``methods`` (ties averaged).

    ``failed`` = ``{row of scores: methods that failed there}``: they get the worst rank on that row
    (see :func:`average_ranks`)."""
    hb = higher_is_better(metric) if higher_better is None else higher_better
    table = metric_table(scores, metric)
    failed = failed or {}
    acc: dict[str, list[float]] = {m: [] for m in methods}
    for d, per in table.items():
        ranks = average_ranks({m: per.get(m) for m in methods if m in per}, hb,
                              failed=[m for m in failed.get(d, ()) if m in acc])
        for m, r in ranks.items():
            acc[m].append(r)
    return {m: (float(np.mean(v)) if v else float("nan")) for m, v in acc.items()}


def wins_ties_losses(scores: Scores, metric: str, method: str, baseline: str, tol: float = 0.0,
                     higher_better: bool | None = None) -> tuple[int, int, int]:
    """Datasets where ``method`` beats / ties (|difference| <= tol) / loses to ``baseline``; datasets
    where either lacks a score are not counted."""
    hb = higher_is_better(metric) if higher_better is None else higher_better
    w = t = l = 0
    for per in metric_table(scores, metric).values():
        a, b = per.get(method), per.get(baseline)
        if not (_ok(a) and _ok(b)):
            continue
        diff = (a - b) if hb else (b - a)
        if abs(diff) <= tol:
            t += 1
        elif diff > 0:
            w += 1
        else:
            l += 1
    return w, t, l


@dataclass
class Report:
    task: str
    scores: Scores  # {dataset: {method: {metric: value}}}
    methods: list[str]
    baselines: list[str]
    metrics: list[str] = field(default_factory=list)
    ranked: list[str] = field(default_factory=list)
    tie_tol: float = 0.0
    errors: dict[str, dict[str, str]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    # optional finer table the mean ranks are computed on (imputation: one row per dataset x
    # condition, as docs/evaluation-protocol.md (reference scores) does); None = rank the per-dataset scores
    rank_scores: Scores | None = None
    # not rendered: the runner's per-dataset results ({dataset: {method: {"metrics", "units", ...}}},
    # used by tabfm.eval.plots) and the run record it writes to run.json
    results: dict | None = field(default=None, repr=False)
    run: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.metrics = self.metrics or list(TASK_METRICS.get(self.task, []))
        self.ranked = self.ranked or [m for m in RANKED_METRICS.get(self.task, self.metrics) if m in self.metrics]

    @property
    def datasets(self) -> list[str]:
        return list(self.scores)

    @property
    def headline(self) -> str:
        return self.metrics[0]

    # ------------------------------------------------------------------ numbers
    def failed(self, dataset: str, method: str) -> bool:
        return method in self.errors.get(dataset, {})

    def _rank_failures(self) -> dict[str, list[str]]:
        """{row of the rank table: failed methods}: a dataset's failures apply to every row of it
        (rank_scores rows are "<dataset>|<condition>")."""
        if not self.errors:
            return {}
        if not self.rank_scores:
            return {d: list(per) for d, per in self.errors.items()}
        out = {}
        by_len = sorted(self.errors, key=len, reverse=True)
        for row in self.rank_scores:
            d = next((d for d in by_len if row.startswith(d + "|")), None)
            if d is not None:
                out[row] = list(self.errors[d])
        return out

    def aggregate(self) -> dict[str, dict[str, float]]:
        """{method: {metric: mean, metric+'_rank': mean rank, 'n_datasets': completed, 'n_failed': failed}}."""
        out = {m: {} for m in self.methods}
        failures = self._rank_failures()
        for metric in self.metrics:
            means = mean_scores(self.scores, metric, self.methods)
            ranks = (mean_ranks(self.rank_scores or self.scores, metric, self.methods, failed=failures)
                     if metric in self.ranked else {})
            for m in self.methods:
                out[m][metric] = means[m]
                if metric in self.ranked:
                    out[m][f"{metric}_rank"] = ranks[m]
        for m in self.methods:
            out[m]["n_datasets"] = sum(1 for per in self.scores.values() if m in per and _ok(per[m].get(self.headline)))
            out[m]["n_failed"] = sum(1 for per in self.errors.values() if m in per)
        return out

    def order(self) -> list[str]:
        """Methods by mean rank of the headline metric (then by mean score)."""
        agg = self.aggregate()
        hb = higher_is_better(self.headline)
        key_rank = f"{self.headline}_rank"

        def key(m):
            r = agg[m].get(key_rank, float("nan"))
            s = agg[m][self.headline]
            return (r if _ok(r) else math.inf, -s if (hb and _ok(s)) else (s if _ok(s) else math.inf))

        return sorted(self.methods, key=key)

    def wtl(self, metric: str | None = None) -> dict[str, dict[str, tuple[int, int, int]]]:
        metric = metric or self.headline
        return {m: {b: wins_ties_losses(self.scores, metric, m, b, self.tie_tol) for b in self.baselines if b != m}
                for m in self.methods}

    # ------------------------------------------------------------------ renderings
    def to_dict(self) -> dict:
        return _clean({
            "task": self.task,
            "metrics": self.metrics,
            "headline": self.headline,
            "methods": self.order(),
            "baselines": self.baselines,
            "datasets": self.datasets,
            "aggregate": self.aggregate(),
            "per_dataset": self.scores,
            "wins_ties_losses": {m: {b: list(v) for b, v in row.items()} for m, row in self.wtl().items()},
            "tie_tolerance": self.tie_tol,
            "ranked_per": "dataset x condition" if self.rank_scores else "dataset",
            "errors": self.errors,
            "failure_rule": "a failed method has no score on that dataset: means are over the datasets it completed; "
                            "ranks count it as the worst rank there (failures tied at the bottom); "
                            "wins/ties/losses skip the dataset",
            "meta": self.meta,
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self, digits: int = 4) -> str:
        agg = self.aggregate()
        order = self.order()
        lines = [f"# {self.task} — {len(self.datasets)} datasets, {len(self.methods)} methods", ""]
        unit = "dataset x condition" if self.rank_scores else "dataset"
        lines.append(f"Means over datasets; mean rank (per {unit}) in brackets (1 = best, ties averaged). "
                     + ", ".join(f"{m} {'↑' if higher_is_better(m) else '↓'}" for m in self.metrics))
        if self.errors:
            lines.append("")
            lines.append("A method that failed on a dataset (shown as `failed`) has no score there: its means are over "
                         "the datasets it completed; in the ranks a failure counts as the worst rank (failures tied "
                         "at the bottom); wins / ties / losses skip that dataset.")
        fail_col = bool(self.errors)
        lines.append("")
        lines.append("| method | " + " | ".join(self.metrics) + (" | failed" if fail_col else "") + " |")
        lines.append("|---|" + "---|" * (len(self.metrics) + fail_col))
        for m in order:
            cells = []
            for metric in self.metrics:
                v = agg[m][metric]
                cell = _fmt(v, digits)
                if metric in self.ranked:
                    cell += f" ({_fmt(agg[m][f'{metric}_rank'], 1)})"
                cells.append(cell)
            if fail_col:
                cells.append(str(agg[m]["n_failed"]))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        for metric in self.metrics if self.task != "imputation" else [self.headline, "cat_accuracy"]:
            lines += ["", f"Per dataset {metric}:", ""]
            lines.append("| dataset | " + " | ".join(order) + " |")
            lines.append("|---|" + "---|" * len(order))
            for d, per in self.scores.items():
                row = ["failed" if self.failed(d, m) else _fmt(per.get(m, {}).get(metric), 3) for m in order]
                lines.append(f"| {d} | " + " | ".join(row) + " |")
        bl = [b for b in self.baselines if b in self.methods]
        if bl:
            lines += ["", f"Wins / ties / losses on {self.headline} (row method vs column baseline"
                      + (f", tie = |difference| <= {self.tie_tol:g}" if self.tie_tol else ", tie = equal score") + "):", ""]
            lines.append("| method | " + " | ".join(bl) + " |")
            lines.append("|---|" + "---|" * len(bl))
            wtl = self.wtl()
            for m in order:
                row = ["—" if b == m else "/".join(map(str, wtl[m][b])) for b in bl]
                lines.append(f"| {m} | " + " | ".join(row) + " |")
        if self.errors:
            lines += ["", "Failures (not cached: a rerun retries them):", ""]
            for d, per in self.errors.items():
                for m, e in per.items():
                    lines.append(f"- {d} / {m}: {e}")
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """Long format: dataset, method, metric, value."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["dataset", "method", "metric", "value"])
        for d, per in self.scores.items():
            for m, res in per.items():
                for metric, v in res.items():
                    w.writerow([d, m, metric, "" if not _ok(v) else repr(float(v))])
        return buf.getvalue()

    def write(self, out_dir, stem: str = "report") -> dict[str, Path]:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out_dir / f"{stem}.md", "json": out_dir / f"{stem}.json", "csv": out_dir / f"{stem}.csv"}
        paths["markdown"].write_text(self.to_markdown())
        paths["json"].write_text(self.to_json() + "\n")
        paths["csv"].write_text(self.to_csv())
        return paths


def _fmt(v, digits: int) -> str:
    return f"{v:.{digits}f}" if _ok(v) else "—"


def _clean(o):
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o
