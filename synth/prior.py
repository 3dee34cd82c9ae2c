"""sample_table: one synthetic table from the prior, a pure function of (cfg, rng state).

Pipeline: random DAG -> evaluate the SCM on n_rows iid rows -> pick a target node and
feature nodes (at least one feature is a direct causal neighbour of the target, so the
target is learnable) -> make some features categorical, warp and quantise numeric ones
-> cut the target into classes, or draw nominal ones from it and its neighbours (classification)
-> drop feature cells missing.
The target is the last column and is never missing.
"""
from __future__ import annotations

import numpy as np

from tabfm.data.batch import CATEGORICAL, NUMERIC
from .config import PriorConfig
from .graph import Dag, sample_dag
from .mechanisms import DISCRETE, run_scm
from .postprocess import categorize, compact_codes, kumaraswamy_warp, missing_mask, quantize
from .table import CLASSIFICATION, REGRESSION, SynthTable
from .target import NOMINAL_NODES, make_classes, nominal_classes


def _choose_nodes(rng: np.random.Generator, dag: Dag, n_features: int) -> tuple[int, np.ndarray]:
    """A non-root target node and n_features other nodes, one of them a neighbour of the target."""
    target = int(rng.choice(np.flatnonzero(~dag.is_root)))
    others = np.delete(np.arange(dag.n_nodes), target)
    features = rng.choice(others, size=n_features, replace=False)
    if n_features:
        near = dag.neighbours(target)
        if not set(features.tolist()) & set(near.tolist()):
            features[rng.integers(n_features)] = rng.choice(near)
    return target, features


def _nominal_nodes(rng: np.random.Generator, dag: Dag, target: int, features: np.ndarray) -> np.ndarray:
    """The nodes a nominal target reads: the target node and 1..NOMINAL_NODES - 1 of the feature nodes."""
    take = int(rng.integers(1, min(len(features), NOMINAL_NODES - 1) + 1)) if len(features) else 0
    return np.concatenate([[target], rng.choice(features, size=take, replace=False)]).astype(np.int64)


def _check_shape(n_rows: int, n_cols: int) -> None:
    for name, v, low in (("n_rows", n_rows, 2), ("n_cols", n_cols, 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
            raise ValueError(f"sample_table: {name}={v!r} must be an int >= {low}")


def sample_table(cfg: PriorConfig, rng: np.random.Generator, n_rows: int, n_cols: int) -> SynthTable:
    """One table of n_rows x n_cols (target included, last column) drawn from the prior."""
    _check_shape(n_rows, n_cols)
    n_rows, n_cols = int(n_rows), int(n_cols)
    n_feat = n_cols - 1
    classification = bool(rng.random() < cfg.p_classification)

    n_nodes = max(2, n_cols + int(rng.uniform(*cfg.hidden_nodes) * n_cols))
    dag = sample_dag(cfg, rng, n_nodes)
    scm = run_scm(cfg, rng, dag, n_rows)
    target, feat_nodes = _choose_nodes(rng, dag, n_feat)

    x = np.empty((n_rows, n_cols))
    x[:, :n_feat] = scm.values[feat_nodes].T
    kind = np.full(n_cols, NUMERIC, dtype=np.int8)
    card = np.zeros(n_cols, dtype=np.int64)

    # categorical features: discretiser nodes first, then cut numeric ones
    n_cat = int(round(rng.uniform(*cfg.categorical_fraction) * n_feat))
    is_discrete = scm.kind[feat_nodes] == DISCRETE
    order = np.concatenate([rng.permutation(np.flatnonzero(is_discrete)), rng.permutation(np.flatnonzero(~is_discrete))])
    for j in order[:n_cat]:
        node = int(feat_nodes[j])
        if node in scm.codes:
            codes, k = compact_codes(rng, scm.codes[node][0])
        else:
            codes, k = categorize(rng, x[:, j], cfg.max_categories)
        x[:, j], kind[j], card[j] = codes, CATEGORICAL, k

    # numeric features (and a regression target): warp, then quantise some features
    numeric = np.flatnonzero(kind[:n_feat] == NUMERIC)
    if not classification:
        numeric = np.append(numeric, n_feat)
        x[:, n_feat] = scm.values[target]
    warp = numeric[rng.random(len(numeric)) < cfg.p_warp]
    if len(warp):
        x[:, warp] = kumaraswamy_warp(rng, x[:, warp])
    for j in numeric[rng.random(len(numeric)) < cfg.p_quantize]:
        if j != n_feat:
            x[:, j] = quantize(rng, x[:, j])

    if classification:
        if cfg.p_nominal_classes > 0 and rng.random() < cfg.p_nominal_classes:
            x[:, n_feat] = nominal_classes(rng, scm.values[_nominal_nodes(rng, dag, target, feat_nodes)], cfg.max_classes)
        else:
            x[:, n_feat] = make_classes(rng, scm.values[target], cfg.max_classes, scm.codes.get(target),
                                         cfg.p_equal_class_shares)
        kind[n_feat], card[n_feat] = CATEGORICAL, int(x[:, n_feat].max()) + 1

    if n_feat and rng.random() < cfg.p_missing:
        mask, _ = missing_mask(cfg, rng, x[:, :n_feat], kind[:n_feat] == CATEGORICAL)
        x[:, :n_feat][mask] = np.nan

    return SynthTable(
        X=x.astype(np.float32),
        kind=kind,
        cardinality=card,
        target=n_feat,
        task=CLASSIFICATION if classification else REGRESSION,
    )
