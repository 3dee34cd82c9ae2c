"""TabFMClassifier: in-context classification of a separate target.

More classes than the model's categorical head (K = model.config.max_categories) are handled
by hierarchical grouping: the classes (in each member's permuted order) are split into
G = ceil(n / K) contiguous groups of at most K; the model predicts the group, then the class
within each group from the context rows of that group (recursively when G > K), and
P(class) = P(group) * P(class | group). Each member's class permutation makes the grouping
random, so the ensemble averages over groupings.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted

from tabfm.model import ModelOutput
from tabfm.model.predict import class_probabilities

from .base import Runtime, SupervisedTabFMEstimator


def _probs_fn(n_classes: int):
    def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
        return class_probabilities(output)[:, :n_classes]
    return fn


class TabFMClassifier(ClassifierMixin, SupervisedTabFMEstimator):
    """sklearn classifier: the training rows are the context, no weight is updated.

    fit(X, y) stores the encoded table; predict_proba(X) averages the members' probabilities
    (columns in `classes_` order, sorted); predict(X) takes the most probable class. A single
    class in y predicts that class with probability 1 (UserWarning). Parameters: see
    TabFMEstimator.
    """

    def fit(self, X: Any, y: Any) -> "TabFMClassifier":
        frame = self._fit_table(X)
        y = self._check_y(y, len(frame))
        check_classification_targets(y)
        try:
            self.classes_, self.y_ = np.unique(y, return_inverse=True)
        except TypeError as err:
            raise ValueError(f"y mixes label types that cannot be sorted ({err}); use one type of label") from None
        if len(self.classes_) == 1:
            warnings.warn(f"y has a single class {self.classes_[0]!r}: every prediction will be that class "
                          "with probability 1", UserWarning, stacklevel=2)
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
        total = np.zeros((len(x), n))
        for m in members:
            rows, ctx, query, kind, card = self._supervised_view(m, x, strata=self.y_)
            probs = self._class_tree(rt.for_member(m), ctx, m.class_perm[self.y_[rows]], query, kind, card, n)
            total += m.unpermute_classes(probs)
        total = np.clip(total / len(members), 0.0, None)
        return total / total.sum(1, keepdims=True)

    def predict(self, X: Any) -> np.ndarray:
        """The most probable class of each row."""
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]

    def _class_tree(self, rt: Runtime, ctx: np.ndarray, y: np.ndarray, query: np.ndarray, kind: np.ndarray,
                    card: np.ndarray, n: int) -> np.ndarray:
        """(n_query, n) probabilities of codes 0..n-1 given context labels y, grouping when n > K."""
        k = rt.max_categories
        if n <= k:
            return self._predict_target(rt, ctx, y, query, kind, card, n, _probs_fn(n))
        n_groups = math.ceil(n / k)
        group = np.arange(n) * n_groups // n  # contiguous, balanced: sizes <= ceil(n / n_groups) <= K
        top = self._class_tree(rt, ctx, group[y], query, kind, card, n_groups)
        out = np.zeros((len(query), n))
        for g in range(n_groups):
            classes = np.flatnonzero(group == g)
            sel = np.isin(y, classes)
            if len(classes) == 1 or not sel.any():
                out[:, classes] = top[:, [g]] / len(classes)
                continue
            local = np.full(n, -1)
            local[classes] = np.arange(len(classes))
            within = self._class_tree(rt, ctx[sel], local[y[sel]], query, kind, card, len(classes))
            out[:, classes] = top[:, [g]] * within
        return out
