"""The synthetic-table prior: determinism, contract, distribution sanity, learnability,
config validation, mechanisms, and the raw DataFrame mode."""
from __future__ import annotations

import dataclasses
from dataclasses import fields, replace

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.synth.config import ACTIVATION_NAMES, PriorConfig
from tabfm.synth.graph import sample_dag
from tabfm.synth.mechanisms import ACTIVATIONS, discretize_node, run_scm, tree_node
from tabfm.synth.postprocess import MAR, MCAR, MNAR, categorize, kumaraswamy_warp, missing_mask, quantize
from tabfm.synth.prior import sample_table
from tabfm.synth.raw import TARGET, to_frame
from tabfm.synth.table import CLASSIFICATION, REGRESSION, SynthTable
from tabfm.synth.target import make_classes, nominal_classes

DEFAULT = PriorConfig()


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def same_table(a: SynthTable, b: SynthTable) -> bool:
    return (
        np.array_equal(a.X, b.X, equal_nan=True)
        and np.array_equal(a.kind, b.kind)
        and np.array_equal(a.cardinality, b.cardinality)
        and a.target == b.target
        and a.task == b.task
    )


def check_contract(t: SynthTable, n_rows: int, n_cols: int, cfg: PriorConfig) -> None:
    """Everything a consumer of SynthTable may rely on."""
    assert t.X.shape == (n_rows, n_cols) and t.X.dtype == np.float32
    assert t.kind.shape == (n_cols,) and t.kind.dtype == np.int8
    assert t.cardinality.shape == (n_cols,) and t.cardinality.dtype == np.int64
    assert set(t.kind.tolist()) <= {NUMERIC, CATEGORICAL}
    assert t.target == n_cols - 1
    assert t.task in (CLASSIFICATION, REGRESSION)
    assert not np.isinf(t.X).any()
    num = t.kind == NUMERIC
    assert (t.cardinality[num] == 0).all() and (t.cardinality[~num] >= 1).all()
    for j in np.flatnonzero(~num):
        col = t.X[:, j][~np.isnan(t.X[:, j])]
        assert (col == np.round(col)).all() and (col >= 0).all() and (col < t.cardinality[j]).all()
    y = t.X[:, t.target]
    assert not np.isnan(y).any(), "target must never be missing"
    if t.task == CLASSIFICATION:
        k = int(t.cardinality[t.target])
        assert t.kind[t.target] == CATEGORICAL and 2 <= k <= cfg.max_classes
        assert set(np.unique(y).astype(int).tolist()) == set(range(k)), "every class must be present"
    else:
        assert t.kind[t.target] == NUMERIC and np.isfinite(y).all()
    TableBatch.from_table(t.X, t.kind, t.cardinality)  # validates codes, kinds, cardinalities


# ------------------------------------------------------------------ determinism
def test_same_seed_same_table_different_seed_different():
    for n_rows, n_cols in [(64, 6), (300, 20)]:
        a = sample_table(DEFAULT, rng(7), n_rows, n_cols)
        b = sample_table(DEFAULT, rng(7), n_rows, n_cols)
        c = sample_table(DEFAULT, rng(8), n_rows, n_cols)
        assert same_table(a, b)
        assert not np.array_equal(a.X, c.X, equal_nan=True)


def test_pure_function_of_generator_state():
    """The table depends only on the generator state, not on earlier calls or globals."""
    g = rng(3)
    first = sample_table(DEFAULT, g, 50, 5)
    state = g.bit_generator.state
    second = sample_table(DEFAULT, g, 50, 5)
    np.random.seed(123)  # global numpy state must not matter
    g2 = rng(0)
    g2.bit_generator.state = state
    assert same_table(second, sample_table(DEFAULT, g2, 50, 5))
    assert not same_table(first, second)


