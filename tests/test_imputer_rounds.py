"""TabFMImputer's rounds (n_rounds / round_parts): round 1 is the one-pass imputer, bit for bit;
later rounds re-predict each missing cell with the row's other missing cells filled with the
previous round's estimates. Uses the shipped default model on small tables."""
from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.base import clone

from tabfm.estimators import TabFMImputer

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def mixed(n: int = 60, seed: int = 0) -> pd.DataFrame:
    """Numeric, integer, categorical and boolean columns that depend on each other, ~25 % missing."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=n)
    X = pd.DataFrame({
        "u": u,
        "v": 2 * u + 0.3 * rng.normal(size=n),
        "w": rng.normal(size=n) * 100,
        "color": pd.Series(np.where(u > 0.3, "red", np.where(u < -0.3, "blue", "green")), dtype=object),
        "count": pd.array(rng.integers(0, 5, n), dtype="Int64"),
        "flag": pd.Series(u + 0.5 * rng.normal(size=n) > 0, dtype=object),
    })
    for col in X.columns:
        X.loc[rng.random(n) < 0.25, col] = None
    return X


def copies(n: int = 80, seed: int = 0) -> np.ndarray:
    """a and b copies of each other, missing together in ~35 % of the rows (a alone in a few more);
    c visible everywhere and related to both."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=n)
    a = c + 0.5 * rng.normal(size=n)
    X = np.c_[a, a, c]
    X[rng.random(n) < 0.35, :2] = NAN
    X[rng.random(n) < 0.1, 0] = NAN
    return X


def test_one_round_is_the_default_bit_for_bit():
    X = mixed()
    for kw in ({}, {"n_estimators": 2, "max_columns": 3, "random_state": 4}):
        default = TabFMImputer(strategy="joint", **kw).fit(X).transform(X)
        pd.testing.assert_frame_equal(TabFMImputer(strategy="joint", n_rounds=1, round_parts=2, **kw).fit(X).transform(X), default)
    # round_parts=1 hides a row's missing cells all together again: round 1 repeated, so nothing changes
    pd.testing.assert_frame_equal(TabFMImputer(strategy="joint", n_rounds=3, round_parts=1).fit(X).transform(X),
                                  TabFMImputer(strategy="joint").fit(X).transform(X))


def test_rounds_change_only_missing_cells_and_are_deterministic():
    X = mixed()
    missing = X.isna().to_numpy()
    one = TabFMImputer(strategy="joint", n_estimators=2).fit(X).transform(X)
    two = TabFMImputer(strategy="joint", n_estimators=2, n_rounds=2).fit(X).transform(X)
    assert not two.isna().to_numpy().any() and two.dtypes.to_dict() == X.dtypes.to_dict()
    for j, col in enumerate(X.columns):
        seen = ~missing[:, j]
        assert (two.loc[seen, col] == X.loc[seen, col]).all(), col
    assert (two["u"] != one["u"]).any() and (two["v"] != one["v"]).any()  # estimates moved
    again = TabFMImputer(strategy="joint", n_estimators=2, n_rounds=2).fit(X).transform(X)
    pd.testing.assert_frame_equal(again, two)
    # a row's answer is its own (the parts are dealt per row): any subset of the rows gives the same
    imp = TabFMImputer(strategy="joint", n_estimators=2, n_rounds=2).fit(X)
    pd.testing.assert_frame_equal(imp.transform(X.iloc[::3]), two.iloc[::3])


@pytest.mark.parametrize("table", ["copies", "mixed"])
def test_a_later_round_is_round_one_given_the_other_estimates(table):
    """Independent reference through the public API: with round_parts >= the missing columns of
    every row, each missing cell is hidden alone in round r, the row's other missing cells showing
    round r-1's output; that is transform(n_rounds=1) of round r-1's output with that cell blanked.
    (Not with integer columns: the output rounds them, the rounds show the predictive mean.)"""
    X = copies() if table == "copies" else mixed(40, seed=1).drop(columns="count")
    frame = pd.DataFrame(X)
    missing = frame.isna().to_numpy()
    kw = {"n_estimators": 2, "round_parts": frame.shape[1]}
    base = TabFMImputer(strategy="joint", **kw).fit(X)
    previous = pd.DataFrame(base.transform(X))
    for rounds in (2, 3):
        got = pd.DataFrame(TabFMImputer(strategy="joint", n_rounds=rounds, **kw).fit(X).transform(X))
        for j in range(frame.shape[1]):
            rows = missing[:, j]
            if not rows.any():
                continue
            blanked = previous.copy()
            blanked.iloc[rows, j] = None
            ref = pd.DataFrame(base.transform(blanked.to_numpy() if table == "copies" else blanked.astype(X.dtypes)))
            pd.testing.assert_series_equal(got.iloc[rows, j], ref.iloc[rows, j], check_dtype=False)
        previous = got


