"""Linear features: what a regularised linear model fitted on the context rows says about the target,
shown as extra columns.

A row's linear feature is the score of a linear model of the target on the feature columns given
(the estimators give every column), on the design of tabfm.data.neighbors (numeric
standardised on the context, categorical one-hot, missing at the mean): the logit of a logistic
regression for a 0/1 target (one class against the rest), the prediction of a ridge regression
otherwise. Context rows get out-of-fold scores (k-fold
over the context rows, a row's score comes from a model that never saw it), query rows the score of
the model fitted on all context rows; no query label is ever involved and a query row's score does
not depend on the other query rows. Like the neighbour features, the model reads the column in
context and learns from the context rows how far to trust it. A small in-context model misses
smooth additive structure over many columns that a linear model catches at once (public suite:
german 0.772 -> 0.793, pbc 0.788 -> 0.808; BENCHMARKS.md).

Where a linear model is clearly the weaker view, its column only distracts the small model
(phoneme, 5 numeric columns with a non-linear boundary: 0.926 -> 0.914 with it). So the
estimators show it only when, on the context rows, it orders them by the target at least about as
well as the neighbour means do (`worth_showing`: concordance within LINEAR_TOLERANCE of the best
neighbour size); the decision uses the context rows' own out-of-sample values, nothing else.
"""
from __future__ import annotations

import warnings

import numpy as np
from scipy.stats import kendalltau
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import roc_auc_score

from tabfm.data.context_features import LINEAR_FOLDS, RIDGE_ALPHA, ridge_folds, ridge_scores
from tabfm.data.neighbors import design

FOLDS = LINEAR_FOLDS  # out-of-fold scores of the context rows: k-fold over them (RIDGE_ALPHA: the ridge's L2 strength)
LOGISTIC_C = 1.0  # inverse L2 strength of the logistic regression (0/1 targets)
MAX_ITER = 200
LINEAR_TOLERANCE = 0.05  # shown unless its concordance trails the best neighbour mean's by more


def _is_binary(t: np.ndarray) -> bool:
    return bool(np.isin(t, (0.0, 1.0)).all())


def _fit_score(train_x: np.ndarray, train_t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Scores of the rows x from a linear model of train_t on train_x (constant target: its value,
    or 0 = even odds for a 0/1 target with one class; no training row: 0)."""
    if len(train_t) == 0:
        return np.zeros(len(x))
    binary = _is_binary(train_t)
    if train_t.min() == train_t.max():
        return np.zeros(len(x)) if binary else np.full(len(x), float(train_t[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # 200 lbfgs steps are plenty for a feature
        if binary:
            return LogisticRegression(C=LOGISTIC_C, max_iter=MAX_ITER).fit(train_x, train_t).decision_function(x)
        return Ridge(alpha=RIDGE_ALPHA).fit(train_x, train_t).predict(x)


class LinearScores:
    """Out-of-fold linear scores of the context rows and full-context scores of the query rows, for
    any target over the context rows (`features`)."""

    def __init__(self, context_points: np.ndarray, query_points: np.ndarray, folds: np.ndarray) -> None:
        if len(context_points) < 2:
            raise ValueError(f"linear features need at least 2 context rows, got {len(context_points)}")
        self._points = (context_points, query_points)
        self.folds = np.asarray(folds)

    @classmethod
    def of(cls, ctx: np.ndarray, query: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
           rng: np.random.Generator) -> "LinearScores | None":
        """Scores over the feature columns (kinds and cardinalities as encoded), the context rows
        dealt at random into FOLDS folds; None with < 2 context rows."""
        if len(ctx) < 2:
            return None
        a, b = design(ctx, query, kind, cardinality)
        return cls(a, b, ridge_folds(len(a), rng))

    def features(self, targets: np.ndarray, dtype: type = np.float32, ridge: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Linear scores of each target column (n_context, m): (n_context, m) out of fold and
        (n_query, m), in `dtype` (float32 as model input; float64 as the regressor's baseline);
        `ridge`: ridge predictions even of a 0/1 target (tabfm.data.context_features.ridge_scores, the
        baseline pretraining's residual episodes subtract)."""
        a, b = self._points
        t = np.asarray(targets, dtype=np.float64).reshape(len(a), -1)
        if ridge:  # the ridge of tabfm.data.context_features, as pretraining's residual episodes compute it
            ctx, query = ridge_scores(a, b, t, self.folds)
            return ctx.astype(dtype), query.astype(dtype)
        ctx, query = np.zeros(t.shape), np.zeros((len(b), t.shape[1]))
        for j in range(t.shape[1]):
            for f in np.unique(self.folds):
                held = self.folds == f
                ctx[held, j] = _fit_score(a[~held], t[~held, j], a[held])
            query[:, j] = _fit_score(a, t[:, j], b)
        return ctx.astype(dtype), query.astype(dtype)

    def subset(self, rows: np.ndarray) -> "LinearScores | None":
        """Scores from the context rows `rows` only (a sub-problem on part of the context)."""
        a, b = self._points
        return LinearScores(a[rows], b, self.folds[rows]) if len(rows) >= 2 else None


def concordance(score: np.ndarray, target: np.ndarray) -> float:
    """How well `score` orders the rows by `target`: the ROC-AUC for a 0/1 target, (1 + Kendall's
    tau-b) / 2 otherwise; 0.5 = no better than chance, also when the target or score is constant."""
    if np.ptp(target) == 0 or np.ptp(score) == 0:
        return 0.5
    if _is_binary(target):
        return float(roc_auc_score(target, score))
    tau = kendalltau(score, target).statistic
    return 0.5 if not np.isfinite(tau) else float(1.0 + tau) / 2.0


def worth_showing(linear_ctx: np.ndarray, neighbor_ctx: np.ndarray | None, targets: np.ndarray) -> np.ndarray:
    """(m,) bool per target column: is its linear column worth showing the model? Yes unless, on the
    context rows (out-of-fold linear scores, leave-one-out neighbour means; neighbour columns grouped
    by size as Neighbors.features returns them), its concordance with the target trails the best
    neighbour size's by more than LINEAR_TOLERANCE. Without neighbour features: always."""
    t = np.asarray(targets, dtype=np.float64).reshape(len(linear_ctx), -1)
    m = t.shape[1]
    if neighbor_ctx is None:
        return np.ones(m, dtype=bool)
    keep = np.ones(m, dtype=bool)
    for j in range(m):
        best = max(concordance(neighbor_ctx[:, i], t[:, j]) for i in range(j, neighbor_ctx.shape[1], m))
        keep[j] = concordance(linear_ctx[:, j], t[:, j]) >= best - LINEAR_TOLERANCE
    return keep
