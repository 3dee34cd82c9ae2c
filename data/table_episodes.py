"""Training episodes from real tables: the fine-tuning counterpart of the synthetic stream.

A user's table becomes an `EpisodeTable`: its *training* rows only (held-out rows never
enter it, see `holdout_split`), encoded features, and the target as the last column (class
codes or numbers). `TableEpisodeSampler` turns such tables into an endless, seeded stream of
`TableBatch`es that ask the same questions pretraining asks:

- prediction episodes: n random training rows, a random fraction of them context, the
  target hidden on the others (a classification or regression question);
- imputation episodes: n random rows, all context, a random fraction of observed cells hidden.

Each episode shows the table the way the estimators do: categorical feature codes and class
codes relabelled by fresh random permutations (codes carry no meaning the model could
memorise), at most `max_columns` random feature columns, more classes than the head's
`max_classes` merged into random groups, and with `categorical="ordinal"` (the estimators'
default) categorical features shown as numbers in prediction episodes.

The batch at stream position p is a pure function of (seed, p, rank): its table, row count and
batch size depend on (seed, p) only, so data-parallel ranks build batches of the same cost; the
episodes depend on the rank too, so ranks never duplicate work. All B episodes of a batch come
from one table and have the same n rows, so they stack with `TableBatch.collate` (prediction
episodes with context features are wider than imputation episodes: those get padding columns).
Resuming needs only the next position (`state_dict`).

`pose_episode` is the episode logic itself, on rows chosen by the caller: the table-store
pretraining source (`tabfm.data.store_episodes`) poses one episode per planned table with it. An
`EpisodeTable` with task "imputation" has no target column (every column is a feature) and
poses only imputation episodes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from .batch import CATEGORICAL, NUMERIC, TableBatch
from .context_features import ContextFeatureSpec, context_features, feature_refs, ridge_baseline
from .encode import TableSchema, encode_frame
from .masking import hide_cells, mechanism_shares
from .seekable import SeekableStream

CLASSIFICATION, REGRESSION, IMPUTATION = "classification", "regression", "imputation"
PREDICTION_TASKS = (CLASSIFICATION, REGRESSION)
CATEGORICAL_MODES = ("ordinal", "identity")
MAX_INT_CLASSES = 20  # an integer target with at most this many distinct values is read as classes (as `tabfm predict`)
_BATCH, _EPISODE, _SPLIT = 0, 1, 2  # spawn-key domains: batch shape, episodes, the holdout split


# --------------------------------------------------------------------------- tasks and splits

def infer_task(y: pd.Series) -> str:
    """classification for non-numeric / boolean targets and integers with few values, else regression."""
    if pd.api.types.is_bool_dtype(y.dtype) or not pd.api.types.is_numeric_dtype(y.dtype):
        return CLASSIFICATION
    if pd.api.types.is_integer_dtype(y.dtype) and y.nunique() <= MAX_INT_CLASSES:
        return CLASSIFICATION
    return REGRESSION


def holdout_split(n_rows: int, fraction: float, seed: int, strata: np.ndarray | None = None, stream: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows), sorted, about `fraction` of the rows held out.

    With `strata` (class codes) the split is stratified: each class with at least 2 rows gives
    round(fraction * its rows) of them (at least 1, never all) to the held-out split; a class
    with a single row stays in training, so every held-out class was seen in training.
    `stream` keeps the splits of several tables apart (e.g. a hash of the table name).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction!r}")
    rng = _rng(seed, _SPLIT, stream)
    if strata is None:
        order = rng.permutation(n_rows)
        k = min(max(int(round(fraction * n_rows)), 1), n_rows - 1) if n_rows >= 2 else 0
        held = order[:k]
    else:
        strata = np.asarray(strata)
        held_parts = []
        for label in np.unique(strata):
            members = rng.permutation(np.flatnonzero(strata == label))
            if len(members) >= 2:
                held_parts.append(members[: min(max(int(round(fraction * len(members))), 1), len(members) - 1)])
        held = np.concatenate(held_parts) if held_parts else np.empty(0, dtype=np.int64)
    mask = np.zeros(n_rows, dtype=bool)
    mask[held] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def fold_split(n_rows: int, folds: int, fold: int, seed: int, strata: np.ndarray | None = None, stream: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of fold `fold` of a `folds`-fold split, sorted: the folds'
    held-out rows partition the rows, so scores pooled over the folds cover every row once.

    Rows are dealt round-robin in a seeded order; with `strata` (class codes) class by class, so
    each fold holds about 1/folds of every class. A class with a single row is never held out
    (it stays in training in every fold, as in `holdout_split`); a class of 2..folds-1 rows gives at
    most one row to each fold, so every held-out class was seen in training."""
    if not (isinstance(folds, int) and folds >= 2 and isinstance(fold, int) and 0 <= fold < folds):
        raise ValueError(f"fold {fold!r} of {folds!r} folds: need folds >= 2 and 0 <= fold < folds")
    if n_rows < folds:
        raise ValueError(f"{n_rows} rows are too few for {folds} folds (each fold holds out at least one row)")
    rng = _rng(seed, _SPLIT, stream)
    assign = np.full(n_rows, -1, dtype=np.int64)
    if strata is None:
        assign[rng.permutation(n_rows)] = np.arange(n_rows) % folds
    else:
        strata = np.asarray(strata)
        dealt = 0  # the deal runs on across classes, so fold sizes differ by at most one row per class
        for label in np.unique(strata):
            members = rng.permutation(np.flatnonzero(strata == label))
            if len(members) >= 2:
                assign[members] = (dealt + np.arange(len(members))) % folds
                dealt += len(members)
    return np.flatnonzero(assign != fold), np.flatnonzero(assign == fold)


