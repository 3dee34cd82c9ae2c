"""Pretraining episodes from a table store: a resumable, bucketed, data-parallel stream of TableBatches.

`StoreEpisodes(store, ...)` is the table-store counterpart of `tabfm.synth.dataset.SynthLoader`: the
Trainer iterates it for batches and saves / restores its position with `state_dict()` /
`load_state_dict()`. Per epoch:

1. Plan. The store's headers (Parquet footers only, `tabfm.data.store.list_store`) give each table's
   rows and planned width, and `tabfm.data.bucketing.BucketedTableSampler` plans the epoch: batches of
   one padded shape under `cells_per_batch` cells and `max_batch` tables, costs balanced across
   the `world_size` data-parallel ranks of a step, every table once per epoch across ranks
   (oversize tables keep a random subset of rows; the cheapest `N mod world_size` batches are
   left out of an epoch, a different set every epoch). Epochs follow one another without end.
2. Load. Each planned table is read (`tabfm.data.store.read_table`, which refuses a table replaced
   since listing) and encoded once into a `tabfm.data.table_episodes.EpisodeTable`: features, then the
   target (class codes or numbers) for a classification / regression table; all columns, no
   target, for an imputation table (task "imputation", no target, a target with fewer than 2
   known values or 2 classes, or no feature column besides it). Rows whose target is missing
   are left out of prediction tables. Encoded tables are cached in the process that loads them
   while they fit `cache_cells` cells: with `num_workers=0` the main process keeps them across
   epochs; workers are restarted every epoch and a table appears once per epoch, so with workers
   each table is read and encoded once per epoch (the cache saves nothing and costs nothing).
3. Pose. Every table of a batch becomes one training episode through
   `tabfm.data.table_episodes.pose_episode` (the fine-tuning episode logic): with probability
   `episodes.imputation` (always, for imputation tables) random observed cells are hidden,
   otherwise the target is hidden on a random share of the rows; categorical codes and classes
   are relabelled, at most `episodes.max_columns` feature columns are shown, more classes than
   `episodes.max_classes` are merged; with `episodes.categorical="ordinal"` categorical features
   are numbers in prediction episodes, as the estimators show them. The rows are the plan's
   (padded up to the batch's row count); EpisodeConfig's min_rows / max_rows / cells_per_batch /
   max_batch are not used (the plan decides). The episode of slot j of a batch is seeded by
   (seed, epoch, step, rank, j), so batches are a pure function of the plan: the same for any
   `num_workers`, and a resumed run sees exactly the batches an uninterrupted run would.

Data-parallel ranks pass `world_size` / `rank` (ranks of one data-parallel replica, e.g. tensor-
parallel peers, pass the same rank and get the same batches); ranks never share a table within an
epoch. The state is the sampler's (epoch, batches handed out) plus a fingerprint of the store's
headers; it resumes only with the same store, settings and world size.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections import OrderedDict
from os import PathLike
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd

from .batch import TableBatch
from .bucketing import BatchPlan, BucketedTableLoader, BucketedTableSampler, apply_plan, encoded_cols
from .context_features import ContextFeatureSpec
from .encode import encode_frame
from .store import SUFFIX, TableHeader, list_store, read_table
from .table_episodes import (
    CLASSIFICATION, IMPUTATION, PREDICTION_TASKS, REGRESSION, EpisodeConfig, EpisodeTable, infer_task, pose_episode,
)

STATE_VERSION = 1
_EPISODES = 7  # spawn-key domain of the episodes (tabfm.data.bucketing uses 0 and 1)
_F32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------- the store
def open_store(path: str | PathLike) -> list[TableHeader]:
    """The headers of a table store (footers only); a clear error naming `path` when it is not one or is empty."""
    p = Path(path)
    hint = (f"a table store is a directory of NAME{SUFFIX} tables written by tabfm.data.store.write_table "
            "or `tabfm synth --out DIR --tables N`")
    if not p.exists():
        raise ValueError(f"{p}: no such table store ({hint})")
    if not p.is_dir():
        raise ValueError(f"{p}: not a table store, it is a file ({hint})")
    headers = list_store(p)  # errors name the file
    if not headers:
        raise ValueError(f"{p}: empty table store, it holds no NAME{SUFFIX} tables ({hint})")
    return headers


def store_fingerprint(headers: Sequence[TableHeader]) -> str:
    """A short hash of a store's headers (names, sizes, columns, kinds, targets, tasks, extras):
    changes when a table is added, removed or replaced by a different one."""
    text = json.dumps([h.to_dict() for h in sorted(headers, key=lambda h: h.name)], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def is_prediction_header(header: TableHeader) -> bool:
    """Whether a table is posed with its target (else: imputation only, all columns features)."""
    return header.target is not None and header.task != IMPUTATION


def planned_width(header: TableHeader, episodes: EpisodeConfig) -> int:
    """Columns an episode of this table shows at most: encoded features capped at max_columns, the
    context-feature columns of a prediction episode (for a class target: as for max_classes classes,
    since a header does not know how many it has) and the target. Batches are planned with it, so
    it must not undercount: a run once planned 3 columns for tables whose episodes showed 15, and
    one batch held 12x the cell budget (17.7 GB, killed for memory)."""
    if not is_prediction_header(header):
        return max(1, min(encoded_cols(header.kinds), episodes.max_columns))
    features = [k for c, k in zip(header.columns, header.kinds) if c != header.target]
    spec = ContextFeatureSpec.named(episodes.context_features)
    extra = 0 if spec is None else spec.width(1 if header.task == REGRESSION else episodes.max_classes - 1)
    return min(encoded_cols(features), episodes.max_columns) + extra + 1


# --------------------------------------------------------------------------- one table
def encode_store_table(header: TableHeader, frame: pd.DataFrame) -> EpisodeTable:
    """Encode the rows of a store table as an EpisodeTable (see the module docstring, step 2).

    The task is the header's, or inferred from the target (tabfm.data.table_episodes.infer_task) when
    the header gives a target without a task. Errors name the file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if is_prediction_header(header):
                table = _prediction_table(header, frame)
                if table is not None:
                    return table
            enc, _ = encode_frame(frame)
    except ValueError as err:
        raise ValueError(f"{header.path}: cannot encode the table for training: {err}") from None
    return EpisodeTable(header.name, enc.x.numpy(), enc.kind.numpy().astype(np.int8),
                        enc.cardinality.numpy().astype(np.int64), IMPUTATION, np.arange(len(frame), dtype=np.int64))


