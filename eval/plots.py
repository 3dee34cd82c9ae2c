"""PNG plots of an evaluation run (matplotlib, Agg canvas; imported lazily here only).

    from .plots import write_plots
    paths = write_plots(report, "runs/eval/imputation/plots")   # the runner calls this itself

* ``scores_<headline>.png``: the headline metric per dataset, one bar per method, grouped by
  dataset; a failed method is marked ``x`` on the axis of that dataset.
* ``ranks_<headline>.png``: mean rank per method, horizontal bars, best (lowest) at the top;
  failures count as the worst rank (see tabfm.eval.report).
* imputation only, ``imputation_rmse_vs_rate.png``: standardised RMSE against the missing rate,
  one panel per mechanism (MCAR / MAR / MNAR), one line per method; each point is the mean over
  datasets of the mean over seeds (per method over the datasets it completed). Needs the
  per-condition units of ``report.results`` (the runner's results, as in results.json).

No matplotlib: a warning and no plots (``write_plots`` returns ``[]``). The figures are drawn on
``matplotlib.figure.Figure`` with an Agg canvas, so pyplot's global backend is never touched.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from .metrics import higher_is_better

MECHANISMS = ("MCAR", "MAR", "MNAR")
_UNIT_INTERVAL = {"roc_auc", "accuracy", "auroc", "auprc", "cat_accuracy"}


def _matplotlib():
    """(Figure, FigureCanvasAgg) or None with a warning when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        warnings.warn(f"matplotlib is not available ({err}); no plots written "
                      "(pip install matplotlib, or pass --no-plots)", RuntimeWarning, stacklevel=3)
        return None
    return Figure, FigureCanvasAgg


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _colors(methods: list[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def _save(fig, canvas_cls, path: Path) -> Path:
    canvas_cls(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _label(metric: str) -> str:
    name = metric.replace("rmse", "standardised RMSE", 1) if metric.startswith("rmse") else metric
    return f"{name} ({'higher' if higher_is_better(metric) else 'lower'} = better)"


# ----------------------------------------------------------------------------------- plots
def score_bars(report, path, metric: str | None = None) -> Path | None:
    """Grouped bars: ``metric`` (default: the headline) per dataset, one bar per method; many
    datasets wrap onto several rows (shared y axis). A failed method is a red ``x`` on the axis."""
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas = mpl
    metric = metric or report.headline
    methods = report.order()
    datasets = report.datasets
    colors = _colors(report.methods)
    nd, nm = len(datasets), len(methods)
    group = 0.22 * nm + 0.35  # inches per dataset
    per_row = max(2, int(18.0 // group))
    rows = max(1, math.ceil(nd / per_row))
    per_row = math.ceil(nd / rows)  # balance the rows
    width = 0.8 / max(nm, 1)
    fig = Figure(figsize=(max(6.0, 1.2 + per_row * group), 1.0 + 3.4 * rows))
    axes = np.atleast_1d(fig.subplots(rows, 1, sharey=True, squeeze=False)[:, 0])
    vals = np.array([[np.nan if report.failed(d, m) else report.scores[d].get(m, {}).get(metric, np.nan)
                      for d in datasets] for m in methods], dtype=float)
    vals = np.where(np.isfinite(vals), vals, np.nan)
    finite = vals[np.isfinite(vals)]
    lo = None
    if finite.size and metric in _UNIT_INTERVAL and finite.min() > 0.5:
        # bounded [0, 1] metric with every score high: start the axis near the data (ticks show it)
        lo = math.floor((finite.min() - 0.05) * 10) / 10
    any_failed = False
    for r, ax in enumerate(axes):
        idx = list(range(r * per_row, min(nd, (r + 1) * per_row)))
        x = np.arange(len(idx))
        for i, m in enumerate(methods):
            ax.bar(x - 0.4 + width * (i + 0.5), vals[i, idx], width=width, color=colors[m], label=m)
        if lo is not None:
            ax.set_ylim(lo, 1.0)
        ax.set_xticks(x)
        ax.set_xticklabels([datasets[j] for j in idx], rotation=30 if len(idx) > 3 else 0,
                           ha="right" if len(idx) > 3 else "center")
        ax.set_xlim(-0.6, per_row - 0.4)
        ax.set_ylabel(_label(metric))
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    for r, ax in enumerate(axes):  # after every ylim is settled
        idx = list(range(r * per_row, min(nd, (r + 1) * per_row)))
        xs = [k - 0.4 + width * (i + 0.5) for k, j in enumerate(idx) for i, m in enumerate(methods)
              if report.failed(datasets[j], m)]
        if xs:
            any_failed = True
            ax.plot(xs, np.full(len(xs), ax.get_ylim()[0]), linestyle="none", marker="x", color="red",
                    markersize=7, markeredgewidth=2, clip_on=False, zorder=5, label="failed")
    axes[0].set_title(f"{report.task}: {metric} per dataset")
    handles, labels = axes[0].get_legend_handles_labels()
    if any_failed and "failed" not in labels:
        handles.append(axes[0].plot([], [], linestyle="none", marker="x", color="red", markeredgewidth=2)[0])
        labels.append("failed")
    axes[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    fig.tight_layout()
    return _save(fig, Canvas, Path(path))


def rank_summary(report, path, metric: str | None = None) -> Path | None:
    """Horizontal bars of each method's mean rank on ``metric`` (default: the headline), sorted,
    best (lowest) at the top."""
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas = mpl
    metric = metric or report.headline
    if metric not in report.ranked:
        raise ValueError(f"{metric!r} is not a ranked metric of {report.task} ({report.ranked})")
    agg = report.aggregate()
    key = f"{metric}_rank"
    methods = sorted(report.methods, key=lambda m: agg[m][key] if _ok(agg[m][key]) else math.inf)
    ranks = [agg[m][key] if _ok(agg[m][key]) else np.nan for m in methods]
    colors = _colors(report.methods)
    fig = Figure(figsize=(6.4, max(2.2, 0.9 + 0.42 * len(methods))))
    ax = fig.add_subplot()
    y = np.arange(len(methods))
    ax.barh(y, ranks, color=[colors[m] for m in methods], height=0.65)
    for yi, m, r in zip(y, methods, ranks):
        text = f"{r:.2f}" if np.isfinite(r) else "n/a"
        if agg[m].get("n_failed"):
            text += f"  ({agg[m]['n_failed']} failed)"
        ax.text((r if np.isfinite(r) else 0) + 0.05, yi, text, va="center", fontsize="small")
    ax.set_yticks(y)
    ax.set_yticklabels(methods)
    ax.invert_yaxis()
    ax.set_xlim(0, len(report.methods) + 0.9)
    unit = "dataset x condition" if report.rank_scores else "dataset"
    ax.set_xlabel(f"mean rank of {metric} per {unit} (1 = best, lower = better)")
    ax.set_title(f"{report.task}: mean rank, {len(report.datasets)} datasets"
                 + ("; failure = worst rank" if report.errors else ""))
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return _save(fig, Canvas, Path(path))


def imputation_curves(report, path, results: dict | None = None) -> Path | None:
    """Standardised RMSE vs missing rate, one panel per mechanism, one line per method.

    ``results``: ``{dataset: {method: {"units": [{"mechanism", "rate", "seed", "rmse", ...}]}}}``
    (default ``report.results``, the runner's results; also the "results" of results.json)."""
    results = results if results is not None else report.results
    if not results:
        raise ValueError("imputation_curves needs the per-condition results (report.results or results.json)")
    curves = rmse_by_condition(results, report.methods)
    if not curves:
        return None
    mpl = _matplotlib()
    if mpl is None:
        return None
    Figure, Canvas = mpl
    colors = _colors(report.methods)
    rates = sorted({r for per in curves.values() for mech in per.values() for r in mech})
    fig = Figure(figsize=(12.0, 4.0))
    axes = fig.subplots(1, len(MECHANISMS), sharey=True)
    for ax, mech in zip(axes, MECHANISMS):
        for m in report.order():
            pts = curves.get(m, {}).get(mech, {})
            if not pts:
                continue
            rs = sorted(pts)
            ax.plot(rs, [pts[r] for r in rs], marker="o", color=colors[m], label=m)
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        ax.set_title(mech)
        ax.set_xticks(rates)
        ax.set_xlabel("missing rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("standardised RMSE (lower = better)")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize="small")
    note = "; methods with failures: mean over the datasets they completed" if report.errors else ""
    fig.suptitle(f"imputation: error vs missing rate, mean over {len(report.datasets)} datasets "
                 f"(dotted line at 1.0 ≈ mean imputation under MCAR){note}", fontsize="medium")
    fig.tight_layout()
    return _save(fig, Canvas, Path(path))


def rmse_by_condition(results: dict, methods: list[str] | None = None) -> dict[str, dict[str, dict[float, float]]]:
    """{method: {mechanism: {rate: mean over datasets of the mean over seeds of the rmse}}}."""
    per: dict[str, dict[str, dict[float, list[float]]]] = {}
    for d, by_method in results.items():
        for m, res in by_method.items():
            if methods is not None and m not in methods:
                continue
            cell: dict[tuple[str, float], list[float]] = {}
            for u in res.get("units", []):
                v = u.get("rmse")
                if "mechanism" in u and "rate" in u and _ok(v):
                    cell.setdefault((u["mechanism"], float(u["rate"])), []).append(float(v))
            for (mech, rate), vals in cell.items():
                per.setdefault(m, {}).setdefault(mech, {}).setdefault(rate, []).append(float(np.mean(vals)))
    return {m: {mech: {r: float(np.mean(v)) for r, v in by_rate.items()} for mech, by_rate in by_mech.items()}
            for m, by_mech in per.items()}


def write_plots(report, out_dir) -> list[Path]:
    """All plots for ``report`` into ``out_dir`` (created); returns the files written ([] without
    matplotlib or without scores)."""
    if _matplotlib() is None:
        return []
    if not report.datasets or not report.methods:
        return []
    out_dir = Path(out_dir)
    out = [score_bars(report, out_dir / f"scores_{report.headline}.png")]
    if report.headline in report.ranked:
        out.append(rank_summary(report, out_dir / f"ranks_{report.headline}.png"))
    if report.task == "imputation" and report.results:
        out.append(imputation_curves(report, out_dir / "imputation_rmse_vs_rate.png"))
    return [p for p in out if p is not None]
