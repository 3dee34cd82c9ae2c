"""eval/: suites, preparation rules, protocols, metrics, ranks, cache, reports, CLI.

Fast and self-contained: sklearn-bundled data, synthetic frames and one ADBench file from
shared/data (skipped if absent); no optional packages (xgboost, pyod, ...) needed.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tabfm.eval.cache import ResultCache, cache_key
from tabfm.eval.detectors import Negated, sklearn_iforest
from tabfm.eval.imputers import MeanModeImputer
from tabfm.eval.metrics import classification_metrics, clip_renormalise
from tabfm.eval.prepare import (PUBLIC_SPECS, check_prepared, prepare_classification, prepare_imputation, prepare_public,
                          public_specs)
from tabfm.eval.protocols import (apply_mask, imputation_mask, run_anomaly, run_classification, run_imputation,
                            run_regression, score_imputation)
from tabfm.eval.report import Report, average_ranks, mean_ranks, wins_ties_losses
from tabfm.eval.runner import Method, evaluate
from tabfm.eval.suites import Dataset, build_public, load_dataset, load_suite, save_dataset, shared_data_dir


# ============================================================================ helpers
def _spec(task: str, name: str):
    return next(s for s in PUBLIC_SPECS if s.task == task and s.name == name)


def _dataset(task: str, name: str) -> Dataset:
    spec = _spec(task, name)
    frame = prepare_public(spec)
    cats = [c for c in frame.columns if isinstance(frame[c].dtype, pd.CategoricalDtype) and c != spec.label]
    return Dataset(name=name, task=task, frame=frame, target=spec.label, categorical=cats, fingerprint=name)


def _logreg():
    from sklearn.linear_model import LogisticRegression

    from tabfm.eval.baselines import numeric_pipeline

    return numeric_pipeline(LogisticRegression())


def _mixed_frame(n: int = 400, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=n)
    b = a + 0.5 * rng.normal(size=n)
    c = rng.exponential(size=n)
    c[rng.random(n) < 0.1] = np.nan  # real NaNs
    d = pd.Categorical(rng.choice(["x", "y", "z"], size=n), categories=["x", "y", "z"])
    e = rng.normal(size=n)
    f = pd.Categorical(np.where(a > 0, "hi", "lo"), categories=["hi", "lo"])
    frame = pd.DataFrame({"a": a, "b": b, "c": c, "d": d, "e": e, "f": f})
    frame.loc[rng.random(n) < 0.05, "d"] = np.nan
    return frame


# ============================================================================ suites
def test_suite_round_trip(tmp_path):
    frame = _mixed_frame(60)
    frame["label"] = pd.Categorical(np.where(frame["a"] > 0, "pos", "neg"))
    save_dataset(tmp_path, "toy", frame, "classification", "label", source="synthetic")
    (ds,) = load_suite(tmp_path)
    assert ds.name == "toy" and ds.task == "classification" and ds.target == "label" and ds.source == "synthetic"
    assert ds.categorical == ["d", "f"]
    assert ds.classes == ["neg", "pos"]
    assert list(ds.frame.columns) == list(frame.columns)
    for c in ["a", "b", "c", "e"]:
        np.testing.assert_array_equal(ds.frame[c].to_numpy(), frame[c].to_numpy())  # NaN kept
    assert isinstance(ds.frame["d"].dtype, pd.CategoricalDtype)
    assert ds.frame["d"].isna().sum() == frame["d"].isna().sum() > 0
    assert list(ds.frame["d"].cat.categories) == ["x", "y", "z"]
    assert ds.fingerprint == load_dataset(tmp_path / "toy.json").fingerprint
    # a changed cell changes the fingerprint (cache key)
    frame.loc[0, "a"] += 1.0
    save_dataset(tmp_path, "toy", frame, "classification", "label")
    assert load_dataset(tmp_path / "toy.parquet").fingerprint != ds.fingerprint


def test_user_suite_types_and_numeric_labels(tmp_path):
    df = pd.DataFrame({"x": [1, 2, 3, 4, 5, 6], "s": ["b", "a", "b", None, "a", "b"], "y": [2, 10, 2, 10, 2, 10]})
    df.to_parquet(tmp_path / "mine.parquet")
    (tmp_path / "mine.json").write_text(json.dumps({"task": "classification", "target": "y", "categorical": ["x"]}))
    ds = load_dataset(tmp_path / "mine.parquet")
    assert ds.categorical == ["x", "s"]
    assert list(ds.frame["s"].cat.categories) == ["a", "b"] and ds.frame["s"].isna().sum() == 1
    assert ds.classes == ["2", "10"]  # numeric labels keep numeric order


@pytest.mark.parametrize("case, message", [
    ("no_json", "missing metadata file"),
    ("bad_task", "unknown task 'clustering'"),
    ("no_target", "target column 'nope' not found"),
    ("null_target", "needs a target column"),
    ("bad_categorical", "categorical column(s) ['zz'] not found"),
    ("bad_anomaly", "must hold 0 (normal) / 1 (anomaly)"),
])
def test_suite_validation_errors(tmp_path, case, message):
    df = pd.DataFrame({"a": [1.0, 2.0, 3.0], "y": [0, 1, 2]})
    df.to_parquet(tmp_path / "t.parquet")
    info = {"task": "classification", "target": "y"}
    if case == "bad_task":
        info["task"] = "clustering"
    elif case == "no_target":
        info["target"] = "nope"
    elif case == "null_target":
        info["target"] = None
    elif case == "bad_categorical":
        info["categorical"] = ["zz"]
    elif case == "bad_anomaly":
        info["task"] = "anomaly"
    if case != "no_json":
        (tmp_path / "t.json").write_text(json.dumps(info))
    with pytest.raises(ValueError) as err:
        load_suite(tmp_path)
    assert message in str(err.value)
    assert "t.json" in str(err.value) or "t.parquet" in str(err.value)  # names the file


def test_suite_task_mismatch_and_empty(tmp_path):
    save_dataset(tmp_path, "imp", _mixed_frame(20), "imputation", None)
    assert load_suite(tmp_path, "imputation")[0].target is None
    with pytest.raises(ValueError, match="evaluated for 'classification'"):
        load_suite(tmp_path, "classification")
    with pytest.raises(ValueError, match="no datasets"):
        load_suite(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else tmp_path)
    with pytest.raises(ValueError, match="not found"):
        load_suite(tmp_path, datasets=["missing"])


# ============================================================================ preparation rules
def test_prepare_rules_on_a_synthetic_table():
    raw = pd.DataFrame({
        "num": np.arange(10, dtype="int64"),
        "const": 1.0,
        "txt": ["b", "a", None, "c", "a", "b", "c", "a", "b", "c"],
        "flag": [True, False] * 5,
        "two": [0, 1] * 5,
        "label": [1, 0, 1, None, 0, 1, 0, 1, 0, 1],
    })
    prep = prepare_classification(raw, "label", cap=6)
    assert "const" not in prep.columns  # constant column dropped
    assert len(prep) == 6  # row cap (rows with a missing label dropped first)
    assert list(prep["txt"].cat.categories) == ["a", "b", "c"] and prep["txt"].isna().sum() <= 1
    assert list(prep["flag"].cat.categories) == ["False", "True"]
    assert prep["num"].dtype == np.float64 and prep["two"].dtype == np.float64  # 2-valued stays numeric here
    assert list(prep["label"].cat.categories) == ["0", "1"] and prep.columns[-1] == "label"
    imp = prepare_imputation(raw.drop(columns=["label"]))
    assert isinstance(imp["two"].dtype, pd.CategoricalDtype)  # imputation: 2 distinct values -> categorical
    assert list(imp["two"].cat.categories) == ["0", "1"]


@pytest.mark.parametrize("task, name", [("classification", "digits"), ("classification", "wine"),
                                        ("imputation", "breast_cancer")])
def test_sklearn_tables_match_suites_md(task, name):
    spec = _spec(task, name)
    frame = prepare_public(spec)
    assert check_prepared(spec, frame) == []
    if name == "digits":
        assert not {"pixel_0_0", "pixel_4_0", "pixel_4_7"} & set(frame.columns)


def test_build_public_skips_missing_package(tmp_path, monkeypatch):
    import dataclasses

    import tabfm.eval.suites as suites

    wine = _spec("classification", "wine")
    fake = dataclasses.replace(wine, name="fake", package="no_such_package_tabfm_xyz")
    monkeypatch.setattr(suites, "public_specs", lambda task: [wine, fake] if task == "classification" else [])
    with pytest.warns(UserWarning, match="no_such_package_tabfm_xyz"):
        written = build_public(tmp_path, tasks=["classification"], verbose=False)
    assert written == {"classification": ["wine"]}
    assert (tmp_path / "classification" / "wine.parquet").exists()
    assert not (tmp_path / "classification" / "fake.json").exists()
    with pytest.raises(ValueError, match="no public suite"):
        build_public(tmp_path, tasks=["regression"])


def test_specs_cover_suites_md():
    assert len(public_specs("classification")) == 15
    assert len(public_specs("imputation")) == 8
    assert len(public_specs("anomaly")) == 12


# ============================================================================ classification
def test_clip_and_metrics():
    P = np.array([[1.0, 0.0], [0.2, 0.8], [0.6, 0.4]])
    Q = clip_renormalise(P)
    assert np.allclose(Q.sum(1), 1) and Q.min() >= 1e-16
    m = classification_metrics(np.array([0, 1, 1]), P)
    assert m["accuracy"] == pytest.approx(2 / 3) and m["roc_auc"] == pytest.approx(1.0)
    assert np.isfinite(m["log_loss"])


@pytest.mark.parametrize("name, ref, tol", [("wine", 1.000, 0.0005), ("breast_cancer", 0.995, 0.003)])
def test_classification_protocol_reproduces_logreg_reference(name, ref, tol):
    ds = _dataset("classification", name)
    res = run_classification(ds, _logreg)
    assert len(res["units"]) == 5
    assert res["metrics"]["roc_auc"] == pytest.approx(ref, abs=tol)
    # a useless model is caught: constant probabilities give ROC-AUC 0.5
    class Constant:
        def fit(self, X, y):
            self.k = int(y.max()) + 1
            return self

        def predict_proba(self, X):
            return np.full((len(X), self.k), 1.0 / self.k)

    assert run_classification(ds, Constant)["metrics"]["roc_auc"] == pytest.approx(0.5)


def test_classification_maps_classes_attribute():
    """predict_proba columns follow est.classes_ (here reversed) when present."""
    ds = _dataset("classification", "wine")

    class Reversed:
        def fit(self, X, y):
            self.inner = _logreg().fit(X, y)
            self.classes_ = self.inner.classes_[::-1]
            return self

        def predict_proba(self, X):
            return self.inner.predict_proba(X)[:, ::-1]

    assert run_classification(ds, Reversed)["metrics"]["roc_auc"] > 0.99


def test_regression_protocol():
    from sklearn.linear_model import Ridge

    from tabfm.eval.baselines import numeric_pipeline

    rng = np.random.default_rng(0)
    X = pd.DataFrame({"a": rng.normal(size=200), "b": rng.normal(size=200)})
    X["y"] = 3 * X["a"] - X["b"] + 0.1 * rng.normal(size=200)
    ds = Dataset("lin", "regression", X, target="y")
    m = run_regression(ds, lambda: numeric_pipeline(Ridge()))["metrics"]
    assert m["r2"] > 0.99 and m["rmse"] < 0.2


# ============================================================================ imputation masks
def test_mcar_follows_the_exact_recipe():
    frame = _mixed_frame(300)
    observed = ~frame.isna().to_numpy()
    for rate, seed in [(0.1, 0), (0.3, 1), (0.5, 2)]:
        M = imputation_mask(frame, "MCAR", rate, seed)
        U = np.random.default_rng([seed, 1, round(100 * rate)]).random(frame.shape)
        np.testing.assert_array_equal(M, (U < rate) & observed)
        assert abs(M.sum() / observed.sum() - rate) < 0.03


@pytest.mark.parametrize("mech", ["MCAR", "MAR", "MNAR"])
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_masks_rates_real_nans_determinism(mech, rate):
    frame = _mixed_frame(500)
    observed = ~frame.isna().to_numpy()
    M = imputation_mask(frame, mech, rate, 0)
    assert M.dtype == bool and M.shape == frame.shape
    assert not (M & ~observed).any()  # real NaNs are never masked
    np.testing.assert_array_equal(M, imputation_mask(frame, mech, rate, 0))  # deterministic
    assert not np.array_equal(M, imputation_mask(frame, mech, rate, 1))  # seed matters
    assert abs(M.sum() / observed.sum() - rate) < 0.05  # overall rate near the target
    assert ((observed & ~M).sum(axis=0) >= 2).all()


def test_mar_drivers_never_masked():
    frame = _mixed_frame(500)
    p = frame.shape[1]
    full = set(np.flatnonzero(frame.notna().all().to_numpy()))  # columns without real NaN
    k = min(len(full), max(1, round(0.3 * p)))
    for seed in range(3):
        M = imputation_mask(frame, "MAR", 0.3, seed)
        untouched = set(np.flatnonzero(~M.any(axis=0)))
        assert len(untouched) == k and untouched <= full
        # rng draw order of docs/evaluation-protocol.md: U, then the drivers
        rng = np.random.default_rng([seed, 2, 30])
        rng.random(frame.shape)
        assert untouched == set(np.sort(rng.choice(np.array(sorted(full)), size=k, replace=False)))
        # the masked columns get rate r' = rate * p / (p - k) on their observed rows
        obs = frame.notna().to_numpy()
        masked_cols = [j for j in range(p) if j not in untouched]
        assert M[:, masked_cols].sum() / obs[:, masked_cols].sum() == pytest.approx(0.3 * p / (p - k), abs=0.06)


def _reference_mask(frame: pd.DataFrame, mech: str, rate: float, seed: int) -> np.ndarray:
    """docs/evaluation-protocol.md "Imputation" steps 1-4, written out independently of tabfm.eval.protocols."""
    n, p = frame.shape
    cat = [isinstance(frame[c].dtype, pd.CategoricalDtype) for c in frame.columns]
    V = np.column_stack([frame[c].cat.codes.to_numpy().astype(float) if k else frame[c].to_numpy(float)
                         for c, k in zip(frame.columns, cat)])
    V[np.array(cat)[None, :] & (V < 0)] = np.nan
    obs = ~np.isnan(V)
    rng = np.random.default_rng([seed, {"MCAR": 1, "MAR": 2, "MNAR": 3}[mech], round(100 * rate)])
    U = rng.random((n, p))
    Z = (V - np.nanmean(V, 0)) / np.nanstd(V, 0)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731

    def bisect(logit, target):
        lo, hi = -60.0, 60.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sig(logit + mid).mean() < target else (lo, mid)
        return (lo + hi) / 2

    P = np.zeros((n, p))
    if mech == "MAR":
        full = np.flatnonzero(obs.all(0))
        k = min(len(full), max(1, round(0.3 * p)))
        drivers = np.sort(rng.choice(full, size=k, replace=False))
        rest = [j for j in range(p) if j not in drivers]
        r = min(rate * p / (p - k), 0.95)
        L = Z[:, drivers] @ rng.standard_normal((k, p - k))
        L /= L.std(0)
        for i, j in enumerate(rest):
            P[:, j] = sig(L[:, i] + bisect(L[obs[:, j], i], r))
    else:
        for j in range(p):
            if not cat[j]:
                s = 1 if rng.random() < 0.5 else -1
                logit = np.nan_to_num(2 * s * Z[:, j])
            else:
                u = rng.standard_normal(len(frame.iloc[:, j].cat.categories))
                logit = np.where(obs[:, j], 2 * u[np.nan_to_num(V[:, j]).astype(int)], 0.0)
            P[:, j] = sig(logit + bisect(logit[obs[:, j]], rate))
    M = (U < P) & obs
    for j in range(p):
        left = (obs[:, j] & ~M[:, j]).sum()
        if left < 2:
            M[rng.choice(np.flatnonzero(M[:, j]), 2 - left, replace=False), j] = False
    return M


@pytest.mark.parametrize("mech", ["MAR", "MNAR"])
def test_mar_mnar_follow_the_exact_recipe(mech):
    frame = _mixed_frame(300)
    for rate, seed in [(0.1, 0), (0.5, 2)]:
        np.testing.assert_array_equal(imputation_mask(frame, mech, rate, seed), _reference_mask(frame, mech, rate, seed))


def test_mnar_self_masking_depends_on_the_value():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({f"c{i}": rng.normal(size=2000) for i in range(3)})
    M = imputation_mask(frame, "MNAR", 0.3, 0)
    for j in range(3):
        v = frame.iloc[:, j].to_numpy()
        # masked values sit on one side: their mean is far from the observed mean
        assert abs(v[M[:, j]].mean() - v[~M[:, j]].mean()) > 0.5


def test_every_column_keeps_two_observed_cells():
    rng = np.random.default_rng(0)
    n = 60
    sparse = np.full(n, np.nan)
    sparse[:3] = [1.0, 2.0, 3.0]  # only 3 observed cells
    frame = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "sparse": sparse})
    for mech in ["MCAR", "MAR", "MNAR"]:
        for seed in range(10):
            M = imputation_mask(frame, mech, 0.5, seed)
            left = (frame.notna().to_numpy() & ~M).sum(axis=0)
            assert (left >= 2).all(), (mech, seed, left)


def test_mean_imputation_under_mcar_is_one():
    ds = _dataset("imputation", "wine")
    res = run_imputation(ds, MeanModeImputer)
    assert len(res["units"]) == 27
    assert res["metrics"]["rmse_mcar"] == pytest.approx(1.0, abs=0.02)
    assert res["metrics"]["rmse_mnar"] > res["metrics"]["rmse_mcar"]
    assert np.isnan(res["metrics"]["cat_accuracy"])  # no categorical columns in wine


def test_imputation_scoring_contract():
    frame = _mixed_frame(200)
    M = imputation_mask(frame, "MCAR", 0.3, 0)
    masked = apply_mask(frame, M)
    assert masked.isna().to_numpy()[M].all()
    # perfect imputation, given back as labels, as codes, and as a plain array of codes
    assert score_imputation(frame, M, frame.fillna({"c": 0.0}).assign(d=frame["d"].fillna("x")))["rmse"] == 0.0
    codes = frame.copy()
    for c in ["d", "f"]:
        codes[c] = frame[c].cat.codes.clip(lower=0).astype(float)
    codes["c"] = codes["c"].fillna(0.0)
    s = score_imputation(frame, M, codes)
    assert s["rmse"] == 0.0 and s["cat_accuracy"] == 1.0
    assert score_imputation(frame, M, codes.to_numpy())["cat_accuracy"] == 1.0
    # leaving a NaN is an error, a wrong shape too
    with pytest.raises(ValueError, match="missing"):
        score_imputation(frame, M, masked)
    with pytest.raises(ValueError, match="shape"):
        score_imputation(frame, M, codes.iloc[:, :3])
    # mean/mode output: categorical mode accuracy is the share of the modal level
    s = score_imputation(frame, M, MeanModeImputer().fit_transform(masked))
    assert 0.2 < s["cat_accuracy"] < 0.8 and 0.8 < s["rmse"] < 1.2


# ============================================================================ anomaly
def test_anomaly_protocol_glass_isolation_forest(tmp_path):
    path = shared_data_dir() / "adbench" / "14_glass.npz"
    if not path.exists():
        pytest.skip(f"{path} not available")
    ds = _dataset("anomaly", "14_glass")
    assert ds.frame.shape == (214, 8) and int(ds.frame["anomaly"].sum()) == 9
    res = run_anomaly(ds, sklearn_iforest)
    # == pyod IForest(random_state=0) on the same splits (pyod wraps this very estimator)
    assert res["metrics"]["auroc"] == pytest.approx(0.8029, abs=0.002)
    assert res["metrics"]["auprc"] == pytest.approx(0.1554, abs=0.002)
    # the raw sklearn sign (higher = more normal) would invert the ranking
    from sklearn.ensemble import IsolationForest

    raw = run_anomaly(ds, lambda: IsolationForest(random_state=0))["metrics"]["auroc"]
    assert raw == pytest.approx(1 - res["metrics"]["auroc"], abs=1e-9)


def test_negated_wrapper_sign():
    from sklearn.ensemble import IsolationForest

    rng = np.random.default_rng(0)
    X = pd.DataFrame(rng.normal(size=(200, 2)), columns=["a", "b"])
    outlier = pd.DataFrame([[8.0, 8.0], [0.0, 0.0]], columns=["a", "b"])
    s = Negated(IsolationForest(random_state=0)).fit(X).score_samples(outlier)
    assert s[0] > s[1]


# ============================================================================ ranks, wins/ties/losses, report
def test_ranks_and_wins_ties_losses_by_hand():
    scores = {
        "d1": {"A": {"roc_auc": 0.9}, "B": {"roc_auc": 0.8}, "C": {"roc_auc": 0.8}},
        "d2": {"A": {"roc_auc": 0.7}, "B": {"roc_auc": 0.9}, "C": {"roc_auc": 0.6}},
        "d3": {"A": {"roc_auc": 0.5}, "B": {"roc_auc": 0.5}, "C": {"roc_auc": 0.5}},
    }
    assert average_ranks({"A": 0.9, "B": 0.8, "C": 0.8}, True) == {"A": 1.0, "B": 2.5, "C": 2.5}
    assert average_ranks({"A": 0.1, "B": 0.3, "C": float("nan")}, False) == {"A": 1.0, "B": 2.0}
    # d1: A1 B2.5 C2.5 ; d2: B1 A2 C3 ; d3: all 2
    r = mean_ranks(scores, "roc_auc", ["A", "B", "C"])
    assert r == pytest.approx({"A": 5 / 3, "B": 5.5 / 3, "C": 7.5 / 3})
    assert wins_ties_losses(scores, "roc_auc", "A", "B") == (1, 1, 1)
    assert wins_ties_losses(scores, "roc_auc", "A", "C") == (2, 1, 0)
    assert wins_ties_losses(scores, "roc_auc", "B", "C") == (1, 2, 0)
    assert wins_ties_losses(scores, "roc_auc", "A", "B", tol=0.15) == (0, 2, 1)
    # lower-is-better metric flips the direction
    ll = {d: {m: {"log_loss": v["roc_auc"]} for m, v in per.items()} for d, per in scores.items()}
    assert wins_ties_losses(ll, "log_loss", "A", "B") == (1, 1, 1)[::-1]
    rep = Report("classification", scores, ["A", "B", "C"], baselines=["B", "C"], metrics=["roc_auc"])
    agg = rep.aggregate()
    assert agg["A"]["roc_auc"] == pytest.approx(0.7) and agg["A"]["roc_auc_rank"] == pytest.approx(5 / 3)
    assert rep.order() == ["A", "B", "C"]
    md = rep.to_markdown()
    assert "| A | 1/1/1 | 2/1/0 |" in md and "| A | 0.7000 (1.7) |" in md
    # imputation-style ranks over finer units (dataset x condition); means stay per dataset
    units = {"d1|c1": {"A": {"roc_auc": 1.0}, "B": {"roc_auc": 0.0}}, "d1|c2": {"A": {"roc_auc": 1.0}, "B": {"roc_auc": 0.0}},
             "d2|c1": {"A": {"roc_auc": 0.0}, "B": {"roc_auc": 1.0}}}
    rep = Report("classification", {d: {m: scores[d][m] for m in "AB"} for d in scores}, ["A", "B"], ["B"],
                 metrics=["roc_auc"], rank_scores=units)
    assert rep.aggregate()["A"]["roc_auc_rank"] == pytest.approx(4 / 3)


# ============================================================================ runner + cache
class _Counted:
    calls = 0

    def __init__(self):
        type(self).calls += 1
        from sklearn.dummy import DummyClassifier

        self.inner = DummyClassifier(strategy="prior")

    def fit(self, X, y):
        self.inner.fit(X, y)
        self.classes_ = self.inner.classes_
        return self

    def predict_proba(self, X):
        return self.inner.predict_proba(X)


def _toy_suite(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(2):
        X = pd.DataFrame({"a": rng.normal(size=60), "b": rng.normal(size=60)})
        X["y"] = pd.Categorical(np.where(X["a"] + 0.3 * rng.normal(size=60) > 0, "p", "n"))
        save_dataset(tmp_path / "suite", f"toy{i}", X, "classification", "y")
    return tmp_path / "suite"


def test_cache_hit_avoids_recomputation(tmp_path):
    suite = _toy_suite(tmp_path)
    _Counted.calls = 0
    kw = dict(cache_dir=tmp_path / "cache", progress=False, verbose=False, plots=False)
    r1 = evaluate("classification", suite, {"logreg": _logreg, "dummy": Method(_Counted, version="1")}, tmp_path / "o", **kw)
    assert _Counted.calls == 10  # 2 datasets x 5 folds
    r2 = evaluate("classification", suite, {"logreg": _logreg, "dummy": Method(_Counted, version="1")}, tmp_path / "o", **kw)
    assert _Counted.calls == 10  # all cached
    assert r2.scores == r1.scores and r2.meta["cache"]["hits"] == 4
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    assert data["methods"] == ["logreg", "dummy"] and data["wins_ties_losses"]["logreg"]["dummy"] == [2, 0, 0]
    evaluate("classification", suite, {"dummy": Method(_Counted, version="2")}, tmp_path / "o", **kw)
    assert _Counted.calls == 20  # a new version recomputes
    assert r1.scores["toy0"]["dummy"]["roc_auc"] == pytest.approx(0.5)
    assert r1.scores["toy0"]["logreg"]["roc_auc"] > 0.8
    for f in ["report.md", "report.json", "report.csv", "results.json"]:
        assert (tmp_path / "o" / f).exists()


def test_cache_key_and_disabled_cache(tmp_path):
    c = ResultCache(tmp_path)
    k = cache_key("d", "fp", "classification/x/v1", "m", {"a": "1"})
    assert c.get(k) is None
    c.put(k, {"metrics": {"roc_auc": 0.9, "x": float("nan")}})
    assert c.get(k)["metrics"]["roc_auc"] == 0.9 and np.isnan(c.get(k)["metrics"]["x"])
    assert c.get(cache_key("d", "fp2", "classification/x/v1", "m", {"a": "1"})) is None
    assert ResultCache(None).get(k) is None


def test_failing_method_is_recorded_not_fatal(tmp_path):
    suite = _toy_suite(tmp_path)

    class Broken:
        def fit(self, X, y):
            raise RuntimeError("boom")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = evaluate("classification", suite, {"logreg": _logreg, "broken": Broken}, None,
                       progress=False, verbose=False)
    assert set(rep.errors) == {"toy0", "toy1"} and "boom" in rep.errors["toy0"]["broken"]
    assert "broken" not in rep.scores["toy0"]


# ============================================================================ failures, run record, plots
class _Flaky:
    """Logistic regression that raises on any dataset with a column "c" while ``fail`` is set."""
    fail = True

    def __init__(self):
        self.inner = _logreg()

    def fit(self, X, y):
        if type(self).fail and "c" in X.columns:
            raise RuntimeError("no column c please")
        self.inner.fit(X, y)
        self.classes_ = np.arange(2)
        return self

    def predict_proba(self, X):
        return self.inner.predict_proba(X)


def _toy_suite3(tmp_path) -> Path:
    rng = np.random.default_rng(1)
    for i in range(3):
        X = pd.DataFrame({"a": rng.normal(size=60), "b": rng.normal(size=60)})
        if i == 1:
            X["c"] = rng.normal(size=60)
        X["y"] = pd.Categorical(np.where(X["a"] + 0.3 * rng.normal(size=60) > 0, "p", "n"))
        save_dataset(tmp_path / "suite3", f"toy{i}", X, "classification", "y")
    return tmp_path / "suite3"


def test_failure_on_one_dataset_is_recorded_and_retried(tmp_path):
    suite = _toy_suite3(tmp_path)
    out = tmp_path / "o"
    kw = dict(progress=False, verbose=False, plots=False)
    methods = {"logreg": _logreg, "flaky": _Flaky, "dummy": Method(_Counted, version="1")}
    _Flaky.fail = True
    try:
        with pytest.warns(RuntimeWarning, match=r"toy1: method 'flaky' failed .*RuntimeError: no column c please"):
            rep = evaluate("classification", suite, methods, out, **kw)
    finally:
        _Flaky.fail = False
    # the run completed; only toy1/flaky failed; every other score is intact
    assert rep.errors == {"toy1": {"flaky": "RuntimeError: no column c please"}}
    assert set(rep.scores["toy1"]) == {"logreg", "dummy"} and set(rep.scores["toy0"]) == {"logreg", "flaky", "dummy"}
    alone = evaluate("classification", suite, {"logreg": _logreg}, None, cache_dir=None, **kw)
    for d in ["toy0", "toy1", "toy2"]:
        assert rep.scores[d]["logreg"] == alone.scores[d]["logreg"]
    assert rep.scores["toy0"]["flaky"] == rep.scores["toy0"]["logreg"]
    # means over completed datasets, worst rank where it failed: flaky = logreg (1.5) on toy0/toy2, 3 on toy1
    agg = rep.aggregate()
    assert agg["flaky"]["n_datasets"] == 2 and agg["flaky"]["n_failed"] == 1
    assert agg["flaky"]["roc_auc"] == pytest.approx(np.mean([rep.scores[d]["flaky"]["roc_auc"] for d in ["toy0", "toy2"]]))
    assert agg["flaky"]["roc_auc_rank"] == pytest.approx((1.5 + 3 + 1.5) / 3)
    # the report shows it, results.json and run.json record it
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| toy1 |"))
    assert "failed" in row and "- toy1 / flaky: RuntimeError: no column c please" in md
    res = json.loads((out / "results.json").read_text())
    assert res["failures"]["toy1"]["flaky"]["type"] == "RuntimeError"
    assert res["failures"]["toy1"]["flaky"]["message"] == "no column c please"
    assert "flaky" not in res["results"]["toy1"] and "flaky" in res["results"]["toy0"]
    run = json.loads((out / "run.json").read_text())
    assert run["failures"] == {"toy1": {"flaky": {"type": "RuntimeError", "message": "no column c please"}}}
    assert run["timings"]["toy1"]["flaky"]["status"] == "failed" and not run["timings"]["toy1"]["flaky"]["cached"]
    assert json.loads((out / "report.json").read_text())["errors"]["toy1"]["flaky"].startswith("RuntimeError")
    # the failure was not cached: a rerun retries it (and only it), the rest comes from the cache
    calls = _Counted.calls
    rep2 = evaluate("classification", suite, methods, out, **kw)
    assert rep2.errors == {} and "flaky" in rep2.scores["toy1"] and _Counted.calls == calls
    t = json.loads((out / "run.json").read_text())["timings"]
    assert t["toy1"]["flaky"]["status"] == "ok" and not t["toy1"]["flaky"]["cached"]
    assert all(t[d][m]["cached"] for d in t for m in t[d] if (d, m) != ("toy1", "flaky"))
    assert rep2.meta["cache"]["hits"] == 8 and rep2.meta["cache"]["misses"] == 1


def test_keyboard_interrupt_stops_the_run(tmp_path):
    suite = _toy_suite(tmp_path)

    class Interrupted:
        def fit(self, X, y):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate("classification", suite, {"logreg": _logreg, "stop": Interrupted}, tmp_path / "o",
                 progress=False, verbose=False, plots=False)
    assert not (tmp_path / "o" / "report.md").exists()
    assert not list((tmp_path / "o" / "cache").rglob("stop-*.json"))


def test_run_json_records_versions_seeds_and_timings(tmp_path):
    suite = _toy_suite(tmp_path)
    methods = {"logreg": _logreg, "dummy": Method(_Counted, version={"ckpt": "abc123"})}
    rep = evaluate("classification", suite, methods, tmp_path / "o", progress=False, verbose=False, plots=False,
                   command={"argv": ["tabfm", "eval"], "methods_spec": "logreg,dummy"})
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    assert run == json.loads(json.dumps(rep.run, default=str))
    for k in ["python", "numpy", "pandas", "sklearn", "torch"]:
        assert k in run["versions"]
    assert run["versions"]["sklearn"] and run["versions"]["python"].count(".") == 2
    assert run["methods"]["dummy"]["versions"]["ckpt"] == "abc123" and "sklearn" in run["methods"]["logreg"]["versions"]
    assert run["seeds"] == {"cv": "StratifiedKFold", "n_splits": 5, "shuffle": True, "random_state": 0}
    assert run["suite"]["dir"] == str(suite.resolve()) and run["suite"]["datasets"] == ["toy0", "toy1"]
    assert run["command"]["task"] == "classification" and run["command"]["methods"] == ["logreg", "dummy"]
    assert run["command"]["methods_spec"] == "logreg,dummy" and run["task"] == "classification"
    assert run["started"].endswith("+00:00") and run["total_seconds"] > 0
    for d in ["toy0", "toy1"]:
        for m in methods:
            t = run["timings"][d][m]
            assert t["status"] == "ok" and t["cached"] is False and t["seconds"] > 0
    evaluate("classification", suite, methods, tmp_path / "o", progress=False, verbose=False, plots=False)
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    t = run["timings"]["toy0"]["dummy"]
    assert t["status"] == "cached" and t["cached"] is True and t["computed_seconds"] > 0
    from tabfm.eval.runner import protocol_seeds

    assert protocol_seeds("imputation")["seeds"] == [0, 1, 2] and protocol_seeds("anomaly")["random_state"] == [0, 1, 2]


def test_rank_rule_with_failures_by_hand():
    # failures take the worst places, tied among themselves, after every method with a score
    assert average_ranks({"A": 0.9, "B": 0.8}, True, failed=["C"]) == {"A": 1.0, "B": 2.0, "C": 3.0}
    assert average_ranks({"A": 0.9}, True, failed=["B", "C"]) == {"A": 1.0, "B": 2.5, "C": 2.5}
    assert average_ranks({"A": 0.1, "B": 0.1}, False, failed=["C"]) == {"A": 1.5, "B": 1.5, "C": 3.0}
    assert average_ranks({"A": float("nan")}, True, failed=["B"]) == {}  # nobody scored: nobody ranked
    scores = {
        "d1": {"A": {"roc_auc": 0.9}, "B": {"roc_auc": 0.8}, "C": {"roc_auc": 0.7}},
        "d2": {"A": {"roc_auc": 0.6}, "C": {"roc_auc": 0.8}},  # B failed on d2
        "d3": {"A": {"roc_auc": 0.5}, "B": {"roc_auc": 0.6}, "C": {"roc_auc": 0.6}},
    }
    errors = {"d2": {"B": "ValueError: bad"}}
    # d1: A1 B2 C3 ; d2: C1 A2 B3 (failed = worst) ; d3: B1.5 C1.5 A3
    assert mean_ranks(scores, "roc_auc", ["A", "B", "C"], failed=errors) == pytest.approx(
        {"A": 6 / 3, "B": 6.5 / 3, "C": 5.5 / 3})
    rep = Report("classification", scores, ["A", "B", "C"], ["A"], metrics=["roc_auc"], errors=errors)
    agg = rep.aggregate()
    assert agg["B"]["roc_auc_rank"] == pytest.approx(6.5 / 3)
    assert agg["B"]["roc_auc"] == pytest.approx(0.7)  # mean over the 2 datasets it completed
    assert agg["B"]["n_datasets"] == 2 and agg["B"]["n_failed"] == 1 and agg["A"]["n_failed"] == 0
    assert wins_ties_losses(scores, "roc_auc", "A", "B") == (1, 0, 1)  # d2 skipped
    assert rep.order() == ["C", "A", "B"]
    md = rep.to_markdown()
    assert "| d2 | 0.800 | 0.600 | failed |" in md and "worst rank" in md
    assert "| method | roc_auc | failed |" in md and "| B | 0.7000 (2.2) | 1 |" in md
    # per dataset x condition ranks: the failure is the worst rank in every condition of its dataset
    units = {"d1|c1": {"A": {"roc_auc": 1.0}, "B": {"roc_auc": 0.0}},
             "d2|c1": {"A": {"roc_auc": 1.0}}, "d2|c2": {"A": {"roc_auc": 0.0}}}
    rep = Report("classification", {"d1": {"A": {"roc_auc": 1.0}, "B": {"roc_auc": 0.0}}, "d2": {"A": {"roc_auc": 0.5}}},
                 ["A", "B"], ["A"], metrics=["roc_auc"], rank_scores=units, errors={"d2": {"B": "boom"}})
    assert rep.aggregate()["A"]["roc_auc_rank"] == pytest.approx(1.0)
    assert rep.aggregate()["B"]["roc_auc_rank"] == pytest.approx(2.0)


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_classification_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    suite = _toy_suite3(tmp_path)
    _Flaky.fail = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = evaluate("classification", suite, {"logreg": _logreg, "flaky": _Flaky}, tmp_path / "o",
                           progress=False, verbose=True)
    finally:
        _Flaky.fail = False
    plots = tmp_path / "o" / "plots"
    assert sorted(p.name for p in plots.iterdir()) == ["ranks_roc_auc.png", "scores_roc_auc.png"]
    assert all(_is_png(p) for p in plots.iterdir())
    out = capsys.readouterr().out
    assert f"plot: {plots / 'scores_roc_auc.png'}" in out and "run.json" in out
    assert rep.meta["files"]["plots"] == [str(plots / "scores_roc_auc.png"), str(plots / "ranks_roc_auc.png")]


def test_plots_imputation_run(tmp_path):
    pytest.importorskip("matplotlib")
    from tabfm.eval.plots import rmse_by_condition

    rng = np.random.default_rng(0)
    for i in range(2):
        z = rng.normal(size=40)
        frame = pd.DataFrame({"x": z, "y": 2 * z + rng.normal(size=40), "k": pd.Categorical(np.where(z > 0, "a", "b"))})
        save_dataset(tmp_path / "imp", f"imp{i}", frame, "imputation", None)

    class Zeros:
        def fit_transform(self, X):
            return X.fillna({"x": 0.0, "y": 0.0, "k": "a"})

    rep = evaluate("imputation", tmp_path / "imp", {"mean": MeanModeImputer, "zeros": Zeros}, tmp_path / "o",
                   progress=False, verbose=False)
    plots = tmp_path / "o" / "plots"
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["imputation_rmse_vs_rate.png", "ranks_rmse.png", "scores_rmse.png"]
    assert all(_is_png(p) for p in plots.iterdir())
    # the curves come from the per-condition units stored in results.json
    res = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    curves = rmse_by_condition(res)
    assert set(curves) == {"mean", "zeros"} and set(curves["mean"]) == {"MCAR", "MAR", "MNAR"}
    assert sorted(curves["mean"]["MCAR"]) == [0.1, 0.3, 0.5]
    mcar = [np.mean([u["rmse"] for u in res[d]["mean"]["units"] if u["mechanism"] == "MCAR" and u["rate"] == 0.3])
            for d in res]
    assert curves["mean"]["MCAR"][0.3] == pytest.approx(np.mean(mcar))
    live = rmse_by_condition(rep.results)
    flat = {(m, k, r): v for m, per in curves.items() for k, rates in per.items() for r, v in rates.items()}
    assert {(m, k, r): v for m, per in live.items() for k, rates in per.items() for r, v in rates.items()} == pytest.approx(flat)


def test_no_matplotlib_warns_and_writes_no_plots(tmp_path, monkeypatch):
    import sys

    for mod in ["matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"]:
        monkeypatch.setitem(sys.modules, mod, None)  # import -> ImportError
    suite = _toy_suite(tmp_path)
    with pytest.warns(RuntimeWarning, match="matplotlib is not available"):
        rep = evaluate("classification", suite, {"logreg": _logreg}, tmp_path / "o", progress=False, verbose=False)
    assert not (tmp_path / "o" / "plots").exists() and rep.meta["files"]["plots"] == []
    assert (tmp_path / "o" / "report.md").exists() and (tmp_path / "o" / "run.json").exists()


# ============================================================================ CLI
def _cli(argv):
    import argparse

    from tabfm.commands import eval as cmd

    parser = argparse.ArgumentParser(prog="tabfm")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd.add_parser(sub)
    return cmd.run(parser.parse_args(argv))


def test_cli_eval_and_method_selection(tmp_path, capsys):
    from tabfm.commands import eval as cmd

    suite = _toy_suite(tmp_path)
    rc = _cli(["eval", "--task", "classification", "--suite", str(suite), "--methods", "logreg,knn",
               "--out", str(tmp_path / "out"), "--no-progress", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| logreg |" in out and "Wins / ties / losses" in out
    assert (tmp_path / "out" / "report.md").exists() and (tmp_path / "out" / "cache").is_dir()
    assert not (tmp_path / "out" / "plots").exists()  # --no-plots
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["command"]["methods_spec"] == "logreg,knn" and run["command"]["methods"] == ["logreg", "knn"]
    with pytest.raises(ValueError, match="unknown classification method 'nope'"):
        cmd.select_methods("classification", "nope")
    with pytest.raises(ValueError, match="--task is required"):
        _cli(["eval"])
    with pytest.raises(ValueError, match="no public regression suite|there is no public regression"):
        _cli(["eval", "--task", "regression"])
    # the seam: a registered extra method joins 'all' and can be named
    extras = {"mine": _Counted}
    assert set(cmd.select_methods("classification", "extra", extras=extras)) == {"mine"}
    assert "mine" in cmd.select_methods("classification", "logreg,mine", extras=extras)


def test_imputer_baselines_beat_the_mean_on_correlated_data():
    from tabfm.eval.baselines import baselines

    rng = np.random.default_rng(0)
    z = rng.normal(size=200)
    frame = pd.DataFrame({f"x{i}": (i + 1) * z + 0.3 * rng.normal(size=200) for i in range(4)})
    frame["f"] = pd.Categorical(np.where(z + 0.2 * rng.normal(size=200) > 0, "hi", "lo"))
    frame.loc[:9, "x0"] = np.nan  # real NaNs stay
    M = imputation_mask(frame, "MCAR", 0.3, 0)
    masked = apply_mask(frame, M)
    scores = {}
    for name, factory in baselines("imputation").items():
        out = factory().fit_transform(masked)
        assert out.shape == frame.shape and not out.isna().any().any()
        observed = ~M & frame.notna().to_numpy()
        for j, c in enumerate(frame.columns):  # observed cells are left alone
            assert (out[c].astype(str).to_numpy()[observed[:, j]] == frame[c].astype(str).to_numpy()[observed[:, j]]).all()
        scores[name] = score_imputation(frame, M, out)
    for name in ["knn", "mice", "missforest"]:
        assert scores[name]["rmse"] < scores["mean_mode"]["rmse"] - 0.1, scores
    for name in ["knn", "mice", "missforest"]:
        assert scores[name]["cat_accuracy"] > scores["mean_mode"]["cat_accuracy"] + 0.2, scores


def test_tabfm_method_versions_follow_weights_and_estimator_parameters(monkeypatch):
    """Cached TabFM scores are keyed by the weights' hash and the estimator's parameters, so a
    changed default recomputes them instead of serving stale results."""
    from tabfm.commands.eval import tabfm_methods
    from tabfm.estimators import TabFMClassifier

    before = tabfm_methods()["classification"]["tabfm"].version
    assert set(before) == {"tabfm", "params", "code"}
    defaults = TabFMClassifier.__init__.__defaults__
    assert defaults[-10:] == ("ordinal", "mixed", (5, 20), True, "auto", None, None, 100, 512, "torch")  # categorical,
    # numeric, n_neighbors, linear_features, multiclass, n_codebooks, alphabet_size, max_classes, local_context, backend
    monkeypatch.setattr(TabFMClassifier.__init__, "__defaults__", defaults[:-6] + ("native", None, None, 100, 512, "torch"))
    after = tabfm_methods()["classification"]["tabfm"].version
    assert after["tabfm"] == before["tabfm"] and after["params"] != before["params"]
    monkeypatch.setattr(TabFMClassifier.__init__, "__defaults__", defaults[:-2] + (0, "torch"))  # local contexts off
    assert tabfm_methods()["classification"]["tabfm"].version["params"] not in (before["params"], after["params"])


def test_tabfm_methods_use_each_tasks_default_weights_unless_named():
    """No --model: each task's estimator default (tabfm.weights.DEFAULT_MODELS); --model: those weights for all."""
    import hashlib

    from tabfm.commands.eval import tabfm_methods
    from tabfm.weights import DEFAULT_MODELS, resolve_model_path

    def digest(name: str) -> str:
        return hashlib.sha256((resolve_model_path(name) / "model.safetensors").read_bytes()).hexdigest()[:16]

    default = tabfm_methods()
    assert {t: m["tabfm"].version["tabfm"] for t, m in default.items()} == {t: digest(n) for t, n in DEFAULT_MODELS.items()}
    assert default["classification"]["tabfm"].factory().model == str(resolve_model_path(DEFAULT_MODELS["classification"]))
    named = tabfm_methods(model="tabfm-tiny")
    assert {m["tabfm"].version["tabfm"] for m in named.values()} == {digest("tabfm-tiny")}
    with pytest.warns(UserWarning, match="TabFM methods skipped"):
        assert tabfm_methods(model="no-such-weights") == {}