# --------------------------------------------------------------------------- one table

@dataclass
class EpisodeTable:
    """The training rows of one real table, ready for episodes.

    x            float32 (n, C): encoded features, then the target as the last column
                 (task "imputation": features only, no target column)
    kind         int8 (C,): tabfm.data.batch NUMERIC / CATEGORICAL per column (target included)
    cardinality  int64 (C,): categories per column (classes for a classification target)
    task         "classification" | "regression" | "imputation" (a table without a target)
    rows         int64 (n,): each row's position in the source table (for audits: which rows trained)
    """

    name: str
    x: np.ndarray
    kind: np.ndarray
    cardinality: np.ndarray
    task: str
    rows: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def n_cols(self) -> int:
        return int(self.x.shape[1])

    @property
    def n_features(self) -> int:
        """Feature columns (all columns but the target; all of them for an imputation table)."""
        return self.n_cols - (self.task != IMPUTATION)

    def __post_init__(self) -> None:
        if self.task == IMPUTATION:
            if self.x.ndim != 2 or self.x.shape[0] < 1 or self.x.shape[1] < 1:
                raise ValueError(f"table {self.name!r}: an imputation table needs at least 1 row and 1 column, "
                                 f"got shape {self.x.shape}")
            if len(self.kind) != self.n_cols or len(self.cardinality) != self.n_cols or len(self.rows) != self.n_rows:
                raise ValueError(f"table {self.name!r}: kind, cardinality and rows do not match x of shape {self.x.shape}")
            return
        if self.task not in PREDICTION_TASKS:
            raise ValueError(f"table {self.name!r}: task {self.task!r} is not one of {PREDICTION_TASKS + (IMPUTATION,)}")
        if self.x.ndim != 2 or self.x.shape[1] < 2 or self.x.shape[0] < 2:
            raise ValueError(f"table {self.name!r}: needs at least 2 training rows and 1 feature column besides "
                             f"the target, got shape {self.x.shape}")
        if len(self.kind) != self.n_cols or len(self.cardinality) != self.n_cols or len(self.rows) != self.n_rows:
            raise ValueError(f"table {self.name!r}: kind, cardinality and rows do not match x of shape {self.x.shape}")
        if np.isnan(self.x[:, -1]).any():
            raise ValueError(f"table {self.name!r}: the target (last column) has missing values")

    @classmethod
    def encode(cls, name: str, features: pd.DataFrame, y: np.ndarray, task: str, rows: np.ndarray,
               n_classes: int | None = None) -> tuple["EpisodeTable", TableSchema]:
        """Encode training-row features (schema fitted on them) and append the target.

        y: class codes 0..n_classes-1 (classification) or numbers (regression), one per row."""
        enc, schema = encode_frame(features)
        target = np.asarray(y, dtype=np.float32)[:, None]
        is_cls = task == CLASSIFICATION
        table = cls(
            name=name,
            x=np.concatenate([enc.x.numpy(), target], axis=1),
            kind=np.append(enc.kind.numpy(), np.int8(CATEGORICAL if is_cls else NUMERIC)).astype(np.int8),
            cardinality=np.append(enc.cardinality.numpy(), n_classes if is_cls else 0).astype(np.int64),
            task=task,
            rows=np.asarray(rows, dtype=np.int64),
        )
        return table, schema


