"""TabFMClassifier: in-context classification of a separate target.

Multi-class strategies (`multiclass`):
- "ovr" (default): one binary task per class (class c against the rest, c's neighbour share and
  linear score as the extra features), P(c) proportional to the odds of that task's P(c). n
  passes per member, but with the shipped weights far stronger than one n-way pass (public
  suite, BENCHMARKS.md), and any number of classes works the same way.
- "native": one n-way pass. More classes than the model's categorical head
  (K = model.config.max_categories) are grouped hierarchically: the classes (in each member's
  permuted order) are split into G = ceil(n / K) contiguous groups of at most K; the model
  predicts the group, then the class within each group from the context rows of that group
  (recursively when G > K), and P(class) = P(group) * P(class | group). Each member's class
  permutation makes the grouping random, so the ensemble averages over groupings.
"""
from __future__ import annotations

import math
import warnings
from os import PathLike
from typing import Any, Callable

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted
from torch import nn

from tabfm.data.context_features import feature_targets
from tabfm.model import ModelOutput
from tabfm.model.predict import class_probabilities
from tabfm.weights import DEFAULT_MODEL

from .base import (DEFAULT_CHUNK_SIZE, DEFAULT_MAX_COLUMNS_SUPERVISED, DEFAULT_MAX_CONTEXT_ROWS, DEFAULT_N_ESTIMATORS,
                   DEFAULT_N_NEIGHBORS, Runtime, SupervisedTabFMEstimator, View)


ODDS_CLIP = 1e-6  # P(c against the rest) is kept in [1e-6, 1 - 1e-6] before it becomes odds
OVR_COST_WARNING = 20  # above this many classes "ovr" warns that it runs one pass per class


def _probs_fn(n_classes: int):
    def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
        return class_probabilities(output)[:, :n_classes]
    return fn


