"""What a context-feature model's own extra columns score on their own (issue #25).

A model pretrained with `--context-features knn-linear` reads, beside the table, the neighbour
class shares of every context / query row (k = 5 and 20) and out-of-fold ridge scores
(`tabfm.data.context_features`). Each group of those columns is a classifier by itself: read its
K - 1 class columns as p(1..K-1), clipped to [0, 1], with p(0) = 1 - their sum, renormalised. This
script scores each group alone on every fold of the classification protocol and sets the model
alone (one n-way pass per member, from a `tabfm eval` report.json, `--report`) beside it. Where a
group alone beats the model, the model throws away information it was shown: what pretraining
has not yet taught it to use.

The columns are built from every encoded column and every training row of the fold (the
estimator builds them from a member's <= 32 columns and <= 2,048 rows, so on digits, 61 columns,
and on tables of more than 2,048 training rows the model's columns are a little weaker).
Costs no model pass: about 20 s for the public suite on one core.

`--synthetic PRESET` scores the groups on the prior of a stream preset instead: --tables
classification tables of 3-10 classes (400 rows x 12 columns, a random 70/30 split, redrawn until
both sides hold every class), and counts on how many each group is the best: what the prior
teaches the model about which of its columns to trust.

    python benchmarks/context_columns.py --report benchmarks/results/tabfm_tiny_realmix5/classification/report.json
    python benchmarks/context_columns.py --datasets vehicle,wine --json /tmp/cc.json
    python benchmarks/context_columns.py --synthetic pretrain-classes,pretrain-nominal --tables 150
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tabfm.data.context_features import ContextFeatureSpec, context_features
from tabfm.data.encode import encode_frame
from tabfm.eval.metrics import classification_metrics
from tabfm.eval.protocols import classification_splits
from tabfm.eval.suites import default_public_dir, load_suite

SPEC = "knn-linear"


def group_probabilities(columns: np.ndarray) -> np.ndarray:
    """(n, K) class probabilities from a group's K - 1 columns (estimates of p(1..K-1))."""
    p = np.clip(np.asarray(columns, dtype=np.float64), 0.0, 1.0)
    p0 = np.clip(1.0 - p.sum(axis=1, keepdims=True), 0.0, 1.0)
    probs = np.hstack([p0, p]) + 1e-6
    return probs / probs.sum(axis=1, keepdims=True)


def group_names(spec: ContextFeatureSpec) -> list[str]:
    """The column groups of `spec`, in the order context_features lays them out."""
    return [f"knn{k}" for k in spec.neighbors] + (["ridge"] if spec.linear else [])


def score_fold(frame, target: str, train: np.ndarray, test: np.ndarray, spec: ContextFeatureSpec,
               seed: int) -> dict[str, dict[str, float]]:
    """Metrics of each column group alone on one fold."""
    features = frame.drop(columns=[target])
    y = frame[target].cat.codes.to_numpy().astype(np.int64)
    n_classes = int(y.max()) + 1
    enc, schema = encode_frame(features.iloc[train])
    x_test = schema.transform(features.iloc[test]).x.numpy()
    _, query = context_features(enc.x.numpy(), x_test, schema.kind.numpy(), schema.cardinality.numpy(), y[train],
                                n_classes, spec, np.random.default_rng(seed))
    m = n_classes - 1
    return {name: classification_metrics(y[test], group_probabilities(query[:, i * m:(i + 1) * m]), n_classes)
            for i, name in enumerate(group_names(spec))}


def synthetic_groups(preset: str, n_tables: int, spec: ContextFeatureSpec, seed: int = 1) -> dict:
    """Mean ROC-AUC of each group alone and how often it is the best, on `n_tables` many-class
    (3..max_classes) tables of `preset`'s prior (classification only)."""
    from dataclasses import replace

    from tabfm.synth.prior import sample_table
    from tabfm.synth.stream import StreamConfig

    prior = replace(StreamConfig.preset(preset).prior, p_classification=1.0)
    rng, names = np.random.default_rng(seed), group_names(spec)
    scores: dict[str, list[float]] = {g: [] for g in names}
    best = dict.fromkeys(names, 0)
    while len(scores[names[0]]) < n_tables:
        t = sample_table(prior, rng, 400, 12)
        y = t.X[:, -1].astype(np.int64)
        k = int(y.max()) + 1
        perm = rng.permutation(len(y))
        train, test = perm[:280], perm[280:]
        if k < 3 or len(np.unique(y[train])) < k or len(np.unique(y[test])) < k:
            continue
        _, query = context_features(t.X[train, :-1], t.X[test, :-1], t.kind[:-1], t.cardinality[:-1], y[train], k,
                                    spec, rng)
        aucs = {g: classification_metrics(y[test], group_probabilities(query[:, i * (k - 1):(i + 1) * (k - 1)]), k)["roc_auc"]
                for i, g in enumerate(names)}
        for g in names:
            scores[g].append(aucs[g])
        best[max(names, key=aucs.get)] += 1
    return {"preset": preset, "tables": n_tables, "mean_roc_auc": {g: float(np.mean(v)) for g, v in scores.items()},
            "best_on": best}


