"""`tabfm predict`: in-context predictions for a test table, with a training table as context.

    tabfm predict --train train.csv --test test.csv --target y [--task classification|regression]
                  [--model NAME | EXPORT_DIR] [--out preds.csv] [--proba]

--train and --test are CSV, TSV or Parquet files (a table store's too), read by
tabfm.data.readers as `tabfm finetune --data` reads them (ISO dates parsed, errors naming the
file and line). Writes one column named after the target (predicted class, or predicted mean),
plus one "proba_<class>" column per class with --proba, as CSV to --out or stdout, rows in test
order. When the test table holds the target column too, it is dropped from the inputs and the
score (accuracy or R^2) is reported on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tabfm.commands._common import PREDICTION_TASKS, add_output_flags

if TYPE_CHECKING:  # pandas loads when the command runs, not for --help
    import pandas as pd

MAX_INT_CLASSES = 20  # an integer target with at most this many distinct values is read as classes
RESIDUAL_FLAGS = {"mixed": "mixed", "on": True, "off": False}  # --linear-residual -> TabFMRegressor(linear_residual=...)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tabfm.weights import DEFAULT_MODELS

    p = subparsers.add_parser(
        "predict",
        help="predict a target column of a test table from a training table (in context)",
        description="Predict the target column of TEST from the labelled rows of TRAIN, without training. "
                    "Both are CSV, TSV or Parquet files.",
    )
    p.add_argument("--train", required=True, metavar="PATH", help="labelled rows (the context): a CSV, TSV or "
                   "Parquet file")
    p.add_argument("--test", required=True, metavar="PATH", help="rows to predict: a CSV, TSV or Parquet file")
    p.add_argument("--target", required=True, metavar="COL", help="name of the target column in the training table")
    p.add_argument("--task", choices=PREDICTION_TASKS, help="default: classification for text/boolean targets and integer "
                   f"targets with <= {MAX_INT_CLASSES} distinct values, else regression")
    p.add_argument("--model", default=None, help="shipped model name or export directory (default: the task's own, "
                   + ", ".join(f"{t} {DEFAULT_MODELS[t]}" for t in PREDICTION_TASKS) + ")")
    p.add_argument("--out", metavar="CSV", help="write predictions here (default: stdout)")
    p.add_argument("--proba", action="store_true", help="classification: add a probability column per class")
    p.add_argument("--n-estimators", type=int, default=4, help="ensemble members (default 4)")
    p.add_argument("--n-neighbors", default="5,20", metavar="K[,K...]",
                   help="sizes of the neighbour features, comma-separated; 0 = off (default 5,20)")
    p.add_argument("--no-linear-features", dest="linear_features", action="store_false",
                   help="leave out the linear-model feature column (default: on)")
    p.add_argument("--linear-residual", choices=RESIDUAL_FLAGS, default=None,
                   help="regression: on = the model predicts a ridge regression's residual, off = the target itself, "
                        "mixed = half the members each, weighted per row by their predictive variances (default mixed)")
    p.add_argument("--max-classes", type=int, default=100,
                   help="classification: refuse a numeric target with more distinct values (default 100: such a "
                        "target is a quantity, use --task regression); raise it to classify anyway")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    add_output_flags(p)  # the estimator's bar over its model passes (TabFM*(progress=...))
    return p


def read_table(path: str, flag: str) -> pd.DataFrame:
    """The one table in file `path` (CSV, TSV or Parquet) through tabfm.data.readers; ValueError
    'cannot read PATH: why' when it cannot be read or holds more than one table."""
    from tabfm.data.readers import read_tables

    where = Path(path)
    if not where.exists():
        raise ValueError(f"cannot read {path}: no such file")
    try:
        tables = read_tables(where)
    except (ValueError, TypeError, OSError) as err:
        why = str(err)
        for prefix in (f"{where}: ", f"{where} "):  # the readers name the file first: say it once
            if why.startswith(prefix):
                why = why[len(prefix):]
                break
        raise ValueError(f"cannot read {path}: {why}") from None
    if len(tables) != 1:
        raise ValueError(f"{flag} {path}: a directory of {len(tables)} tables; {flag} takes one table file")
    return tables[0].frame


def infer_task(y: pd.Series) -> str:
    """classification for non-numeric/boolean targets and integers with few values, else regression."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(y.dtype) or not pd.api.types.is_numeric_dtype(y.dtype):
        return "classification"
    if pd.api.types.is_integer_dtype(y.dtype) and y.nunique() <= MAX_INT_CLASSES:
        return "classification"
    return "regression"


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from tabfm.estimators import TabFMClassifier, TabFMRegressor
    from tabfm.weights import ModelNotFoundError

    if args.out:  # before any work: a path that cannot be written fails now, not after the predictions
        target = Path(args.out)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--out {args.out}: cannot create its directory ({err.strerror})") from None
        if target.is_dir() or not os.access(target.parent, os.W_OK):
            raise ValueError(f"--out {args.out}: " + ("is a directory; give a file path" if target.is_dir()
                                                       else f"{target.parent} is not writable"))
    train, test = read_table(args.train, "--train"), read_table(args.test, "--test")
    if args.target not in train.columns:
        raise ValueError(f"target column {args.target!r} is not in {args.train} (columns: {list(train.columns)})")
    y = train.pop(args.target)
    y_test = test.pop(args.target) if args.target in test.columns else None
    missing, extra = [c for c in train.columns if c not in test.columns], [c for c in test.columns if c not in train.columns]
    if missing or extra:
        raise ValueError(f"the feature columns of --test {args.test} are not those of --train {args.train}: "
                         + "; ".join(f"{what} {cols}" for what, cols in (("missing", missing), ("extra", extra)) if cols))
    task = args.task or infer_task(y)
    if args.proba and task != "classification":
        raise ValueError("--proba applies to classification only")

    try:
        sizes = tuple(int(k) for k in args.n_neighbors.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--n-neighbors: expected comma-separated integers such as 5,20, got {args.n_neighbors!r}") from None
    # --progress / --no-progress decide; else the estimator's own rule (a bar for long calls in a terminal), off with --quiet
    progress = args.progress if args.progress is not None else (False if args.quiet else None)
    params = dict(n_estimators=args.n_estimators, random_state=args.seed, device=args.device, n_neighbors=sizes,
                  linear_features=args.linear_features, progress=progress)
    if args.model is not None:  # else the estimator's own default for its task
        params["model"] = args.model
    if args.linear_residual is not None and task == "classification":
        raise ValueError("--linear-residual applies to regression only")
    if args.linear_residual is not None:  # else the regressor's own default
        params["linear_residual"] = RESIDUAL_FLAGS[args.linear_residual]
    est = TabFMClassifier(**params, max_classes=args.max_classes) if task == "classification" else TabFMRegressor(**params)
    try:
        est.fit(train, y)
        if task == "classification":
            proba = est.predict_proba(test)
            out = pd.DataFrame({args.target: est.classes_[proba.argmax(1)]})
            if args.proba:
                for j, c in enumerate(est.classes_):
                    out[f"proba_{c}"] = proba[:, j]
        else:
            out = pd.DataFrame({args.target: est.predict(test)})
    except ModelNotFoundError as err:
        raise ValueError(str(err)) from None
    if args.task is None and not args.quiet:  # once it worked: bad input stays one line
        print(f"tabfm predict: task {task} (inferred from target dtype {y.dtype}; --task to choose)", file=sys.stderr)

    if y_test is not None and y_test.notna().all():
        from sklearn.metrics import accuracy_score, r2_score

        if task == "classification":
            score = accuracy_score(y_test.astype(str), out[args.target].astype(str))
            print(f"tabfm predict: accuracy on {args.test}: {score:.4f}", file=sys.stderr)
        else:
            print(f"tabfm predict: R^2 on {args.test}: {r2_score(y_test, out[args.target]):.4f}", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out.to_csv(args.out, index=False)
        print(f"tabfm predict: wrote {len(out)} predictions to {args.out}", file=sys.stderr)
    else:
        out.to_csv(sys.stdout, index=False)
    return 0
