"""Neighbour features and the one-vs-rest classifier, against hand computations and direct model calls."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.estimators import TabFMClassifier, TabFMRegressor
from tabfm.estimators.linear import LinearScores
from tabfm.data.neighbors import RELEVANCE_FLOOR, Neighbors, neighbor_sizes, relevance
from tabfm.inference import forward_eval, target_batch
from tabfm.model import ModelConfig, TabFM
from tabfm.model.predict import class_probabilities
from tabfm.weights import load_model

NAN = float("nan")


def brute_force(ctx, query, kind, card, k):
    """Neighbour indices by explicit pairwise distances (numeric standardised, categorical mismatch = 1)."""
    def dist(u, v):
        d = 0.0
        for j in range(ctx.shape[1]):
            if kind[j] == CATEGORICAL:
                a, b = u[j], v[j]
                d += 0.5 if (np.isnan(a) != np.isnan(b)) else (0.0 if np.isnan(a) or a == b else 1.0)
            else:
                col = ctx[:, j]
                mu, sd = np.nanmean(col), np.nanstd(col)
                za = 0.0 if np.isnan(u[j]) else (u[j] - mu) / sd
                zb = 0.0 if np.isnan(v[j]) else (v[j] - mu) / sd
                d += (za - zb) ** 2
        return d

    def nearest(point, skip):
        ds = [(np.inf if i == skip else dist(point, ctx[i]), i) for i in range(len(ctx))]
        return [i for _, i in sorted(ds)[:k]]

    return (np.array([nearest(ctx[i], i) for i in range(len(ctx))]),
            np.array([nearest(q, -1) for q in query]))


def test_neighbours_by_hand():
    rng = np.random.default_rng(0)
    n, m = 25, 7
    ctx = np.column_stack([rng.normal(size=n + m) * 5, rng.integers(0, 3, n + m), rng.normal(size=n + m)])
    ctx[[2, 9], 0] = NAN
    ctx[[4, 26], 1] = NAN
    ctx, query = ctx[:n].astype(np.float32), ctx[n:].astype(np.float32)
    kind, card = np.array([NUMERIC, CATEGORICAL, NUMERIC]), np.array([0, 3, 0])
    nb = Neighbors.of(ctx, query, kind, card, (2, 4))
    want_c, want_q = brute_force(ctx.astype(np.float64), query.astype(np.float64), kind, card, 4)
    np.testing.assert_array_equal(np.sort(nb.context_index, 1), np.sort(want_c, 1))
    np.testing.assert_array_equal(np.sort(nb.query_index, 1), np.sort(want_q, 1))
    assert not (nb.context_index == np.arange(n)[:, None]).any()  # a context row is never its own neighbour
    y = rng.integers(0, 2, n).astype(float)
    fc, fq = nb.features(np.column_stack([y, 1 - y]))  # two targets x two sizes, grouped by size
    want2_c, want2_q = brute_force(ctx.astype(np.float64), query.astype(np.float64), kind, card, 2)
    for got, near2, near4 in ((fc, want2_c, want_c), (fq, want2_q, want_q)):
        assert got.shape[1] == 4
        np.testing.assert_allclose(got[:, 0], y[near2].mean(1), rtol=1e-6)
        np.testing.assert_allclose(got[:, 1], 1 - y[near2].mean(1), rtol=1e-6)
        np.testing.assert_allclose(got[:, 2], y[near4].mean(1), rtol=1e-6)
        np.testing.assert_allclose(got[:, 3], 1 - y[near4].mean(1), rtol=1e-6)


def test_relevance_by_hand_and_what_it_changes():
    """Column 0 separates the classes (correlation ratio 1), column 1 does not (0); with a numeric
    target equal to column 0, |r| = 1 and 0. Weighted, the informative column decides who is near."""
    points = np.array([[0.0, 5.0], [0.0, 3.0], [2.0, 5.0], [2.0, 3.0]])
    np.testing.assert_allclose(relevance(points, np.array([0, 0, 1, 1]), classes=True), [1 + RELEVANCE_FLOOR, RELEVANCE_FLOOR])
    np.testing.assert_allclose(relevance(points, points[:, 0], classes=False), [1 + RELEVANCE_FLOOR, RELEVANCE_FLOOR])
    np.testing.assert_allclose(relevance(np.ones((4, 1)), np.array([0, 1, 0, 1]), classes=True), [RELEVANCE_FLOOR])
    # one informative column among six: weighted, the neighbours share the query's class far more often
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(int)
    kind, card = np.full(6, NUMERIC), np.zeros(6, dtype=int)
    plain = Neighbors.of(x[:300], x[300:], kind, card, (5,))
    weighted = Neighbors.of(x[:300], x[300:], kind, card, (5,), y[:300], classes=True)
    agree = [float((y[:300][nb.query_index] == y[300:, None]).mean()) for nb in (plain, weighted)]
    assert agree[1] > agree[0] + 0.1, agree  # measured 0.84 -> 0.97


def test_neighbours_edge_cases():
    ctx = np.array([[0.0], [0.0], [10.0]], dtype=np.float32)
    nb = Neighbors.of(ctx, np.array([[9.0]], dtype=np.float32), np.array([NUMERIC]), np.array([0]), (1, 50))
    assert nb.ks == (1, 2)  # at most the other context rows
    np.testing.assert_array_equal(nb.context_index[0], [1, 2])  # the duplicate first, never itself
    assert nb.query_index[0, 0] == 2
    assert Neighbors.of(ctx[:1], ctx[:1], np.array([NUMERIC]), np.array([0]), (3,)) is None
    assert neighbor_sizes(10) == (10,) and neighbor_sizes((5, 20)) == (5, 20) and neighbor_sizes(0) == ()
    for bad in (-1, 2.5, True, (5, 5), (5, -1), "5"):
        with pytest.raises(ValueError, match="n_neighbors"):
            neighbor_sizes(bad)
    # query features depend on that row only, not on the other query rows
    rng = np.random.default_rng(1)
    big, q = rng.normal(size=(40, 3)).astype(np.float32), rng.normal(size=(9, 3)).astype(np.float32)
    kind, card = np.full(3, NUMERIC), np.zeros(3, dtype=int)
    full = Neighbors.of(big, q, kind, card, (5,)).query_index
    np.testing.assert_array_equal(Neighbors.of(big, q[3:5], kind, card, (5,)).query_index, full[3:5])
    # a subset keeps the whole context's scaling and searches only its rows
    sub = Neighbors.of(big, q, kind, card, (5,)).subset(np.arange(0, 40, 2))
    z, zq = (big - big.mean(0)) / big.std(0), (q - big.mean(0)) / big.std(0)
    d = ((zq[:, None, :] - z[None, ::2, :]) ** 2).sum(-1)
    np.testing.assert_array_equal(np.sort(sub.query_index, 1), np.sort(np.argsort(d, 1)[:, :5], 1))


def table(n=70, seed=0):
    rng = np.random.default_rng(seed)
    X = pd.DataFrame({"a": rng.normal(size=n), "b": rng.choice(["u", "v", "w"], n), "c": rng.normal(size=n)})
    y = np.where(X["a"] > 0.5, "hi", np.where(X["c"] > 0, "mid", "lo"))
    return X, y


def test_one_vs_rest_equals_direct_binary_passes(export_dir):
    """One member: P(class) proportional to the odds of each class-vs-rest pass's P(code 1), that
    class's neighbour share and linear score the last two features, un-permuted."""
    torch.set_num_threads(1)
    X, y = table()
    clf = TabFMClassifier(model=export_dir, n_estimators=1, random_state=5, n_neighbors=6).fit(X, y)
    (m,) = clf._members(cover_all=False, n_classes=3)
    cols = m.column_groups[0]
    ctx = m.view(clf.train_x_, cols)
    kind = np.where(clf._kind[cols] == CATEGORICAL, NUMERIC, clf._kind[cols])
    card = np.where(clf._kind[cols] == CATEGORICAL, 0, clf._card[cols])
    codes = m.class_perm[clf.y_]
    nb = Neighbors.of(ctx, ctx, clf._kind[cols], clf._card[cols], (6,), clf.y_, classes=True)  # tested above
    want_c, want_q = nb.context_index, nb.query_index
    lin = LinearScores.of(ctx, ctx, clf._kind[cols], clf._card[cols], m.rng(0, 1))  # tested in test_linear
    model = load_model(export_dir)
    direct = np.zeros((len(X), 3))
    for c in range(3):
        is_c = (codes == c).astype(np.float32)
        share_c, share_q = is_c[want_c].mean(1), is_c[want_q].mean(1)
        lin_c, lin_q = lin.features(is_c)
        batch = target_batch(np.column_stack([ctx, share_c, lin_c]), is_c, np.column_stack([ctx, share_q, lin_q]),
                             np.append(kind, [NUMERIC, NUMERIC]), np.append(card, [0, 0]), 2)
        p = class_probabilities(forward_eval(model, batch, id_seed=m.seed & 0xFFFFFFFF))[:, :2].numpy()
        p_c = p[:, 1] / p.sum(1)
        direct[:, c] = p_c / (1 - p_c)  # combined by odds
    direct /= direct.sum(1, keepdims=True)
    np.testing.assert_allclose(clf.predict_proba(X), direct[:, m.class_perm], atol=1e-5)


