"""TabFMClassifier(multiclass="ecoc"): error-correcting output codes for more classes than the head's codes.

Random-weight models (the conftest export, K = 10 codes, or a 3-code head) keep these fast; where an
answer must be right, the model pass is replaced by an oracle (the meta-class of the nearest context
row), so the codebooks, the decoding, the members' class permutations and the order of `classes_`
are checked without trained weights.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tabfm import TabFMClassifier
from tabfm.estimators.classifier import (ECOC_ALPHABET, ECOC_ROUNDS, ecoc_codebooks, ecoc_n_codebooks,
                                         ecoc_rounds_length, ecoc_scores, softmax_rows, tree_passes)
from tabfm.model import ModelConfig, TabFM

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = dict(chunk_size=16, n_neighbors=0, linear_features=False)  # passes padded to 16 rows, no extra columns


def small_head(k: int = 3) -> TabFM:
    return TabFM(ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, n_bins=16, id_dim=8, max_categories=k))


def table(n_classes: int, per_class: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows (three numeric features) and unsorted string labels, every class present."""
    rng = np.random.default_rng(seed)
    k = rng.permutation(np.repeat(np.arange(n_classes), per_class))
    X = np.column_stack([k + rng.normal(0, 0.1, len(k)), rng.normal(size=len(k)), rng.normal(size=len(k))])
    names = np.array([f"class-{(7 * c) % n_classes:03d}{'xyz'[c % 3]}" for c in range(n_classes)])
    return X, names[k]


def oracle(self, rt, view, context_y, n_classes, fn, feature_targets=None):
    """A model pass stand-in: probability 0.9 on the label of the nearest context row, the rest spread."""
    d = ((view.query[:, None, :] - view.ctx[None, :, :]) ** 2).sum(-1)
    q = np.full((len(view.query), n_classes), 0.1 / (n_classes - 1))
    q[np.arange(len(q)), np.asarray(context_y)[d.argmin(1)]] = 0.9
    return q


# ------------------------------------------------------------------ codebooks and decoding, by hand
class Identity:
    """A generator stand-in whose permutation is the identity: class c sits at position c."""

    def permutation(self, n: int) -> np.ndarray:
        return np.arange(n)


def test_codebooks_by_hand():
    # n = 5 classes, k = 3 codes: L = 2 (3 < 5 <= 9). Positions p = d0 + 3 d1: d0 = 0 1 2 0 1, d1 = 0 0 0 1 1;
    # codebooks d0 and (d0 + d1) mod 3
    assert ecoc_rounds_length(5, 3) == 2
    books = ecoc_codebooks(5, 3, 4, Identity())
    np.testing.assert_array_equal(books, [[0, 1, 2, 0, 1], [0, 1, 2, 1, 2]] * 2)
    # balanced: each meta-class holds 1 or 2 classes; codewords (0,0) (1,1) (2,2) (0,1) (1,2) all differ
    assert all(sorted(np.bincount(b, minlength=3)) == [1, 2, 2] for b in books)
    assert len({tuple(w) for w in books[:2].T}) == 5
    # fewer classes than codes: one codebook, every class its own meta-class (the native pass)
    np.testing.assert_array_equal(ecoc_codebooks(3, 10, 1, Identity()), [[0, 1, 2]])