def test_tabfm_method_version_follows_the_inference_code(tmp_path):
    """An edit to the estimators' source changes the TabFM methods' cache version (no stale scores)."""
    from tabfm.commands.eval import inference_code_hash

    for sub in ("tabfm/estimators", "tabfm/model", "data"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "tabfm/inference.py").write_text("x = 1\n")
    (tmp_path / "tabfm/estimators/neighbors.py").write_text("K = 5\n")
    first = inference_code_hash(tmp_path)
    assert inference_code_hash(tmp_path) == first
    (tmp_path / "tabfm/estimators/neighbors.py").write_text("K = 6\n")
    assert inference_code_hash(tmp_path) != first
    assert len(inference_code_hash()) == 12  # the installed source


def test_tabfm_params_reach_the_estimator_and_its_version():
    """`--tabfm-params` values are parsed as literals, set on every estimator, change the cache
    key, and a name the estimator does not take is an error naming it."""
    from tabfm.commands.eval import parse_params, tabfm_methods

    assert parse_params("n_estimators=1, precision=fp32,max_offset_rows=None") == {
        "n_estimators": 1, "precision": "fp32", "max_offset_rows": None}
    assert parse_params("n_neighbors=(5, 20),n_estimators=2,x=[1,(2,3)]") == {
        "n_neighbors": (5, 20), "n_estimators": 2, "x": [1, (2, 3)]}  # commas inside brackets stay
    assert parse_params(None) == {} and parse_params("") == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params("n_estimators")
    default = tabfm_methods()["anomaly"]["tabfm"]
    one = tabfm_methods(params={"n_estimators": 1})["anomaly"]["tabfm"]
    assert one.version["tabfm"] == default.version["tabfm"] and one.version["params"] != default.version["params"]
    assert one.factory().detector.n_estimators == 1 and default.factory().detector.n_estimators == 2
    with pytest.raises(ValueError, match="no parameter.*'n_trees'"):
        tabfm_methods(params={"n_trees": 3})["anomaly"]["tabfm"]
    # a parameter only some estimators take: fine for their tasks, an error naming the one that lacks it
    quantile = tabfm_methods(params={"numeric": "quantile"}, tasks=("classification",))
    assert list(quantile) == ["classification"] and quantile["classification"]["tabfm"].factory().numeric == "quantile"
    with pytest.raises(ValueError, match="TabFMImputer has no parameter.*'numeric'"):
        tabfm_methods(params={"numeric": "quantile"}, tasks=("imputation",))
