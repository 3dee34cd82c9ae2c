"""Baseline methods: a registry of factories per task (name -> zero-argument callable that returns a
fresh estimator following the contract of tabfm.eval.protocols).

Shared preprocessing (documented, used by every baseline that needs numeric input):

* ``logreg`` / ``ridge`` / ``knn``: numeric columns mean-imputed then standardised; categorical
  columns one-hot encoded (missing = its own indicator, unseen levels ignored) — ``numeric_pipeline``.
* ``random_forest`` / ``extra_trees``: categorical columns ordinal-encoded (sorted levels, missing
  stays NaN) and placed first, numeric columns after them with their NaN (sklearn trees route
  missing values natively) — ``tree_pipeline``.
* ``hist_gb``, ``lightgbm``, ``xgboost``: native categorical handling from the pandas
  ``category`` dtype, native missing values. ``catboost``: categorical columns passed as
  ``cat_features`` (labels as strings, missing as the string "nan").

All hyper-parameters are library defaults; only the thread count is pinned (``n_jobs``, default 1)
and ``random_state=0`` where a library has one, so runs are reproducible.

Optional libraries (xgboost, lightgbm, catboost, pyod) are imported lazily: a missing one drops
its baselines with a warning, never an error.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.impute import SimpleImputer
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import OneHotEncoder, OrdinalEncoder, StandardScaler

Factory = Callable[[], Any]

# baseline name -> (import name of the optional library or None, pip name)
OPTIONAL = {
    "xgboost": ("xgboost", "xgboost"),
    "lightgbm": ("lightgbm", "lightgbm"),
    "catboost": ("catboost", "catboost"),
}


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


# ============================================================================ preprocessing
_cat = make_column_selector(dtype_include="category")
_num = make_column_selector(dtype_exclude="category")


def _onehot() -> OneHotEncoder:
    return OneHotEncoder(handle_unknown="ignore", sparse_output=False)


def numeric_pipeline(model) -> Pipeline:
    """mean-impute + standardise numeric columns, one-hot categorical columns, then ``model``."""
    pre = ColumnTransformer(
        [("num", make_pipeline(SimpleImputer(strategy="mean", keep_empty_features=True), StandardScaler()), _num),
         ("cat", _onehot(), _cat)],
        verbose_feature_names_out=False,
    )
    return Pipeline([("pre", pre), ("model", model)])


def _ordinal() -> OrdinalEncoder:
    return OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1, encoded_missing_value=np.nan)


def tree_pipeline(model) -> Pipeline:
    """ordinal-encode categorical columns (sorted levels, missing stays NaN) and put them first,
    numeric columns after them untouched (NaN kept: sklearn trees route it), then ``model``."""
    pre = ColumnTransformer([("cat", _ordinal(), _cat)], remainder="passthrough", verbose_feature_names_out=False)
    return Pipeline([("pre", pre), ("model", model)])


class CatBoostWrapper(BaseEstimator):
    """CatBoost with the frame's categorical columns as ``cat_features`` (string labels, NaN -> "nan")."""

    def __init__(self, kind: str = "classifier", thread_count: int = 1, random_state: int = 0):
        self.kind = kind
        self.thread_count = thread_count
        self.random_state = random_state

    def _frame(self, X: pd.DataFrame) -> pd.DataFrame:
        X = X.copy()
        for c in self.cat_columns_:
            X[c] = X[c].astype(object).where(X[c].notna(), "nan").astype(str)
        return X

    def fit(self, X: pd.DataFrame, y):
        import catboost

        self.cat_columns_ = [c for c in X.columns if isinstance(X[c].dtype, pd.CategoricalDtype)]
        cls = catboost.CatBoostClassifier if self.kind == "classifier" else catboost.CatBoostRegressor
        self.model_ = cls(thread_count=self.thread_count, random_seed=self.random_state, verbose=False,
                          allow_writing_files=False)
        self.model_.fit(self._frame(X), y, cat_features=self.cat_columns_)
        if self.kind == "classifier":
            self.classes_ = np.asarray(self.model_.classes_)
        return self

    def predict_proba(self, X):
        return self.model_.predict_proba(self._frame(X))

    def predict(self, X):
        return np.asarray(self.model_.predict(self._frame(X))).reshape(-1)