# --------------------------------------------------------------------------- sampler

@dataclass(frozen=True)
class EpisodeConfig:
    """How episodes are cut from real tables.

    min_rows, max_rows   rows per episode, drawn per batch (capped by the table's training rows)
    cells_per_batch      B = clamp(cells_per_batch // (rows * cols), 1, max_batch) episodes per batch
    max_columns          feature columns per episode; wider tables show a random subset
    max_classes          classes the categorical head scores (model.config.max_categories); more
                         classes are merged into random groups of classes per episode
    context_fraction     prediction episodes: share of the rows that are context, ~ U(low, high)
    mask_fraction        imputation episodes: share of observed cells hidden, ~ U(low, high)
    mask_mechanisms      imputation episodes: shares of MCAR / MAR / MNAR masks (data.masking)
    imputation           probability that an episode is an imputation episode
    categorical          "ordinal" (categorical features shown as relabelled codes read as numbers in
                         prediction episodes, the estimators' default) or "identity" (categorical cells)
    context_features     extra columns of prediction episodes (tabfm.data.context_features; the model's
                         ModelConfig.context_features), inserted before the target as the estimators do
    row_multiple         episode rows are a multiple of this (row-sequence parallelism splits every
                         table's rows evenly over its sp ranks; 1: any count)
    residual_targets     share of regression episodes whose target is what a context-fitted ridge
                         misses (context_features.ridge_baseline), as TabFMRegressor asks by default
    """

    min_rows: int = 32
    max_rows: int = 512
    cells_per_batch: int = 16384
    max_batch: int = 32
    max_columns: int = 100
    max_classes: int = 10
    context_fraction: tuple[float, float] = (0.3, 0.9)
    mask_fraction: tuple[float, float] = (0.05, 0.3)
    mask_mechanisms: tuple[float, float, float] = (1.0, 0.0, 0.0)
    imputation: float = 0.2
    categorical: str = "ordinal"
    context_features: str = "none"
    row_multiple: int = 1
    residual_targets: float = 0.0

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"EpisodeConfig.{name} = {getattr(self, name)!r}: {what}")

        for name in ("min_rows", "max_rows", "cells_per_batch", "max_batch", "max_columns", "row_multiple"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "must be an integer >= 1")
        need(self.min_rows >= 2, "min_rows", "must be >= 2 (a context and a query row)")
        need(self.min_rows <= self.max_rows, "min_rows", f"must be <= max_rows = {self.max_rows}")
        need(isinstance(self.max_classes, int) and self.max_classes >= 2, "max_classes", "must be an integer >= 2")
        need(0.0 <= self.imputation <= 1.0, "imputation", "must be a probability in [0, 1]")
        need(isinstance(self.residual_targets, (int, float)) and not isinstance(self.residual_targets, bool)
             and 0.0 <= self.residual_targets <= 1.0, "residual_targets", "must be a probability in [0, 1]")
        need(self.categorical in CATEGORICAL_MODES, "categorical", f"must be one of {CATEGORICAL_MODES}")
        need(self.context_features in ContextFeatureSpec.NAMES, "context_features",
             f"must be one of {ContextFeatureSpec.NAMES}")
        for name, open_low in (("context_fraction", True), ("mask_fraction", False)):
            v = getattr(self, name)
            ok = isinstance(v, (tuple, list)) and len(v) == 2 and 0.0 <= v[0] <= v[1] <= 1.0 and (v[1] > 0 or not open_low)
            need(ok, name, "must be a (low, high) pair with 0 <= low <= high <= 1")
            object.__setattr__(self, name, (float(v[0]), float(v[1])))
        object.__setattr__(self, "mask_mechanisms", mechanism_shares(self.mask_mechanisms, "EpisodeConfig.mask_mechanisms"))

    def replace(self, **changes: Any) -> "EpisodeConfig":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- one episode

