"""Evaluation protocols of docs/evaluation-protocol.md, for any sklearn-style estimator.

Estimator contract (what each protocol calls; ``factory()`` must return a fresh, unfitted one):

* classification: ``est.fit(X_train, y_train)``; ``est.predict_proba(X_test)``.
  ``X_*`` are DataFrames of the feature columns (categorical columns keep pandas ``category``
  dtype, NaN kept, index reset); ``y_train`` is an int64 array of class codes ``0..K-1`` (code =
  position of the label in the dataset's sorted levels). The probability columns follow
  ``est.classes_`` when the estimator has it, else they must be codes ``0..K-1`` in order.
  Probabilities are clipped to [1e-15, 1] and renormalised per row before scoring.
* regression: ``est.fit(X_train, y_train)`` (float64 target); ``est.predict(X_test)``.
* imputation: ``est.fit_transform(X)`` where X is the whole table with the masked cells set to
  NaN (plus the real NaNs). It must return the same shape with every cell filled: a DataFrame
  (columns by name if the names match, else by position) or an array. Numeric columns are
  numbers. Categorical columns are either labels (``category`` / object / string values, as in
  the input's categories) or, when the returned column is numeric, integer category codes.
* anomaly: ``est.fit(X_train)`` on unlabelled, MinMax-scaled training rows (a float DataFrame,
  anomalies included); ``est.score_samples(X_test)`` where **higher = more anomalous**. (sklearn
  detectors use the opposite sign; wrap them, see ``tabfm.eval.baselines.Negated``.)

Every protocol returns ``{"metrics": {...}, "units": [...], "seconds": float}``: ``metrics`` are
the dataset scores (means over folds / conditions / seeds), ``units`` the per-fold details.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd
from sklearn.model_selection import KFold, StratifiedKFold, train_test_split
from sklearn.preprocessing import MinMaxScaler

from .metrics import anomaly_metrics, classification_metrics, imputation_errors, regression_metrics
from .suites import Dataset

Factory = Callable[[], Any]
Progress = Callable[[], None] | None

N_FOLDS = 5
CV_SEED = 0
MECHANISMS = {"MCAR": 1, "MAR": 2, "MNAR": 3}
RATES = (0.1, 0.3, 0.5)
IMPUTATION_SEEDS = (0, 1, 2)
ANOMALY_SEEDS = (0, 1, 2)
ANOMALY_TEST_SIZE = 0.3


def _tick(progress: Progress) -> None:
    if progress is not None:
        progress()


# ============================================================================ classification
def classification_splits(y_codes: np.ndarray, n_splits: int = N_FOLDS, seed: int = CV_SEED):
    n = len(y_codes)
    return list(StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n), y_codes))


def regression_splits(n_rows: int, n_splits: int = N_FOLDS, seed: int = CV_SEED):
    """The (train, test) index pairs of the regression protocol: shuffled K-fold."""
    return list(KFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n_rows)))


def _proba_in_code_order(est, P, n_classes: int) -> np.ndarray:
    P = np.asarray(P, dtype=np.float64)
    if P.ndim != 2:
        raise ValueError(f"predict_proba returned shape {P.shape}, expected (n, {n_classes})")
    classes = getattr(est, "classes_", None)
    if classes is not None and len(classes) == P.shape[1]:
        full = np.zeros((P.shape[0], n_classes))
        full[:, np.asarray(classes).astype(int)] = P
        return full
    if P.shape[1] != n_classes:
        raise ValueError(f"predict_proba returned {P.shape[1]} columns, expected {n_classes}")
    return P


def run_classification(ds: Dataset, factory: Factory, progress: Progress = None) -> dict:
    X = ds.X
    y = ds.frame[ds.target].cat.codes.to_numpy().astype(np.int64)
    K = len(ds.frame[ds.target].cat.categories)
    units, t0 = [], time.perf_counter()
    for fold, (tr, te) in enumerate(classification_splits(y)):
        est = factory()
        est.fit(X.iloc[tr].reset_index(drop=True), y[tr])
        P = _proba_in_code_order(est, est.predict_proba(X.iloc[te].reset_index(drop=True)), K)
        units.append({"fold": fold, **classification_metrics(y[te], P, K)})
        _tick(progress)
    return _summarise(units, ["roc_auc", "accuracy", "log_loss"], t0)


# ============================================================================ regression
def run_regression(ds: Dataset, factory: Factory, progress: Progress = None) -> dict:
    X = ds.X
    y = ds.frame[ds.target].to_numpy(dtype=np.float64)
    units, t0 = [], time.perf_counter()
    for fold, (tr, te) in enumerate(regression_splits(len(y))):
        est = factory()
        est.fit(X.iloc[tr].reset_index(drop=True), y[tr])
        pred = est.predict(X.iloc[te].reset_index(drop=True))
        units.append({"fold": fold, **regression_metrics(y[te], pred)})
        _tick(progress)
    return _summarise(units, ["rmse", "r2"], t0)


# ============================================================================ imputation masks
def imputation_conditions() -> list[tuple[str, float, int]]:
    """The 27 conditions: mechanism x rate x seed."""
    return [(m, r, s) for m in MECHANISMS for r in RATES for s in IMPUTATION_SEEDS]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _intercept(logit: np.ndarray, target: float) -> float:
    """b such that mean(sigmoid(logit + b)) == target: 100 halvings of [-60, 60]."""
    lo, hi = -60.0, 60.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _sigmoid(logit + mid).mean() < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def column_values(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(values, observed, n_levels): numeric values or category codes as floats (NaN = missing),
    the observed mask, and the number of levels per column (0 for numeric)."""
    n, p = frame.shape
    V = np.empty((n, p))
    levels = []
    for j, c in enumerate(frame.columns):
        s = frame[c]
        if isinstance(s.dtype, pd.CategoricalDtype):
            codes = s.cat.codes.to_numpy().astype(float)
            codes[codes < 0] = np.nan
            V[:, j] = codes
            levels.append(len(s.cat.categories))
        else:
            V[:, j] = s.to_numpy(dtype=np.float64, na_value=np.nan)
            levels.append(0)
    return V, ~np.isnan(V), levels


