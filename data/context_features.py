"""Context features: extra columns computed from a prediction episode's context rows, part of what
the model sees.

A model pretrained with a context-feature spec gets, for every prediction episode, extra numeric
columns appended after the table's own columns: what the nearest context rows say about the
target (their mean of it at each neighbourhood size k; leave-one-out for the context rows) and,
optionally, an out-of-fold ridge regression's score of it. The synthetic stream, the table-store
episodes, fine-tuning and the estimators all build them with `context_features`, so the model
reads at inference exactly the inputs it learnt from. No query label is ever involved: a query
row's features come from the context rows only, and do not depend on the other query rows.

Targets of the features (`feature_targets`): a class target with n classes gives the indicators of
classes 1..n-1 (n = 2: one 0/1 column), a numeric target its value; every target gets one column
per neighbourhood size and, with `linear`, one ridge column. Distances and the ridge design are
`tabfm.data.neighbors.design` (numeric standardised on the context, categorical one-hot, missing at the
mean), scaled by each coordinate's relevance to the target for the neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .neighbors import Neighbors, design, relevance

LINEAR_FOLDS = 5  # out-of-fold ridge scores of the context rows
RIDGE_ALPHA = 1.0  # L2 strength of the ridge on the standardised design
MAX_ESTIMATORS = 8  # neighbour sizes + ridge a spec may have (the model's estimator slots, ModelConfig.context_refs)


@dataclass(frozen=True)
class ContextFeatureSpec:
    """Which context features an episode carries: neighbour means at sizes `neighbors`, and a ridge
    score when `linear`. `ContextFeatureSpec.named(name)` gives the presets ("none" -> None)."""

    neighbors: tuple[int, ...] = (5, 20)
    linear: bool = True

    PRESETS: ClassVar[dict[str, dict]] = {
        "knn-linear": dict(neighbors=(5, 20), linear=True),
        "knn": dict(neighbors=(5, 20), linear=False),
    }
    NAMES: ClassVar[tuple[str, ...]] = ("none", "knn-linear", "knn")

    def __post_init__(self) -> None:
        if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1 for k in self.neighbors):
            raise ValueError(f"ContextFeatureSpec.neighbors must be sizes >= 1, got {self.neighbors!r}")
        if len(self.neighbors) + int(self.linear) > MAX_ESTIMATORS:
            raise ValueError(f"ContextFeatureSpec has {len(self.neighbors)} neighbour sizes"
                             f"{' and a linear score' if self.linear else ''}: at most {MAX_ESTIMATORS} estimators")
        if not self.neighbors and not self.linear:
            raise ValueError("ContextFeatureSpec with no neighbour sizes and no linear score carries nothing; "
                             "use the name 'none'")

    @classmethod
    def named(cls, name: str) -> "ContextFeatureSpec | None":
        """The spec of a preset name; None for "none"."""
        if name == "none":
            return None
        if name not in cls.PRESETS:
            raise ValueError(f"unknown context features {name!r}; choose from {', '.join(cls.NAMES)}")
        return cls(**cls.PRESETS[name])

    def width(self, n_targets: int) -> int:
        """Extra columns for `n_targets` feature targets."""
        return n_targets * (len(self.neighbors) + int(self.linear))


def feature_targets(y: np.ndarray, n_classes: int | None) -> np.ndarray:
    """(len(y), m) what the features average: indicators of classes 1..n-1 for class codes 0..n-1,
    or the value itself (n_classes None: a numeric target)."""
    y = np.asarray(y, dtype=np.float64)
    if n_classes is None:
        return y[:, None]
    if n_classes < 2:
        raise ValueError(f"a class target needs n_classes >= 2, got {n_classes}")
    return (y[:, None] == np.arange(1, n_classes)[None, :]).astype(np.float64)


def feature_estimates(spec: ContextFeatureSpec, n_classes: int | None) -> np.ndarray:
    """int64 (E, 2) what each of `context_features`' columns estimates, in its column order: (the class
    code whose share it is, or -1 for a numeric target; its estimator: i for neighbour size
    spec.neighbors[i], len(spec.neighbors) for the ridge score)."""
    codes = np.arange(1, n_classes) if n_classes is not None else np.array([-1])
    blocks = len(spec.neighbors) + int(spec.linear)
    return np.stack([np.tile(codes, blocks), np.repeat(np.arange(blocks), len(codes))], axis=1).astype(np.int64)


def feature_refs(n_columns: int, extra: slice, target: int, spec: ContextFeatureSpec | None,
                 n_classes: int | None) -> np.ndarray:
    """int64 (n_columns, 3) a table's `TableBatch.feature_ref` rows: the columns `extra` hold the
    context features of the target column `target` (`feature_estimates`), every other row is -1."""
    ref = np.full((n_columns, 3), -1, dtype=np.int64)
    if spec is not None:
        est = feature_estimates(spec, n_classes)
        rows = np.arange(n_columns)[extra]
        if len(rows) != len(est):
            raise ValueError(f"feature_refs: {len(rows)} columns for {len(est)} context features")
        ref[rows, 0], ref[rows, 1:] = target, est
    return ref


def ridge_scores(ctx_points: np.ndarray, query_points: np.ndarray, targets: np.ndarray,
                 folds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ridge (with intercept, alpha RIDGE_ALPHA) scores of every target column: out of fold for the
    context rows (fold f's rows from the model fitted on the others), the full fit for the query rows."""

    def fit_predict(a: np.ndarray, t: np.ndarray, x: np.ndarray) -> np.ndarray:
        if len(a) == 0:
            return np.zeros((len(x), t.shape[1]))
        mu_a, mu_t = a.mean(0), t.mean(0)
        ac = a - mu_a
        gram = ac.T @ ac + RIDGE_ALPHA * np.eye(a.shape[1])
        w = np.linalg.solve(gram, ac.T @ (t - mu_t))
        return (x - mu_a) @ w + mu_t

    ctx = np.zeros(targets.shape)
    for f in np.unique(folds):
        held = folds == f
        ctx[held] = fit_predict(ctx_points[~held], targets[~held], ctx_points[held])
    return ctx, fit_predict(ctx_points, targets, query_points)