def _supervised(task: str, n_jobs: int) -> dict[str, Factory]:
    """Classification or regression baselines: the same eight families, library defaults."""
    from sklearn import ensemble, linear_model, neighbors

    cls = task == "classification"
    suffix = "Classifier" if cls else "Regressor"
    linear = ("logreg", linear_model.LogisticRegression) if cls else ("ridge", linear_model.Ridge)
    forest, extra = getattr(ensemble, f"RandomForest{suffix}"), getattr(ensemble, f"ExtraTrees{suffix}")
    knn, hist = getattr(neighbors, f"KNeighbors{suffix}"), getattr(ensemble, f"HistGradientBoosting{suffix}")
    out: dict[str, Factory] = {
        linear[0]: lambda: numeric_pipeline(linear[1]()),
        "knn": lambda: numeric_pipeline(knn(n_jobs=n_jobs)),
        "random_forest": lambda: tree_pipeline(forest(random_state=0, n_jobs=n_jobs)),
        "extra_trees": lambda: tree_pipeline(extra(random_state=0, n_jobs=n_jobs)),
        "hist_gb": lambda: hist(random_state=0),
    }
    if _has("xgboost"):
        import xgboost

        xgb = getattr(xgboost, f"XGB{suffix}")
        out["xgboost"] = lambda: xgb(enable_categorical=True, n_jobs=n_jobs, random_state=0)
    if _has("lightgbm"):
        import lightgbm

        lgbm = getattr(lightgbm, f"LGBM{suffix}")
        out["lightgbm"] = lambda: lgbm(n_jobs=n_jobs, random_state=0, verbose=-1)
    if _has("catboost"):
        out["catboost"] = lambda: CatBoostWrapper("classifier" if cls else "regressor", thread_count=n_jobs)
    return out


# ============================================================================ registry
BASELINE_NAMES = {
    "classification": ["logreg", "knn", "random_forest", "extra_trees", "hist_gb", "xgboost", "lightgbm", "catboost"],
    "regression": ["ridge", "knn", "random_forest", "extra_trees", "hist_gb", "xgboost", "lightgbm", "catboost"],
    "imputation": ["mean_mode", "knn", "mice", "missforest"],
    "anomaly": ["iforest", "lof", "knn", "ocsvm", "ecod", "copod"],
}
_NEEDS = {"xgboost": "xgboost", "lightgbm": "lightgbm", "catboost": "catboost"}


def baselines(task: str, n_jobs: int = 1, names=None, warn: bool = True) -> dict[str, Factory]:
    """The baseline factories of ``task`` (optionally only ``names``); a baseline whose library is
    not installed is left out with a warning naming the package."""
    if task not in BASELINE_NAMES:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(BASELINE_NAMES)})")
    if task in ("classification", "regression"):
        available = _supervised(task, n_jobs)
    elif task == "imputation":
        from .imputers import imputer_baselines

        available = imputer_baselines()
    else:
        from .detectors import detector_baselines

        available = detector_baselines()
    wanted = BASELINE_NAMES[task] if names is None else list(names)
    out = {}
    for name in wanted:
        if name in available:
            out[name] = available[name]
        elif name in BASELINE_NAMES[task]:
            if warn:
                pkg = _NEEDS.get(name, "pyod" if task == "anomaly" else name)
                warnings.warn(f"baseline {name!r} skipped: package {pkg!r} is not installed (pip install {pkg})",
                              stacklevel=2)
        else:
            raise ValueError(f"unknown {task} baseline {name!r} (known: {', '.join(BASELINE_NAMES[task])})")
    return out


def library_versions() -> dict[str, str]:
    """Versions of the libraries baselines depend on (part of the cache key)."""
    out = {}
    for mod in ["numpy", "pandas", "sklearn", "scipy", "xgboost", "lightgbm", "catboost", "pyod"]:
        try:
            out[mod] = str(importlib.import_module(mod).__version__)
        except Exception:  # noqa: BLE001 - absent or odd module: no version
            pass
    return out


BASELINE_LIBRARY = {
    "xgboost": "xgboost", "lightgbm": "lightgbm", "catboost": "catboost",
    "iforest": "pyod", "lof": "pyod", "knn": None, "ocsvm": "pyod", "ecod": "pyod", "copod": "pyod",
}


# bump when a baseline's wrapper or preprocessing changes (invalidates its cached results)
BASELINE_REVISION = "1"
BASELINE_REVISIONS = {"imputation/missforest": "2"}  # per-baseline overrides


def baseline_version(task: str, name: str) -> dict[str, str]:
    """The versions a baseline's result depends on: numpy/pandas/sklearn + its own library +
    ``BASELINE_REVISION``."""
    v = library_versions()
    v["baselines"] = BASELINE_REVISIONS.get(f"{task}/{name}", BASELINE_REVISION)
    keys = ["baselines", "numpy", "pandas", "sklearn"]
    lib = BASELINE_LIBRARY.get(name)
    if task == "anomaly":
        lib = "pyod"
    if lib and lib in v:
        keys.append(lib)
    return {k: v[k] for k in keys if k in v}