# ------------------------------------------------------------------ contract
@pytest.mark.parametrize("n_rows,n_cols", [(2, 1), (2, 2), (3, 2), (5, 3), (16, 1), (40, 12), (128, 40)])
def test_contract_on_shapes(n_rows, n_cols):
    for seed in range(12):
        for p_cls in (0.0, 1.0):
            cfg = replace(DEFAULT, p_classification=p_cls, p_missing=0.5)
            t = sample_table(cfg, rng(seed), n_rows, n_cols)
            check_contract(t, n_rows, n_cols, cfg)
            assert t.task == (CLASSIFICATION if p_cls == 1.0 else REGRESSION)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_rows=st.integers(2, 80),
    n_cols=st.integers(1, 16),
    max_classes=st.integers(2, 12),
    p_missing=st.sampled_from([0.0, 1.0]),
    p_non_iid=st.sampled_from([0.0, 1.0]),
    p_disjoint=st.sampled_from([0.0, 1.0]),
    cat_hi=st.floats(0.0, 1.0),
)
def test_contract_property(seed, n_rows, n_cols, max_classes, p_missing, p_non_iid, p_disjoint, cat_hi):
    cfg = replace(
        DEFAULT, max_classes=max_classes, p_missing=p_missing, p_non_iid=p_non_iid,
        p_disjoint_subgraphs=p_disjoint, categorical_fraction=(0.0, cat_hi), missing_rate=(0.0, 0.9),
    )
    check_contract(sample_table(cfg, rng(seed), n_rows, n_cols), n_rows, n_cols, cfg)


@pytest.mark.parametrize("n_rows,n_cols", [(1, 5), (0, 5), (10, 0), (-3, 4), (10, 2.5), (True, 3)])
def test_bad_shapes_raise(n_rows, n_cols):
    with pytest.raises(ValueError, match="n_rows|n_cols"):
        sample_table(DEFAULT, rng(0), n_rows, n_cols)


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_each_activation_alone_gives_a_valid_table(name):
    cfg = replace(DEFAULT, activations=(name,), p_tree_node=0.0, p_discretize_node=0.0)
    for seed in range(3):
        check_contract(sample_table(cfg, rng(seed), 60, 6), 60, 6, cfg)


# ------------------------------------------------------------------ distribution sanity
@pytest.fixture(scope="module")
def sample100() -> list[SynthTable]:
    return [sample_table(DEFAULT, rng(10_000 + s), 128, 11) for s in range(100)]


def test_task_and_missing_table_shares(sample100):
    cls = np.mean([t.task == CLASSIFICATION for t in sample100])
    has_missing = np.mean([np.isnan(t.X).any() for t in sample100])
    assert 0.3 <= cls <= 0.7  # p_classification = 0.5
    assert 0.12 <= has_missing <= 0.5  # p_missing = 0.3


def test_missing_rate_within_configured_range(sample100):
    lo, hi = DEFAULT.missing_rate
    rates = []
    for t in sample100:
        feats = t.X[:, :-1]
        if np.isnan(feats).any():
            rate = float(np.isnan(feats).mean())
            tol = 4 * np.sqrt(hi * (1 - hi) / feats.size) + 1.0 / feats.size
            assert lo - tol <= rate <= hi + tol, rate
            rates.append(rate)
    assert len(rates) >= 10
    assert abs(np.mean(rates) - (lo + hi) / 2) < 0.06


def test_class_balance_and_counts(sample100):
    tables = [t for t in sample100 if t.task == CLASSIFICATION]
    minority = [np.bincount(t.X[:, -1].astype(int)).min() / t.X.shape[0] for t in tables]
    ks = [int(t.cardinality[-1]) for t in tables]
    assert min(minority) >= 0.01  # no near-empty classes
    assert np.median(minority) >= 0.03
    assert min(ks) == 2 and max(ks) >= 6  # binary and many-class targets both occur


def test_categorical_fraction_within_range(sample100):
    lo, hi = DEFAULT.categorical_fraction
    fracs = []
    for t in sample100:
        n_feat = t.X.shape[1] - 1
        frac = float((t.kind[:-1] == CATEGORICAL).mean())
        assert lo - 0.5 / n_feat <= frac <= hi + 0.5 / n_feat
        fracs.append(frac)
    assert abs(np.mean(fracs) - (lo + hi) / 2) < 0.08
    cards = np.concatenate([t.cardinality[:-1][t.kind[:-1] == CATEGORICAL] for t in sample100])
    assert cards.max() <= DEFAULT.max_categories and (cards >= 2).mean() > 0.9


def test_numeric_columns_are_diverse(sample100):
    """Warping and quantisation show up: some numeric columns have few levels, some are bounded in [0, 1]."""
    few_levels = bounded = total = 0
    for t in sample100:
        for j in np.flatnonzero(t.kind[:-1] == NUMERIC):
            col = t.X[:, j][~np.isnan(t.X[:, j])]
            total += 1
            few_levels += len(np.unique(col)) <= 20
            bounded += col.min() >= 0 and col.max() <= 1
    assert 0.05 < few_levels / total < 0.6
    assert 0.1 < bounded / total < 0.6


