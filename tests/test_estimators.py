"""sklearn-style estimators: API contract, ensembling and its un-permuting, limits, bad input, `tabfm predict`.

Uses a tiny random-weight export (quality with trained weights is tested elsewhere) and a stub
model whose answers are known, to check that permutations are undone in the right direction.
"""
from __future__ import annotations

import pickle
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from torch import nn

from tabfm.data.batch import TableBatch
from tabfm import cli
from tabfm.estimators import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
from tabfm.estimators.ensemble import subsample
from tabfm.inference import forward_eval, query_batch, target_batch
from tabfm.model import BarDistribution, ModelConfig, ModelOutput
from tabfm.model.predict import class_probabilities, numeric_mean
from tabfm.weights import ModelNotFoundError, load_model, resolve_model_path

ESTIMATORS = (TabFMClassifier, TabFMRegressor, TabFMImputer, TabFMAnomalyDetector)
NAN = float("nan")


# ------------------------------------------------------------------ fixtures
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class StubModel(nn.Module):
    """Puts logit 5 on code 0 of every categorical query cell (0 elsewhere); flat numeric bins.

    Records every batch it sees, so tests can check what reached the model.
    """

    def __init__(self, max_categories: int = 10, n_bins: int = 16) -> None:
        super().__init__()
        self.config = ModelConfig.preset("tiny", max_categories=max_categories, n_bins=n_bins)
        self.weight = nn.Parameter(torch.zeros(1))
        self.bar = BarDistribution.from_range(n_bins, 10.0)
        self.batches = []

    def forward(self, batch, id_seed: int = 0) -> ModelOutput:
        self.batches.append(batch)
        index = batch.query.nonzero()
        b, _, c = index.unbind(1)
        card = batch.cardinality[b, c]
        k, n = self.config.max_categories, len(index)
        logits = torch.zeros(n, k)
        logits[:, 0] = 5.0
        logits = logits.masked_fill(torch.arange(k)[None, :] >= card[:, None], float("-inf"))
        logits = logits.masked_fill(card[:, None] == 0, 0.0)
        return ModelOutput(index=index, cat_logits=logits, num_logits=torch.zeros(n, self.config.n_bins),
                           mean=torch.zeros(n, dtype=torch.float64), std=torch.ones(n, dtype=torch.float64),
                           kind=batch.kind[b, c], cardinality=card, bar=self.bar)

    def encode_context(self, batch, id_seed: int = 0):
        """The cache is the context batch itself, so `forward_queries` records whole tables."""
        return batch, id_seed

    def forward_queries(self, batch, cache) -> ModelOutput:
        ctx, id_seed = cache
        n = ctx.x.shape[1]
        whole = TableBatch(**{k: torch.cat([getattr(ctx, k), v], 1) if k in ("x", "row_valid", "context", "query")
                              else v for k, v in vars(batch).items()})
        out = self.forward(whole, id_seed)
        out.index[:, 1] -= n  # row numbers of the query batch
        return out