def ridge_folds(n_ctx: int, rng: np.random.Generator) -> np.ndarray:
    """The context rows dealt at random into min(LINEAR_FOLDS, n_ctx) folds (the ridge's out-of-fold scores)."""
    return rng.permutation(n_ctx) % min(LINEAR_FOLDS, n_ctx)


def ridge_baseline(ctx: np.ndarray, query: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                   y_ctx: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A numeric target's ridge baseline, float64: out of fold for the context rows (n_ctx,), the full
    fit for the query rows (n_query,), on the design of the feature columns given. The regressor's
    linear residual (the model predicts y minus it) and pretraining's residual regression episodes
    (StreamConfig.residual_targets) both take it from here. Fewer than 2 context rows or no feature
    column: the context mean."""
    y = np.asarray(y_ctx, dtype=np.float64)
    if len(y) < 2 or ctx.shape[1] == 0:
        mean = float(y.mean()) if len(y) else 0.0
        return np.full(len(y), mean), np.full(len(query), mean)
    a, b = design(ctx, query, kind, cardinality)
    c, q = ridge_scores(a, b, y[:, None], ridge_folds(len(a), rng))
    return c[:, 0], q[:, 0]


def context_features(ctx: np.ndarray, query: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                     y_ctx: np.ndarray, n_classes: int | None, spec: ContextFeatureSpec,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The extra columns of one prediction episode: (n_ctx, E) and (n_query, E) float32, E =
    spec.width(m), grouped as [neighbour means at each k (m columns each), ridge scores (m)].

    ctx / query: the feature columns of the context and query rows (no target), with their `kind`
    and `cardinality`; y_ctx: the context rows' target (class codes 0..n_classes-1, or numbers with
    n_classes None). `rng` deals the context rows into the ridge's folds. With a single context row
    (or no feature column) there is nothing to compare rows by: query rows get the context mean of
    each target, the lone context row 0 (leave-one-out leaves nothing).
    """
    t = feature_targets(y_ctx, n_classes)
    n_ctx, n_query, width = len(ctx), len(query), spec.width(t.shape[1])
    if n_ctx == 0:
        raise ValueError("context features need at least one context row")
    if n_ctx < 2 or ctx.shape[1] == 0:  # nothing to compare rows by: every row gets the context mean
        mean = np.tile(t.mean(0), width // t.shape[1])
        return (np.zeros((n_ctx, width), np.float32) if n_ctx < 2 else np.tile(mean, (n_ctx, 1)).astype(np.float32),
                np.tile(mean, (n_query, 1)).astype(np.float32))
    a, b = design(ctx, query, kind, cardinality)
    parts_c, parts_q = [], []
    if spec.neighbors:
        w = relevance(a, np.asarray(y_ctx, dtype=np.float64), classes=n_classes is not None)
        sizes = neighbor_sizes_for(spec.neighbors, n_ctx)
        nb = Neighbors(a * w, b * w, sizes)
        nb_c, nb_q = nb.features(t)
        parts_c += _per_size(nb_c, nb.ks, sizes, n_ctx)
        parts_q += _per_size(nb_q, nb.ks, sizes, n_ctx)
    if spec.linear:
        lin_c, lin_q = ridge_scores(a, b, t, ridge_folds(n_ctx, rng))
        parts_c.append(lin_c)
        parts_q.append(lin_q)
    return np.hstack(parts_c).astype(np.float32), np.hstack(parts_q).astype(np.float32)


def neighbor_sizes_for(sizes: tuple[int, ...], n_ctx: int) -> tuple[int, ...]:
    """The neighbourhood sizes used with `n_ctx` context rows: each at most half the other rows. A size
    that takes in (nearly) every other row makes a context row's leave-one-out mean (S - y_i) / (n - 1),
    which falls as its own target rises: on small contexts the feature would be anti-correlated with the
    target there while the query rows' is not (the model then inverts its answer)."""
    cap = max(1, (n_ctx - 1) // 2)
    return tuple(min(int(k), cap) for k in sizes)


def _per_size(features: np.ndarray, computed: tuple[int, ...], requested: tuple[int, ...], n_ctx: int) -> list[np.ndarray]:
    """Neighbors computes each distinct size min(k, n_ctx - 1) once, in sorted order: give every
    requested size its own block of columns, in the requested order (coinciding sizes repeat), so
    the width never depends on the number of rows."""
    m = features.shape[1] // len(computed)
    blocks = []
    for k in requested:
        i = computed.index(min(k, n_ctx - 1))
        blocks.append(features[:, i * m:(i + 1) * m])
    return blocks