def cat_copies(n: int = 60, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """Categorical a == b in every row, missing together in ~35 % of them; numeric c visible and
    related to both (noisily, so the category of some rows is a close call)."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=n)
    label = np.where(c + 0.6 * rng.normal(size=n) > 0.4, "hi", np.where(c + 0.6 * rng.normal(size=n) < -0.4, "lo", "mid"))
    X = pd.DataFrame({"a": pd.Series(label, dtype=object), "b": pd.Series(label, dtype=object), "c": c})
    both = rng.random(n) < 0.35
    X.loc[both, ["a", "b"]] = None
    return X, both


def test_a_visible_copy_is_copied():
    """Hand-checkable: where a and b are both missing, round 1 predicts each from c alone (hidden
    together), and in close calls the two answers differ. Round 2 hides them in turn (2 parts), so a
    is predicted with round 1's b visible and copies it, and b copies round 1's a: the rows where
    round 1 disagreed come out swapped; round 3 copies round 2 and swaps them back."""
    X, both = cat_copies()
    one, two, three = (TabFMImputer(strategy="joint", n_estimators=2, n_rounds=r, round_parts=2).fit(X).transform(X) for r in (1, 2, 3))
    assert (one.a[both] != one.b[both]).sum() >= 1  # a close call (how many depends on the weights), so the swaps below are seen
    assert (two.a[both] == one.b[both]).all() and (two.b[both] == one.a[both]).all()
    assert (three.a[both] == two.b[both]).all() and (three.b[both] == two.a[both]).all()
    pd.testing.assert_frame_equal(three[~both], X[~both])  # rows with nothing missing are untouched


def test_progress_bar_counts_every_pass(monkeypatch):
    X = copies()  # rows miss at most 2 source columns: 2 parts per later round, 1 member, 1 column group
    seen = []

    class Bar:
        def __init__(self, total):
            self.total, self.n = total, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append((self.total, self.n))

        def update(self, n=1):
            self.n += n

    for rounds, parts, total in ((1, 4, 1), (2, 4, 3), (3, 4, 5), (3, 1, 1)):
        imp = TabFMImputer(strategy="joint", n_estimators=1, n_rounds=rounds, round_parts=parts).fit(X)
        monkeypatch.setattr(imp, "_bar", lambda passes, what: Bar(passes))
        imp.transform(X)
        assert seen[-1] == (total, total), (rounds, parts)


@pytest.mark.parametrize("name", ["n_rounds", "round_parts"])
@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, True, "2", None])
def test_bad_values_raise_naming_the_parameter(name, value):
    X = copies(20)
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {value!r}"):
        TabFMImputer(strategy="joint", **{name: value}).fit(X)
    imp = TabFMImputer(strategy="joint").fit(X).set_params(**{name: value})
    with pytest.raises(ValueError, match=name):
        imp.transform(X)


def test_params_clone_and_pickles_from_before_the_parameters():
    X = copies(40)
    est = TabFMImputer(strategy="joint", n_rounds=3, round_parts=2)
    params = clone(est).get_params()
    assert params["n_rounds"] == 3 and params["round_parts"] == 2
    assert TabFMImputer(strategy="joint").get_params()["n_rounds"] == 1 and TabFMImputer(strategy="joint").get_params()["round_parts"] == 4
    fitted = TabFMImputer(strategy="joint", n_estimators=1).fit(X)
    expected = fitted.transform(X)
    for name in ("n_rounds", "round_parts"):  # as an imputer pickled before they existed
        del fitted.__dict__[name]
    np.testing.assert_array_equal(fitted.transform(X), expected)
    for name in ("strategy", "table_"):  # older still: unpickled, it imputes jointly, as it did then
        del fitted.__dict__[name]
    old = pickle.loads(pickle.dumps(fitted))
    assert old.get_params()["n_rounds"] == 1 and clone(old).get_params()["round_parts"] == 4
    assert old.get_params()["strategy"] == "joint"  # what an imputer pickled then did
    np.testing.assert_array_equal(old.transform(X), expected)