@pytest.mark.parametrize(
    "changes,check",
    [
        ({"p_missing": 0.0}, lambda t: not np.isnan(t.X).any()),
        ({"categorical_fraction": (0.0, 0.0)}, lambda t: (t.kind[:-1] == NUMERIC).all()),
        ({"categorical_fraction": (1.0, 1.0)}, lambda t: (t.kind[:-1] == CATEGORICAL).all()),
        ({"max_classes": 2, "p_classification": 1.0}, lambda t: t.cardinality[-1] == 2),
        ({"p_classification": 0.0}, lambda t: t.task == REGRESSION),
    ],
)
def test_config_knobs_take_effect(changes, check):
    cfg = replace(DEFAULT, **changes)
    assert all(check(sample_table(cfg, rng(s), 64, 9)) for s in range(15))


@pytest.mark.parametrize("p_mcar,p_mar,p_mnar", [(1, 0, 0), (0, 1, 0), (0, 0, 1)])
def test_forced_missing_rate_per_mechanism(p_mcar, p_mar, p_mnar):
    cfg = replace(DEFAULT, p_missing=1.0, missing_rate=(0.2, 0.2), p_mcar=p_mcar, p_mar=p_mar, p_mnar=p_mnar)
    rates = [np.isnan(sample_table(cfg, rng(s), 200, 10).X[:, :-1]).mean() for s in range(15)]
    assert abs(np.mean(rates) - 0.2) < 0.03


# ------------------------------------------------------------------ missingness mechanisms
def _mask(mech: str, seed: int = 0, n: int = 4000, m: int = 6):
    weights = {"p_mcar": float(mech == MCAR), "p_mar": float(mech == MAR), "p_mnar": float(mech == MNAR)}
    cfg = replace(DEFAULT, missing_rate=(0.3, 0.3), **weights)
    x = rng(seed + 99).standard_normal((n, m))
    mask, got = missing_mask(cfg, rng(seed), x, np.zeros(m, bool))
    assert got == mech
    return x, mask


def _own_value_gap(x, mask):
    """Largest |mean(x | missing) - mean(x | observed)| over columns with missing cells."""
    return max(abs(x[mask[:, j], j].mean() - x[~mask[:, j], j].mean()) for j in range(x.shape[1]) if mask[:, j].any())


def test_mcar_is_independent_of_values():
    x, mask = _mask(MCAR)
    assert abs(mask.mean() - 0.3) < 0.02 and _own_value_gap(x, mask) < 0.15


def test_mnar_depends_on_own_value():
    x, mask = _mask(MNAR)
    assert abs(mask.mean() - 0.3) < 0.02 and _own_value_gap(x, mask) > 0.5


def test_mar_depends_on_observed_columns_only():
    x, mask = _mask(MAR)
    observed = ~mask.any(axis=0)
    assert observed.any() and (~observed).any(), "MAR keeps driver columns fully observed"
    assert abs(mask.mean() - 0.3) < 0.03
    # missingness of a non-driver column is predictable from the drivers
    j = int(np.flatnonzero(~observed)[0])
    drivers = x[:, observed]
    coef, *_ = np.linalg.lstsq(np.c_[drivers, np.ones(len(x))], mask[:, j].astype(float), rcond=None)
    pred = np.c_[drivers, np.ones(len(x))] @ coef
    assert np.corrcoef(pred, mask[:, j])[0, 1] > 0.3


# ------------------------------------------------------------------ learnability
def test_classification_targets_are_learnable():
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import train_test_split

    cfg = replace(DEFAULT, p_classification=1.0)
    wins = 0
    for s in range(20):
        t = sample_table(cfg, rng(500 + s), 300, 8)
        X = np.nan_to_num(t.X[:, :-1], nan=-999.0)
        y = t.X[:, -1].astype(int)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=0)
        acc = RandomForestClassifier(n_estimators=50, random_state=0, n_jobs=1).fit(Xtr, ytr).score(Xte, yte)
        majority = float((yte == np.bincount(ytr).argmax()).mean())
        wins += acc > majority
    assert wins >= 14, f"RandomForest beat the majority class on only {wins}/20 tables"