def frame(n: int = 60, seed: int = 0) -> pd.DataFrame:
    """Mixed-type features: floats, strings, an integer, a boolean."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "a": rng.normal(size=n),
        "b": rng.choice(["u", "v", "w"], n),
        "c": rng.normal(size=n) * 100,
        "k": rng.integers(0, 5, n),
        "f": rng.random(n) > 0.5,
    })


def labels(n: int = 60, seed: int = 0) -> np.ndarray:
    """Unsorted string labels."""
    return np.random.default_rng(seed + 1).choice(["zebra", "apple", "mango"], n)


NATIVE = dict(multiclass="native", n_neighbors=0, linear_features=False)  # one n-way pass, the table's own columns


def make(cls, model, **kw):
    return cls(model=model, n_estimators=kw.pop("n_estimators", 2), random_state=kw.pop("random_state", 0), **kw)


# ------------------------------------------------------------------ sklearn API
@pytest.mark.parametrize("cls", ESTIMATORS)
def test_clone_get_params_set_params(cls, export_dir):
    est = cls(model=export_dir, n_estimators=3, random_state=7, max_context_rows=100)
    params = est.get_params()
    assert params["model"] == export_dir and params["n_estimators"] == 3 and params["random_state"] == 7
    copy = clone(est)
    assert copy.get_params() == params and copy is not est
    assert est.set_params(n_estimators=5) is est and est.n_estimators == 5
    # no logic in __init__: bad values are stored as given and rejected at fit
    bad = cls(model=export_dir, n_estimators=0)
    assert bad.n_estimators == 0
    with pytest.raises(ValueError, match="n_estimators"):
        bad.fit(frame(), labels()) if cls is TabFMClassifier else bad.fit(frame(), np.arange(60.0))


def test_anomaly_params_round_trip(export_dir):
    est = TabFMAnomalyDetector(model=export_dir, contamination=0.2, n_folds=3)
    assert clone(est).get_params()["contamination"] == 0.2 and clone(est).get_params()["n_folds"] == 3


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_predict_before_fit_raises_not_fitted(cls, export_dir):
    method = {"TabFMClassifier": "predict", "TabFMRegressor": "predict", "TabFMImputer": "transform",
              "TabFMAnomalyDetector": "score_samples"}[cls.__name__]
    with pytest.raises(NotFittedError):
        getattr(cls(model=export_dir), method)(frame())


def test_fitted_attributes(export_dir):
    X = frame()
    clf = make(TabFMClassifier, export_dir).fit(X, labels())
    assert clf.n_features_in_ == 5 and list(clf.feature_names_in_) == list(X.columns)
    arr = make(TabFMRegressor, export_dir).fit(X[["a", "c"]].to_numpy(), np.arange(60.0))
    assert arr.n_features_in_ == 2 and not hasattr(arr, "feature_names_in_")


# random weights cannot pass sklearn's accuracy/R^2 floors (the shipped weights' quality is tested elsewhere)
EXPECTED_SKLEARN_FAILURES = {
    "check_classifiers_train": "random weights: accuracy floor",
    "check_regressors_train": "random weights: R^2 floor",
}


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_sklearn_estimator_checks(cls, export_dir):
    from sklearn.utils.estimator_checks import check_estimator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_estimator(cls(model=export_dir, n_estimators=1, random_state=0),
                        expected_failed_checks=EXPECTED_SKLEARN_FAILURES)


# ------------------------------------------------------------------ classifier
def test_predict_proba_rows_sum_to_one_in_sorted_class_order(export_dir):
    X, y = frame(), labels()
    clf = make(TabFMClassifier, export_dir).fit(X, y)
    assert list(clf.classes_) == ["apple", "mango", "zebra"]
    p = clf.predict_proba(X)
    assert p.shape == (60, 3) and (p >= 0).all()
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)
    assert (clf.predict(X) == clf.classes_[p.argmax(1)]).all()
    assert 0.0 <= clf.score(X, y) <= 1.0
    # string labels and their sorted integer codes give the same columns
    codes = np.searchsorted(clf.classes_, y)
    np.testing.assert_allclose(make(TabFMClassifier, export_dir).fit(X, codes).predict_proba(X), p, atol=1e-6)


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_default_random_state_is_fixed(cls, export_dir):
    """Two identical calls give identical answers without a seed (random_state defaults to 0)."""
    assert cls().random_state == 0
    X = frame().drop(columns="f")
    X.iloc[3, 0] = NAN
    y = labels() if cls is TabFMClassifier else np.arange(60.0)
    answers = []
    for _ in range(2):
        est = cls(model=export_dir, n_estimators=2)
        if cls is TabFMImputer:
            answers.append(est.fit(X).transform(X).drop(columns="b").to_numpy(dtype=float))
        elif cls is TabFMAnomalyDetector:
            answers.append(est.fit(X).score_samples(X))
        else:
            est.fit(X, y)
            answers.append(est.predict_proba(X) if cls is TabFMClassifier else est.predict(X))
    np.testing.assert_array_equal(answers[0], answers[1])


@pytest.mark.parametrize("cls", [TabFMClassifier, TabFMRegressor, TabFMAnomalyDetector])
def test_a_rows_answer_does_not_depend_on_the_rows_beside_it(cls, export_dir):
    """Bitwise: predicting rows one at a time, in another order, or 300 at once (more than one pass
    of chunk_size) gives the same answer per row."""
    X = pd.concat([frame(n=150, seed=s) for s in range(2)], ignore_index=True).drop(columns="f")
    y = np.tile(labels(), 5)[:300] if cls is TabFMClassifier else np.arange(300.0)
    est = cls(model=export_dir, n_estimators=1, chunk_size=128)
    est.fit(X.iloc[:200], y[:200]) if cls is not TabFMAnomalyDetector else est.fit(X.iloc[:200])
    method = {"TabFMClassifier": "predict_proba", "TabFMRegressor": "predict",
              "TabFMAnomalyDetector": "score_samples"}[cls.__name__]
    predict = getattr(est, method)
    full = predict(X)
    order = np.random.default_rng(0).permutation(300)[:140]
    np.testing.assert_array_equal(predict(X.iloc[order]), full[order])
    for i in (0, 7, 299):
        np.testing.assert_array_equal(predict(X.iloc[[i]]), full[[i]])


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_pickled_fitted_estimator_holds_no_weights(cls, export_dir, tmp_path):
    """A fitted estimator pickles without the model (reloaded by name or path) and predicts the same."""
    import os
    import pickle

    X = frame().drop(columns="f")
    X.iloc[5, 1] = NAN
    est = cls(model=export_dir, n_estimators=2)
    est.fit(X, labels() if cls is TabFMClassifier else np.arange(60.0)) if cls in (TabFMClassifier, TabFMRegressor) \
        else est.fit(X)
    blob = pickle.dumps(est)
    weights = os.path.getsize(os.path.join(export_dir, "model.safetensors"))
    assert len(blob) < weights / 2, (len(blob), weights)
    again = pickle.loads(blob)
    answer = {"TabFMClassifier": "predict_proba", "TabFMRegressor": "predict", "TabFMImputer": "transform",
              "TabFMAnomalyDetector": "score_samples"}[cls.__name__]
    a, b = getattr(est, answer)(X), getattr(again, answer)(X)
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b)
    else:
        np.testing.assert_array_equal(a, b)


def test_imputer_set_output_and_feature_names(export_dir):
    X = frame()[["a", "c", "k"]].astype(float)
    X.iloc[[2, 9], 0] = NAN
    arr = X.to_numpy()
    imp = TabFMImputer(model=export_dir, n_estimators=1).fit(arr)
    assert list(imp.get_feature_names_out()) == ["x0", "x1", "x2"]
    out = imp.set_output(transform="pandas").transform(arr)
    assert isinstance(out, pd.DataFrame) and list(out.columns) == ["x0", "x1", "x2"]
    np.testing.assert_array_equal(out.to_numpy(), TabFMImputer(model=export_dir, n_estimators=1).fit(arr).transform(arr))
    named = TabFMImputer(model=export_dir, n_estimators=1).fit(X)
    assert list(named.get_feature_names_out()) == list(X.columns)
    with pytest.raises(ValueError, match="differ from the fitted columns"):
        named.get_feature_names_out(["p", "q", "r"])
    default = TabFMImputer(model=export_dir, n_estimators=1).set_output(transform="default").fit(X).transform(X)
    assert isinstance(default, pd.DataFrame) and default.notna().all().all()


def test_determinism_and_random_state(export_dir):
    X, y = frame(), labels()
    p1 = make(TabFMClassifier, export_dir, random_state=3).fit(X, y).predict_proba(X)
    p2 = make(TabFMClassifier, export_dir, random_state=3).fit(X, y).predict_proba(X)
    p3 = make(TabFMClassifier, export_dir, random_state=4).fit(X, y).predict_proba(X)
    np.testing.assert_array_equal(p1, p2)
    assert not np.allclose(p1, p3, atol=1e-6)
    fitted = make(TabFMClassifier, export_dir, random_state=None).fit(X, y)
    np.testing.assert_array_equal(fitted.predict_proba(X), fitted.predict_proba(X))  # fixed at fit


def test_ensemble_is_the_average_of_its_members(export_dir):
    X, y = frame(), labels()
    clf = make(TabFMClassifier, export_dir, n_estimators=3).fit(X, y)
    members = clf._members(cover_all=False, n_classes=3)
    singles = []
    for m in members:
        one = clone(clf).fit(X, y)
        one._members = lambda m=m, **kw: [m]
        singles.append(one.predict_proba(X))
    assert not np.allclose(singles[0], singles[1], atol=1e-6)  # members differ
    np.testing.assert_allclose(clf.predict_proba(X), np.mean(singles, axis=0), atol=1e-9)


def test_class_permutation_is_undone(export_dir):
    """One member, a non-identity class permutation: P(class c) = the model's P(code perm[c])."""
    X, y = frame(), labels()
    for seed in range(20):
        clf = make(TabFMClassifier, export_dir, n_estimators=1, random_state=seed, categorical="identity",
                   **NATIVE).fit(X, y)
        (m,) = clf._members(cover_all=False, n_classes=3)
        if (m.class_perm != np.arange(3)).any():
            break
    cols = m.column_groups[0]
    batch = target_batch(m.view(clf.train_x_, cols), m.class_perm[clf.y_], m.view(clf.train_x_, cols),
                         clf._kind[cols], clf._card[cols], 3)
    # the member runs with its own column-identity salt
    direct = class_probabilities(forward_eval(load_model(export_dir), batch, id_seed=m.seed & 0xFFFFFFFF))[:, :3].numpy()
    np.testing.assert_allclose(clf.predict_proba(X), direct[:, m.class_perm], atol=1e-5)