class TabFMClassifier(ClassifierMixin, SupervisedTabFMEstimator):
    """sklearn classifier: the training rows are the context, no weight is updated.

    fit(X, y) stores the encoded table; predict_proba(X) averages the members' probabilities
    (columns in `classes_` order, sorted); predict(X) takes the most probable class. A single
    class in y predicts that class with probability 1 (UserWarning).

    multiclass   "ovr" (default) or "native": how more than two classes are predicted (module doc).
    n_neighbors  sizes k of the neighbour features (default (5, 20); 0 = off): each task also shows
                 the model the share of its class(es) among every row's k nearest context rows.
    linear_features  each task also shows the model a logistic regression's logit of its class(es),
                 fitted on the context rows (default True).
    max_classes  fit refuses a numeric y with more distinct values than this (default 100): such a
                 target is almost always a quantity to regress (TabFMRegressor); raise it to classify.
    Other parameters: see SupervisedTabFMEstimator and TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODEL, n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS_SUPERVISED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 categorical: str = "ordinal", numeric: str = "raw",
                 n_neighbors: int | tuple[int, ...] = DEFAULT_N_NEIGHBORS, linear_features: bool = True,
                 multiclass: str = "ovr", max_classes: int = 100,
                 backend: str = "torch") -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, categorical=categorical, numeric=numeric, n_neighbors=n_neighbors,
                         linear_features=linear_features, backend=backend)
        self.multiclass = multiclass
        self.max_classes = max_classes

    def fit(self, X: Any, y: Any) -> "TabFMClassifier":
        frame = self._fit_table(X)
        y = self._check_y(y, len(frame))
        check_classification_targets(y)
        try:
            self.classes_, self.y_ = np.unique(y, return_inverse=True)
        except TypeError as err:
            raise ValueError(f"y mixes label types that cannot be sorted ({err}); use one type of label") from None
        n = len(self.classes_)
        if not isinstance(self.max_classes, (int, np.integer)) or isinstance(self.max_classes, bool) or self.max_classes < 2:
            raise ValueError(f"max_classes must be an int >= 2, got {self.max_classes!r}")
        if np.asarray(y).dtype.kind in "iuf" and n > self.max_classes:
            raise ValueError(f"y has {n} distinct numeric values, more than max_classes={self.max_classes}: it looks like "
                             "a quantity to regress (TabFMRegressor, tabfm predict --task regression); to classify it "
                             f"anyway pass max_classes >= {n}")
        if n == 1:
            warnings.warn(f"y has a single class {self.classes_[0]!r}: every prediction will be that class "
                          "with probability 1", UserWarning, stacklevel=2)
        if n > OVR_COST_WARNING and self.multiclass == "ovr":
            warnings.warn(f"{n} classes: multiclass='ovr' runs {n} passes per ensemble member ({n * self.n_estimators} "
                          "in all), so predictions take about that many times one pass; multiclass='native' is one "
                          "pass per member", UserWarning, stacklevel=2)
        return self

    def predict_proba(self, X: Any) -> np.ndarray:
        """(n_rows, n_classes) class probabilities; columns follow `classes_`; rows sum to 1."""
        check_is_fitted(self, "classes_")
        _, x = self._encode(X)
        n = len(self.classes_)
        if n == 1:
            return np.ones((len(x), 1))
        rt = self._runtime()
        members = self._members(cover_all=False, n_classes=n)
        ovr = n > 2 and self.multiclass == "ovr"
        total = np.zeros((len(x), n))
        with self._bar(len(members) * (n if ovr else 1), "predict_proba") as bar:
            for m in members:
                view = self._supervised_view(m, x, classes=True, rt=rt)
                y = m.class_perm[self.y_[view.rows]]
                if ovr:
                    probs = self._one_vs_rest(rt.for_member(m), view, y, n, bar.update)
                else:
                    probs = self._class_tree(rt.for_member(m), view, y, n)
                    bar.update()
                total += m.unpermute_classes(probs)
        total = np.clip(self._finite(total / len(members), "class probabilities"), 0.0, None)
        return total / total.sum(1, keepdims=True)

    def predict(self, X: Any) -> np.ndarray:
        """The most probable class of each row."""
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]

    def _one_vs_rest(self, rt: Runtime, view: View, y: np.ndarray, n: int,
                     done: Callable[[], Any] = lambda: None) -> np.ndarray:
        """(n_query, n): P(class) from the class-against-the-rest passes, combined by their odds.

        With p_c = P(c against the rest) and exactly one true class, P(c) is proportional to
        p_c * prod_{j != c} (1 - p_j), i.e. to the odds p_c / (1 - p_c); on the public suite's
        multi-class tables this ranks and calibrates better than normalising p_c (BENCHMARKS.md).
        """
        odds = np.zeros((len(view.query), n))
        for c in range(n):
            is_c = (y == c).astype(np.int64)
            p = self._predict_target(rt, view, is_c, 2, _probs_fn(2), feature_targets=is_c)
            p_c = np.clip(p[:, 1] / np.clip(p.sum(1), 1e-12, None), ODDS_CLIP, 1.0 - ODDS_CLIP)
            odds[:, c] = p_c / (1.0 - p_c)
            done()
        return odds / odds.sum(1, keepdims=True)

    def _class_tree(self, rt: Runtime, view: View, y: np.ndarray, n: int) -> np.ndarray:
        """(n_query, n) probabilities of codes 0..n-1 given context labels y, grouping when n > K."""
        k = rt.max_categories
        if n <= k:
            return self._predict_target(rt, view, y, n, _probs_fn(n), feature_targets=feature_targets(y, n))
        n_groups = math.ceil(n / k)
        group = np.arange(n) * n_groups // n  # contiguous, balanced: sizes <= ceil(n / n_groups) <= K
        top = self._class_tree(rt, view, group[y], n_groups)
        out = np.zeros((len(view.query), n))
        for g in range(n_groups):
            classes = np.flatnonzero(group == g)
            sel = np.isin(y, classes)
            if len(classes) == 1 or not sel.any():
                out[:, classes] = top[:, [g]] / len(classes)
                continue
            local = np.full(n, -1)
            local[classes] = np.arange(len(classes))
            within = self._class_tree(rt, view.subset(sel), local[y[sel]], len(classes))
            out[:, classes] = top[:, [g]] * within
        return out