@pytest.mark.parametrize("k", [2, 3, 5, 10])
def test_codebook_rule_separates_every_pair_and_balances(k):
    for n in [k + 1, 2 * k + 1, k * k, k * k + 1, 100]:
        c = ecoc_n_codebooks(n, k)
        assert c == ECOC_ROUNDS * ecoc_rounds_length(n, k) and k ** (c // ECOC_ROUNDS) >= n
        books = ecoc_codebooks(n, k, c, np.random.default_rng(n))
        assert books.shape == (c, n) and books.min() >= 0 and books.max() < k
        for b in books:  # a meta-class holds floor(n / k) or ceil(n / k) classes
            assert set(np.bincount(b, minlength=k)) <= {n // k, -(-n // k)}
        separated = (books[:, :, None] != books[:, None, :]).sum(0)
        off = ~np.eye(n, dtype=bool)
        assert separated[off].min() >= ECOC_ROUNDS, (n, k)  # every pair apart in >= one codebook per round


def test_codebook_counts():
    assert ECOC_ALPHABET == 3 and ECOC_ROUNDS == 3
    assert [ecoc_n_codebooks(n, 3) for n in (2, 3, 4, 9, 10, 27, 28, 81, 82, 100)] == [1, 1, 6, 6, 9, 9, 12, 12, 15, 15]
    assert [ecoc_n_codebooks(n, 10) for n in (2, 10, 11, 26, 50, 100, 101)] == [1, 1, 6, 6, 6, 6, 9]
    assert ecoc_n_codebooks(50, 3, 4) == 4 and ecoc_n_codebooks(3, 3, 4) == 1
    assert [tree_passes(n, 10) for n in (2, 10, 11, 26, 50, 100)] == [1, 1, 3, 4, 6, 11]


def test_decoding_by_hand():
    # 3 classes, 2 meta-classes, 2 codebooks: P(class) proportional to the product of its meta-classes' probabilities
    books = np.array([[0, 0, 1], [0, 1, 1]])
    q1, q2 = np.array([[0.8, 0.2]]), np.array([[0.3, 0.7]])
    scores = ecoc_scores([q1, q2], books)
    np.testing.assert_allclose(scores, np.log([[0.8 * 0.3, 0.8 * 0.7, 0.2 * 0.7]]))
    np.testing.assert_allclose(softmax_rows(scores), [[0.24 / 0.94, 0.56 / 0.94, 0.14 / 0.94]])
    # two members pooled in log space: exp(mean of their scores), normalised
    other = np.log([[0.5, 0.25, 0.25]])
    expected = np.sqrt([0.24 * 0.5, 0.56 * 0.25, 0.14 * 0.25])
    np.testing.assert_allclose(softmax_rows((scores + other) / 2), [expected / expected.sum()])


# ------------------------------------------------------------------ the estimator
@pytest.mark.parametrize("n_classes", [2, 4, 10])
def test_ecoc_is_native_up_to_the_head(export_dir, n_classes):
    X, y = table(n_classes)
    for kw in (dict(chunk_size=16), FAST):  # with and without the neighbour and linear columns
        native = TabFMClassifier(model=export_dir, n_estimators=2, multiclass="native", **kw).fit(X, y)
        ecoc = TabFMClassifier(model=export_dir, n_estimators=2, multiclass="ecoc", **kw).fit(X, y)
        np.testing.assert_allclose(ecoc.predict_proba(X[:15]), native.predict_proba(X[:15]), atol=1e-6, rtol=0)


def test_auto_is_ecoc_with_context_features_and_ovr_without(export_dir):
    """multiclass="auto" (the default) equals "ecoc" for a model pretrained with context features and "ovr"
    for one without: same probabilities as naming the strategy."""
    X, y = table(12)
    plain = TabFMClassifier(model=export_dir, n_estimators=2, **FAST).fit(X, y)
    assert plain.multiclass == "auto" and plain._strategy() == "ovr"
    ovr = TabFMClassifier(model=export_dir, n_estimators=2, multiclass="ovr", **FAST).fit(X, y)
    np.testing.assert_array_equal(plain.predict_proba(X[:9]), ovr.predict_proba(X[:9]))
    torch.manual_seed(0)
    cf = TabFM(ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, n_bins=16, id_dim=8,
                                  context_features="knn-linear")).eval()
    auto = TabFMClassifier(model=cf, n_estimators=2, chunk_size=16).fit(X, y)
    assert auto._strategy() == "ecoc"
    ecoc = TabFMClassifier(model=cf, n_estimators=2, chunk_size=16, multiclass="ecoc").fit(X, y)
    np.testing.assert_array_equal(auto.predict_proba(X[:9]), ecoc.predict_proba(X[:9]))
    with pytest.warns(UserWarning, match="multiclass='ovr' runs"):  # the cost warning follows the resolved strategy
        TabFMClassifier(model=export_dir, n_estimators=1, **FAST).fit(*table(40, per_class=1))


def test_ecoc_probabilities_and_passes(export_dir, monkeypatch):
    X, y = table(25)
    calls = []
    real = TabFMClassifier._predict

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TabFMClassifier, "_predict", counting)
    # 25 classes, head of 10 codes: 3 meta-classes -> 3 rounds of 3 codebooks; 10 -> 3 rounds of 2
    for mode, kw, per_member in (("ecoc", {}, 9), ("ecoc", dict(alphabet_size=10), 6), ("ecoc", dict(n_codebooks=3), 3),
                                 ("native", {}, tree_passes(25, 10))):
        calls.clear()
        clf = TabFMClassifier(model=export_dir, n_estimators=2, multiclass=mode, **kw, **FAST).fit(X, y)
        p = clf.predict_proba(X[:12])
        assert p.shape == (12, 25) and np.isfinite(p).all() and (p >= 0).all()
        np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
        assert len(calls) == 2 * per_member == 2 * clf._passes_per_member(25, 10, mode), (mode, kw)
        assert list(clf.classes_) == sorted(set(y))