def _not_self_inverse(perm: np.ndarray) -> bool:
    """Undoing perm the wrong way round (argsort) would give another answer."""
    return (np.argsort(perm) != perm).any()


def test_permutations_undone_with_stub_model():
    """The stub favours code 0: the predicted class/category is the one each member shows as code 0."""
    X, y = frame(), labels()
    stub = StubModel()
    for seed in range(50):
        clf = TabFMClassifier(model=stub, n_estimators=1, random_state=seed, **NATIVE).fit(X, y)
        (m,) = clf._members(cover_all=False, n_classes=3)
        if _not_self_inverse(m.class_perm):
            break
    expected = clf.classes_[np.flatnonzero(m.class_perm == 0)[0]]
    assert (clf.predict(X) == expected).all()
    np.testing.assert_allclose(clf.predict_proba(X).max(1), np.exp(5) / (np.exp(5) + 2))

    Xm = X.copy()
    Xm.loc[[1, 4], "b"] = None
    for seed in range(50):
        imp = TabFMImputer(model=stub, strategy="joint", n_estimators=1, random_state=seed).fit(Xm)
        (m,) = imp._members(cover_all=True)
        j = imp.schema_.encoded_indices("b")[0]
        if _not_self_inverse(m.code_perms[j]):
            break
    expected = imp.schema_["b"].categories[int(np.flatnonzero(m.code_perms[j] == 0)[0])]
    out = imp.transform(Xm)
    assert (out.loc[[1, 4], "b"] == expected).all()


