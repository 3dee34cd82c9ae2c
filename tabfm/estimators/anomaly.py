"""TabFMAnomalyDetector: how surprising each row is to the model, given the fitted rows.

Anomaly score of a row = sum over its source columns of the negative log-likelihood of the
column's value when that column is hidden (all its encoded parts at once) and predicted from the
row's cells left visible, with the fitted rows as context. Numeric NLLs are taken on the context-
standardised scale (z-NLL: the original-scale density NLL minus log std), so columns with big
units do not dominate; categorical NLL is -log p(category). Scored parts: numeric values (and
their inf flag), categories that fit the model's head, a datetime's epoch, a text's length and
word count; constant columns and missing cells add nothing. Members' scores are averaged.

No leakage on the fitted rows: they are split into `n_folds` random folds, and a row of X that
equals a fitted row (same encoded values) is scored with that row's fold left out of the context.
Other rows have all fitted rows as context.

Query copies (`columns_per_copy`): each query row is replicated once per group of source columns
hidden together. A member splits the scored source columns of each of its column groups into a
seeded random partition (near-equal groups of at most `columns_per_copy` columns, or, for a float,
that fraction of them), drawn from the member's seed: fixed at fit, independent of the rows
scored, different from member to member, so the ensemble averages over partitions. A copy hides
one group, each of its columns is predicted from the cells outside the group, and every scored cell
is hidden in exactly one copy per member. 1 hides every column alone: its NLL given all the other
cells of the row; the default, 0.5, hides half of a row's scored columns per copy: two copies per
member whatever the width (one on a single scored column). Measured on the 12 ADBench tables, it
scores as well as hiding fewer at once (mean AUROC 0.822 against 0.820 for 0.125) at a third of the
seconds, and better on the wide tables, where one hidden cell is easy to read off its correlated
neighbours; hiding every column at once (1.0) loses the row's own evidence (0.771).

Cost: each (member, fold, column group) context is encoded once and reused for every query copy
(`ContextPredictor`), so scoring costs about the query copies alone, n_rows x (number of copies)
row passes per member: n_rows x ceil(scored columns / columns_per_copy).

sklearn convention (as IsolationForest): score_samples = -score, so HIGHER = MORE NORMAL;
offset_ = the `contamination` quantile of score_samples over at most `max_offset_rows` fitted rows
(a seeded random subset, `offset_rows_`; scoring fitted rows costs as much as scoring new ones,
so a large fit would otherwise cost more than the rows one wants scored), computed when first
needed (decision_function, predict, or reading offset_), not at fit: ranking rows with
score_samples pays only for the rows it scores;
decision_function = score_samples - offset_ (negative = outlier); predict: -1 outlier, 1 inlier.
"""
from __future__ import annotations

from os import PathLike
from typing import Any

import numpy as np
import torch
from sklearn.base import OutlierMixin
from sklearn.utils.validation import check_is_fitted
from torch import nn

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.data.schema import CONSTANT_T, DATETIME_T
from tabfm.inference import ContextPredictor
from tabfm.model import ModelOutput
from tabfm.model.predict import cell_nll
from tabfm.weights import DEFAULT_MODELS

from .base import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_COLUMNS, Runtime, TabFMEstimator
from .ensemble import subsample

FOLD_KEY = 7  # keys the fold assignment's generator apart from the members'
OFFSET_KEY = 8  # keys the offset rows' generator apart
COPY_KEY = 9  # keys a member's partition of the scored columns into query copies apart from its other choices
# The detector's defaults (BENCHMARKS.md, "Anomaly scoring at a user's cost"): several members with small
# contexts score better than one large context, as subsampling does for IsolationForest (an anomaly's
# look-alikes in a large context make it less surprising), and cost a fraction of it; hiding half of a
# row's scored columns per copy makes two copies per member, whatever its width.
DETECTOR_N_ESTIMATORS = 2
DETECTOR_MAX_CONTEXT_ROWS = 256
DEFAULT_COLUMNS_PER_COPY = 0.5
UNSET_COLUMNS_PER_COPY = 1  # what a detector pickled before the parameter existed did: every column alone


def valid_columns_per_copy(value: Any) -> bool:
    """An int >= 1 (columns per copy) or a float in (0, 1] (a fraction of them): the one check, also the server's."""
    return (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 1) or \
        (isinstance(value, (float, np.floating)) and 0.0 < value <= 1.0)