def model_alone(report: Path | None) -> dict[str, dict[str, float]]:
    """Per-dataset metrics of the one method of a `tabfm eval` report.json ({} without one)."""
    if report is None:
        return {}
    data = json.loads(Path(report).read_text())
    method = data["methods"][0]
    return {name: scores[method] for name, scores in data["per_dataset"].items() if method in scores}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", type=Path, default=None, help="classification suite directory (default: the public one)")
    ap.add_argument("--datasets", default=None, help="comma-separated subset")
    ap.add_argument("--report", type=Path, default=None, help="a `tabfm eval` report.json of the model alone")
    ap.add_argument("--folds", type=int, default=None, help="only the first N folds of the protocol")
    ap.add_argument("--synthetic", default=None, help="comma-separated stream presets: score their prior instead")
    ap.add_argument("--tables", type=int, default=150, help="--synthetic: many-class tables per preset")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    spec = ContextFeatureSpec.named(SPEC)
    names = group_names(spec)
    if args.synthetic:
        start = time.time()
        priors = [synthetic_groups(p, args.tables, spec) for p in args.synthetic.split(",")]
        print(f"Each context-column group alone ({SPEC}) on {args.tables} synthetic 3-10-class tables per preset")
        print("| preset | " + " | ".join(f"{g} ROC-AUC" for g in names) + " | " + " | ".join(f"{g} best on" for g in names) + " |")
        print("|---|" + "---:|" * (2 * len(names)))
        for r in priors:
            print(f"| {r['preset']} | " + " | ".join(f"{r['mean_roc_auc'][g]:.4f}" for g in names) + " | "
                  + " | ".join(str(r["best_on"][g]) for g in names) + " |")
        record = {"benchmark": "context_columns", "spec": SPEC, "command": " ".join(sys.argv), "synthetic": priors,
                  "seconds": time.time() - start}
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))
        return record
    suite = args.suite or default_public_dir() / "classification"
    datasets = load_suite(suite, "classification", args.datasets.split(",") if args.datasets else None)
    alone = model_alone(args.report)
    start, rows = time.time(), []
    for ds in datasets:
        y = ds.frame[ds.target].cat.codes.to_numpy()
        folds = classification_splits(y)[:args.folds]
        per_fold = [score_fold(ds.frame, ds.target, tr, te, spec, seed=f) for f, (tr, te) in enumerate(folds)]
        row = {"dataset": ds.name, "rows": len(ds.frame), "classes": int(y.max()) + 1, "folds": len(folds)}
        for g in names:
            row[g] = {m: float(np.mean([f[g][m] for f in per_fold])) for m in per_fold[0][g]}
        row["best_group"] = max(names, key=lambda g: row[g]["roc_auc"])
        if ds.name in alone:
            row["model"] = alone[ds.name]
        rows.append(row)
        print(f"{ds.name}: " + ", ".join(f"{g} {row[g]['roc_auc']:.4f}" for g in names)
              + (f", model {row['model']['roc_auc']:.4f}" if "model" in row else ""), file=sys.stderr, flush=True)

    print(f"\nROC-AUC of each context-column group alone ({SPEC}), {len(rows)} tables"
          + (f"; model alone from {args.report}" if alone else ""))
    head = "| dataset | classes | " + " | ".join(names) + (" | model alone | model − best group |" if alone else " |")
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    for r in rows:
        cells = [f"**{r[g]['roc_auc']:.4f}**" if g == r["best_group"] else f"{r[g]['roc_auc']:.4f}" for g in names]
        if alone:
            gap = r["model"]["roc_auc"] - r[r["best_group"]]["roc_auc"] if "model" in r else float("nan")
            cells += [f"{r['model']['roc_auc']:.4f}" if "model" in r else "—", f"{gap:+.4f}"]
        print(f"| {r['dataset']} | {r['classes']} | " + " | ".join(cells) + " |")
    means = {g: float(np.mean([r[g]["roc_auc"] for r in rows])) for g in names}
    best = float(np.mean([r[r["best_group"]]["roc_auc"] for r in rows]))
    summary = {"mean_roc_auc": means, "mean_best_group": best}
    line = f"| mean | | " + " | ".join(f"{means[g]:.4f}" for g in names)
    scored = [r for r in rows if "model" in r]
    if alone and scored:
        summary["mean_model"] = float(np.mean([r["model"]["roc_auc"] for r in scored]))
        summary["model_below_best_group"] = [r["dataset"] for r in scored
                                             if r["model"]["roc_auc"] < r[r["best_group"]]["roc_auc"]]
        line += f" | {summary['mean_model']:.4f} | {summary['mean_model'] - best:+.4f}"
    print(line + " |")
    print(f"(mean of the best group per table {best:.4f}; {time.time() - start:.0f} s)")
    record = {"benchmark": "context_columns", "spec": SPEC, "command": " ".join(sys.argv), "report": str(args.report),
              "rows": rows, "summary": summary, "seconds": time.time() - start}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