# ------------------------------------------------------------------ config validation
BAD_VALUES = [
    ("p_classification", -0.1), ("p_classification", 1.5), ("max_classes", 1), ("max_classes", 2.5),
    ("p_equal_class_shares", -0.1), ("p_equal_class_shares", 1.5),
    ("p_nominal_classes", -0.1), ("p_nominal_classes", float("nan")),
    ("hidden_nodes", (-1.0, 1.0)), ("hidden_nodes", (1.0, 0.5)), ("root_fraction", (0.1, 1.5)),
    ("p_redirect", (0.0, 2.0)), ("max_parents", 0), ("p_disjoint_subgraphs", 2.0),
    ("activations", ()), ("activations", ("tanh", "nope")), ("activations", "tanh"), ("max_hidden", 0),
    ("p_tree_node", -0.5), ("max_tree_depth", 0), ("p_discretize_node", 1.2), ("p_discretize_node", 0.9),
    ("noise_std", (0.3, 0.1)), ("noise_std", (0.0, 0.1)), ("noise_std", (0.1, float("nan"))),
    ("root_distributions", ()), ("root_distributions", ("cauchy",)), ("p_non_iid", -1.0),
    ("p_warp", 1.01), ("p_quantize", -0.01), ("categorical_fraction", (0.6, 0.2)),
    ("categorical_fraction", (0.0, 1.1)), ("max_categories", 1), ("p_missing", 1.1),
    ("missing_rate", (-0.1, 0.2)), ("missing_rate", (0.1, 1.2)), ("missing_rate", [0.1, 0.2]),
    ("p_mcar", -0.5), ("p_mar", 1.5), ("p_mnar", float("nan")), ("p_datetime", 2.0), ("p_text", -1.0),
    ("p_bool", 1.5), ("p_string_target", -0.2),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_config_raises_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        PriorConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg


def test_every_field_has_a_bad_value_test():
    assert {f.name for f in fields(PriorConfig)} == {f for f, _ in BAD_VALUES}


def test_zero_mechanism_weights_raise():
    with pytest.raises(ValueError, match="p_mcar"):
        PriorConfig(p_mcar=0.0, p_mar=0.0, p_mnar=0.0)


def test_default_config_is_valid_and_frozen():
    cfg = PriorConfig()
    assert cfg.max_classes == 10 and cfg.p_classification == 0.5 and len(cfg.activations) >= 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_classes = 3  # type: ignore[misc]


# ------------------------------------------------------------------ building blocks
def test_activation_set_is_complete_and_finite():
    assert set(ACTIVATIONS) == set(ACTIVATION_NAMES) and len(ACTIVATIONS) >= 12
    a = np.linspace(-50, 50, 201).reshape(3, -1)
    for name, f in ACTIVATIONS.items():
        out = f(a)
        assert out.shape == a.shape and np.isfinite(out).all(), name


def test_dag_is_topological_and_disjoint_subgraphs_are_disjoint():
    for seed in range(30):
        cfg = replace(DEFAULT, p_disjoint_subgraphs=float(seed % 2))
        dag = sample_dag(cfg, rng(seed), 12)
        assert dag.n_nodes == 12 and dag.is_root[0]
        for i, ps in enumerate(dag.parents):
            assert (ps < i).all() and len(ps) <= cfg.max_parents
            assert (dag.component[ps] == dag.component[i]).all(), "edges stay inside a subgraph"
        if seed % 2:
            assert len(np.unique(dag.component)) >= 2
        else:
            assert len(np.unique(dag.component)) == 1


def test_scm_values_are_standardised_and_finite():
    cfg = DEFAULT
    dag = sample_dag(cfg, rng(1), 20)
    scm = run_scm(cfg, rng(2), dag, 500)
    assert scm.values.shape == (20, 500) and np.isfinite(scm.values).all()
    assert (np.abs(scm.values.mean(axis=1)) < 0.5).all()


def test_tree_and_discretiser_nodes():
    x = rng(0).standard_normal((3, 400))
    cfg = replace(DEFAULT, max_tree_depth=3)
    v = tree_node(cfg, rng(1), x, [0.99, 0.0, 0.0])  # depth 3
    assert 2 <= len(np.unique(v)) <= 8
    codes, k, val = discretize_node(DEFAULT, rng(2), x, [0.5, 0.0, 0.0])
    assert codes.min() >= 0 and codes.max() < k and len(np.unique(codes)) == k  # each prototype wins its own row
    assert len(np.unique(val)) == k


def test_postprocess_blocks():
    g = rng(0)
    x = g.standard_normal((300, 4))
    w = kumaraswamy_warp(g, x)
    assert w.min() >= 0 and w.max() <= 1
    assert (np.argsort(w[:, 0]) == np.argsort(x[:, 0])).mean() > 0.95  # monotone
    q = quantize(g, x[:, 0])
    assert len(np.unique(q)) <= 20 and (q == np.round(q)).all()
    codes, k = categorize(g, x[:, 1], 6)
    assert 2 <= k <= 6 and set(np.unique(codes).tolist()) == set(range(k))


def test_make_classes_all_present_even_when_tiny():
    for seed in range(200):
        n = int(rng(seed).integers(2, 40))
        v = rng(seed + 1).standard_normal(n)
        y = make_classes(rng(seed + 2), v, 10)
        k = int(y.max()) + 1
        assert 2 <= k <= 10 and np.array_equal(np.unique(y), np.arange(k))
    y = make_classes(rng(0), np.zeros(10), 5)  # constant node still yields 2 classes
    assert set(y.tolist()) == {0, 1}



def test_equal_class_shares_keep_every_drawn_class():
    """p_equal_shares = 1: a continuous node of 600 rows is cut into the K classes drawn (2..10), each
    with n / K rows (+-1), whatever K; p_equal_shares = 0 draws exactly as before (same labels, same
    generator state afterwards), so earlier stages' streams are unchanged."""
    v = rng(1).standard_normal(600)
    drawn = set()
    for seed in range(60):
        y = make_classes(rng(seed), v, 10, None, 1.0)
        k = int(rng(seed).integers(2, 11))  # the K make_classes draws first
        counts = np.bincount(y)
        assert len(counts) == k and counts.min() >= 600 // k - 1 and counts.max() <= 600 // k + 1
        drawn.add(k)
    assert drawn == set(range(2, 11))
    for seed in range(20):
        g0, g1 = rng(seed), rng(seed)
        assert np.array_equal(make_classes(g0, v, 10), make_classes(g1, v, 10, None, 0.0))
        assert g0.random() == g1.random()
    y = make_classes(rng(0), np.zeros(40), 5, None, 1.0)  # a constant node still yields >= 2 classes
    assert len(np.unique(y)) >= 2


def test_nominal_classes_keep_the_class_contract():
    """Every class 0..K'-1 present, 2 <= K' <= max_classes, int64, for any number of input nodes,
    rows and a constant node."""
    seen = set()
    for seed in range(80):
        p, n = 1 + seed % 6, (20, 300, 1000)[seed % 3]
        y = nominal_classes(rng(seed), rng(seed + 1).standard_normal((p, n)), 10)
        k = int(y.max()) + 1
        assert y.dtype == np.int64 and 2 <= k <= 10 and np.array_equal(np.unique(y), np.arange(k))
        seen.add(k)
    assert len(seen) >= 7
    assert len(np.unique(nominal_classes(rng(0), np.zeros((3, 40)), 5))) >= 2


def test_nominal_classes_are_a_multinomial_logit_not_cuts_of_one_node():
    """Classes drawn from 3 nodes: a multinomial logistic regression on the nodes recovers them well
    above the majority class (they follow noisy linear scores), and the best cut of any single node
    into ordered intervals recovers them worse than it recovers classes cut from that node."""
    from sklearn.linear_model import LogisticRegression

    lift, nominal_best_cut = [], []
    for seed in range(30):
        z = rng(100 + seed).standard_normal((3, 600))
        y = nominal_classes(rng(seed), z, 6)
        if y.max() < 2:
            continue
        acc = LogisticRegression(max_iter=2000).fit(z.T, y).score(z.T, y)
        lift.append(acc - np.bincount(y).max() / len(y))
        # an ordered cut of node j: each class is an interval; at best the interval of each
        # class's median rank order -> accuracy of predicting y from the rank of z_j by class order
        best = 0.0
        for j in range(3):
            order = np.argsort([np.median(z[j][y == c]) for c in range(y.max() + 1)])
            ranks = np.argsort(np.argsort(z[j]))
            cut = np.searchsorted(np.cumsum(np.bincount(y)[order])[:-1], ranks, side="right")
            best = max(best, float((order[cut] == y).mean()))
        nominal_best_cut.append(best)
    assert len(lift) >= 15
    assert np.mean(lift) > 0.25, np.mean(lift)
    assert np.mean(nominal_best_cut) < 0.6, np.mean(nominal_best_cut)
    y = make_classes(rng(0), z[0], 6, None, 1.0)  # a cut of node 0 is recovered exactly by its ranks
    order = np.argsort([np.median(z[0][y == c]) for c in range(y.max() + 1)])
    cut = np.searchsorted(np.cumsum(np.bincount(y)[order])[:-1], np.argsort(np.argsort(z[0])), side="right")
    assert (order[cut] == y).mean() == 1.0


def test_prior_nominal_targets_are_drawn_only_when_asked():
    """p_nominal_classes = 0 (every preset but pretrain-nominal) draws the same tables as before;
    = 1 gives valid class targets that differ from the cut ones."""
    cut = replace(DEFAULT, p_classification=1.0)
    for seed in range(10):
        a, b = sample_table(cut, rng(seed), 200, 8), sample_table(replace(cut, p_nominal_classes=0.0), rng(seed), 200, 8)
        assert np.array_equal(a.X, b.X, equal_nan=True)
    differ = 0
    for seed in range(10):
        a, b = sample_table(cut, rng(seed), 200, 8), sample_table(replace(cut, p_nominal_classes=1.0), rng(seed), 200, 8)
        y = b.X[:, -1].astype(np.int64)
        assert b.task == CLASSIFICATION and np.array_equal(np.unique(y), np.arange(b.cardinality[-1]))
        differ += not np.array_equal(a.X[:, -1], b.X[:, -1])
    assert differ >= 8


# ------------------------------------------------------------------ raw mode
RAW_ALL = replace(DEFAULT, p_datetime=1.0, p_text=1.0, p_bool=1.0, p_missing=0.5)


def _frames(cfg: PriorConfig, n: int = 12) -> list[tuple[SynthTable, pd.DataFrame]]:
    out = []
    for s in range(n):
        t = sample_table(cfg, rng(s), 40, 9)
        out.append((t, to_frame(t, rng(10_000 + s), cfg)))
    return out


def _is_text(col: pd.Series) -> bool:
    vals = col.dropna()
    return (pd.api.types.is_object_dtype(col) or pd.api.types.is_string_dtype(col)) and len(vals) > 0 and vals.map(
        lambda v: isinstance(v, str) and " " in v
    ).all()


def test_to_frame_real_dtypes_with_raw_probabilities_forced():
    frames = _frames(RAW_ALL)
    dtypes_seen = {"datetime": 0, "text": 0, "bool": 0, "free": 0}
    for t, df in frames:
        assert list(df.columns)[-1] == TARGET and df.shape == t.shape
        assert not df[TARGET].isna().any()
        for j, name in enumerate(df.columns[:-1]):
            col = df[name]
            assert col.isna().sum() == np.isnan(t.X[:, j]).sum(), name  # missing cells stay missing
            if t.kind[j] == NUMERIC:
                assert pd.api.types.is_datetime64_any_dtype(col)  # p_datetime = 1
                dtypes_seen["datetime"] += 1
            elif t.cardinality[j] == 2:
                assert pd.api.types.is_bool_dtype(col)  # p_bool = 1
                dtypes_seen["bool"] += 1
            else:
                assert _is_text(col), col.head()  # p_text = 1
                dtypes_seen["text"] += 1
                assert col.nunique() >= len(np.unique(t.X[:, j][~np.isnan(t.X[:, j])]))
                dtypes_seen["free"] += col.nunique() > 2 * t.cardinality[j]  # row-level filler words
    assert all(v > 0 for v in dtypes_seen.values()), dtypes_seen


def test_to_frame_default_mix_and_target_types():
    cfg = replace(DEFAULT, p_datetime=0.0, p_text=0.0, p_bool=0.0)
    kinds = set()
    for t, df in _frames(cfg, 20):
        for j, name in enumerate(df.columns[:-1]):
            col = df[name]
            assert not pd.api.types.is_datetime64_any_dtype(col) and not pd.api.types.is_bool_dtype(col)
            if t.kind[j] == NUMERIC:
                assert pd.api.types.is_numeric_dtype(col)
            if isinstance(col.dtype, pd.CategoricalDtype):
                kinds.add("category")
            elif pd.api.types.is_string_dtype(col) or col.dtype == object:
                kinds.add("string")
            else:
                kinds.add("number")
        y = df[TARGET]
        if t.task == REGRESSION:
            assert pd.api.types.is_float_dtype(y)
        else:
            assert y.nunique() == t.cardinality[-1]
    assert {"category", "string", "number"} <= kinds


def test_to_frame_is_deterministic():
    t = sample_table(RAW_ALL, rng(5), 30, 8)
    a, b = to_frame(t, rng(1), RAW_ALL), to_frame(t, rng(1), RAW_ALL)
    pd.testing.assert_frame_equal(a, b)
