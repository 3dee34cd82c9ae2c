"""TabFMImputer(strategy="columns"): each column with missing cells is the target of the supervised
estimator of its type (TabFMRegressor for numbers, TabFMClassifier for categories and booleans),
fitted on the rows where it is observed. Checked against those estimators called directly, and on
tables whose missing cells are predictable from the other columns. Uses the shipped default model."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tabfm.estimators import TabFMClassifier, TabFMImputer, TabFMRegressor
from tabfm.estimators.imputer import column_seed

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def related(n: int = 120, seed: int = 0, missing: float = 0.25) -> pd.DataFrame:
    """v is 2u plus a little noise, color a banding of u, flag mostly u > 0; ~`missing` of each column missing."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=n)
    X = pd.DataFrame({
        "u": u,
        "v": 2 * u + 0.2 * rng.normal(size=n),
        "w": rng.normal(size=n),
        "color": pd.Series(np.where(u > 0.4, "red", np.where(u < -0.4, "blue", "green")), dtype=object),
        "flag": pd.Series(u + 0.2 * rng.normal(size=n) > 0, dtype=object),
    })
    full = X.copy()
    for col in ("v", "color", "flag"):
        X.loc[rng.random(n) < missing, col] = None
    X.loc[rng.random(n) < 0.1, "u"] = None
    return X, full


def test_each_column_is_its_supervised_estimator():
    X, _ = related()
    imp = TabFMImputer(n_estimators=2, random_state=5).fit(X)
    out = imp.transform(X)
    kw = {"model": imp.model, "n_estimators": 2, "max_columns": 32, "progress": False}
    for j, (col, est_type) in enumerate([("u", TabFMRegressor), ("v", TabFMRegressor), ("color", TabFMClassifier),
                                         ("flag", TabFMClassifier)]):
        j = list(X.columns).index(col)
        miss = X[col].isna().to_numpy()
        y = X.loc[~miss, col]
        y = y.astype(float) if est_type is TabFMRegressor else y.astype(bool) if col == "flag" else y
        # the imputer's column estimators are the supervised estimators with their defaults (mixed regressor members)
        est = est_type(random_state=column_seed(imp.ensemble_seed_, j), **kw).fit(X.loc[~miss].drop(columns=[col]), y)
        expected = est.predict(X.loc[miss].drop(columns=[col]))
        got = out.loc[miss, col].to_numpy()
        if est_type is TabFMRegressor:
            np.testing.assert_allclose(got.astype(float), expected, rtol=1e-6)
        else:
            assert list(got) == list(expected), col
    observed = X.notna().to_numpy()
    pd.testing.assert_frame_equal(out.where(observed), X.where(observed))  # observed cells come back as given


def test_local_context_reaches_the_column_estimators():
    """With local_context > 0 each column is its supervised estimator with that local_context: here 40 of
    the ~90 observed rows, so members 2 and 3 of 4 read local contexts and the answer differs from off."""
    X, _ = related(n=120, seed=3)
    col, j = "v", list(X.columns).index("v")
    imp = TabFMImputer(n_estimators=4, random_state=2, local_context=40).fit(X)
    got = imp.transform(X)
    miss = X[col].isna().to_numpy()
    kw = {"model": imp.model, "n_estimators": 4, "max_columns": 32, "progress": False}
    est = TabFMRegressor(random_state=column_seed(imp.ensemble_seed_, j), local_context=40, **kw).fit(
        X.loc[~miss].drop(columns=[col]), X.loc[~miss, col].astype(float))
    assert est.local_ is not None  # the reference has local members
    np.testing.assert_allclose(got.loc[miss, col].to_numpy(float), est.predict(X.loc[miss].drop(columns=[col])), rtol=1e-6)
    off = TabFMImputer(n_estimators=4, random_state=2).fit(X).transform(X)
    assert not np.allclose(off.loc[miss, col].to_numpy(float), got.loc[miss, col].to_numpy(float))
    with pytest.raises(ValueError, match="local_context must be an int >= 0"):
        TabFMImputer(local_context=-1).fit(X)


