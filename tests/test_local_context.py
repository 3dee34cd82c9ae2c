"""Local contexts (tabfm.estimators.local_context): the grouping against hand computations, and
the estimators' local members on tables where the groups are known."""
import numpy as np
import pandas as pd
import pytest

from tabfm import TabFMClassifier, TabFMRegressor
from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.data.neighbors import design, relevance
from tabfm.estimators.local_context import MIN_CLASS_SHARE, LocalContexts, context_rows, sq_distances


def two_blobs(n_per: int = 300, seed: int = 0):
    """Two far-apart blobs along x0 (which also carries the target), plus a noise column."""
    rng = np.random.default_rng(seed)
    x0 = np.concatenate([rng.normal(0, 1, n_per), rng.normal(50, 1, n_per)])
    noise = rng.normal(0, 1, 2 * n_per)
    y = (x0 > 25).astype(int) ^ (rng.random(2 * n_per) < 0.1)
    return np.column_stack([x0, noise]), y


def test_sq_distances_by_hand():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(7, 3)), rng.normal(size=(5, 3))
    np.testing.assert_allclose(sq_distances(a, b), ((a[:, None] - b[None]) ** 2).sum(-1), atol=1e-10)


def test_groups_cover_every_row_once_with_the_nearest_context_rows():
    x, y = two_blobs()
    kind, card = np.array([NUMERIC, NUMERIC]), np.array([0, 0])
    local = LocalContexts.of(x, kind, card, y.astype(float), classes=False, size=100, seed=0)
    assert len(local.centers) == 24  # ceil(4 * 600 / 100)
    z = local.embed(x)
    for c, rows in enumerate(local.rows):  # each context: the 100 rows nearest its centre, by brute force
        d = ((z - local.centers[c]) ** 2).sum(1)
        assert len(rows) == 100 and d[rows].max() <= np.delete(d, rows).min() + 1e-12
    q = np.random.default_rng(2).normal([[0.0, 0.0]], 1, size=(40, 2)) + np.array([[50.0, 0.0]]) * (np.arange(40) % 2)[:, None]
    groups = local.groups(q)
    covered = np.sort(np.concatenate([g for g, _ in groups]))
    np.testing.assert_array_equal(covered, np.arange(40))
    zq = local.embed(q)
    nearest = np.array([((local.centers - v) ** 2).sum(1).argmin() for v in zq])  # brute force
    for g, rows in groups:  # each group: the queries nearest one centre, with that centre's context
        (c,) = np.unique(nearest[g])
        np.testing.assert_array_equal(g, np.flatnonzero(nearest == c))
        np.testing.assert_array_equal(rows, local.rows[c])


def test_context_rows_keep_every_class_by_hand():
    d = np.arange(10.0)  # row i is the i-th nearest
    assert MIN_CLASS_SHARE == 0.25
    # 8 rows of class 0, then 2 of class 1: class 1's floor is ceil(0.25 * 4 * 2 / 10) = 1 row, its nearest (8)
    np.testing.assert_array_equal(context_rows(d, 4, np.array([0] * 8 + [1] * 2)), [0, 1, 2, 8])
    np.testing.assert_array_equal(context_rows(d, 4), [0, 1, 2, 3])  # no labels: the nearest rows
    np.testing.assert_array_equal(context_rows(d, 4, np.array([0, 1] * 5)), [0, 1, 2, 3])  # floors met: the same
    # 7 rows of class 0 then 3 of class 1, 6 kept: floors ceil(0.25 * 6 * 7 / 10) = 2 and ceil(0.25 * 6 * 3 / 10) = 1;
    # the plain nearest six (0..5) hold no class 1, so its nearest row (7) goes in for the farthest of them (5)
    np.testing.assert_array_equal(context_rows(d, 6, np.array([0] * 7 + [1] * 3)), [0, 1, 2, 3, 4, 7])
    # distances in another order: the rows are chosen by distance, not by index
    np.testing.assert_array_equal(context_rows(d[::-1].copy(), 6, np.array([1] * 3 + [0] * 7)), [2, 5, 6, 7, 8, 9])


def test_class_contexts_meet_their_floors_with_the_nearest_rows():
    """On the two blobs (10 % of each blob's labels flipped, under the floors of 0.25 x 100 x the class share,
    12-13 rows): every context holds each class's nearest `floor` rows of that class, and 100 rows in all."""
    x, y = two_blobs()
    local = LocalContexts.of(x, np.array([NUMERIC, NUMERIC]), np.array([0, 0]), y, classes=True, size=100, seed=0)
    z = local.embed(x)
    floors = np.ceil(MIN_CLASS_SHARE * 100 * np.bincount(y) / len(y)).astype(int)
    np.testing.assert_array_equal(floors, [12, 13])  # 288 and 312 rows of 600
    raised = 0
    dist = sq_distances(local.centers, z)  # the library's distances: near-ties order as it orders them
    for c, rows in enumerate(local.rows):
        d = dist[c]
        np.testing.assert_allclose(d, ((z - local.centers[c]) ** 2).sum(1), atol=1e-9)
        assert len(rows) == 100
        for k in (0, 1):  # each class's nearest `floor` rows are in
            cls_rows = np.flatnonzero(y == k)
            assert set(cls_rows[np.argsort(d[cls_rows], kind="stable")[:floors[k]]]) <= set(rows)
        plain = np.argsort(d, kind="stable")[:100]
        raised += (np.bincount(y[plain], minlength=2) < floors).any()
    assert raised > 0  # the floor binds on some contexts of this table