def standardise(V: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Each column minus the mean, over the std (ddof 0), of its observed cells (std 0 -> 1)."""
    Z = np.full_like(V, np.nan)
    for j in range(V.shape[1]):
        obs = observed[:, j]
        if not obs.any():
            continue
        mu, sd = V[obs, j].mean(), V[obs, j].std()
        Z[:, j] = (V[:, j] - mu) / (sd if sd > 0 else 1.0)
    return Z


def imputation_mask(frame: pd.DataFrame, mechanism: str, rate: float, seed: int) -> np.ndarray:
    """Boolean (n, p) mask of the cells to hide, exactly as docs/evaluation-protocol.md "Imputation" prescribes.

    Only originally observed cells are masked; every column keeps >= 2 observed unmasked cells
    (when it had them); under MAR the driver columns are never masked."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mechanism!r} (expected one of {list(MECHANISMS)})")
    V, observed, levels = column_values(frame)
    n, p = V.shape
    rng = np.random.default_rng([seed, MECHANISMS[mechanism], round(100 * rate)])
    U = rng.random((n, p))
    Z = standardise(V, observed)
    if mechanism == "MCAR":
        P = np.full((n, p), float(rate))
    elif mechanism == "MAR":
        full = np.flatnonzero(observed.all(axis=0))
        k = min(len(full), max(1, round(0.3 * p)))
        drivers = np.sort(rng.choice(full, size=k, replace=False))
        masked = [j for j in range(p) if j not in set(drivers.tolist())]
        r = min(rate * p / (p - k), 0.95) if p > k else 0.0
        W = rng.standard_normal((k, p - k))
        L = Z[:, drivers] @ W
        sd = L.std(axis=0)
        L = L / np.where(sd > 0, sd, 1.0)
        P = np.zeros((n, p))
        for i, j in enumerate(masked):
            obs = observed[:, j]
            b = _intercept(L[obs, i], r)
            P[:, j] = _sigmoid(L[:, i] + b)
    else:  # MNAR, self-masking
        P = np.zeros((n, p))
        for j in range(p):
            if levels[j] == 0:
                s = 1.0 if rng.random() < 0.5 else -1.0
                logit = np.nan_to_num(2.0 * s * Z[:, j], nan=0.0)
            else:
                u = rng.standard_normal(levels[j])
                codes = np.nan_to_num(V[:, j], nan=-1).astype(int)
                logit = np.where(codes >= 0, 2.0 * u[np.clip(codes, 0, None)], 0.0)
            obs = observed[:, j]
            b = _intercept(logit[obs], rate)
            P[:, j] = _sigmoid(logit + b)
    M = (U < P) & observed
    for j in range(p):
        left = int((observed[:, j] & ~M[:, j]).sum())
        if left < 2:
            rows = np.flatnonzero(M[:, j])
            need = min(2 - left, len(rows))
            if need > 0:
                M[rng.choice(rows, need, replace=False), j] = False
    return M


