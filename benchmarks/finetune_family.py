"""Fine-tuning on a family of tables vs in-context prediction on a new table of the family (issue #24).

    nice -n 10 python benchmarks/finetune_family.py --task regression --table computers --group trend --minutes 5
    nice -n 10 python benchmarks/finetune_family.py --table phoneme --shards 10 --minutes 5
    nice -n 10 python benchmarks/finetune_family.py --quick

A user with many tables of one kind (a store per month, a plant per site) can fine-tune once on the
tables they have and predict a new one in context. This benchmark builds such a family from one table
of a suite: its rows cut by the values of a column (`--group`, the column stays a feature) or into
`--shards` random shards. Every `--holdout-every`-th group (by sorted value; shards by index, from the
last) is a *new table*, never trained on; the rest are the *family*.

On every new table, out-of-fold over the protocol's 5 folds of that table (stratified for
classification, `classification_splits` / `regression_splits`, seed 0), so each of its rows is
predicted once from the other rows of its table:

    in-context          the init's weights; context = the new table's other rows
    pooled              the init's weights; context = those rows + every family row (the estimator
                        subsamples to max_context_rows): what a user can do without training
    full-zZ             `finetune()` on the family (its own 20 % row holdout per table picks the step,
                        --significance Z), context = the new table's other rows
    full-zZ pooled      the same weights with the pooled context

Estimator parameters are the ones fine-tuning scores and exports with (`HoldoutEval.params_for`).
Metrics per new table on its out-of-fold predictions (ROC-AUC, accuracy, log-loss; R^2, RMSE), then
the mean over new tables. Writes JSON (default benchmarks/results/finetune_family_TABLE.json) and
prints one table per metric and a summary line with wins / ties / losses against in-context.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / sklearn load their thread pools

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from common import machine_info  # noqa: E402
from finetune_vs_context import HIGHER, METRICS, PRIMARY, _fmt  # noqa: E402
from tabfm.eval.metrics import classification_metrics, regression_metrics  # noqa: E402
from tabfm.eval.protocols import _proba_in_code_order, classification_splits, regression_splits  # noqa: E402
from tabfm.eval.suites import default_public_dir, load_suite  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QUICK = {"task": "classification", "table": "wine", "shards": 4, "holdout_every": 2, "minutes": 0.3}


# --------------------------------------------------------------------------- the family

def family(frame: pd.DataFrame, group: str | None, shards: int | None, holdout_every: int,
           seed: int) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """({name: family table}, {name: new table}) cut from `frame` by the values of `group` or into
    `shards` random shards; every holdout_every-th one, counted from the last, is a new table."""
    if group is not None:
        if group not in frame.columns:
            raise SystemExit(f"--group {group!r} is not a column of the table (columns: {list(frame.columns)})")
        keys = sorted(frame[group].dropna().unique())
        parts = {f"{group}={k:g}" if isinstance(k, (int, float, np.number)) else f"{group}={k}":
                 frame[frame[group] == k].reset_index(drop=True) for k in keys}
    else:
        order = np.random.default_rng(seed).permutation(len(frame))
        parts = {f"shard{i}": frame.iloc[np.sort(idx)].reset_index(drop=True)
                 for i, idx in enumerate(np.array_split(order, shards))}
    names = list(parts)
    new = set(names[::-1][::holdout_every])
    return ({n: parts[n] for n in names if n not in new}, {n: parts[n] for n in names if n in new})


# --------------------------------------------------------------------------- scoring

def out_of_fold(model, params: dict, table: pd.DataFrame, target: str, task: str, classes: list,
                extra: pd.DataFrame | None = None) -> dict:
    """The protocol's metrics of out-of-fold predictions on `table`: each fold's rows predicted from
    the table's other rows (and `extra` rows, the pooled family, when given)."""
    from tabfm.estimators import TabFMClassifier, TabFMRegressor

    X = table.drop(columns=[target])
    if task == "classification":
        y = pd.Categorical(table[target], categories=classes).codes.astype(np.int64)
        K = len(classes)
        pred = np.zeros((len(table), K))
        splits = classification_splits(y)
    else:
        y = table[target].to_numpy(np.float64)
        pred = np.zeros(len(table))
        splits = regression_splits(len(y))
    if extra is not None:
        Xe = extra.drop(columns=[target])
        ye = (pd.Categorical(extra[target], categories=classes).codes.astype(np.int64) if task == "classification"
              else extra[target].to_numpy(np.float64))
    t0 = time.perf_counter()
    for tr, te in splits:
        Xtr, ytr = X.iloc[tr], y[tr]
        if extra is not None:
            Xtr, ytr = pd.concat([Xtr, Xe], ignore_index=True), np.concatenate([ytr, ye])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if task == "classification":
                est = TabFMClassifier(model=model, progress=False, **params).fit(Xtr, ytr)
                pred[te] = _proba_in_code_order(est, est.predict_proba(X.iloc[te]), K)
            else:
                reg = {k: v for k, v in params.items() if k != "multiclass"}
                pred[te] = TabFMRegressor(model=model, progress=False, **reg).fit(Xtr, ytr).predict(X.iloc[te])
    metrics = classification_metrics(y, pred, K) if task == "classification" else regression_metrics(y, pred)
    return {**metrics, "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- the benchmark

def run(args) -> dict:
    from tabfm.train.finetune import FinetuneConfig, HoldoutEval, finetune
    from tabfm.weights import load_model

    torch.set_num_threads(1)
    task, primary = args.task, PRIMARY[args.task]
    suite_dir = Path(args.suite_dir) if args.suite_dir else (
        default_public_dir() if task == "classification" else ROOT / "runs" / "regression-suite")
    (ds,) = load_suite(suite_dir, task, [args.table])
    frame = ds.frame
    classes = list(frame[ds.target].cat.categories) if task == "classification" else []
    fam, new = family(frame, args.group, args.shards, args.holdout_every, args.seed)
    pooled = pd.concat(list(fam.values()), ignore_index=True)
    print(f"{args.table}: {len(frame)} rows; family {len(fam)} tables ({len(pooled)} rows), new tables "
          f"{list(new)} ({sum(len(t) for t in new.values())} rows)", flush=True)

    base = FinetuneConfig(init=args.init, task=task, target=ds.target, steps=args.steps, max_minutes=args.minutes,
                          threads=1, seed=args.seed, lr=args.lr, eval_every=args.eval_every,
                          warmup_steps=args.warmup_steps, patience=args.patience)
    params = HoldoutEval.params_for(base, load_model(args.init).config.context_features)
    zs = [float(z) for z in args.significance.split(",")]
    print(f"init {args.init}; estimator parameters {params}; budget {args.minutes} min; significance {zs}", flush=True)

    t_start = time.perf_counter()
    models = {"in-context": args.init}
    runs = {}
    for z in zs:
        out = Path(args.work) / args.table / f"full-z{z:g}"
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            res = finetune(base.replace(significance=z), out, data=fam, progress=False, restart=True)
        runs[f"full-z{z:g}"] = {"wall_s": time.perf_counter() - t0, "steps": res.step, "stopped": res.stopped,
                                "best_step": res.best_step, "holdout_before": res.initial.get("score"),
                                "holdout_best": res.best.get("score")}
        models[f"full-z{z:g}"] = str(res.export)
        print(f"  full-z{z:g}: {res.step} steps ({res.stopped}), best step {res.best_step}, holdout score "
              f"{res.initial.get('score'):.4f} -> {res.best.get('score'):.4f}, "
              f"{runs[f'full-z{z:g}']['wall_s'] / 60:.1f} min", flush=True)

    def label(name: str, pooled_ctx: bool) -> str:
        return name if not pooled_ctx else ("pooled" if name == "in-context" else f"{name} pooled")

    variants = [label(name, p) for name in models for p in (False, True)]
    results = {}
    for tname, table in new.items():
        row = {"rows": len(table)}
        for name, model in models.items():
            for pooled_ctx in (False, True):
                row[label(name, pooled_ctx)] = out_of_fold(model, params, table, ds.target, task, classes,
                                                           pooled if pooled_ctx else None)
        results[tname] = row
        print(f"  {tname} ({len(table)} rows): " + ", ".join(f"{v} {row[v][primary]:.4f}" for v in variants),
              flush=True)

    return {"benchmark": "finetune_family", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
            "task": task, "table": args.table, "group": args.group, "shards": args.shards,
            "holdout_every": args.holdout_every, "family_tables": {n: len(t) for n, t in fam.items()},
            "new_tables": {n: len(t) for n, t in new.items()}, "init": args.init, "estimator_params": params,
            "minutes": args.minutes, "finetune_config": base.to_dict(), "runs": runs, "variants": variants,
            "primary_metric": primary, "results": results, "total_wall_s": time.perf_counter() - t_start}


def report(record: dict) -> str:
    task, variants, results = record["task"], record["variants"], record["results"]
    primary = record["primary_metric"]
    lines = []
    for metric in METRICS[task]:
        arrow = "higher is better" if HIGHER[metric] else "lower is better"
        lines += [f"\n{metric}, out-of-fold on each new table ({arrow})\n",
                  "| new table | rows | " + " | ".join(variants) + " |", "|---|---:|" + "---:|" * len(variants)]
        for name, row in results.items():
            vals = [row[v][metric] for v in variants]
            best = (max if HIGHER[metric] else min)(vals)
            lines.append(f"| {name} | {row['rows']} | " + " | ".join(f"**{_fmt(x)}**" if x == best else _fmt(x)
                                                                     for x in vals) + " |")
        lines.append("| mean | | " + " | ".join(_fmt(float(np.mean([r[v][metric] for r in results.values()])))
                                              for v in variants) + " |")
    lines.append("\nfine-tuning runs: " + "; ".join(
        f"{n} {r['steps']} steps ({r['stopped']}), best step {r['best_step']}, {r['wall_s'] / 60:.1f} min"
        for n, r in record["runs"].items()))
    wins = []
    for v in variants[1:]:
        d = [row[v][primary] - row["in-context"][primary] for row in results.values()]
        wins.append(f"{v} {sum(x > 0 for x in d)}/{sum(x == 0 for x in d)}/{sum(x < 0 for x in d)}")
    lines.append(f"summary: {primary} wins/ties/losses against in-context over {len(results)} new tables: "
                 + ", ".join(wins) + f"; total wall {record['total_wall_s'] / 60:.1f} min")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=tuple(PRIMARY), default="classification",
                    help="classification (public suite) or regression (runs/regression-suite)")
    ap.add_argument("--table", default="phoneme", help="the suite table the family is cut from")
    ap.add_argument("--group", default=None, help="cut by the values of this column (it stays a feature)")
    ap.add_argument("--shards", type=int, default=10, help="without --group: this many random shards")
    ap.add_argument("--holdout-every", type=int, default=5, help="every N-th table (from the last) is a new table")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall budget of each fine-tuning run")
    ap.add_argument("--steps", type=int, default=100_000, help="step cap (large: the budget binds)")
    ap.add_argument("--lr", type=float, default=1e-4, help="fine-tuning learning rate (FinetuneConfig default)")
    ap.add_argument("--eval-every", type=int, default=20, help="held-out evaluations every N steps")
    ap.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    ap.add_argument("--patience", type=int, default=8, help="evaluations without improvement before stopping")
    ap.add_argument("--significance", default="0,2", help="comma list of FinetuneConfig.significance values")
    ap.add_argument("--init", default="tabfm-tiny-cf", help="starting weights (shipped name or export directory)")
    ap.add_argument("--seed", type=int, default=0, help="shard, fine-tuning and estimator seed")
    ap.add_argument("--suite-dir", default=None, help="suite directory (default: the task's suite)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "finetune_family"), help="fine-tuning run directories")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/finetune_family_TABLE.json)")
    ap.add_argument("--quick", action="store_true", help=f"smoke check: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.group = None
    if args.group is None and (args.shards is None or args.shards < 2):
        raise SystemExit("--shards must be >= 2 without --group")
    path = Path(args.json) if args.json else RESULTS / f"finetune_family_{args.table}{'_quick' if args.quick else ''}.json"
    record = run(args)
    text = report(record)
    record["report"] = text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=float))
    print(text)
    print(f"\nwrote {path}")
    return record


if __name__ == "__main__":
    main()