def _z_nll(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
    """Cell NLL with numeric cells on the standardised scale (NaN where the value is missing)."""
    nll = cell_nll(output, values)
    return torch.where(output.kind == NUMERIC, nll - torch.log(output.std), nll)


def _row_keys(x: np.ndarray) -> list[bytes]:
    """Bytes of each encoded row, NaN and -0.0 canonicalised, to recognise fitted rows."""
    canon = np.where(np.isnan(x), np.float32(np.nan), x + np.float32(0.0)).astype(np.float32)
    return [row.tobytes() for row in np.ascontiguousarray(canon)]


class TabFMAnomalyDetector(OutlierMixin, TabFMEstimator):
    """sklearn outlier detector (IsolationForest-style API). See the module docstring.

    contamination  expected fraction of outliers in the fitted rows, in (0, 0.5]: sets offset_.
    n_folds        folds of the fitted rows for leakage-free scoring of those rows (>= 2).
    max_offset_rows  fitted rows scored to set offset_ when it is first needed (None = all of them).
    columns_per_copy  source columns hidden together in one query copy of a row: an int >= 1 (at most
                   that many), or a float in (0, 1] (that fraction of a column group's scored source
                   columns, rounded up; 1.0 = all at once). Each scored column is hidden in exactly
                   one copy per member (a seeded partition per member); cost ~ 1 / columns_per_copy.
                   Default 0.5: two copies per member, each hiding half of the scored columns.
    Other parameters: see TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODELS["anomaly"], n_estimators: int = DETECTOR_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DETECTOR_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 contamination: float = 0.1, n_folds: int = 5, max_offset_rows: int | None = 512,
                 backend: str = "torch", columns_per_copy: int | float = DEFAULT_COLUMNS_PER_COPY) -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, backend=backend)
        self.contamination = contamination
        self.n_folds = n_folds
        self.max_offset_rows = max_offset_rows
        self.columns_per_copy = columns_per_copy

    def fit(self, X: Any, y: Any = None) -> "TabFMAnomalyDetector":
        if not isinstance(self.contamination, (float, int)) or not 0.0 < self.contamination <= 0.5:
            raise ValueError(f"contamination must be a float in (0, 0.5], got {self.contamination!r}")
        if not isinstance(self.n_folds, (int, np.integer)) or self.n_folds < 2:
            raise ValueError(f"n_folds must be an int >= 2, got {self.n_folds!r}")
        limit = self.max_offset_rows
        if limit is not None and (not isinstance(limit, (int, np.integer)) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"max_offset_rows must be None or an int >= 1, got {limit!r}")
        self._check_columns_per_copy()
        self._fit_table(X)
        n = len(self.train_x_)
        if n < 2:
            raise ValueError(f"TabFMAnomalyDetector needs at least 2 rows to fit, got n_samples = {n}")
        order = np.random.default_rng([self.ensemble_seed_, FOLD_KEY]).permutation(n)
        self.folds_ = np.empty(n, dtype=np.int64)
        self.folds_[order] = np.arange(n) % min(self.n_folds, n)
        n_off = n if self.max_offset_rows is None else min(n, int(self.max_offset_rows))
        pick = np.random.default_rng([self.ensemble_seed_, OFFSET_KEY]).choice(n, n_off, replace=False)
        self.offset_rows_ = np.sort(pick)
        # offset_'s memo, filled when first asked for: a container set here, so that predict leaves the
        # fitted attributes as fit made them (sklearn's rule); the offset is a function of the fit alone
        self.offset_memo_: dict[str, float] = {}
        self.__dict__.pop("offset_", None)  # a detector unpickled with an eager offset, refitted
        return self

    @property
    def offset_(self) -> float:
        """The `contamination` quantile of score_samples over the offset rows (`offset_rows_`).

        Computed on first use (decision_function, predict, or reading it) and kept: scoring the
        offset rows costs as much as scoring as many new rows, which a user who only ranks rows
        with score_samples should not pay for at fit."""
        if "offset_" in self.__dict__:  # pickled before the offset was lazy: computed at its fit
            return self.__dict__["offset_"]
        check_is_fitted(self, "folds_")
        if "offset" not in self.offset_memo_:
            scores = -self._scores(self.train_x_[self.offset_rows_])
            self.offset_memo_["offset"] = float(np.percentile(scores, 100.0 * self.contamination))
        return self.offset_memo_["offset"]

    def score_samples(self, X: Any) -> np.ndarray:
        """-(anomaly score) of each row: higher = more normal (sklearn convention)."""
        check_is_fitted(self, "folds_")
        _, x = self._encode(X)
        return -self._finite(self._scores(x), "anomaly scores")

    def decision_function(self, X: Any) -> np.ndarray:
        """score_samples - offset_: negative for outliers."""
        check_is_fitted(self, "folds_")
        return self.score_samples(X) - self.offset_

    def predict(self, X: Any) -> np.ndarray:
        """-1 for outliers (decision_function < 0), 1 for inliers."""
        return np.where(self.decision_function(X) < 0, -1, 1)

    # ------------------------------------------------------------------ scoring
    def _check_columns_per_copy(self) -> None:
        value = getattr(self, "columns_per_copy", UNSET_COLUMNS_PER_COPY)  # pickled before the parameter existed
        if not valid_columns_per_copy(value):
            raise ValueError("columns_per_copy must be an int >= 1 (source columns hidden together per query copy) "
                             f"or a float in (0, 1] (that fraction of the scored columns), got {value!r}")

    def _copies(self, n_units: int, rng: np.random.Generator) -> list[np.ndarray]:
        """A partition of a column group's `n_units` scored source columns (indices) into the groups one
        query copy each hides: ceil(n_units / k) groups of near-equal size (at most k = columns_per_copy
        each), in a random order drawn from `rng`; k = 1 is one column per copy in column order."""
        value = getattr(self, "columns_per_copy", UNSET_COLUMNS_PER_COPY)
        k = int(np.ceil(value * n_units - 1e-9)) if isinstance(value, (float, np.floating)) else int(value)
        k = max(1, min(k, n_units))
        if k == 1:
            return [np.array([i]) for i in range(n_units)]
        return np.array_split(rng.permutation(n_units), -(-n_units // k))

    def _scored_parts(self, rt: Runtime) -> np.ndarray:
        """Encoded columns whose NLL counts (see the module docstring)."""
        kind, card = self._kind, self._card
        scored = (kind == NUMERIC) | ((kind == CATEGORICAL) & (card <= rt.max_categories))
        for spec, unit in zip(self.schema_.columns, self._units()):
            if spec.type == CONSTANT_T:
                scored[unit] = False
            elif spec.type == DATETIME_T:
                scored[unit] = [part == "epoch" for part in spec.parts]
        return scored

    def _fold_of(self, x: np.ndarray) -> np.ndarray:
        """Fold of the fitted row each row of x equals, -1 when it equals none."""
        index: dict[bytes, int] = {}
        for i, key in enumerate(_row_keys(self.train_x_)):
            index.setdefault(key, i)
        return np.array([self.folds_[index[k]] if k in index else -1 for k in _row_keys(x)], dtype=np.int64)

    def _scores(self, x: np.ndarray) -> np.ndarray:
        """Anomaly score (summed cell NLL) of each row, members averaged."""
        rt = self._runtime()
        scored = self._scored_parts(rt)
        if not scored.any():
            raise ValueError("no column can be scored: every column is constant, text-hashed or has more "
                             f"categories than the model's head ({rt.max_categories})")
        self._check_columns_per_copy()
        fold = self._fold_of(x)
        members = self._members(cover_all=True)
        total = np.zeros(len(x))
        folds = np.unique(fold)
        with self._bar(sum(len(m.column_groups) for m in members) * len(folds), "score_samples") as bar:
            for m in members:
                # the member's query copies of each column group: fixed at fit, whatever rows are scored
                copies = [self._copies(len(self._group_units(group, scored[group])), m.rng(COPY_KEY, g))
                          for g, group in enumerate(m.column_groups)]
                for f in folds:
                    rows = np.flatnonzero(fold == f)
                    pool = np.arange(len(self.train_x_)) if f < 0 else np.flatnonzero(self.folds_ != f)
                    ctx_rows = subsample(m.rng(0, int(f) + 1), pool, self.max_context_rows)
                    for group, parts in zip(m.column_groups, copies):
                        context = self._context(rt.for_member(m), m.view(self.train_x_[ctx_rows], group),
                                                self._kind[group], self._card[group])
                        total[rows] += self._group_scores(context, m.view(x[rows], group), scored[group], group,
                                                          parts)
                        bar.update()
        return total / len(members)

    def _group_units(self, group: np.ndarray, scored: np.ndarray) -> list[np.ndarray]:
        """Positions in `group` of each scored source column's encoded parts, in column order."""
        in_group = set(group.tolist())
        units = [np.flatnonzero(np.isin(group, u)) for u in self._units() if int(u[0]) in in_group]
        return [u for u in units if scored[u].any()]

    def _group_scores(self, context: ContextPredictor, query: np.ndarray, scored: np.ndarray,
                      group: np.ndarray, copies: list[np.ndarray] | None = None) -> np.ndarray:
        """Summed NLL per query row over the source columns of one column group.

        Query rows are replicated, one copy per entry of `copies` (a partition of the group's scored
        source columns, `_copies`; default one column per copy), whose columns the copy hides at
        once; as many copies per pass as fit in `chunk_size` rows.
        """
        units = self._group_units(group, scored)
        copies = [np.array([i]) for i in range(len(units))] if copies is None else copies
        n_q = len(query)
        observed = ~np.isnan(query) & scored[None, :]
        out = np.zeros(n_q)
        per_pass = max(1, self.chunk_size // max(n_q, 1))
        for start in range(0, len(copies), per_pass):
            block = copies[start:start + per_pass]
            qx = np.concatenate([query] * len(block))
            mask = np.zeros(qx.shape, dtype=bool)
            for i, part in enumerate(block):
                for j in part:
                    cols = units[j]
                    hide = observed[:, cols].any(1)  # nothing to score where all its scored parts are missing
                    mask[i * n_q:(i + 1) * n_q][np.ix_(hide, cols)] = True
            if not mask.any():
                continue
            nll = context.predict(qx, mask, _z_nll, self.chunk_size)
            r, c = np.nonzero(mask)
            keep = scored[c] & ~np.isnan(qx[r, c])  # a missing cell has no NLL; an observed one must have one
            np.add.at(out, r[keep] % n_q, self._finite(nll[keep], "anomaly scores"))
        return out
