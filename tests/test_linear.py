"""Linear features: out-of-fold scores against sklearn fitted by hand, and what reaches the model."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression, Ridge

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.estimators import TabFMClassifier, TabFMRegressor
from tabfm.estimators.linear import FOLDS, LOGISTIC_C, RIDGE_ALPHA, LinearScores
from tabfm.data.neighbors import design

NAN = float("nan")


def small_table(n=60, m=9, seed=0):
    rng = np.random.default_rng(seed)
    x = np.column_stack([rng.normal(size=n + m) * 4 + 1, rng.integers(0, 3, n + m), rng.normal(size=n + m)])
    x[[3, 11], 0] = NAN
    x[[5, 62], 1] = NAN
    kind, card = np.array([NUMERIC, CATEGORICAL, NUMERIC]), np.array([0, 3, 0])
    return x[:n].astype(np.float32), x[n:].astype(np.float32), kind, card, rng


def test_scores_are_sklearn_fits_out_of_fold():
    ctx, query, kind, card, rng = small_table()
    lin = LinearScores.of(ctx, query, kind, card, np.random.default_rng(1))
    a, b = design(ctx, query, kind, card)  # the neighbours' design, tested in test_neighbors
    assert sorted(np.bincount(lin.folds)) == [len(ctx) // FOLDS] * FOLDS  # dealt evenly
    y = (ctx[:, 2] + rng.normal(size=len(ctx)) > 0).astype(float)
    v = np.nan_to_num(ctx[:, 0]) * 2 + rng.normal(size=len(ctx))
    fc, fq = lin.features(np.column_stack([y, v]))
    assert fc.shape == (len(ctx), 2) and fq.shape == (len(query), 2) and fc.dtype == np.float32
    # query rows: models fitted on every context row
    np.testing.assert_allclose(fq[:, 0], LogisticRegression(C=LOGISTIC_C).fit(a, y).decision_function(b), atol=1e-4)
    np.testing.assert_allclose(fq[:, 1], Ridge(alpha=RIDGE_ALPHA).fit(a, v).predict(b), rtol=1e-5, atol=1e-4)
    # context rows: each fold scored by models fitted on the other folds
    for f in range(FOLDS):
        held = lin.folds == f
        np.testing.assert_allclose(fc[held, 0], LogisticRegression(C=LOGISTIC_C).fit(a[~held], y[~held])
                                   .decision_function(a[held]), atol=1e-4)
    # a context row's own label never reaches its score; it does reach other folds' rows
    flipped = y.copy()
    flipped[0] = 1 - flipped[0]
    fc2, fq2 = lin.features(flipped)
    assert fc2[0, 0] == pytest.approx(fc[0, 0], abs=1e-6)
    assert not np.allclose(fc2[lin.folds != lin.folds[0], 0], fc[lin.folds != lin.folds[0], 0])
    # a query row's score does not depend on the other query rows
    one = LinearScores.of(ctx, query[4:5], kind, card, np.random.default_rng(1)).features(y)[1]
    assert one[0, 0] == pytest.approx(fq[4, 0], abs=1e-6)


def test_ridge_scores_of_a_zero_one_target():
    """ridge=True (the regressor's baseline): a 0/1 number gets ridge predictions on its own scale, not
    a logistic logit."""
    ctx, query, kind, card, rng = small_table()
    lin = LinearScores.of(ctx, query, kind, card, np.random.default_rng(1))
    a, b = design(ctx, query, kind, card)
    y = (ctx[:, 2] + rng.normal(size=len(ctx)) > 0).astype(float)
    fc, fq = lin.features(y, dtype=np.float64, ridge=True)
    np.testing.assert_allclose(fq[:, 0], Ridge(alpha=RIDGE_ALPHA).fit(a, y).predict(b), rtol=1e-9, atol=1e-9)
    held = lin.folds == 0
    np.testing.assert_allclose(fc[held, 0], Ridge(alpha=RIDGE_ALPHA).fit(a[~held], y[~held]).predict(a[held]), atol=1e-9)
    assert not np.allclose(lin.features(y)[1], fq)  # the default for a 0/1 target is the logit


def test_degenerate_targets_and_subsets():
    ctx, query, kind, card, _ = small_table()
    lin = LinearScores.of(ctx, query, kind, card, np.random.default_rng(0))
    fc, fq = lin.features(np.column_stack([np.zeros(len(ctx)), np.full(len(ctx), 3.5)]))
    assert (fc[:, 0] == 0).all() and (fq[:, 0] == 0).all()  # one class: even odds
    np.testing.assert_allclose(fc[:, 1], 3.5)  # a constant number predicts itself
    np.testing.assert_allclose(fq[:, 1], 3.5)
    rows = np.arange(0, len(ctx), 2)
    sub = lin.subset(rows)
    np.testing.assert_array_equal(sub.folds, lin.folds[rows])
    y = (np.arange(len(rows)) % 3 == 0).astype(float)
    a, b = design(ctx, query, kind, card)  # a subset keeps the whole context's standardisation
    want = LogisticRegression(C=LOGISTIC_C).fit(a[rows], y).decision_function(b)
    np.testing.assert_allclose(sub.features(y)[1][:, 0], want, atol=1e-4)
    assert lin.subset(np.array([1])) is None and LinearScores.of(ctx[:1], query, kind, card, np.random.default_rng(0)) is None


def table(n=70, seed=0):
    rng = np.random.default_rng(seed)
    X = pd.DataFrame({"a": rng.normal(size=n), "b": rng.choice(["u", "v", "w"], n), "c": rng.normal(size=n)})
    y = np.where(X["a"] + 0.3 * rng.normal(size=n) > 0.2, "hi", "lo")
    return X, y


def test_linear_switch_reaches_the_model(export_dir):
    X, y = table()
    runs = {}
    for lf in (False, True):
        for k in (0, 5):
            p = TabFMClassifier(model=export_dir, n_estimators=2, random_state=0, n_neighbors=k,
                                linear_features=lf).fit(X, y).predict_proba(X[:20])
            np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)
            runs[lf, k] = p
    assert not np.allclose(runs[True, 0], runs[False, 0], atol=1e-4)
    assert not np.allclose(runs[True, 5], runs[False, 5], atol=1e-4)
    v = X["a"].to_numpy() * 3 + 1
    a = TabFMRegressor(model=export_dir, n_estimators=1, random_state=0, linear_features=False).fit(X, v).predict(X[:10])
    b = TabFMRegressor(model=export_dir, n_estimators=1, random_state=0).fit(X, v).predict(X[:10])
    assert np.isfinite(b).all() and not np.allclose(a, b)
    with pytest.raises(ValueError, match="linear_features"):
        TabFMClassifier(model=export_dir, linear_features="yes").fit(X, y).predict(X)


def test_concordance_and_the_showing_rule():
    from scipy.stats import kendalltau
    from sklearn.metrics import roc_auc_score

    from tabfm.estimators.linear import LINEAR_TOLERANCE, concordance, worth_showing

    rng = np.random.default_rng(3)
    t = (rng.random(200) > 0.6).astype(float)
    s = t + rng.normal(size=200)
    assert concordance(s, t) == pytest.approx(roc_auc_score(t, s))
    v = s + rng.normal(size=200)
    assert concordance(s, v) == pytest.approx((1 + kendalltau(s, v).statistic) / 2)
    assert concordance(s, np.ones(200)) == 0.5 and concordance(np.zeros(200), t) == 0.5
    # two targets, neighbour means at two sizes (grouped by size: k1 t0, k1 t1, k2 t0, k2 t1)
    u = (rng.random(200) > 0.5).astype(float)
    good, good_u, noise = t + 0.3 * rng.normal(size=200), u + 0.3 * rng.normal(size=200), rng.normal(size=200)
    nb = np.column_stack([noise, good_u, good, noise])  # best neighbour column: t at k2, u at k1
    keep = worth_showing(np.column_stack([good, noise]), nb, np.column_stack([t, u]))
    assert keep.tolist() == [True, False]  # equal to the best neighbour size / far below it
    a_bit_worse = good + 0.2 * rng.normal(size=200)  # trails the best, within the tolerance
    gap = concordance(good, t) - concordance(a_bit_worse, t)
    assert 0 < gap < LINEAR_TOLERANCE and worth_showing(a_bit_worse[:, None], good[:, None], t).tolist() == [True]
    assert worth_showing(noise[:, None], None, t).tolist() == [True]  # no neighbour features: always shown


def test_features_read_every_column_the_model_the_members(export_dir):
    """max_columns=2 on a 3-column table: the model gets 2 feature columns, but the neighbour shares
    come from all 3 (members differ in their columns, not in their neighbours)."""
    from tabfm.data.batch import CATEGORICAL as CAT
    from tabfm.data.neighbors import Neighbors
    from tests.test_estimators import StubModel

    X, y = table(80)
    stub = StubModel()
    clf = TabFMClassifier(model=stub, n_estimators=3, random_state=0, max_columns=2, n_neighbors=5,
                          linear_features=False, numeric="raw").fit(X, y)  # raw: shares of the raw view below
    clf.predict_proba(X[:10])
    members = clf._members(cover_all=False, n_classes=2)
    assert {len(m.column_groups[0]) for m in members} == {2} and len({tuple(m.column_groups[0]) for m in members}) > 1
    every = np.arange(clf.train_x_.shape[1])
    assert (clf._kind == CAT).sum() == 1
    for m, batch in zip(members, stub.batches):
        nb = Neighbors.of(m.view(clf.train_x_, every), m.view(clf._encode(X[:10])[1], every), clf._kind, clf._card,
                          (5,), clf.y_, classes=True)
        is_one = (m.class_perm[clf.y_] == 1).astype(float)
        want_c, want_q = nb.features(is_one)
        assert batch.shape[2] == 2 + 1 + 1  # member's columns, the share, the target
        n = len(X)
        np.testing.assert_allclose(batch.x[0, :n, 2].numpy(), want_c[:, 0], atol=1e-6)
        np.testing.assert_allclose(batch.x[0, n:n + 10, 2].numpy(), want_q[:, 0], atol=1e-6)


def test_regressor_predicts_the_ridge_residual(export_dir):
    """With random weights the model's own guess is poor, so an exactly linear target shows what the
    residual does: the ridge's prediction is added back (R^2 near 1, against far lower without), the
    quantiles move with it, and a query row's prediction does not depend on the other query rows."""
    rng = np.random.default_rng(1)
    X = pd.DataFrame({"a": rng.normal(size=80) * 5 + 2, "b": rng.choice(["u", "v", "w"], 80), "c": rng.normal(size=80)})
    y = 3.0 * X["a"].to_numpy() - 2.0 * X["c"].to_numpy() + X["b"].map({"u": 0.0, "v": 4.0, "w": -4.0}).to_numpy() + 100
    tr, te = slice(0, 60), slice(60, 80)
    kw = dict(model=export_dir, n_estimators=2, random_state=0)
    res = TabFMRegressor(**kw, linear_residual=True).fit(X[tr], y[tr])
    plain = TabFMRegressor(**kw, linear_residual=False).fit(X[tr], y[tr])

    def r2(p):
        return 1 - ((y[te] - p) ** 2).sum() / ((y[te] - y[te].mean()) ** 2).sum()
    assert r2(res.predict(X[te])) > 0.98 > r2(plain.predict(X[te])) + 0.1
    q = res.predict_quantiles(X[te], [0.1, 0.5, 0.9])
    assert (np.diff(q, axis=1) >= 0).all()
    np.testing.assert_allclose(res.predict(X[te], output="median"), q[:, 1], rtol=1e-9)
    assert np.abs(q[:, 1] - y[te]).mean() < 0.1 * y[te].std()  # the quantiles are shifted too
    np.testing.assert_allclose(res.predict(X[60:70]), res.predict(X[te])[:10], rtol=1e-5, atol=1e-4)
    assert TabFMRegressor().get_params()["linear_residual"] == "mixed" and res.get_params()["numeric"] == "quantile"


def test_precision_weighted_by_hand():
    """Two predictions (mean, q16, q84) per row: each row weights them by the inverse of its spread
    squared; equal spreads give the plain mean, two zero spreads 0.5 each."""
    from tabfm.estimators.regressor import precision_weighted

    a = np.array([[10.0, 9.0, 11.0], [0.0, -3.0, 3.0], [1.0, 1.0, 1.0]])  # spreads 2, 6, 0
    b = np.array([[20.0, 16.0, 24.0], [6.0, 3.0, 9.0], [3.0, 3.0, 3.0]])  # spreads 8, 6, 0
    w = np.array([64 / (4 + 64), 0.5, 0.5])[:, None]  # var_b / (var_a + var_b)
    np.testing.assert_allclose(precision_weighted(a, b), w * a + (1 - w) * b)
    assert precision_weighted(a, b)[0, 0] == pytest.approx(10 + 10 * 4 / 68)


def test_mixed_regressor_members_and_weights(export_dir, monkeypatch):
    """linear_residual="mixed": member 0 predicts the ridge residual, member 1 the target, and the two
    are combined per row by precision_weighted of their own distributions: one member alone is
    the residual regressor; two give exactly the weighted mean of the residual half (member 0,
    as TabFMRegressor(n_estimators=1, linear_residual=True)) and the target half (member 1)."""
    import tabfm.estimators.regressor as regressor

    rng = np.random.default_rng(3)
    X = pd.DataFrame({"a": rng.normal(size=70), "c": rng.normal(size=70)})
    y = np.sin(2 * X["a"].to_numpy()) + X["c"].to_numpy() + 5
    tr, te = slice(0, 50), slice(50, 70)
    kw = dict(model=export_dir, random_state=0)
    one = TabFMRegressor(**kw, n_estimators=1, linear_residual=True).fit(X[tr], y[tr]).predict_quantiles(X[te], [0.2, 0.7])
    np.testing.assert_allclose(TabFMRegressor(**kw, n_estimators=1, linear_residual="mixed").fit(X[tr], y[tr])
                               .predict_quantiles(X[te], [0.2, 0.7]), one)
    seen = []
    real = regressor.precision_weighted
    monkeypatch.setattr(regressor, "precision_weighted", lambda a, b: seen.append((a, b)) or real(a, b))
    mixed = TabFMRegressor(**kw, n_estimators=2, linear_residual="mixed").fit(X[tr], y[tr])
    mean, q = mixed._distribution(X[te], [0.2, 0.7])
    (a, b), = seen
    resid = TabFMRegressor(**kw, n_estimators=1, linear_residual=True).fit(X[tr], y[tr])._distribution(X[te], [0.2, 0.7, 0.16, 0.84])
    np.testing.assert_allclose(a[:, 0], resid[0], rtol=1e-6)
    np.testing.assert_allclose(a[:, 1:], resid[1], rtol=1e-6)
    w = ((b[:, 4] - b[:, 3]) ** 2 / ((a[:, 4] - a[:, 3]) ** 2 + (b[:, 4] - b[:, 3]) ** 2))
    np.testing.assert_allclose(mean, w * a[:, 0] + (1 - w) * b[:, 0])
    assert not np.allclose(b[:, 0], a[:, 0])  # the target half asked another question
    with pytest.raises(ValueError, match="linear_residual must be True, False or 'mixed'"):
        TabFMRegressor(**kw, linear_residual="on").fit(X[tr], y[tr])


@pytest.fixture(scope="module")
def cf_export_dir(tmp_path_factory) -> str:
    """A random-weight tiny model pretrained (shape-wise) with context features, as tabfm-tiny-cf."""
    import torch
    from tabfm.model import ModelConfig, TabFM
    from tabfm.parallel import export_model
    from tabfm.train.pretrain import EXPORT_FORMAT

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, n_bins=16, id_dim=8, context_features="knn-linear")
    out = tmp_path_factory.mktemp("weights") / "export"
    export_model(TabFM(cfg), out, {"format": EXPORT_FORMAT, "version": 1, "model": cfg.to_dict()})
    return str(out)