@pytest.mark.parametrize("mode", ["ordinal", "identity"])
def test_categorical_features_reach_the_model_as_the_mode_says(mode):
    """ordinal: a categorical feature arrives as a numeric column holding the member's relabelled
    codes; identity: as a categorical column. The target stays categorical either way."""
    from tabfm.data.batch import CATEGORICAL, NUMERIC

    X, y = frame(), labels()
    stub = StubModel()
    clf = TabFMClassifier(model=stub, n_estimators=1, random_state=3, categorical=mode, **NATIVE).fit(X, y)
    (m,) = clf._members(cover_all=False, n_classes=3)
    clf.predict_proba(X)
    batch = stub.batches[-1]
    j = clf.schema_.encoded_indices("b")[0]
    pos = int(np.flatnonzero(m.column_groups[0] == j)[0])  # where column b sits in the member's view
    codes = clf.train_x_[:, j].astype(int)
    shown = batch.x[0, : len(codes), pos].numpy()
    np.testing.assert_array_equal(shown, m.code_perms[j][codes])  # relabelled codes in both modes
    assert int(batch.kind[0, pos]) == (NUMERIC if mode == "ordinal" else CATEGORICAL)
    assert int(batch.cardinality[0, pos]) == (0 if mode == "ordinal" else 3)
    assert int(batch.kind[0, -1]) == CATEGORICAL and int(batch.cardinality[0, -1]) == 3  # the target
    with pytest.raises(ValueError, match="categorical must be one of"):
        TabFMClassifier(model=stub, categorical="onehot").fit(X, y).predict(X)


def test_quantile_normal_by_hand():
    """Mid-ranks of the context values -> standard-normal quantiles; linear in between, clamped outside."""
    from scipy.stats import norm

    from tabfm.estimators.ensemble import quantile_normal

    ctx = np.array([1.0, 2.0, 2.0, 3.0, 100.0, NAN], dtype=np.float32)  # n = 5 observed
    # mid-ranks: 1 -> 0.5/5, 2 -> 2/5, 3 -> 3.5/5, 100 -> 4.5/5
    at = norm.ppf([0.1, 0.4, 0.7, 0.9])
    got = quantile_normal(ctx, np.array([0.0, 1.0, 2.0, 2.5, 3.0, 51.5, 100.0, 1e6, NAN], dtype=np.float32))
    want = [at[0], at[0], at[1], (at[1] + at[2]) / 2, at[2], (at[2] + at[3]) / 2, at[3], at[3], NAN]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    same = np.array([4.0, 4.0, NAN], dtype=np.float32)
    np.testing.assert_array_equal(quantile_normal(same, same), same)  # < 2 distinct values: unchanged


@pytest.mark.parametrize("numeric", ["raw", "quantile", "mixed"])
def test_numeric_features_reach_the_model_as_the_mode_says(numeric):
    """quantile: numeric features arrive as the normal scores of their ranks among the member's
    context rows (query rows scored against the context); raw: unchanged; mixed: members alternate.
    Categorical codes and the target are never transformed."""
    from scipy.stats import rankdata
    from scipy.special import ndtri

    X, y = frame(), labels()
    stub = StubModel()
    clf = TabFMClassifier(model=stub, n_estimators=2, random_state=3, numeric=numeric, **NATIVE).fit(X, y)
    members = clf._members(cover_all=False, n_classes=3)
    assert [m.numeric for m in members] == {"raw": ["raw"] * 2, "quantile": ["quantile"] * 2,
                                            "mixed": ["raw", "quantile"]}[numeric]
    Xq = X.iloc[:7].copy()
    Xq.loc[0, "c"] = 1e9  # beyond every context value: the largest score
    clf.predict_proba(Xq)
    for m, batch in zip(members, stub.batches[-2:]):
        a, b, c = (clf.schema_.encoded_indices(name)[0] for name in "abc")
        pos = {j: int(np.flatnonzero(m.column_groups[0] == j)[0]) for j in (a, b, c)}
        ctx = batch.x[0, : len(X), pos[a]].numpy()
        query = batch.x[0, len(X):len(X) + 7, pos[c]].numpy()
        if m.numeric == "quantile":
            expected = ndtri(rankdata(X["a"]) / len(X) - 0.5 / len(X))  # distinct values: mid-rank = rank - 1/2
            np.testing.assert_allclose(ctx, expected, rtol=1e-5)
            assert query[0] == pytest.approx(ndtri(1 - 0.5 / len(X)), rel=1e-5)
            np.testing.assert_allclose(query[1:], ndtri(rankdata(X["c"]) / len(X) - 0.5 / len(X))[1:7], rtol=1e-5)
        else:
            np.testing.assert_allclose(ctx, X["a"].to_numpy(), rtol=1e-6)
            assert query[0] == pytest.approx(1e9)
        codes = clf.train_x_[:, b].astype(int)
        np.testing.assert_array_equal(batch.x[0, : len(X), pos[b]].numpy(), m.code_perms[b][codes])
    with pytest.raises(ValueError, match="numeric must be one of"):
        TabFMClassifier(model=stub, numeric="log").fit(X, y).predict(X)


def test_chunked_prediction_equals_one_shot(export_dir):
    X, y = frame(), labels()
    big = make(TabFMClassifier, export_dir, chunk_size=1000).fit(X, y).predict_proba(X)
    small = make(TabFMClassifier, export_dir, chunk_size=7).fit(X, y).predict_proba(X)
    np.testing.assert_allclose(small, big, atol=1e-5)
    yr = X["a"].to_numpy() * 2
    big = make(TabFMRegressor, export_dir, chunk_size=1000).fit(X, yr).predict_quantiles(X, [0.2, 0.8])
    small = make(TabFMRegressor, export_dir, chunk_size=5).fit(X, yr).predict_quantiles(X, [0.2, 0.8])
    np.testing.assert_allclose(small, big, atol=1e-4)
    big = make(TabFMAnomalyDetector, export_dir, chunk_size=1000).fit(X).score_samples(X)
    small = make(TabFMAnomalyDetector, export_dir, chunk_size=9).fit(X).score_samples(X)
    np.testing.assert_allclose(small, big, atol=1e-4)


