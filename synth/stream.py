"""SynthStream: an endless, seeded, size-bucketed stream of synthetic TableBatches.

Stream position p is one training step. Its shape (rows R, columns C, batch size B)
is a pure function of (seed, p), so every data-parallel rank at step p builds a
batch of the same shape and cost. Rank r's table j at position p is a pure function
of (seed, p, r, j): no two ranks or workers see the same table, any table can be
rebuilt from its index, and resuming needs only the next position.

Sizes: R is a multiple of `row_quantum` (shapes form a finite set of buckets),
R*C <= max_cells, and B = clamp(cells_per_batch // (R*C), 1, max_batch), so every
batch carries about the same number of cells whatever its shape.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from tabfm.data.batch import TableBatch
from tabfm.data.seekable import SeekableStream
from .config import PriorConfig
from tabfm.data.context_features import ContextFeatureSpec
from tabfm.data.masking import mechanism_shares
from .episodes import (IMPUTATION, TASKS, Episode, imputation_episode, pack, prediction_episode, with_residual_target,
                            with_context_features)
from .prior import sample_table
from .table import CLASSIFICATION, REGRESSION, SynthTable

# spawn-key domains: keep the random streams of shapes, tables, raw frames and context features apart
_SHAPE, _TABLE, _RAW, _FEATURES, _RESIDUAL = 0, 1, 2, 3, 4
_SHAPE_TRIES = 64


# the wide CPU stages (pretrain-wide, pretrain-mixed): tables up to 1024 x 64
_WIDE = dict(min_rows=64, max_rows=1024, min_cols=2, max_cols=64, max_cells=16384, row_quantum=32,
             cells_per_batch=32768, max_batch=32, classification=0.6, regression=0.2, imputation=0.2)


@dataclass(frozen=True)
class StreamConfig:
    """Sizes, batching and episode mix of a synthetic stream (the prior is `prior`).

    Columns count the target. Rows are rounded to multiples of `row_quantum`.
    The episode mix (classification / regression / imputation) is normalised.
    `mask_mechanisms` are the shares of MCAR / MAR / MNAR masks in imputation episodes
    (synth.episodes.imputation_episode), normalised.
    `context_features` names a tabfm.data.context_features spec ("none", "knn-linear", "knn"): prediction
    episodes then carry those extra columns after their own, so a batch is wider than its bucket
    by the widest table's extras (up to (max_classes - 1) x 3 columns with "knn-linear"), and holds
    only as many of the bucket's tables as keep it within `cells_per_batch` padded cells.
    `residual_targets`: the share of regression episodes whose target is what a context-fitted ridge
    misses (synth.episodes.with_residual_target), the question TabFMRegressor asks by default.
    `table_multiple` = M > 1: every batch holds a multiple of M tables (at least M, even where M of
    the position's shape exceed `cells_per_batch`), so it cuts into M equal micro-batches of whole
    tables (`tabfm pretrain --microbatches M`, the pipeline's micro-batches).
    """

    prior: PriorConfig = field(default_factory=PriorConfig)
    min_rows: int = 64
    max_rows: int = 1024
    min_cols: int = 2
    max_cols: int = 64
    max_cells: int = 32768
    row_quantum: int = 32
    cells_per_batch: int = 131072
    max_batch: int = 64
    classification: float = 0.4
    regression: float = 0.3
    imputation: float = 0.3
    context_fraction: tuple[float, float] = (0.3, 0.9)
    mask_fraction: tuple[float, float] = (0.05, 0.3)
    mask_mechanisms: tuple[float, float, float] = (1.0, 0.0, 0.0)
    context_features: str = "none"
    table_multiple: int = 1
    residual_targets: float = 0.0

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # the pretraining default: tables up to 1024 x 64, ~128k cells per batch
        "default": {},
        # a quick look or a CPU smoke run: tables up to 256 x 16
        "small": dict(min_rows=16, max_rows=256, min_cols=2, max_cols=16, max_cells=4096,
                      row_quantum=16, cells_per_batch=16384, max_batch=32),
        # unit tests: tables up to 64 x 8
        "tiny": dict(min_rows=8, max_rows=64, min_cols=2, max_cols=8, max_cells=512,
                     row_quantum=8, cells_per_batch=2048, max_batch=16),
        # CPU pretraining of tabfm-tiny: tables up to 512 x 24, ~16k cells per batch, mostly classification
        "pretrain": dict(min_rows=32, max_rows=512, min_cols=2, max_cols=24, max_cells=8192,
                         row_quantum=32, cells_per_batch=16384, max_batch=32,
                         classification=0.6, regression=0.2, imputation=0.2),
        # a longer CPU stage from pretrained weights: tables up to 1024 x 64 (wide, long contexts)
        "pretrain-wide": _WIDE,
        # pretrain-wide with up to all features categorical (the default prior stops at half):
        # categorical-heavy tables such as tic-tac-toe or german credit
        "pretrain-mixed": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0))},
        # pretrain-mixed with half of the classification targets cut into equal-share classes: every
        # class count 2..10 about as often (10-class targets ~7% instead of ~2%), for the many-class tables
        "pretrain-classes": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5)},
        # pretrain-classes with half of the classification targets nominal (a multinomial logit of the
        # target node and some feature nodes: classes not ordered along one node, often linearly
        # separated), as in tables such as vehicle or segment
        "pretrain-nominal": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                            p_nominal_classes=0.5)},
        # nanoTabPFN-sized tables: 150 rows x 5 features + the target, classification only, a
        # context share drawn as nanoTabPFN draws its split (the equal-budget study of BENCHMARKS.md)
        "nano": dict(min_rows=150, max_rows=150, min_cols=6, max_cols=6, max_cells=900, row_quantum=10,
                     cells_per_batch=28800, max_batch=32, classification=1.0, regression=0.0, imputation=0.0,
                     context_fraction=(0.1, 0.9)),
        # many small tables of every task (up to 256 x 12, context share 0.1-0.9, up to all features
        # categorical): a curriculum stage for more episodes per CPU-minute than pretrain-mixed
        "pretrain-small": dict(min_rows=32, max_rows=256, min_cols=3, max_cols=12, max_cells=3072,
                               row_quantum=16, cells_per_batch=24576, max_batch=48,
                               classification=0.6, regression=0.2, imputation=0.2,
                               context_fraction=(0.1, 0.9), prior=PriorConfig(categorical_fraction=(0.0, 1.0))),
        # pretrain-nominal with more imputation episodes at an imputation benchmark's missingness: up
        # to half the observed cells hidden, MCAR, MAR and MNAR masks in equal shares
        "pretrain-impute": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                           p_nominal_classes=0.5),
                            "classification": 0.45, "regression": 0.2, "imputation": 0.35,
                            "mask_fraction": (0.05, 0.55), "mask_mechanisms": (1.0, 1.0, 1.0)},
        # pretrain-impute's imputation episodes, with feature cells missing in more tables and at an
        # imputation benchmark's rates (up to 60 %, MCAR/MAR/MNAR in equal shares): the prediction
        # questions a column-at-a-time imputer asks, whose other columns are half empty
        "pretrain-missing": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                            p_nominal_classes=0.5, p_missing=0.6, missing_rate=(0.05, 0.6),
                                                            p_mcar=1.0, p_mar=1.0, p_mnar=1.0),
                             "mask_fraction": (0.05, 0.55), "mask_mechanisms": (1.0, 1.0, 1.0)},
        # pretrain-nominal with half of the regression episodes asking for the ridge residual, the
        # question TabFMRegressor asks by default (its linear_residual)
        "pretrain-residual": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                             p_nominal_classes=0.5),
                              "residual_targets": 0.5},
        # pretrain-impute's episode mix and masks with pretrain-residual's regression questions: a stage
        # that keeps what the residual stage gains for the regressor without losing the imputer
        "pretrain-residual-impute": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                                    p_nominal_classes=0.5),
                                     "classification": 0.45, "regression": 0.2, "imputation": 0.35,
                                     "mask_fraction": (0.05, 0.55), "mask_mechanisms": (1.0, 1.0, 1.0),
                                     "residual_targets": 0.5},
        # pretrain-residual-impute on tables whose answer changes by region: twice the decision-tree nodes
        # (piecewise answers split on a few columns) and three times the clustered (prototype-mixture) rows,
        # the tables where the estimators' local contexts gain over one global context
        "pretrain-regions": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.5,
                                                            p_nominal_classes=0.5, p_tree_node=0.4, p_non_iid=0.3),
                             "classification": 0.45, "regression": 0.2, "imputation": 0.35,
                             "mask_fraction": (0.05, 0.55), "mask_mechanisms": (1.0, 1.0, 1.0),
                             "residual_targets": 0.5},
        # pretrain-residual-impute with more classification episodes (60 %) and nine of ten class targets cut
        # at equal shares, so 5-10-class targets (digits, segment, vehicle) are half of the classification
        # episodes instead of about a third
        "pretrain-many-classes": {**_WIDE, "prior": PriorConfig(categorical_fraction=(0.0, 1.0), p_equal_class_shares=0.9,
                                                                 p_nominal_classes=0.5),
                                  "classification": 0.6, "regression": 0.15, "imputation": 0.25,
                                  "mask_fraction": (0.05, 0.55), "mask_mechanisms": (1.0, 1.0, 1.0),
                                  "residual_targets": 0.5},
        # larger tables for longer pretraining
        "large": dict(min_rows=128, max_rows=4096, min_cols=2, max_cols=128, max_cells=131072,
                      row_quantum=64, cells_per_batch=524288, max_batch=128),
    }

    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> "StreamConfig":
        """A named configuration with field overrides (validated)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown StreamConfig preset {name!r}; choose from {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "StreamConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- derived
    @property
    def row_range(self) -> tuple[int, int]:
        """Smallest and largest row count after rounding to row_quantum."""
        q = self.row_quantum
        return -(-self.min_rows // q) * q, self.max_rows // q * q

    @property
    def mix(self) -> dict[str, float]:
        """Normalised episode mix {task: probability}."""
        w = {CLASSIFICATION: self.classification, REGRESSION: self.regression, IMPUTATION: self.imputation}
        total = sum(w.values())
        return {k: v / total for k, v in w.items()}

    # ------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"StreamConfig.{name} {msg} (got {getattr(self, name.split('.')[0])!r})")

        if self.context_features not in ContextFeatureSpec.NAMES:
            raise ValueError(f"StreamConfig.context_features must be one of {', '.join(ContextFeatureSpec.NAMES)} "
                             f"(got {self.context_features!r})")
        if not isinstance(self.prior, PriorConfig):
            raise ValueError(f"StreamConfig.prior must be a PriorConfig, got {type(self.prior).__name__}")
        for name in ("min_rows", "max_rows", "min_cols", "max_cols", "max_cells", "row_quantum", "cells_per_batch", "max_batch",
                     "table_multiple"):
            v = getattr(self, name)
            need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(self.min_rows >= 2, "min_rows", "must be >= 2 (a prediction episode needs a context and a query row)")
        need(self.min_rows <= self.max_rows, "min_rows", f"must be <= max_rows={self.max_rows}")
        need(self.min_cols >= 2, "min_cols", "must be >= 2 (the target and at least one feature)")
        need(self.min_cols <= self.max_cols, "min_cols", f"must be <= max_cols={self.max_cols}")
        lo, hi = self.row_range
        need(lo <= hi, "row_quantum", f"leaves no multiple of itself in [min_rows, max_rows] = [{self.min_rows}, {self.max_rows}]")
        need(lo * self.min_cols <= self.max_cells, "max_cells",
             f"must be >= the smallest table, {lo} rows x {self.min_cols} cols = {lo * self.min_cols}")
        need(self.max_cells <= self.cells_per_batch, "cells_per_batch", f"must be >= max_cells={self.max_cells}")
        max_classes = getattr(self.prior, "max_classes", 2)
        if not (isinstance(max_classes, numbers.Integral) and max_classes >= 2):
            raise ValueError(f"StreamConfig.prior.max_classes must be an integer >= 2 (got {max_classes!r})")
        p_cls = getattr(self.prior, "p_classification", 0.5)
        if not 0.0 <= p_cls <= 1.0:
            raise ValueError(f"StreamConfig.prior.p_classification must be in [0, 1] (got {p_cls!r})")
        for name in ("classification", "regression", "imputation", "residual_targets"):
            v = getattr(self, name)
            need(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= v <= 1.0, name, "must be a probability in [0, 1]")
        if self.classification + self.regression + self.imputation <= 0:
            raise ValueError("StreamConfig.classification + regression + imputation (the episode mix) must sum to > 0")
        for name, open_low in (("context_fraction", True), ("mask_fraction", False)):
            v = getattr(self, name)
            ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(u, numbers.Real) for u in v)
            need(ok, name, "must be a (low, high) pair")
            need(0.0 <= v[0] <= v[1] <= 1.0 and (v[1] > 0 or not open_low), name, "must satisfy 0 <= low <= high <= 1")
            object.__setattr__(self, name, (float(v[0]), float(v[1])))  # frozen: normalise once here
        object.__setattr__(self, "mask_mechanisms", mechanism_shares(self.mask_mechanisms, "StreamConfig.mask_mechanisms"))


@dataclass(frozen=True)
class Bucket:
    """The shape of one stream position: B tables of R rows x C columns."""

    rows: int
    cols: int
    batch: int

    @property
    def cost(self) -> int:
        """Cells in the batch, B * R * C."""
        return self.batch * self.rows * self.cols


@dataclass(frozen=True)
class BatchInfo:
    """What a batch holds beyond its tensors: where it came from and which task each table poses."""

    position: int
    rank: int
    tasks: tuple[str, ...]
    n_classes: tuple[int, ...]  # classes of each classification target, 0 for the other tasks


def bucket_at(cfg: StreamConfig, seed: int, position: int) -> Bucket:
    """The shape of stream position `position`: a pure function of (cfg, seed, position).

    R and C are drawn uniformly (R over multiples of row_quantum) and redrawn while
    R*C > max_cells; after a few misses R is cut to fit, so the draw always ends.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_SHAPE, position)))
    q = cfg.row_quantum
    lo, hi = cfg.row_range
    for _ in range(_SHAPE_TRIES):
        rows = int(rng.integers(lo // q, hi // q + 1)) * q
        cols = int(rng.integers(cfg.min_cols, cfg.max_cols + 1))
        if rows * cols <= cfg.max_cells:
            break
    else:
        cols = min(cols, cfg.max_cells // lo)
        rows = max(lo, cfg.max_cells // cols // q * q)
    batch = int(np.clip(cfg.cells_per_batch // (rows * cols), 1, cfg.max_batch))
    m = cfg.table_multiple
    return Bucket(rows=rows, cols=cols, batch=max(m, batch // m * m))


def table_rng(seed: int, position: int, rank: int, index: int, domain: int = _TABLE) -> np.random.Generator:
    """The generator of table `index` of rank `rank` at stream position `position`."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(domain, position, rank, index)))


def _check_index(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class SynthStream(SeekableStream):
    """An endless iterable of TableBatches for rank `rank` of `world_size`.

    Iteration starts at `position` and advances it by one per yielded batch, so
    `state_dict()` taken after k batches resumes at batch k exactly.
    """

    def __init__(self, cfg: StreamConfig | None = None, seed: int = 0, rank: int = 0, world_size: int = 1, position: int = 0):
        self.cfg = StreamConfig() if cfg is None else cfg
        if not isinstance(self.cfg, StreamConfig):
            raise ValueError(f"SynthStream cfg must be a StreamConfig, got {type(self.cfg).__name__}")
        self.seed = _check_index("seed", seed)
        self.world_size = _check_index("world_size", world_size, 1)
        self.rank = _check_index("rank", rank)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        self.position = _check_index("position", position)
        prior = self.cfg.prior
        # one prior per task, so the episode mix (not the prior) decides the task of a prediction table
        self._priors = {
            CLASSIFICATION: dataclasses.replace(prior, p_classification=1.0),
            REGRESSION: dataclasses.replace(prior, p_classification=0.0),
            IMPUTATION: prior,
        }
        self._features = ContextFeatureSpec.named(self.cfg.context_features)
        mix = self.cfg.mix
        self._tasks = list(mix)
        self._cum = np.cumsum([mix[t] for t in self._tasks])

    # ------------------------------------------------------------ generation
    def bucket(self, position: int) -> Bucket:
        """Shape of `position` (the same on every rank)."""
        return bucket_at(self.cfg, self.seed, position)

    def table(self, position: int, index: int) -> tuple[SynthTable, Episode]:
        """Table `index` of this rank at `position` and the episode it poses."""
        b = self.bucket(position)
        return self._table(position, index, b.rows, b.cols)

    def _table(self, position: int, index: int, rows: int, cols: int, features: bool = True
               ) -> tuple[SynthTable, Episode]:
        rng = table_rng(self.seed, position, self.rank, index)
        task = self._tasks[min(int(np.searchsorted(self._cum, rng.random(), side="right")), len(self._tasks) - 1)]
        table = sample_table(self._priors[task], rng, rows, cols)
        if task == IMPUTATION:
            episode = imputation_episode(table, rng, self.cfg.mask_fraction, self.cfg.mask_mechanisms)
        else:
            episode = prediction_episode(table, rng, self.cfg.context_fraction)
        if features and task == REGRESSION and self.cfg.residual_targets > 0:  # own stream: the rest draws as without
            rng_r = table_rng(self.seed, position, self.rank, index, _RESIDUAL)
            if rng_r.random() < self.cfg.residual_targets:
                table = with_residual_target(table, episode, rng_r)
        if features and self._features is not None:
            rng_f = table_rng(self.seed, position, self.rank, index, _FEATURES)
            table, episode = with_context_features(table, episode, self._features, rng_f)
        return table, episode

    def episode_at(self, position: int) -> tuple[TableBatch, BatchInfo]:
        """The batch at `position` with its BatchInfo (tasks, classes)."""
        position = _check_index("position", position)
        b = self.bucket(position)
        pairs: list[tuple[SynthTable, Episode]] = []
        width, m = 0, self.cfg.table_multiple
        for j in range(b.batch):  # context features widen tables: stop where the padded batch outgrows the budget
            pair = self._table(position, j, b.rows, b.cols)
            wider = max(width, pair[0].shape[1])
            if len(pairs) >= m and (len(pairs) + 1) * b.rows * wider > self.cfg.cells_per_batch:
                break
            pairs.append(pair)
            width = wider
        pairs = pairs[:len(pairs) // m * m]  # whole groups of table_multiple
        width = max(t.shape[1] for t, _ in pairs)
        tables = [t for t, _ in pairs]
        episodes = [e for _, e in pairs]
        info = BatchInfo(
            position=position,
            rank=self.rank,
            tasks=tuple(e.task for e in episodes),
            n_classes=tuple(int(t.cardinality[t.target]) if e.task == CLASSIFICATION else 0 for t, e in pairs),
        )
        return pack(tables, episodes, b.rows, width), info

    def batch_at(self, position: int) -> TableBatch:
        """The TableBatch at `position`."""
        return self.episode_at(position)[0]

    def frames_at(self, position: int) -> tuple[list, BatchInfo]:
        """The same tables as `episode_at(position)`, as raw pandas DataFrames (slow path)."""
        from .raw import to_frame  # pandas path, only loaded when asked for

        position = _check_index("position", position)
        b = self.bucket(position)
        frames, tasks, classes = [], [], []
        for j in range(b.batch):
            table, episode = self._table(position, j, b.rows, b.cols, features=False)  # raw tables: own columns
            frames.append(to_frame(table, table_rng(self.seed, position, self.rank, j, _RAW), self.cfg.prior))
            tasks.append(episode.task)
            classes.append(int(table.cardinality[table.target]) if episode.task == CLASSIFICATION else 0)
        return frames, BatchInfo(position, self.rank, tuple(tasks), tuple(classes))

    def _check_position(self, position: Any) -> int:
        return _check_index("position", position)