def apply_mask(frame: pd.DataFrame, M: np.ndarray) -> pd.DataFrame:
    """A copy of ``frame`` with the ``M`` cells set to NaN (categoricals keep their dtype)."""
    out = frame.copy()
    for j, c in enumerate(frame.columns):
        if M[:, j].any():
            col = out[c].copy()
            col[M[:, j]] = np.nan
            out[c] = col
    return out


def _as_codes(values, categories: list[str]) -> np.ndarray:
    """Imputed categorical column -> int codes (-2 = not a known level)."""
    s = pd.Series(values)
    if isinstance(s.dtype, pd.CategoricalDtype) or not pd.api.types.is_numeric_dtype(s.dtype) or s.dtype == bool:
        if s.isna().any():
            raise ValueError("imputer left missing values in a categorical column")
        index = {lvl: i for i, lvl in enumerate(categories)}
        from .prepare import label_string

        return np.array([index.get(label_string(v), -2) for v in s.astype(object)], dtype=np.int64)
    v = s.to_numpy(dtype=np.float64)
    if np.isnan(v).any():
        raise ValueError("imputer left missing values in a categorical column")
    codes = np.rint(v).astype(np.int64)
    codes[(codes < 0) | (codes >= len(categories))] = -2
    return codes


def imputed_arrays(out, frame: pd.DataFrame) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Convert an imputer's output to (numeric values (n, p) float, {categorical column: codes})."""
    n, p = frame.shape
    if isinstance(out, pd.DataFrame):
        if out.shape != (n, p):
            raise ValueError(f"imputer returned shape {out.shape}, expected {(n, p)}")
        cols = [out[c] for c in frame.columns] if list(out.columns) == list(frame.columns) else [out.iloc[:, j] for j in range(p)]
        cols = [c.to_numpy() if not isinstance(c.dtype, pd.CategoricalDtype) else c.values for c in cols]
    else:
        arr = np.asarray(out)
        if arr.shape != (n, p):
            raise ValueError(f"imputer returned shape {arr.shape}, expected {(n, p)}")
        cols = [arr[:, j] for j in range(p)]
    num = np.zeros((n, p))
    cats = {}
    for j, c in enumerate(frame.columns):
        if isinstance(frame[c].dtype, pd.CategoricalDtype):
            cats[j] = _as_codes(cols[j], [str(x) for x in frame[c].cat.categories])
        else:
            v = pd.to_numeric(pd.Series(cols[j]), errors="coerce").to_numpy(dtype=np.float64)
            if np.isnan(v).any():
                raise ValueError(f"imputer left missing (or non-numeric) values in numeric column {c!r}")
            num[:, j] = v
    return num, cats


def score_imputation(frame: pd.DataFrame, M: np.ndarray, out) -> dict[str, float]:
    """Standardised RMSE on masked numeric cells, accuracy on masked categorical cells."""
    V, observed, levels = column_values(frame)
    num_out, cat_out = imputed_arrays(out, frame)
    is_cat = np.array([lv > 0 for lv in levels])
    std = np.array([V[observed[:, j], j].std() if observed[:, j].any() else 1.0 for j in range(V.shape[1])])
    std = np.where(std > 0, std, 1.0)
    nj = np.flatnonzero(~is_cat)
    cj = np.flatnonzero(is_cat)
    cat_pred = np.stack([cat_out[j] for j in cj], axis=1) if len(cj) else np.zeros((len(frame), 0), int)
    true_cat = np.nan_to_num(V[:, cj], nan=-1).astype(np.int64)
    res = imputation_errors(V[:, nj], num_out[:, nj], std[nj], M[:, nj], true_cat, cat_pred, M[:, cj])
    res["n_masked_num"] = int(M[:, nj].sum())
    res["n_masked_cat"] = int(M[:, cj].sum())
    return res