def test_context_rows_and_columns_above_the_limits(export_dir):
    X = frame(120)
    y = np.where(np.arange(120) < 6, "rare", "common")
    stub = StubModel()
    # the members' random context rows (local members, which read the rows nearest their queries, off)
    TabFMClassifier(model=stub, n_estimators=3, random_state=0, max_context_rows=30, local_context=0).fit(
        X, y).predict_proba(X[:10])
    assert len(stub.batches) == 3
    for batch in stub.batches:
        ctx = batch.context[0]
        assert int(ctx.sum()) == 30
        codes = batch.x[0, ctx, -1]
        assert len(torch.unique(codes)) == 2  # stratified: the rare class stays
    contexts = [tuple(b.x[0, b.context[0], 0].tolist()) for b in stub.batches]
    assert len(set(contexts)) == 3  # each member draws its own rows
    stub.batches.clear()  # more feature columns than max_columns: a random subset per member
    TabFMClassifier(model=stub, n_estimators=4, random_state=0, max_columns=2, linear_features=False).fit(
        X, y).predict(X[:10])
    subsets = [tuple(b.x[0, 0, :-3].tolist()) for b in stub.batches]
    # 2 feature columns + the neighbour shares at k = 5 and 20 (on top of max_columns) + the target
    assert all(b.shape[2] == 5 for b in stub.batches) and len(set(subsets)) > 1
    full = make(TabFMRegressor, export_dir).fit(X, X["a"]).predict(X[:10])
    sub = make(TabFMRegressor, export_dir, max_context_rows=30).fit(X, X["a"]).predict(X[:10])
    assert not np.allclose(full, sub)


def test_stratified_subsample_keeps_shares():
    rng = np.random.default_rng(0)
    strata = np.array([0] * 90 + [1] * 9 + [2])
    rows = subsample(rng, np.arange(100), 20, strata)
    assert len(rows) == 20 and len(set(rows)) == 20
    assert sorted(np.bincount(strata[rows]).tolist()) == [1, 2, 17]


def test_more_classes_than_the_head(export_dir):
    rng = np.random.default_rng(0)
    X = frame(90)
    y = np.array([f"c{k:02d}" for k in rng.permutation(np.arange(90) % 15)])
    clf = make(TabFMClassifier, export_dir).fit(X, y)
    p = clf.predict_proba(X[:20])
    assert p.shape == (20, 15) and (p >= 0).all() and (p > 0).any(0).all()
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)
    # recursive grouping: 20 classes with a head of 3 (7 groups > 3 -> grouped again)
    y20 = np.arange(90) % 20
    p = TabFMClassifier(model=StubModel(max_categories=3), n_estimators=2, random_state=0).fit(X, y20).predict_proba(X)
    assert p.shape == (90, 20)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)


def test_single_class_predicts_it_with_warning(export_dir):
    with pytest.warns(UserWarning, match="single class"):
        clf = make(TabFMClassifier, export_dir).fit(frame(), ["only"] * 60)
    np.testing.assert_array_equal(clf.predict_proba(frame(5)), np.ones((5, 1)))
    assert (clf.predict(frame(5)) == "only").all()


# ------------------------------------------------------------------ regressor
def test_regressor_mean_median_quantiles(export_dir):
    X = frame()
    y = X["a"].to_numpy() * 1000 + 50
    reg = make(TabFMRegressor, export_dir).fit(X, y)
    q = reg.predict_quantiles(X, [0.1, 0.25, 0.5, 0.75, 0.9])
    assert q.shape == (60, 5) and (np.diff(q, axis=1) >= 0).all()
    med = reg.predict(X, output="median")
    np.testing.assert_allclose(med, q[:, 2], rtol=1e-9)
    assert ((q[:, 0] <= med) & (med <= q[:, 4])).all()
    mean = reg.predict(X)
    assert mean.shape == (60,) and np.isfinite(mean).all()
    assert -2000 < mean.mean() < 2000  # back on the target's original scale
    assert np.isfinite(reg.score(X, y))
    with pytest.raises(ValueError, match="output"):
        reg.predict(X, output="mode")
    with pytest.raises(ValueError, match="quantile"):
        reg.predict_quantiles(X, [0.0, 0.5])