def pose_episode(table: EpisodeTable, take: np.ndarray, cols: int, task: str, cfg: EpisodeConfig,
                 rng: np.random.Generator) -> TableBatch:
    """One episode of `task` on rows `take` (positions in `table.x`, in that order): a one-table TableBatch.

    cols: columns the episode shows (target included for prediction tables); a wider table shows
    `cols` random feature columns (`cols - 1` plus the target for a prediction table). Categorical
    codes (target classes included) are relabelled, more classes than `cfg.max_classes` merged
    into random groups; prediction episodes hide the target on a random share of the rows
    (`cfg.context_fraction` are context), imputation episodes a random share of the observed
    cells (`cfg.mask_fraction`, `cfg.mask_mechanisms`). Prediction needs at least 2 rows and a prediction table.
    """
    if task != IMPUTATION and (table.task == IMPUTATION or len(take) < 2):
        raise ValueError(f"table {table.name!r}: a {task} episode needs a prediction table and at least 2 rows "
                         f"(table task {table.task!r}, {len(take)} rows)")
    has_target = table.task != IMPUTATION
    n, n_feat = len(take), table.n_features
    n_show = cols - 1 if has_target else cols
    feats = np.sort(rng.choice(n_feat, size=n_show, replace=False)) if n_show < n_feat else np.arange(n_feat)
    columns = np.append(feats, n_feat) if has_target else feats  # the target stays last
    cols = len(columns)
    x = table.x[np.ix_(take, columns)].copy()
    kind, card = table.kind[columns].copy(), table.cardinality[columns].copy()

    # codes carry no meaning: relabel every categorical column (target classes included)
    for j in np.flatnonzero((kind == CATEGORICAL) & (card >= 2)):
        present = ~np.isnan(x[:, j])
        x[present, j] = rng.permutation(int(card[j]))[x[present, j].astype(np.int64)]
    if table.task == CLASSIFICATION and card[-1] > cfg.max_classes:  # more classes than the head: random groups
        # max_classes groups, as many as the head scores (this was ceil(classes / max_classes): 3 groups
        # of 25 classes, and over max_classes groups past max_classes^2 classes, which the loss skips)
        n_groups = cfg.max_classes
        group = np.arange(int(card[-1])) * n_groups // int(card[-1])
        x[:, -1] = group[x[:, -1].astype(np.int64)]
        card[-1] = n_groups

    context = np.ones(n, dtype=bool)
    query = np.zeros((n, cols), dtype=bool)
    refs = None
    if task == IMPUTATION:
        query = hide_cells(x, rng, cfg.mask_fraction, cfg.mask_mechanisms)
    else:
        lo, hi = cfg.context_fraction
        n_ctx = int(np.clip(round(rng.uniform(lo, hi) * n), 1, n - 1))
        context[:] = False
        context[rng.permutation(n)[:n_ctx]] = True
        query[~context, -1] = True
        if table.task == REGRESSION and cfg.residual_targets > 0 and rng.random() < cfg.residual_targets:
            base_c, base_q = ridge_baseline(x[context, :-1], x[~context, :-1], kind[:-1], card[:-1], x[context, -1], rng)
            x[context, -1] -= base_c.astype(x.dtype)
            x[~context, -1] -= base_q.astype(x.dtype)
        spec = ContextFeatureSpec.named(cfg.context_features)
        if spec is not None:  # measured on the codes as encoded, before they are shown as numbers
            n_classes = int(card[-1]) if table.task == CLASSIFICATION else None
            extra_c, extra_q = context_features(x[context, :-1], x[~context, :-1], kind[:-1], card[:-1],
                                                x[context, -1], n_classes, spec, rng)
            extra = np.zeros((n, extra_c.shape[1]), dtype=np.float32)
            extra[context], extra[~context] = extra_c, extra_q
            x = np.hstack([x[:, :-1], extra, x[:, -1:]])
            kind = np.concatenate([kind[:-1], np.full(extra.shape[1], NUMERIC, dtype=kind.dtype), kind[-1:]])
            card = np.concatenate([card[:-1], np.zeros(extra.shape[1], dtype=card.dtype), card[-1:]])
            query = np.hstack([query[:, :-1], np.zeros((n, extra.shape[1]), dtype=bool), query[:, -1:]])
            refs = feature_refs(x.shape[1], slice(x.shape[1] - 1 - extra.shape[1], -1), x.shape[1] - 1, spec, n_classes)
        if cfg.categorical == "ordinal":  # as the estimators show features by default: codes read as numbers
            cat_feat = kind[:-1] == CATEGORICAL
            kind[:-1][cat_feat], card[:-1][cat_feat] = NUMERIC, 0
    return TableBatch.from_table(torch.from_numpy(x), torch.from_numpy(kind), torch.from_numpy(card),
                                 torch.from_numpy(context), torch.from_numpy(query),
                                 feature_ref=None if refs is None else torch.from_numpy(refs))