def run_imputation(ds: Dataset, factory: Factory, progress: Progress = None) -> dict:
    frame = ds.frame if ds.target is None else ds.frame.drop(columns=[ds.target])
    units, t0 = [], time.perf_counter()
    for mech, rate, seed in imputation_conditions():
        M = imputation_mask(frame, mech, rate, seed)
        est = factory()
        out = est.fit_transform(apply_mask(frame, M))
        units.append({"mechanism": mech, "rate": rate, "seed": seed, **score_imputation(frame, M, out)})
        _tick(progress)
    res = _summarise(units, ["rmse", "cat_accuracy"], t0)
    for mech in MECHANISMS:
        res["metrics"][f"rmse_{mech.lower()}"] = _nanmean([u["rmse"] for u in units if u["mechanism"] == mech])
    for rate in RATES:
        res["metrics"][f"rmse_rate_{rate}"] = _nanmean([u["rmse"] for u in units if u["rate"] == rate])
    return res


# ============================================================================ anomaly
def anomaly_splits(X: np.ndarray, y: np.ndarray, seed: int):
    """One ADBench split: stratified 70/30 with ``random_state=seed``, MinMax fit on train."""
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=ANOMALY_TEST_SIZE, stratify=y, random_state=seed)
    scaler = MinMaxScaler().fit(X_tr)
    return scaler.transform(X_tr), scaler.transform(X_te), y_tr, y_te


def run_anomaly(ds: Dataset, factory: Factory, progress: Progress = None) -> dict:
    feats = ds.features
    X = ds.frame[feats].to_numpy(dtype=np.float64, na_value=np.nan)
    y = ds.frame[ds.target].to_numpy().astype(int)
    units, t0 = [], time.perf_counter()
    for seed in ANOMALY_SEEDS:
        X_tr, X_te, _, y_te = anomaly_splits(X, y, seed)
        est = factory()
        est.fit(pd.DataFrame(X_tr, columns=feats))
        scores = est.score_samples(pd.DataFrame(X_te, columns=feats))
        units.append({"seed": seed, **anomaly_metrics(y_te, scores)})
        _tick(progress)
    return _summarise(units, ["auroc", "auprc"], t0)


# ============================================================================ registry
def _nanmean(values) -> float:
    v = np.asarray([x for x in values], dtype=float)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else float("nan")


def _summarise(units: list[dict], metrics: list[str], t0: float) -> dict:
    return {
        "metrics": {m: _nanmean(u[m] for u in units) for m in metrics},
        "units": units,
        "seconds": time.perf_counter() - t0,
    }


@dataclass(frozen=True)
class Protocol:
    task: str
    name: str  # goes into the cache key; bump the version when the protocol changes
    run: Callable[[Dataset, Factory, Progress], dict]
    n_units: int
    # rank methods per unit (fold / condition) instead of per dataset: imputation ranks each
    # dataset x condition, as the imputation mean ranks of the reference scores (docs/evaluation-protocol.md) are computed
    rank_unit_keys: tuple[str, ...] = ()


PROTOCOLS: dict[str, Protocol] = {
    "classification": Protocol("classification", "classification/stratified-5fold-seed0/v1", run_classification, N_FOLDS),
    "regression": Protocol("regression", "regression/5fold-seed0/v1", run_regression, N_FOLDS),
    "imputation": Protocol("imputation", "imputation/27-conditions/v1", run_imputation, len(imputation_conditions()),
                           rank_unit_keys=("mechanism", "rate", "seed")),
    "anomaly": Protocol("anomaly", "anomaly/adbench-70-30-3seeds/v1", run_anomaly, len(ANOMALY_SEEDS)),
}


def get_protocol(task: str) -> Protocol:
    if task not in PROTOCOLS:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(PROTOCOLS)})")
    return PROTOCOLS[task]