def test_predictable_cells_are_predicted():
    X, full = related(n=160)
    out = TabFMImputer().fit_transform(X)
    miss = X["v"].isna().to_numpy() & X["u"].notna().to_numpy()  # v's missing cells where u is there to read
    rmse = float(np.sqrt(np.mean((out.loc[miss, "v"].astype(float) - full.loc[miss, "v"]) ** 2)))
    mean_rmse = float(np.sqrt(np.mean((X["v"].mean() - full.loc[miss, "v"]) ** 2)))
    assert rmse < 0.25 * mean_rmse, (rmse, mean_rmse)  # v = 2u + noise: the mean fill is ~10x the noise
    for col in ("color", "flag"):
        m = X[col].isna().to_numpy()
        acc = float((out.loc[m, col].to_numpy() == full.loc[m, col].to_numpy()).mean())
        majority = float(full.loc[m, col].value_counts(normalize=True).iloc[0])
        assert acc >= max(0.8, majority + 0.15), (col, acc, majority)


def test_new_rows_datetimes_and_one_column_tables():
    X, _ = related(n=100, seed=1)
    X["when"] = pd.Timestamp("2024-01-01") + pd.to_timedelta(np.arange(100), unit="D")
    X.loc[[3, 50, 77], "when"] = pd.NaT
    imp = TabFMImputer(n_estimators=1).fit(X.iloc[:70])
    out = imp.transform(X.iloc[70:])  # rows the imputer was not fitted on
    assert not out.isna().any().any()
    assert out.dtypes.tolist() == X.dtypes.tolist()
    one = pd.DataFrame({"a": [1.0, 2.0, np.nan, 4.0, 5.0, np.nan, 3.0]})  # nothing else to read: the joint path
    filled = TabFMImputer(n_estimators=1).fit_transform(one)
    assert filled["a"].notna().all() and 1.0 <= filled["a"].iloc[2] <= 5.0


def test_strategy_and_rounds_are_checked():
    X, _ = related(n=30)
    with pytest.raises(ValueError, match="strategy must be one of"):
        TabFMImputer(strategy="rows").fit(X)
    with pytest.raises(ValueError, match="n_rounds must be an int >= 1"):
        TabFMImputer(n_rounds=0).fit(X)


def test_a_later_round_refits_each_column_on_the_filled_table():
    """Round 2 = each column's supervised estimator fitted where the column is observed, its features
    the fitted table filled by round 1, predicting from the query rows filled by round 1."""
    X, _ = related(n=80, seed=2)
    kw = {"n_estimators": 1, "random_state": 7}
    one = TabFMImputer(**kw).fit_transform(X)
    imp = TabFMImputer(n_rounds=2, **kw).fit(X)
    two = imp.transform(X)
    ref = {"model": imp.model, "n_estimators": 1, "max_columns": 32, "progress": False}
    for col, est_type in (("v", TabFMRegressor), ("color", TabFMClassifier)):
        j = list(X.columns).index(col)
        miss = X[col].isna().to_numpy()
        features = one.drop(columns=[col])
        est = est_type(random_state=column_seed(imp.ensemble_seed_, j), **ref).fit(features[~miss], X.loc[~miss, col])
        expected = est.predict(features[miss])
        got = two.loc[miss, col].to_numpy()
        if est_type is TabFMRegressor:
            np.testing.assert_allclose(got.astype(float), expected, rtol=1e-6)
            assert not np.allclose(got.astype(float), one.loc[miss, col].astype(float))  # round 2 did change them
        else:
            assert list(got) == list(expected)
    # rows the imputer was not fitted on: the fitted rows' own round-1 estimates are its context
    new, _ = related(n=20, seed=3)
    out = imp.transform(new)
    assert not out.isna().any().any()
    pd.testing.assert_frame_equal(out, imp.transform(new))


def test_text_columns_fall_back_to_the_mode_with_a_warning_naming_them():
    X, _ = related(n=80, seed=4)
    X["note"] = [f"free text {i}" for i in range(80)]  # distinct strings: a text column
    X.loc[[2, 9], "note"] = None
    with pytest.warns(UserWarning, match=r"columns \['note'\] cannot be predicted by the model \(text or constant\)"):
        out = TabFMImputer(n_estimators=1).fit_transform(X)
    assert out.loc[[2, 9], "note"].notna().all() and not out.isna().any().any()