@pytest.mark.parametrize("n_classes,head,alphabet", [(12, None, None), (30, None, None), (30, None, 10), (7, 3, 2)])
def test_ecoc_decodes_an_oracle_exactly(export_dir, monkeypatch, n_classes, head, alphabet):
    """With a pass that knows each row's meta-class, every row is decoded to its own class, in classes_ order."""
    monkeypatch.setattr(TabFMClassifier, "_predict_target", oracle)
    X, y = table(n_classes, per_class=3, seed=n_classes)
    model = export_dir if head is None else small_head(head)
    for mode in ("ecoc", "native"):
        clf = TabFMClassifier(model=model, n_estimators=3, multiclass=mode, random_state=1,
                              alphabet_size=alphabet).fit(X, y)
        p = clf.predict_proba(X)
        np.testing.assert_array_equal(clf.classes_[p.argmax(1)], y)
        np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
        if mode == "ecoc":  # every other class loses at least one codebook per round
            assert p[np.arange(len(y)), np.searchsorted(clf.classes_, y)].min() > 0.5


def test_ecoc_parameters_are_checked(export_dir):
    X, y = table(12)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n_codebooks"):
            TabFMClassifier(model=export_dir, multiclass="ecoc", n_codebooks=bad).fit(X, y)
    for bad in (1, 3.0, False):
        with pytest.raises(ValueError, match="alphabet_size"):
            TabFMClassifier(model=export_dir, multiclass="ecoc", alphabet_size=bad).fit(X, y)
    with pytest.raises(ValueError, match="alphabet_size=11 is more meta-classes than the model's head"):
        TabFMClassifier(model=export_dir, multiclass="ecoc", alphabet_size=11).fit(X, y).predict(X[:2])
    with pytest.raises(ValueError, match="multiclass"):
        TabFMClassifier(model=export_dir, multiclass="ecc").fit(X, y).predict(X)


def test_serve_schema_takes_ecoc():
    from tabfm.serve.schemas import ClassifierParams

    params = ClassifierParams(multiclass="ecoc", n_codebooks=4, alphabet_size=5)
    clf = TabFMClassifier(**params.model_dump())
    assert clf.multiclass == "ecoc" and clf.n_codebooks == 4 and clf.alphabet_size == 5
    assert ClassifierParams().n_codebooks is None and ClassifierParams().alphabet_size is None


def test_codebooks_are_fixed_by_the_seed(export_dir):
    X, y = table(15)

    def proba(rows, **kw):
        clf = TabFMClassifier(model=export_dir, n_estimators=1, multiclass="ecoc", **FAST, **kw)
        return clf.fit(X, y).predict_proba(rows)

    a = proba(X[:5])
    np.testing.assert_array_equal(a, proba(X[:5]))
    assert not np.allclose(a, proba(X[:5], random_state=3))
    np.testing.assert_array_equal(proba(X[2:3]), a[2:3])  # a row's answer is its own (subset invariance)


def test_pairs_of_classes_rarely_share_a_meta_class():
    """Beyond the guarantee: with 100 classes and 10 codes, a pair shares a meta-class in about a
    tenth of the codebooks."""
    books = ecoc_codebooks(100, 10, 6, np.random.default_rng(0))
    together = np.mean([(b[i] == b[j]) for b in books for i, j in itertools.combinations(range(100), 2)])
    assert 0.05 < together < 0.15


def test_benchmark_script_runs_and_writes_json(export_dir, tmp_path, capsys, load_benchmark):
    """benchmarks/many_classes.py on one small synthetic table with the random-weight export."""
    import json

    bench = load_benchmark("many_classes")
    out = tmp_path / "mc.json"
    bench.main(["--tables", "synth50", "--models", export_dir, "--strategies", "ecoc,native", "--baselines", "rf",
                "--seeds", "0", "--max-train", "100", "--max-test", "50", "--n-estimators", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    methods = {r["method"]: r for r in record["runs"]}
    assert set(methods) == {f"{export_dir}/native", f"{export_dir}/ecoc", "rf"}
    assert methods[f"{export_dir}/ecoc"]["passes"] == 12 and methods[f"{export_dir}/native"]["passes"] == 6
    assert methods["rf"]["n_train"] == 100 and methods["rf"]["n_test"] == 50
    assert "accuracy per table" in capsys.readouterr().out and record["versions"]["torch"]