def test_multiclass_modes_and_neighbour_switch(export_dir):
    X, y = table()
    runs = {}
    for mode in ("ovr", "native"):
        for k in (0, 5):
            p = TabFMClassifier(model=export_dir, n_estimators=2, random_state=0, multiclass=mode,
                                n_neighbors=k).fit(X, y).predict_proba(X[:20])
            assert p.shape == (20, 3)
            np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)
            runs[mode, k] = p
    assert not np.allclose(runs["ovr", 5], runs["native", 5], atol=1e-4)  # two strategies
    assert not np.allclose(runs["ovr", 5], runs["ovr", 0], atol=1e-4)  # the feature reaches the model
    # a model with a 3-code head: native groups 5 classes, neighbour shares recomputed within each group
    y5 = np.arange(len(X)) % 5
    p = TabFMClassifier(model=TabFM(ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, n_bins=16,
                                                       id_dim=8, max_categories=3)),
                        n_estimators=2, random_state=0, multiclass="native").fit(X, y5).predict_proba(X[:10])
    assert p.shape == (10, 5)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)
    for bad, match in ((dict(n_neighbors=-1), "n_neighbors"), (dict(n_neighbors=2.5), "n_neighbors"),
                       (dict(multiclass="ovo"), "multiclass")):
        with pytest.raises(ValueError, match=match):
            TabFMClassifier(model=export_dir, **bad).fit(X, y).predict(X)


def test_regressor_neighbour_feature(export_dir):
    X, _ = table()
    y = X["a"].to_numpy() * 3 + 1
    a = TabFMRegressor(model=export_dir, n_estimators=1, random_state=0, n_neighbors=0).fit(X, y).predict(X[:10])
    b = TabFMRegressor(model=export_dir, n_estimators=1, random_state=0, n_neighbors=5).fit(X, y).predict(X[:10])
    assert np.isfinite(b).all() and not np.allclose(a, b)