@dataclass(frozen=True)
class EpisodeInfo:
    """What a batch holds beyond its tensors: its table, each episode's task and source rows."""

    position: int
    rank: int
    table: str
    tasks: tuple[str, ...]
    rows: tuple[np.ndarray, ...]  # per episode: the source-table row of each batch row


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


class TableEpisodeSampler(SeekableStream):
    """An endless, seeded stream of episode batches from the training rows of real tables.

    Iterating yields `TableBatch`es from `position` on (advancing it); `episode_at(p)` also
    returns the `EpisodeInfo` (which rows each episode used). Tables are drawn in proportion
    to their training rows.
    """

    kind = "sampler"

    def __init__(self, tables: Sequence[EpisodeTable], cfg: EpisodeConfig | None = None, seed: int = 0,
                 rank: int = 0, world_size: int = 1, position: int = 0) -> None:
        if not tables:
            raise ValueError("TableEpisodeSampler needs at least one table")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.tables = list(tables)
        self.cfg = cfg or EpisodeConfig()
        self.seed, self.rank, self.world_size, self.position = int(seed), int(rank), int(world_size), int(position)
        sizes = np.array([t.n_rows for t in self.tables], dtype=np.float64)
        self._cum = np.cumsum(sizes / sizes.sum())

    # ------------------------------------------------------------ shapes
    def shape_at(self, position: int) -> tuple[int, int, int, int]:
        """(table index, rows, columns, episodes) of the batch at `position`: the same on every rank."""
        rng = _rng(self.seed, _BATCH, position)
        t = min(int(np.searchsorted(self._cum, rng.random(), side="right")), len(self.tables) - 1)
        table = self.tables[t]
        lo, hi = min(self.cfg.min_rows, table.n_rows), min(self.cfg.max_rows, table.n_rows)
        rows = int(rng.integers(lo, hi + 1))
        m = self.cfg.row_multiple
        if m > 1:
            if table.n_rows < m:
                raise ValueError(f"table {table.name!r}: {table.n_rows} training rows cannot be split over "
                                 f"{m} row-sequence-parallel ranks")
            rows = max(m, rows - rows % m)
        cols = min(table.n_features, self.cfg.max_columns) + (table.task != IMPUTATION)
        batch = int(np.clip(self.cfg.cells_per_batch // (rows * cols), 1, self.cfg.max_batch))
        return t, rows, cols, batch

    # ------------------------------------------------------------ episodes
    def episode_at(self, position: int) -> tuple[TableBatch, EpisodeInfo]:
        """The batch at `position` and what it holds."""
        t, rows, cols, batch = self.shape_at(position)
        table = self.tables[t]
        parts, tasks, used = [], [], []
        for j in range(batch):
            rng = _rng(self.seed, _EPISODE, position, self.rank, j)
            part, task, source_rows = self._episode(table, rng, rows, cols)
            parts.append(part)
            tasks.append(task)
            used.append(source_rows)
        info = EpisodeInfo(position, self.rank, table.name, tuple(tasks), tuple(used))
        return TableBatch.collate(parts, pad_columns=True), info

    def batch_at(self, position: int) -> TableBatch:
        return self.episode_at(position)[0]

    def _episode(self, table: EpisodeTable, rng: np.random.Generator, n: int, cols: int
                 ) -> tuple[TableBatch, str, np.ndarray]:
        task = IMPUTATION if rng.random() < self.cfg.imputation else table.task
        take = rng.choice(table.n_rows, size=n, replace=False)
        return pose_episode(table, take, cols, task, self.cfg, rng), task, table.rows[take]
