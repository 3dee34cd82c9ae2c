"""TabFMClassifier: in-context classification of a separate target.

Multi-class strategies (`multiclass`):
- "auto" (default): "ecoc" for a model pretrained with context features (the default
  tabfm-tiny-cf: one n-way pass up to K classes, a few codebook passes above), "ovr" for one
  without (tabfm-tiny, whose single n-way pass is far weaker; BENCHMARKS.md "Defaults").
- "ovr": one binary task per class (class c against the rest, c's neighbour share and
  linear score as the extra features), P(c) proportional to the odds of that task's P(c). n
  passes per member; any number of classes works the same way.
- "native": one n-way pass. More classes than the model's categorical head
  (K = model.config.max_categories) are grouped hierarchically: the classes (in each member's
  permuted order) are split into G = ceil(n / K) contiguous groups of at most K; the model
  predicts the group, then the class within each group from the context rows of that group
  (recursively when G > K), and P(class) = P(group) * P(class | group). Each member's class
  permutation makes the grouping random, so the ensemble averages over groupings.
- "ecoc": error-correcting output codes, as TabPFN handles many classes. Up to K classes it is
  "native" (the same single pass, the same numbers). Above K each member runs C codebooks: a
  codebook is a seeded random, balanced assignment of the n classes to m meta-classes (sizes
  floor(n / m) or ceil(n / m); m = `alphabet_size`, default min(K, ECOC_ALPHABET) = 3), and one
  m-way pass predicts the meta-class of the query rows from the context rows relabelled by it
  (the model's inputs built as for "native"). A member's
  score of a class is the sum over its codebooks of the log-probability of the class's
  meta-class (`ecoc_scores`), and the ensemble pools the members in log space:
  P(class) proportional to exp(mean over members of the score) (`softmax_rows`), i.e. to
  exp(C * the mean over all codebooks of log P_c(meta-class of class)).
  Codebooks come in rounds (`ecoc_codebooks`): a round is L = ceil(log_m n) codebooks built from
  one random arrangement of the classes, jointly injective, so every pair of classes is separated
  (sent to different meta-classes) in at least one codebook of every round; C = L * rounds
  (`n_codebooks`, default None: ECOC_ROUNDS = 3 rounds, see `ecoc_n_codebooks`).
  Measured choices (benchmarks/many_classes.py tables vowel, movement_libras, letter, synth50,
  synth100 at split seed 7, 600 / 400 rows, not the benchmark's seeds; 4 members):
  - m = 3 rather than K: the shipped models answer few-way questions far better than 10-way ones
    (and a pass with fewer meta-classes carries fewer context-feature columns). tabfm-tiny-cf's
    mean accuracy / log-loss: m = 3 0.692 / 1.18, m = 5 0.682 / 1.27, m = 10 0.637 / 1.65,
    "native" 0.621 / 1.81.
  - Pooling the codebooks' log-probabilities by their sum (a product of the codebooks' answers)
    rather than their mean: the mean ranks the classes the same way but is far too flat (m = 10:
    log-loss 2.58 against 1.65 with tabfm-tiny-cf, 2.92 against 2.16 with tabfm-tiny, same
    accuracy); pooling the members in log space rather than averaging their probabilities: +0.009
    accuracy with either model.
  - More rounds kept helping (m = 10, 4 rounds instead of 3: accuracy 0.637 -> 0.656), at a third
    more passes.
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
from tabfm.weights import DEFAULT_MODELS

from .base import (DEFAULT_CHUNK_SIZE, DEFAULT_MAX_COLUMNS_SUPERVISED, DEFAULT_MAX_CONTEXT_ROWS, DEFAULT_N_ESTIMATORS,
                   DEFAULT_N_NEIGHBORS, Runtime, SupervisedTabFMEstimator, View)
from .local_context import LOCAL_CONTEXT_ROWS


ODDS_CLIP = 1e-6  # P(c against the rest) is kept in [1e-6, 1 - 1e-6] before it becomes odds
OVR_COST_WARNING = 20  # above this many classes "ovr" warns that it runs one pass per class
ECOC_ROUNDS = 3  # multiclass="ecoc", n_codebooks=None: every pair of classes separated in >= 3 codebooks
ECOC_ALPHABET = 3  # multiclass="ecoc", alphabet_size=None: meta-classes per codebook (at most the head's K)
ECOC_LOG_CLIP = 1e-12  # a meta-class probability is kept >= this before its log


def ecoc_rounds_length(n: int, k: int) -> int:
    """L = ceil(log_k n): the fewest codebooks over k meta-classes whose codewords tell n classes apart."""
    if k < 2:
        raise ValueError(f"codebooks need k >= 2 meta-classes, got {k}")
    length, reach = 1, k
    while reach < n:
        length, reach = length + 1, reach * k
    return length


def ecoc_n_codebooks(n: int, m: int, n_codebooks: int | None = None) -> int:
    """Codebooks per ensemble member for n classes and m meta-classes per codebook: `n_codebooks`, or
    by default ECOC_ROUNDS rounds of ceil(log_m n) codebooks, so that every pair of classes is
    separated in at least ECOC_ROUNDS of them (m = 3: 9 codebooks for 10-27 classes, 12 for 28-81,
    15 for 82-243). n <= m: 1."""
    if n <= m:
        return 1
    return int(n_codebooks) if n_codebooks is not None else ECOC_ROUNDS * ecoc_rounds_length(n, m)


def ecoc_codebooks(n: int, k: int, n_codebooks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_codebooks, n) meta-class (0..min(n, k)-1) of every class in every codebook.

    Built in rounds of L = ceil(log_k n) codebooks (the last round cut short when n_codebooks is not
    a multiple of L). A round places the classes at the positions 0..n-1 of a random arrangement and
    writes a position p in base k, p = d_0 + d_1 k + ... + d_{L-1} k^(L-1); its codebooks are
    d_0 and (d_0 + d_i) mod k for i = 1..L-1. Jointly they give back every digit, so no two classes
    share all of a round's meta-classes: every pair is separated at least once per full round.
    Each codebook is balanced: every full run of k consecutive positions (fixed d_1..d_{L-1}) puts
    one class in each meta-class, and the one partial run puts its classes in distinct ones, so a
    meta-class holds floor(n / k) or ceil(n / k) classes. Each codebook alone is a uniformly random
    balanced assignment (the arrangement is).
    """
    m = min(n, k)
    length = ecoc_rounds_length(n, k) if n > k else 1
    books = []
    while len(books) < n_codebooks:
        pos = rng.permutation(n)  # class c sits at position pos[c]
        digits = [(pos // m ** i) % m for i in range(length)]
        books.append(digits[0])
        books.extend((digits[0] + d) % m for d in digits[1:])
    return np.stack(books[:n_codebooks]).astype(np.int64)


def ecoc_scores(meta_probs: list[np.ndarray] | np.ndarray, books: np.ndarray) -> np.ndarray:
    """(n_query, n) score of every class: the sum over codebooks c of log meta_probs[c][:, books[c, class]]
    (meta_probs[c]: (n_query, meta-classes), rows summing to 1; each kept >= ECOC_LOG_CLIP before its log)."""
    score = np.zeros((len(meta_probs[0]), books.shape[1]))
    for q, book in zip(meta_probs, books):
        score += np.log(np.clip(q, ECOC_LOG_CLIP, None))[:, book]
    return score


def softmax_rows(score: np.ndarray) -> np.ndarray:
    """Probabilities proportional to exp(score), row by row."""
    p = np.exp(score - score.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def tree_passes(n: int, k: int) -> int:
    """Model passes of the native strategy's class tree over n classes with a k-code head (one per
    node with at least two classes; `TabFMClassifier._class_tree`)."""
    if n <= k:
        return 1
    n_groups = math.ceil(n / k)
    sizes = np.bincount(np.arange(n) * n_groups // n, minlength=n_groups)
    return tree_passes(n_groups, k) + sum(tree_passes(int(s), k) for s in sizes if s >= 2)


def _probs_fn(n_classes: int):
    def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
        return class_probabilities(output)[:, :n_classes]
    return fn


class TabFMClassifier(ClassifierMixin, SupervisedTabFMEstimator):
    """sklearn classifier: the training rows are the context, no weight is updated.

    fit(X, y) stores the encoded table; predict_proba(X) averages the members' probabilities
    (columns in `classes_` order, sorted); predict(X) takes the most probable class. A single
    class in y predicts that class with probability 1 (UserWarning).

    multiclass   "auto" (default), "ovr", "native" or "ecoc": how more than two classes are predicted
                 (module doc; "auto" is "ecoc" for a model with context features, else "ovr").
    n_codebooks  multiclass="ecoc" with more classes than the head's K codes: codebooks (model passes)
                 per member; None (default) = 3 rounds of ceil(log_m n), every pair of classes then
                 separated in >= 3 of them (`ecoc_n_codebooks`).
    alphabet_size  multiclass="ecoc" beyond K classes: meta-classes per codebook, 2..K; None (default)
                 = min(K, 3) (module doc).
    n_neighbors  sizes k of the neighbour features (default (5, 20); 0 = off): each task also shows
                 the model the share of its class(es) among every row's k nearest context rows.
    linear_features  each task also shows the model a logistic regression's logit of its class(es),
                 fitted on the context rows (default True).
    max_classes  fit refuses a numeric y with more distinct values than this (default 100): such a
                 target is almost always a quantity to regress (TabFMRegressor); raise it to classify.
    Other parameters: see SupervisedTabFMEstimator and TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODELS["classification"],
                 n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS_SUPERVISED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 categorical: str = "ordinal", numeric: str = "mixed",
                 n_neighbors: int | tuple[int, ...] = DEFAULT_N_NEIGHBORS, linear_features: bool = True,
                 multiclass: str = "auto", n_codebooks: int | None = None, alphabet_size: int | None = None,
                 max_classes: int = 100, local_context: int = LOCAL_CONTEXT_ROWS,
                 backend: str = "torch") -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, categorical=categorical, numeric=numeric, n_neighbors=n_neighbors,
                         linear_features=linear_features, local_context=local_context, backend=backend)
        self.multiclass = multiclass
        self.n_codebooks = n_codebooks
        self.alphabet_size = alphabet_size
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
        self._check_ecoc_params()
        if np.asarray(y).dtype.kind in "iuf" and n > self.max_classes:
            raise ValueError(f"y has {n} distinct numeric values, more than max_classes={self.max_classes}: it looks like "
                             "a quantity to regress (TabFMRegressor, tabfm predict --task regression); to classify it "
                             f"anyway pass max_classes >= {n}")
        self._fit_local(self.y_, classes=True)
        if n == 1:
            warnings.warn(f"y has a single class {self.classes_[0]!r}: every prediction will be that class "
                          "with probability 1", UserWarning, stacklevel=2)
        if n > OVR_COST_WARNING and self._strategy() == "ovr":
            warnings.warn(f"{n} classes: multiclass='ovr' runs {n} passes per ensemble member ({n * self.n_estimators} "
                          "in all), so predictions take about that many times one pass; multiclass='ecoc' or "
                          "'native' take a few passes per member", UserWarning, stacklevel=2)
        return self

    def _check_ecoc_params(self, k: int | None = None) -> None:
        """n_codebooks and alphabet_size (<= the head's k codes, when known)."""
        for name, low in (("n_codebooks", 1), ("alphabet_size", 2)):
            v = getattr(self, name, None)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low):
                raise ValueError(f"{name} must be None or an int >= {low}, got {v!r}")
        m = getattr(self, "alphabet_size", None)
        if k is not None and m is not None and m > k:
            raise ValueError(f"alphabet_size={m} is more meta-classes than the model's head predicts ({k} codes)")

    def _alphabet(self, k: int) -> int:
        """Meta-classes per codebook for a k-code head (alphabet_size, or min(k, ECOC_ALPHABET))."""
        m = getattr(self, "alphabet_size", None)
        return min(k, ECOC_ALPHABET) if m is None else int(m)

    def _strategy(self, rt: Runtime | None = None) -> str:
        """`multiclass` with "auto" resolved for the model (module doc): "ecoc" when it was pretrained
        with context features, else "ovr"."""
        if self.multiclass != "auto":
            return self.multiclass
        rt = rt if rt is not None else self._runtime()
        return "ecoc" if rt.context_features != "none" else "ovr"

    def _passes_per_member(self, n: int, k: int, strategy: str) -> int:
        """Model passes one member makes for n classes with a k-code head (the progress bar's unit)."""
        if n > 2 and strategy == "ovr":
            return n
        if n > k and strategy == "ecoc":
            return ecoc_n_codebooks(n, self._alphabet(k), getattr(self, "n_codebooks", None))
        return tree_passes(n, k)

    def predict_proba(self, X: Any) -> np.ndarray:
        """(n_rows, n_classes) class probabilities; columns follow `classes_`; rows sum to 1."""
        check_is_fitted(self, "classes_")
        _, x = self._encode(X)
        n = len(self.classes_)
        if n == 1:
            return np.ones((len(x), 1))
        rt = self._runtime()
        self._check_ecoc_params(rt.max_categories)
        members = self._members(cover_all=False, n_classes=n)
        strategy = self._strategy(rt)
        ovr = n > 2 and strategy == "ovr"
        ecoc = n > rt.max_categories and strategy == "ecoc"
        total = np.zeros((len(x), n))  # members' probabilities, or ("ecoc") their class scores, summed
        with self._bar(len(members) * self._passes_per_member(n, rt.max_categories, strategy), "predict_proba") as bar:
            for i, m in enumerate(members):
                views = self._views(m, i, x, classes=True, rt=rt)
                done = bar.update if len(views) == 1 else (lambda: None)  # a local member: one tick per member
                for q, view in views:
                    y = m.class_perm[self.y_[view.rows]]
                    if ovr:
                        probs = self._one_vs_rest(rt.for_member(m), view, y, n, done)
                    elif ecoc:
                        probs = self._output_codes(rt.for_member(m), view, y, n, m.rng(2), done)  # scores
                    else:
                        probs = self._class_tree(rt.for_member(m), view, y, n, done)
                    total[q] += m.unpermute_classes(probs)
                if len(views) > 1:
                    bar.update(self._passes_per_member(n, rt.max_categories, strategy))
        total = self._finite(total / len(members), "class scores" if ecoc else "class probabilities")
        if ecoc:  # members pooled in log space (module doc)
            total = softmax_rows(total)
        total = np.clip(total, 0.0, None)
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

    def _output_codes(self, rt: Runtime, view: View, y: np.ndarray, n: int, rng: np.random.Generator,
                      done: Callable[[], Any] = lambda: None) -> np.ndarray:
        """(n_query, n) scores of codes 0..n-1 (n > K; `ecoc_scores`) from the member's codebooks (module doc):
        each codebook is one m-way pass on the context labels relabelled to their meta-classes."""
        m = self._alphabet(rt.max_categories)
        books = ecoc_codebooks(n, m, ecoc_n_codebooks(n, m, getattr(self, "n_codebooks", None)), rng)
        meta_probs = []
        for book in books:
            meta = book[y]
            meta_probs.append(self._predict_target(rt, view, meta, m, _probs_fn(m),
                                                   feature_targets=feature_targets(meta, m)))
            done()
        return ecoc_scores(meta_probs, books)

    def _class_tree(self, rt: Runtime, view: View, y: np.ndarray, n: int,
                    done: Callable[[], Any] = lambda: None) -> np.ndarray:
        """(n_query, n) probabilities of codes 0..n-1 given context labels y, grouping when n > K."""
        k = rt.max_categories
        if n <= k:
            out = self._predict_target(rt, view, y, n, _probs_fn(n), feature_targets=feature_targets(y, n))
            done()
            return out
        n_groups = math.ceil(n / k)
        group = np.arange(n) * n_groups // n  # contiguous, balanced: sizes <= ceil(n / n_groups) <= K
        top = self._class_tree(rt, view, group[y], n_groups, done)
        out = np.zeros((len(view.query), n))
        for g in range(n_groups):
            classes = np.flatnonzero(group == g)
            sel = np.isin(y, classes)
            if len(classes) == 1 or not sel.any():
                out[:, classes] = top[:, [g]] / len(classes)
                continue
            local = np.full(n, -1)
            local[classes] = np.arange(len(classes))
            within = self._class_tree(rt, view.subset(sel), local[y[sel]], len(classes), done)
            out[:, classes] = top[:, [g]] * within
        return out