def _prediction_table(header: TableHeader, frame: pd.DataFrame) -> EpisodeTable | None:
    """The rows with a known target, features then target; None when the target cannot be predicted."""
    y = frame[header.target]
    features = frame.drop(columns=[header.target])
    if features.shape[1] == 0:
        return None
    present = np.flatnonzero(y.notna().to_numpy())
    task = header.task if header.task in PREDICTION_TASKS else infer_task(y.iloc[present])
    n_classes = None
    if task == CLASSIFICATION:
        known = present
        labels = y.iloc[known].to_numpy()
        try:
            classes, values = np.unique(labels, return_inverse=True)
        except TypeError:  # mixed label types: compare them as text
            classes, values = np.unique(labels.astype(str), return_inverse=True)
        n_classes = len(classes)
        if n_classes < 2:
            return None
    else:
        numbers = pd.to_numeric(y, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        known = np.flatnonzero(np.isfinite(numbers) & (np.abs(numbers) <= _F32_MAX))
        values = numbers[known]
    if len(known) < 2:
        return None
    table, _ = EpisodeTable.encode(header.name, features.iloc[known].reset_index(drop=True), values, task,
                                   known, n_classes=n_classes)
    return table


def table_episode(table: EpisodeTable, source_rows: np.ndarray, max_rows: int, cfg: EpisodeConfig,
                  rng: np.random.Generator) -> TableBatch:
    """One episode of `table` on the given source rows (a one-table TableBatch of at most max_rows rows).

    Prediction tables hold only rows with a known target: planned rows without one are left out,
    and when fewer than 2 remain, random rows with a target stand in for the planned ones."""
    task = IMPUTATION if table.task == IMPUTATION or rng.random() < cfg.imputation else table.task
    pos = np.minimum(np.searchsorted(table.rows, source_rows), table.n_rows - 1)
    take = pos[table.rows[pos] == source_rows]
    need = 1 if task == IMPUTATION else 2
    if len(take) < need:
        n = min(max(len(source_rows), need), max_rows, table.n_rows)
        take = np.sort(rng.choice(table.n_rows, size=n, replace=False))
    cols = min(table.n_features, cfg.max_columns) + (table.task != IMPUTATION)
    return pose_episode(table, take, cols, task, cfg, rng)


# --------------------------------------------------------------------------- the data source
class StoreEpisodes:
    """An endless, resumable stream of episode batches from a table store, for one data-parallel rank.

    store            a table store directory (or pass `headers` already listed from it)
    episodes         how episodes are posed (EpisodeConfig; set max_classes to the model's head width)
    cells_per_batch  padded cells per batch (B * R * C), and max_batch tables at most per batch
    seed             plans, row subsets and episodes all follow from it
    world_size, rank data-parallel ranks (the plugin's dp_world_size / dp_rank)
    num_workers      DataLoader workers building batches (the same batches for any number)
    cache_cells      encoded cells kept per process (0: no cache)
    growth, rows     BucketedTableSampler's bucket width and row policy
    loader_kwargs    more DataLoader arguments (prefetch_factor, ...)

    Iterating yields TableBatches from where the stream stands, through the epochs, without end.
    """

    def __init__(self, store: str | PathLike, episodes: EpisodeConfig | None = None, *,
                 cells_per_batch: int = 16384, max_batch: int = 32, seed: int = 0, world_size: int = 1,
                 rank: int = 0, num_workers: int = 0, cache_cells: int = 1 << 24, growth: float = 1.25,
                 rows: str = "pad", headers: Sequence[TableHeader] | None = None, **loader_kwargs: Any) -> None:
        self.path = Path(store)
        self.headers = list(headers) if headers is not None else open_store(self.path)
        if not self.headers:
            raise ValueError(f"{self.path}: empty table store, it holds no NAME{SUFFIX} tables")
        self.fingerprint = store_fingerprint(self.headers)
        self.episodes = episodes or EpisodeConfig()
        self.seed = seed
        widths = [planned_width(h, self.episodes) for h in self.headers]
        for h, w in zip(self.headers, widths):
            least = w * min(2, h.n_rows)
            if isinstance(cells_per_batch, int) and least > cells_per_batch:
                raise ValueError(f"{h.path}: episodes of this table show {w} columns, so even {min(2, h.n_rows)} rows "
                                 f"need {least} cells, more than cells_per_batch={cells_per_batch}; raise the cells "
                                 f"per batch or lower EpisodeConfig.max_columns")
        try:
            self.sampler = BucketedTableSampler(
                [(h.n_rows, w) for h, w in zip(self.headers, widths)], cells_per_batch=cells_per_batch,
                max_batch=max_batch, world_size=world_size, rank=rank, seed=seed, growth=growth, rows=rows)
        except ValueError as err:
            raise ValueError(f"{self.path} ({len(self.headers)} tables): {err}") from None
        self.cache_cells = int(cache_cells)
        self._cache: OrderedDict[int, EpisodeTable] = OrderedDict()
        self._cached = 0
        self.loader = BucketedTableLoader(self.sampler, self.load, build=self.build, num_workers=num_workers,
                                          **loader_kwargs)

    # ------------------------------------------------------------ tables and batches
    def load(self, index: int) -> EpisodeTable:
        """Table `index` of the store (in list_store order), encoded; cached while it fits cache_cells."""
        table = self._cache.get(index)
        if table is not None:
            self._cache.move_to_end(index)
            return table
        header = self.headers[index]
        table = encode_store_table(header, read_table(header))
        size = table.x.size
        if size <= self.cache_cells:
            while self._cache and self._cached + size > self.cache_cells:
                self._cached -= self._cache.popitem(last=False)[1].x.size
            self._cache[index] = table
            self._cached += size
        return table

    def build(self, plan: BatchPlan, tables: Sequence[EpisodeTable]) -> TableBatch:
        """The batch of a plan: one episode per table (seeded by epoch, step, rank, slot), padded to one shape."""
        parts = []
        for j, table in enumerate(tables):
            rng = np.random.default_rng(np.random.SeedSequence(
                self.seed, spawn_key=(_EPISODES, plan.epoch, plan.step, plan.rank, j)))
            rows = plan.row_indices(j)
            source_rows = np.arange(plan.sizes[j][0], dtype=np.int64) if rows is None else rows.astype(np.int64)
            parts.append(table_episode(table, source_rows, plan.rows, self.episodes, rng))
        # the episodes hold the plan's rows already: a plan of their own sizes pads them into one batch
        shaped = dataclasses.replace(plan, sizes=tuple((p.shape[1], p.shape[2]) for p in parts),
                                     keep=tuple(p.shape[1] for p in parts))
        return apply_plan(shaped, parts)

    def batch(self, plan: BatchPlan) -> TableBatch:
        """The batch a plan gives (what iterating yields for it), built in this process."""
        return self.build(plan, [self.load(i) for i in plan.indices])

    def plans(self, epoch: int | None = None) -> list[BatchPlan]:
        """This rank's plans of an epoch (default: the current one)."""
        return self.sampler.plans(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batches_per_epoch(self) -> int:
        """Batches (steps) of the current epoch, the same on every rank."""
        return len(self.sampler)

    def table_names(self, plan: BatchPlan) -> list[str]:
        return [self.headers[i].name for i in plan.indices]

    # ------------------------------------------------------------ iteration and resume
    def __iter__(self) -> Iterator[TableBatch]:
        while True:
            epoch, got = self.sampler.epoch, False
            for batch in self.loader:
                got = True
                yield batch
            if not got:
                raise RuntimeError(f"{self.path}: epoch {epoch} packs into fewer batches than the "
                                   f"{self.sampler.world_size} data-parallel ranks; lower cells_per_batch / max_batch")

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands (the same on every rank): epoch, batches of it handed out, the store."""
        return {"version": STATE_VERSION, "store": self.fingerprint, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict() of a stream over the same store with the same settings."""
        if not isinstance(state, dict) or "sampler" not in state:
            raise ValueError(f"{self.path}: the saved data state is not a table-store state (keys: "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}); "
                             "was the run trained on the synthetic stream?")
        if state.get("store") != self.fingerprint:
            raise ValueError(f"{self.path}: the saved data state belongs to another store (fingerprint "
                             f"{state.get('store')}, this store {self.fingerprint}); resuming would repeat or skip tables")
        saved = state["sampler"]
        if int(saved.get("world_size", -1)) != self.sampler.world_size:
            raise ValueError(f"{self.path}: the run was saved with {saved.get('world_size')} data-parallel ranks, "
                             f"this one has {self.sampler.world_size}; a run on a table store resumes only with the "
                             "same number of data-parallel ranks")
        try:
            self.sampler.load_state_dict(saved)
        except ValueError as err:
            raise ValueError(f"{self.path}: cannot resume the saved data position: {err}") from None
