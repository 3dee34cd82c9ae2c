"""TabFMAnomalyDetector's query copies (`columns_per_copy`, issue #25): 1 is the scorer as it was
(every source column hidden alone), a larger value hides a seeded partition of the scored columns,
each cell exactly once per member, in proportionally fewer passes.

A random-weight tiny export keeps these fast; `OldDetector` is the scorer before the parameter
existed, copied verbatim, as the reference for the exactness of columns_per_copy=1.
"""
from __future__ import annotations

import pickle
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from tabfm.estimators import TabFMAnomalyDetector
from tabfm.estimators.anomaly import _z_nll
from tabfm.estimators.ensemble import subsample
from tabfm.inference import ContextPredictor


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class OldDetector(TabFMAnomalyDetector):
    """The scorer before `columns_per_copy` (every scored source column hidden in turn), verbatim."""

    def _scores(self, x: np.ndarray) -> np.ndarray:
        rt = self._runtime()
        scored = self._scored_parts(rt)
        fold = self._fold_of(x)
        members = self._members(cover_all=True)
        total = np.zeros(len(x))
        for m in members:
            for f in np.unique(fold):
                rows = np.flatnonzero(fold == f)
                pool = np.arange(len(self.train_x_)) if f < 0 else np.flatnonzero(self.folds_ != f)
                ctx_rows = subsample(m.rng(0, int(f) + 1), pool, self.max_context_rows)
                for group in m.column_groups:
                    context = self._context(rt.for_member(m), m.view(self.train_x_[ctx_rows], group),
                                            self._kind[group], self._card[group])
                    total[rows] += self._old_group_scores(context, m.view(x[rows], group), scored[group], group)
        return total / len(members)

    def _old_group_scores(self, context, query, scored, group):
        in_group = set(group.tolist())
        units = [np.flatnonzero(np.isin(group, u)) for u in self._units() if int(u[0]) in in_group]
        units = [u for u in units if scored[u].any()]
        n_q = len(query)
        observed = ~np.isnan(query) & scored[None, :]
        out = np.zeros(n_q)
        per_pass = max(1, self.chunk_size // max(n_q, 1))
        for start in range(0, len(units), per_pass):
            block = units[start:start + per_pass]
            qx = np.concatenate([query] * len(block))
            mask = np.zeros(qx.shape, dtype=bool)
            for i, cols in enumerate(block):
                hide = observed[:, cols].any(1)
                mask[i * n_q:(i + 1) * n_q][np.ix_(hide, cols)] = True
            if not mask.any():
                continue
            nll = context.predict(qx, mask, _z_nll, self.chunk_size)
            r, c = np.nonzero(mask)
            keep = scored[c] & ~np.isnan(qx[r, c])
            np.add.at(out, r[keep] % n_q, nll[keep])
        return out


def mixed(n: int = 40, seed: int = 0) -> pd.DataFrame:
    """Floats (with missing cells and an inf), a string, an integer, a boolean, a constant."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=n)
    a[[3, 7]] = np.nan
    c = rng.normal(size=n) * 100
    c[5] = np.inf
    return pd.DataFrame({"a": a, "b": rng.choice(["u", "v", "w"], n), "c": c, "k": rng.integers(0, 5, n),
                         "f": rng.random(n) > 0.5, "z": 1.0, "d": rng.normal(size=n)})


def numeric(n: int = 30, width: int = 12) -> pd.DataFrame:
    """Numeric columns whose every cell value is unique in the table: value = column + row / 100."""
    return pd.DataFrame({f"x{j}": j + np.arange(n) / 100.0 + 0.001 for j in range(width)})


def detector(model, **kw) -> TabFMAnomalyDetector:
    return TabFMAnomalyDetector(model=model, n_estimators=kw.pop("n_estimators", 2),
                                random_state=kw.pop("random_state", 0), **kw)


class Recorder:
    """Records every ContextPredictor.predict call (query rows, mask) and every model pass."""

    def __init__(self, monkeypatch):
        self.calls, self.passes = [], 0
        predict, chunk = ContextPredictor.predict, ContextPredictor._chunk

        def recording_predict(predictor, query_x, query_mask, fn, chunk_size=256):
            self.calls.append((np.array(query_x), np.array(query_mask)))
            return predict(predictor, query_x, query_mask, fn, chunk_size)

        def counting_chunk(predictor, *args, **kwargs):
            self.passes += 1
            return chunk(predictor, *args, **kwargs)

        monkeypatch.setattr(ContextPredictor, "predict", recording_predict)
        monkeypatch.setattr(ContextPredictor, "_chunk", counting_chunk)

    def clear(self):
        self.calls, self.passes = [], 0


# ------------------------------------------------------------------ exactness of 1
def test_defaults_are_two_small_contexts_and_two_copies():
    """BENCHMARKS.md, "Anomaly scoring at a user's cost": the detector's own defaults, not the base's."""
    p = TabFMAnomalyDetector().get_params()
    assert (p["n_estimators"], p["max_context_rows"], p["columns_per_copy"]) == (2, 256, 0.5)


def test_the_default_hides_half_of_the_columns_per_copy(export_dir):
    """Two copies per member: on 8 columns the default is groups of 4 (the same seeded partition as
    columns_per_copy=4), not every column alone; on 2 columns it is every column alone."""
    X, new = numeric(30, width=8), numeric(30, width=8).iloc[:6] + 0.5
    default = TabFMAnomalyDetector(model=export_dir, n_estimators=2, random_state=0).fit(X).score_samples(new)
    np.testing.assert_array_equal(default, detector(export_dir, columns_per_copy=4).fit(X).score_samples(new))
    assert not np.allclose(default, detector(export_dir, columns_per_copy=1).fit(X).score_samples(new))
    two, new2 = numeric(30, width=2), numeric(30, width=2).iloc[:6] + 0.5
    np.testing.assert_array_equal(TabFMAnomalyDetector(model=export_dir, n_estimators=2, random_state=0).fit(two)
                                  .score_samples(new2), detector(export_dir, columns_per_copy=1).fit(two).score_samples(new2))


def test_a_detector_pickled_before_columns_per_copy_hides_every_column_alone(export_dir):
    X, new = mixed(40), mixed(9, seed=3)
    cur = detector(export_dir, columns_per_copy=1).fit(X)
    old = pickle.loads(pickle.dumps(cur))
    del old.__dict__["columns_per_copy"]  # as a detector pickled before the parameter existed unpickles
    np.testing.assert_array_equal(old.score_samples(new), cur.score_samples(new))


@pytest.mark.parametrize("kw", [dict(), dict(chunk_size=7, max_columns=3), dict(n_folds=3, max_context_rows=20)])
def test_one_column_per_copy_reproduces_the_old_scorer(export_dir, kw):
    X, new = mixed(40), mixed(9, seed=3)
    new.loc[new.index[0], "a"] = 40.0
    old = OldDetector(model=export_dir, n_estimators=2, random_state=0, **kw).fit(X)
    cur = detector(export_dir, columns_per_copy=1, **kw).fit(X)
    np.testing.assert_allclose(cur.score_samples(X), old.score_samples(X), rtol=0, atol=1e-6)
    np.testing.assert_allclose(cur.score_samples(new), old.score_samples(new), rtol=0, atol=1e-6)
    assert cur.offset_ == pytest.approx(old.offset_, abs=1e-6)


# ------------------------------------------------------------------ what a grouped copy hides
def hidden_cells(rec: Recorder, where: dict) -> list[set[tuple[int, int]]]:
    """(row of X, column) of the cells each recorded query copy hides (copies hiding nothing left out)."""
    out = []
    for qx, mask in rec.calls:
        for row in np.flatnonzero(mask.any(1)):
            out.append({where[np.float32(qx[row, j])] for j in np.flatnonzero(mask[row])})
    return out


def cell_index(X: pd.DataFrame) -> dict:
    return {np.float32(v): (r, c) for (r, c), v in np.ndenumerate(X.to_numpy(np.float32)) if not np.isnan(v)}


@pytest.mark.parametrize("value, sizes", [(1, [1] * 12), (3, [3] * 4), (5, [4] * 3), (0.25, [3] * 4), (0.125, [2] * 6),
                                          (0.5, [6, 6]), (1.0, [12]), (100, [12])])
def test_each_scored_cell_is_hidden_exactly_once_per_member(export_dir, monkeypatch, value, sizes):
    """12 numeric columns: a member's copies partition them into ceil(12 / k) near-equal groups, the
    same for every row; every cell of every scored row is hidden exactly once per member."""
    X = numeric(30)
    det = detector(export_dir, columns_per_copy=value, n_estimators=1).fit(X)
    rec = Recorder(monkeypatch)
    det.score_samples(X.iloc[:10])  # fitted rows: each is scored with its own fold left out
    copies = hidden_cells(rec, cell_index(X))
    assert all(len({r for r, _ in cells}) == 1 for cells in copies)  # a copy is one row of X
    assert Counter(cell for cells in copies for cell in cells) == Counter(
        {(r, c): 1 for r in range(10) for c in range(12)})
    groups = Counter(frozenset(c for _, c in cells) for cells in copies)
    assert sorted(len(g) for g in groups) == sorted(sizes)  # disjoint (cells hidden once), covering all 12
    assert set(groups.values()) == {10}  # each row in each group: the partition does not depend on the rows
    two = detector(export_dir, columns_per_copy=value, n_estimators=2).fit(X)
    rec.clear()
    two.score_samples(X.iloc[:10])
    assert Counter(cell for cells in hidden_cells(rec, cell_index(X)) for cell in cells) == Counter(
        {(r, c): 2 for r in range(10) for c in range(12)})


def test_members_draw_their_own_partition_and_missing_cells_are_never_hidden(export_dir, monkeypatch):
    X = numeric(30)
    X.iloc[2, 4] = np.nan
    det = detector(export_dir, columns_per_copy=4, n_estimators=2).fit(X)
    rec = Recorder(monkeypatch)
    new = X.iloc[:5] + 0.5  # new rows: one context per member, one predict call each
    det.score_samples(new)
    assert len(rec.calls) == 2 and all(not np.isnan(qx[mask]).any() for qx, mask in rec.calls)
    where, partitions = cell_index(new), []
    for qx, mask in rec.calls:
        copies = [{where[np.float32(qx[r, j])] for j in np.flatnonzero(mask[r])} for r in np.flatnonzero(mask.any(1))]
        groups = {frozenset(c for _, c in cells) for cells in copies if next(iter(cells))[0] != 2}
        assert sorted(len(g) for g in groups) == [4, 4, 4] and len(frozenset().union(*groups)) == 12
        row2 = sorted(len(cells) for cells in copies if next(iter(cells))[0] == 2)
        assert row2 == [3, 4, 4]  # its missing cell is not hidden, the rest are
        partitions.append(groups)
    assert partitions[0] != partitions[1]  # each member its own partition


# ------------------------------------------------------------------ cost
@pytest.mark.parametrize("value, copies", [(1, 12), (2, 6), (4, 3), (5, 3), (0.5, 2), (1.0, 1)])
def test_passes_drop_by_the_copies_factor(export_dir, monkeypatch, value, copies):
    """New rows (one context per member), chunk_size = their number: one pass per copy per member."""
    X, new = numeric(30), numeric(30).iloc[:8] + 0.5
    det = detector(export_dir, columns_per_copy=value, n_estimators=2, chunk_size=8).fit(X)
    rec = Recorder(monkeypatch)
    det.score_samples(new)
    assert rec.passes == 2 * copies
    assert sum(int(mask.any(1).sum()) for _, mask in rec.calls) == 2 * 8 * copies  # query row copies


# ------------------------------------------------------------------ determinism, validation
def test_grouped_scores_are_deterministic_under_random_state(export_dir):
    X, new = mixed(40), mixed(12, seed=5)
    a = detector(export_dir, columns_per_copy=2, random_state=3).fit(X)
    b = detector(export_dir, columns_per_copy=2, random_state=3).fit(X)
    np.testing.assert_array_equal(a.score_samples(new), b.score_samples(new))
    np.testing.assert_array_equal(a.score_samples(new), a.score_samples(new))
    assert a.offset_ == b.offset_
    # a row's score does not depend on the rows scored with it
    np.testing.assert_allclose(a.score_samples(new.iloc[:4]), a.score_samples(new)[:4], rtol=0, atol=1e-9)
    other = detector(export_dir, columns_per_copy=2, random_state=4).fit(X)
    assert not np.allclose(other.score_samples(new), a.score_samples(new))
    assert np.isfinite(detector(export_dir, columns_per_copy=1.0).fit(X).score_samples(new)).all()


@pytest.mark.parametrize("bad", [0, -2, 0.0, 1.5, -0.5, True, "all", None, np.nan])
def test_bad_columns_per_copy_is_a_value_error_naming_it(export_dir, bad):
    with pytest.raises(ValueError, match=r"columns_per_copy must be .*got " + re.escape(repr(bad))):
        detector(export_dir, columns_per_copy=bad).fit(numeric(10, 3))
    det = detector(export_dir).fit(numeric(10, 3))
    det.set_params(columns_per_copy=bad)
    with pytest.raises(ValueError, match="columns_per_copy"):
        det.score_samples(numeric(10, 3))