def test_distance_is_the_neighbour_columns_distance():
    """One notion of near per table: the local contexts' embedding is tabfm.data.neighbors' design,
    standardised by the training rows and scaled by its relevance, checked by hand here."""
    x = np.array([[1.0, 0], [2.0, 1], [np.nan, 2], [4.0, np.nan], [2.0, 0], [3.0, 1]])
    kind, card = np.array([NUMERIC, CATEGORICAL]), np.array([0, 3])
    t = np.array([0.0, 1.0, 2.0, 3.0, 1.0, 2.0])
    local = LocalContexts.of(x, kind, card, t, classes=False, size=2, seed=0)
    seen = np.array([1.0, 2.0, 4.0, 2.0, 3.0])
    num = np.where(np.isnan(x[:, 0]), 0.0, (x[:, 0] - seen.mean()) / seen.std())  # missing: the mean
    hot = np.zeros((6, 3))
    hot[[0, 1, 2, 4, 5], [0, 1, 2, 0, 1]] = 1 / np.sqrt(2)  # row 3's category is missing: no column set
    points = np.column_stack([num, hot])
    weights = relevance(points, t, classes=False)
    np.testing.assert_allclose(local.weights, weights)
    np.testing.assert_allclose(local.embed(x), points * weights)
    q = np.array([[10.0, 2.0]])  # a query is standardised by the training rows, not by itself
    np.testing.assert_allclose(local.embed(q), design(x, q, kind, card)[1] * weights)
    assert local.embed(q)[0, 0] == (10.0 - seen.mean()) / seen.std() * weights[0]
    assert LocalContexts.of(x, kind, card, t, classes=False, size=6, seed=0) is None  # the whole table


def test_noise_columns_do_not_decide_who_is_near():
    x, y = two_blobs()
    local = LocalContexts.of(x, np.array([NUMERIC, NUMERIC]), np.array([0, 0]), y, classes=True, size=100, seed=0)
    assert local.weights[0] > 0.8 and local.weights[1] < 0.2  # x0 carries the class (10 % flipped), x1 is noise
    for rows in local.rows:  # so every context stays within one blob
        assert len(np.unique(x[rows, 0] > 25)) == 1


def test_local_members_read_their_groups_contexts():
    x, y = two_blobs()
    est = TabFMClassifier(local_context=200, n_estimators=4).fit(x, y)
    assert est.local_ is not None and [est._is_local(i) for i in range(4)] == [False, False, True, True]
    q = np.array([[0.0, 0.0], [50.0, 0.0], [1.0, 1.0]])
    rt = est._runtime()
    m = est._members(cover_all=False, n_classes=2)[2]
    views = est._views(m, 2, q, classes=True, rt=rt)
    groups = est.local_.groups(q)
    assert len(views) == len(groups)
    for (g, view), (g2, rows) in zip(views, groups):  # each group's rows, with its own context rows
        np.testing.assert_array_equal(g, g2)
        np.testing.assert_array_equal(view.rows, rows)
        assert len(view.rows) == 200 and len(view.query) == len(g)
    assert sorted(np.concatenate([g for g, _ in views]).tolist()) == [0, 1, 2]
    (g, view), = est._views(m, 0, q, classes=True, rt=rt)  # a global member: one view of every row
    assert len(view.rows) == len(x) and g.tolist() == [0, 1, 2]


def test_small_tables_and_local_context_zero_predict_as_before():
    x, y = two_blobs(100)
    a = TabFMClassifier(local_context=512).fit(x, y)  # 200 rows <= 512: no local members
    b = TabFMClassifier(local_context=0).fit(x, y)
    assert a.local_ is None and b.local_ is None
    np.testing.assert_array_equal(a.predict_proba(x[:20]), b.predict_proba(x[:20]))


@pytest.mark.parametrize("kind", ["classifier", "regressor"])
def test_local_members_predict_every_row(kind):
    x, y = two_blobs(150)
    frame = pd.DataFrame(x, columns=["a", "b"])
    if kind == "classifier":
        est = TabFMClassifier(local_context=100).fit(frame, y)
        p = est.predict_proba(frame.iloc[:50])
        assert p.shape == (50, 2) and np.isfinite(p).all()
        np.testing.assert_allclose(p.sum(1), 1.0)
        np.testing.assert_array_equal(p, est.predict_proba(frame.iloc[:50]))  # deterministic
        assert (est.predict(frame) == y).mean() > 0.8
    else:
        target = x[:, 0] + np.sin(x[:, 1])
        est = TabFMRegressor(local_context=100).fit(frame, target)
        pred = est.predict(frame.iloc[:50])
        assert pred.shape == (50,) and np.isfinite(pred).all()
        assert np.corrcoef(pred, target[:50])[0, 1] > 0.9


def test_bad_local_context_is_refused():
    x, y = two_blobs(50)
    with pytest.raises(ValueError, match="local_context must be an int >= 0"):
        TabFMClassifier(local_context=-1).fit(x, y)