def test_column_permutations_and_groups_are_undone_in_imputation(export_dir):
    """Numeric-only table: the model is column-order invariant, so one member with all columns in one
    group must equal a direct call on the original column order (checks the cell bookkeeping)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 5))
    X[rng.random(X.shape) < 0.2] = NAN
    imp = TabFMImputer(model=export_dir, strategy="joint", n_estimators=1, random_state=3).fit(X)
    (m,) = imp._members(cover_all=True)
    assert (m.column_groups[0] != np.arange(5)).any()
    out = imp.transform(X)
    enc = imp.train_x_
    batch = query_batch(enc, enc, np.isnan(enc), imp._kind, imp._card)
    direct = numeric_mean(forward_eval(load_model(export_dir), batch, id_seed=m.seed & 0xFFFFFFFF)).numpy()
    np.testing.assert_allclose(out[np.isnan(X)], direct, rtol=1e-4, atol=1e-4)
    # split into column groups of 2: every missing cell is still filled, observed cells untouched
    grouped = TabFMImputer(model=export_dir, strategy="joint", n_estimators=2, random_state=3, max_columns=2).fit(X).transform(X)
    assert not np.isnan(grouped).any() and (grouped[~np.isnan(X)] == X[~np.isnan(X)]).all()


# ------------------------------------------------------------------ imputer
def mixed_missing(n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    X = pd.DataFrame({
        "num": rng.normal(size=n),
        "big": rng.normal(size=n) * 1e4,
        "color": pd.Series(rng.choice(["red", "blue", "green"], n), dtype="str"),
        "size": pd.Categorical(rng.choice(["S", "M"], n), categories=["S", "M", "L"]),
        "count": pd.array(rng.integers(0, 5, n), dtype="Int64"),
        "when": pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 300, n), unit="D"),
        "flag": pd.Series(rng.random(n) > 0.5, dtype=object),
    })
    for col in X.columns:
        X.loc[rng.random(n) < 0.2, col] = None
    return X


def test_imputer_fills_every_nan_and_keeps_observed_cells_and_dtypes(export_dir):
    X = mixed_missing()
    assert X.isna().to_numpy().sum() > 30
    out = make(TabFMImputer, export_dir).fit(X).transform(X)
    assert not out.isna().to_numpy().any()
    assert list(out.columns) == list(X.columns) and out.index.equals(X.index)
    assert out.dtypes.to_dict() == X.dtypes.to_dict()
    assert list(out["size"].cat.categories) == ["S", "M", "L"]
    for col in X.columns:
        seen = X[col].notna()
        assert (out.loc[seen, col] == X.loc[seen, col]).all(), col
    assert set(out["color"]) <= {"red", "blue", "green"} and set(out["flag"]) <= {True, False}
    # columns given in another order come back in that order
    shuffled = X[list(reversed(X.columns))]
    out2 = make(TabFMImputer, export_dir).fit(X).transform(shuffled)
    assert list(out2.columns) == list(shuffled.columns)
    pd.testing.assert_frame_equal(out2[list(X.columns)], out)


def test_imputer_array_and_fallbacks(export_dir):
    X = np.array([[1.0, NAN], [2.0, 4.0], [NAN, 6.0], [4.0, 8.0], [5.0, 10.0]])
    out = make(TabFMImputer, export_dir).fit(X).transform(X)
    assert isinstance(out, np.ndarray) and out.dtype == X.dtype and not np.isnan(out).any()
    assert (out[~np.isnan(X)] == X[~np.isnan(X)]).all()
    n = 40
    words = pd.Series([f"free text number {i}" for i in range(n)], dtype=object)
    words[[3, 5]] = None
    df = pd.DataFrame({"x": np.arange(n, dtype=float), "note": words, "empty": [NAN] * n})
    df.loc[7, "x"] = NAN
    with pytest.warns(UserWarning) as record:
        filled = make(TabFMImputer, export_dir).fit(df).transform(df)
    text = " ".join(str(w.message) for w in record)
    assert "'note'" in text and "'empty'" in text
    assert filled["note"].notna().all() and filled["empty"].isna().all() and filled["x"].notna().all()


# ------------------------------------------------------------------ anomaly detector
def test_anomaly_detector_scores_offset_and_contamination(export_dir):
    X = frame(80)
    det = make(TabFMAnomalyDetector, export_dir, contamination=0.1).fit(X)
    s = det.score_samples(X)
    assert s.shape == (80,) and np.isfinite(s).all()
    np.testing.assert_allclose(det.decision_function(X), s - det.offset_)
    assert np.array_equal(det.offset_rows_, np.arange(80))  # max_offset_rows (512) >= 80: every fitted row
    few = make(TabFMAnomalyDetector, export_dir, contamination=0.1, max_offset_rows=20).fit(X)
    assert len(few.offset_rows_) == 20 and len(set(few.offset_rows_)) == 20
    assert few.offset_ == pytest.approx(np.percentile(s[few.offset_rows_], 10.0), abs=1e-9)
    pred = det.predict(X)
    assert set(np.unique(pred)) <= {-1, 1} and (pred == -1).sum() == 8
    # fitted rows are scored with their own fold held out, whatever else is in X
    np.testing.assert_allclose(det.score_samples(X[:7]), s[:7], atol=1e-9)
    odd = X.iloc[:3].copy()
    odd.loc[odd.index[0], "c"] = 1e6  # a gross outlier in one column: far less normal
    so = det.score_samples(odd)
    assert so[0] < s.min() - 100 and det.predict(odd)[0] == -1


def test_anomaly_offset_is_scored_when_first_needed_and_kept(export_dir, monkeypatch):
    """fit scores no rows (ranking with score_samples pays only for its rows); the first
    decision_function / predict / offset_ scores the offset rows once; a pickle keeps the offset."""
    X = frame(60)
    det = make(TabFMAnomalyDetector, export_dir, contamination=0.2, max_offset_rows=30)
    calls = []
    real = TabFMAnomalyDetector._scores
    monkeypatch.setattr(TabFMAnomalyDetector, "_scores", lambda self, x: calls.append(len(x)) or real(self, x))
    det.fit(X)
    assert calls == []
    s = det.score_samples(X)
    assert calls == [60]
    d = det.decision_function(X)
    assert calls == [60, 60, 30]  # its own rows, then the 30 offset rows, once
    assert det.offset_ == pytest.approx(np.percentile(s[det.offset_rows_], 20.0), abs=1e-9)
    np.testing.assert_allclose(d, s - det.offset_)
    back = pickle.loads(pickle.dumps(det))
    assert back.offset_ == det.offset_ and calls == [60, 60, 30]
    old = pickle.loads(pickle.dumps(det))
    old.__dict__.pop("offset_memo_")
    old.__dict__["offset_"] = 1.25  # as a detector pickled when fit set offset_ unpickles
    assert old.offset_ == 1.25 and calls == [60, 60, 30]
    det.fit(X.iloc[:40])  # a refit forgets the old offset
    assert det.offset_memo_ == {} and len(det.offset_rows_) == 30 and calls[-1] == 30
    with pytest.raises(NotFittedError):
        make(TabFMAnomalyDetector, export_dir).decision_function(X)


def test_anomaly_fitted_rows_never_are_their_own_context():
    X = frame(50)
    stub = StubModel()
    det = TabFMAnomalyDetector(model=stub, n_estimators=1, random_state=0, n_folds=5).fit(X)
    det.offset_  # scores the offset rows: here every fitted row
    assert stub.batches
    for batch in stub.batches:
        ctx = batch.context[0]
        assert int(ctx.sum()) == 40  # 4 of 5 folds
        context_rows = {tuple(r) for r in batch.x[0, ctx].tolist()}
        assert not any(tuple(r) in context_rows for r in batch.x[0, ~ctx].tolist())
    stub.batches.clear()
    det.score_samples(frame(5, seed=9))  # new rows: all fitted rows are context
    assert all(int(b.context[0].sum()) == 50 for b in stub.batches)


# ------------------------------------------------------------------ bad input
def test_bad_input_errors(export_dir):
    X, y = frame(), labels()
    clf = make(TabFMClassifier, export_dir).fit(X, y)
    with pytest.raises(ValueError, match=r"missing \['c'\], extra \['zz'\]"):
        clf.predict(X.drop(columns="c").assign(zz=1.0))
    with pytest.raises(ValueError, match="3 missing value"):
        make(TabFMClassifier, export_dir).fit(X, pd.Series(y).where(np.arange(60) >= 3))
    with pytest.raises(ValueError, match="60 rows but y has 59"):
        make(TabFMClassifier, export_dir).fit(X, y[:59])
    with pytest.raises(ValueError, match="must be numeric, got dtype"):
        make(TabFMRegressor, export_dir).fit(X, y)
    with pytest.raises(ValueError, match="2 missing value"):
        make(TabFMRegressor, export_dir).fit(X, np.r_[NAN, NAN, np.arange(58.0)])
    with pytest.raises(ValueError, match="infinite"):
        make(TabFMRegressor, export_dir).fit(X, np.r_[np.inf, np.arange(59.0)])
    with pytest.raises(ValueError, match="X has 4 features, but TabFMClassifier is expecting 5"):
        clf.predict(X.to_numpy()[:, :4])
    with pytest.raises(ValueError, match="contamination"):
        make(TabFMAnomalyDetector, export_dir, contamination=0.7).fit(X)


def test_odd_but_valid_input(export_dir):
    X, y = frame(), labels()
    X["empty"] = NAN  # all-missing column: carries no information, accepted
    X.loc[[2, 9], "a"] = [np.inf, -np.inf]  # inf: kept distinct by the schema's flag column
    clf = make(TabFMClassifier, export_dir).fit(X, y)
    new = X.iloc[:5].copy()
    new.loc[new.index[0], "b"] = "never-seen"
    with pytest.warns(UserWarning, match="not seen at fit"):
        p = clf.predict_proba(new)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-9)


def test_model_resolution_errors_and_cache(export_dir, tmp_path):
    assert load_model(export_dir) is load_model(export_dir)  # cached per process
    assert resolve_model_path(export_dir).name == "export"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        resolve_model_path("no-such-model")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"lacks \['model.safetensors'\].*config.json"):
        resolve_model_path(tmp_path / "half")
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        TabFMRegressor(model=str(tmp_path / "does-not-exist")).fit(frame(), np.arange(60.0)).predict(frame())


# ------------------------------------------------------------------ command line
@pytest.fixture
def cli_main(monkeypatch):
    if "predict" not in cli.COMMANDS:  # until the lead registers the subcommand
        monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, "predict"])
    return cli.main


def test_cli_predict(cli_main, export_dir, tmp_path, capsys):
    X, y = frame(40), labels(40)
    X.assign(label=y).iloc[:30].to_csv(tmp_path / "train.csv", index=False)
    X.assign(label=y).iloc[30:].to_csv(tmp_path / "test.csv", index=False)
    out = tmp_path / "preds.csv"
    args = ["predict", "--model", export_dir, "--train", str(tmp_path / "train.csv"), "--test",
            str(tmp_path / "test.csv"), "--target", "label", "--n-estimators", "1"]
    assert cli_main([*args, "--out", str(out), "--proba"]) == 0
    preds = pd.read_csv(out)
    assert list(preds.columns) == ["label", "proba_apple", "proba_mango", "proba_zebra"] and len(preds) == 10
    np.testing.assert_allclose(preds.iloc[:, 1:].sum(axis=1), 1.0, atol=1e-6)
    assert "accuracy" in capsys.readouterr().err
    # --n-neighbors / --no-linear-features reach the estimator: the CLI's probabilities are the estimator's
    assert cli_main([*args, "--out", str(out), "--proba", "--n-neighbors", "0", "--no-linear-features"]) == 0
    train = pd.read_csv(tmp_path / "train.csv")
    want = TabFMClassifier(model=export_dir, n_estimators=1, random_state=0, n_neighbors=(),
                           linear_features=False).fit(
        train.drop(columns="label"), train["label"]).predict_proba(pd.read_csv(tmp_path / "test.csv").drop(columns="label"))
    np.testing.assert_allclose(pd.read_csv(out).iloc[:, 1:].to_numpy(), want, atol=1e-6)
    assert cli_main([*args, "--n-neighbors", "5,x"]) == 2
    assert "--n-neighbors" in capsys.readouterr().err
    assert cli_main([*args, "--out", str(tmp_path)]) == 2  # checked before any prediction
    assert "is a directory" in capsys.readouterr().err

    X.assign(target=X["a"] * 3).to_csv(tmp_path / "reg.csv", index=False)
    assert cli_main(["predict", "--model", export_dir, "--train", str(tmp_path / "reg.csv"), "--test",
                     str(tmp_path / "reg.csv"), "--target", "target", "--task", "regression",
                     "--n-estimators", "1"]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0] == "target" and len(stdout) == 41
    # --linear-residual off reaches the regressor: the CLI's predictions are the estimator's
    out = tmp_path / "reg_pred.csv"
    assert cli_main(["predict", "--model", export_dir, "--train", str(tmp_path / "reg.csv"), "--test",
                     str(tmp_path / "reg.csv"), "--target", "target", "--task", "regression",
                     "--n-estimators", "1", "--linear-residual", "off", "--out", str(out)]) == 0
    reg = pd.read_csv(tmp_path / "reg.csv")
    want = TabFMRegressor(model=export_dir, n_estimators=1, random_state=0, linear_residual=False).fit(
        reg.drop(columns="target"), reg["target"]).predict(reg.drop(columns="target"))
    np.testing.assert_allclose(pd.read_csv(out)["target"].to_numpy(), want, rtol=1e-5, atol=1e-5)
    assert cli_main([*args, "--linear-residual", "on"]) == 2
    assert "regression only" in capsys.readouterr().err


def test_cli_predict_uses_each_tasks_default_weights(cli_main, tmp_path):
    """No --model: the classifier's and the regressor's own defaults (tabfm.weights.DEFAULT_MODELS)."""
    from tabfm.weights import DEFAULT_MODELS

    X, y = frame(40), labels(40)
    X.assign(label=y).to_csv(tmp_path / "c.csv", index=False)
    X.assign(target=X["a"] * 3).to_csv(tmp_path / "r.csv", index=False)
    base = ["predict", "--n-estimators", "1", "--out", str(tmp_path / "out.csv")]
    assert cli_main([*base, "--train", str(tmp_path / "c.csv"), "--test", str(tmp_path / "c.csv"), "--target", "label",
                     "--proba"]) == 0
    want = TabFMClassifier(model=DEFAULT_MODELS["classification"], n_estimators=1, random_state=0).fit(X, y)
    np.testing.assert_allclose(pd.read_csv(tmp_path / "out.csv").iloc[:, 1:].to_numpy(), want.predict_proba(X), atol=1e-6)
    assert cli_main([*base, "--train", str(tmp_path / "r.csv"), "--test", str(tmp_path / "r.csv"), "--target", "target",
                     "--task", "regression"]) == 0
    want = TabFMRegressor(model=DEFAULT_MODELS["regression"], n_estimators=1, random_state=0).fit(X, X["a"] * 3)
    np.testing.assert_allclose(pd.read_csv(tmp_path / "out.csv")["target"], want.predict(X), rtol=1e-5, atol=1e-5)


def test_cli_predict_errors(cli_main, export_dir, tmp_path, capsys):
    frame(10).to_csv(tmp_path / "t.csv", index=False)
    base = ["predict", "--model", export_dir, "--test", str(tmp_path / "t.csv")]
    assert cli_main([*base, "--train", str(tmp_path / "t.csv"), "--target", "nope"]) == 2
    assert "'nope' is not in" in capsys.readouterr().err
    assert cli_main([*base, "--train", str(tmp_path / "missing.csv"), "--target", "a"]) == 2
    assert f"cannot read {tmp_path / 'missing.csv'}" in capsys.readouterr().err
    assert cli_main(["predict", "--model", str(tmp_path / "nowhere"), "--train", str(tmp_path / "t.csv"),
                     "--test", str(tmp_path / "t.csv"), "--target", "a"]) == 2
    assert "nowhere" in capsys.readouterr().err