def test_regressor_residual_with_a_context_feature_model(cf_export_dir):
    """A model pretrained with context features also predicts the ridge residual (its context features
    then describe the residual); a 0/1 numeric target's baseline is a ridge prediction too."""
    rng = np.random.default_rng(2)
    X = pd.DataFrame({"a": rng.normal(size=80) * 5 + 2, "c": rng.normal(size=80)})
    y = 3.0 * X["a"].to_numpy() - 2.0 * X["c"].to_numpy() + 100
    tr, te = slice(0, 60), slice(60, 80)
    kw = dict(model=cf_export_dir, n_estimators=2, random_state=0)
    res = TabFMRegressor(**kw).fit(X[tr], y[tr])
    plain = TabFMRegressor(**kw, linear_residual=False).fit(X[tr], y[tr])

    def r2(t, p):
        return 1 - ((t - p) ** 2).sum() / ((t - t.mean()) ** 2).sum()
    assert res._runtime().context_features == "knn-linear"
    assert r2(y[te], res.predict(X[te])) > 0.98 > r2(y[te], plain.predict(X[te])) + 0.1
    b = (X["a"].to_numpy() > 2).astype(float)  # a 0/1 number: ridge baseline, predictions near [0, 1]
    p = TabFMRegressor(**kw).fit(X[tr], b[tr]).predict(X[te])
    assert p.min() > -1.0 and p.max() < 2.0
