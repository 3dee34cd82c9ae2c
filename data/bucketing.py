"""Cost-bucketed, rank-balanced batching of real tables of very different sizes.

Data-parallel ranks wait for the slowest one at every step. Tables range from a few
hundred to millions of cells, so shuffling tables into batches naively makes one rank
carry many times the cells of another. `BucketedTableSampler` plans each epoch so that
every batch has one shape and every rank's batch at a step costs about the same.

Plan of an epoch (a pure function of the table sizes, the settings, `seed` and `epoch`;
every rank computes the same plan and takes its own column of it):

1. Rows to keep. A table with more than `cells_per_batch` cells keeps
   `cells_per_batch // n_cols` random rows (`oversize="subsample"`, the default) or is
   refused at construction (`oversize="error"`). Columns are never dropped; a table with
   more than `cells_per_batch // min_rows` columns is always refused.
2. Buckets: geometric bins on rows and columns, bucket = (floor(log_g rows),
   floor(log_g cols)) with g = `growth`. Tables in one bucket differ by less than a factor
   g in rows and in columns.
3. Batches of one shape (R, C), filled greedily in a shuffled order within each bucket while
   B * R * C <= cells_per_batch and B <= max_batch. C = the widest table (narrower tables
   are padded with padding columns). R depends on `rows`:
   - "pad" (default): R = the most rows kept; shorter tables get padding rows. No row is
     lost; padding is < 1 - 1/g^2 of any table's cells (under 36 % for g = 1.25).
   - "subsample": R = the fewest rows in the batch; every table keeps R random rows
     (< 1/g of its rows are dropped). No padding rows.
   Row subsets are random, sorted, and a function of (seed, epoch, table index).
4. Balance: batches are sorted by cost (B * R * C, the padded cells the model computes) and
   consecutive runs of `world_size` batches form one step, so the ranks' batches at a step
   have neighbouring costs. Steps are then shuffled and each step's batches dealt to ranks
   in a random order.
5. Remainder: every rank gets the same number of steps. With `drop_last=True` (default) the
   N mod world_size cheapest batches of the epoch are left out (`dropped(epoch)` names their
   tables; which tables varies with the epoch). With `drop_last=False` the last step is
   completed with copies of its own batches, the cheapest of the epoch (`repeated(epoch)`).

`BucketedTableLoader` runs the plan through a torch DataLoader (any number of workers, the
same batches in the same order) and `apply_plan` turns one plan plus its encoded tables
into one TableBatch. Both resume exactly from `state_dict()`.
"""
from __future__ import annotations

import math
import numbers
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .batch import PAD, TableBatch
from .schema import DATETIME_PARTS, DATETIME_T, TEXT_PARTS, TEXT_T

ROW_POLICIES = ("pad", "subsample")
OVERSIZE_POLICIES = ("subsample", "error")
_ORDER, _ROWS = 0, 1  # spawn-key domains: epoch order vs per-table row subsets
STATE_VERSION = 1


# --------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class BatchPlan:
    """One batch of one rank: which tables, which rows of each, and the padded shape (rows, cols).

    Table j is `indices[j]` with original size `sizes[j]` = (n_rows, n_cols); it contributes
    `keep[j]` rows (all of them when keep[j] == n_rows, else the random subset
    `row_indices(j)`) padded up to `rows`, and its columns padded up to `cols` (see apply_plan).
    """

    epoch: int
    step: int
    rank: int
    indices: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]
    keep: tuple[int, ...]
    rows: int
    cols: int
    seed: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, R, C) of the TableBatch this plan builds."""
        return len(self.indices), self.rows, self.cols

    @property
    def cost(self) -> int:
        """Cells the model computes over, padding included: B * R * C."""
        return len(self.indices) * self.rows * self.cols

    @property
    def cells(self) -> int:
        """Real (non-padding) cells."""
        return sum(k * c for k, (_, c) in zip(self.keep, self.sizes))

    def row_indices(self, j: int) -> np.ndarray | None:
        """Sorted rows to take from table j of the batch, or None for all of its rows in order."""
        return row_subset(self.seed, self.epoch, self.indices[j], self.sizes[j][0], self.keep[j])


def row_subset(seed: int, epoch: int, index: int, n_rows: int, keep: int) -> np.ndarray | None:
    """The `keep` rows table `index` contributes in `epoch`: sorted random rows, None if all."""
    if keep >= n_rows:
        return None
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_ROWS, epoch, index)))
    return np.sort(rng.choice(n_rows, size=keep, replace=False))


# --------------------------------------------------------------------------- checks
def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def table_sizes(tables: Any) -> np.ndarray:
    """(N, 2) int64 array of (n_rows, n_cols) from pairs, an (N, 2) array, or objects with n_rows / n_cols."""
    sizes = []
    for i, t in enumerate(tables):
        if hasattr(t, "n_rows") and hasattr(t, "n_cols"):
            pair = (t.n_rows, t.n_cols)
        else:
            try:
                pair = tuple(t)
            except TypeError:
                raise ValueError(f"table {i}: expected (n_rows, n_cols) or an object with n_rows/n_cols, got {t!r}") from None
        if len(pair) != 2:
            raise ValueError(f"table {i}: expected (n_rows, n_cols), got {pair!r}")
        for what, v in zip(("n_rows", "n_cols"), pair):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"table {i}: {what} must be an integer >= 1, got {v!r}")
        sizes.append((int(pair[0]), int(pair[1])))
    if not sizes:
        raise ValueError("BucketedTableSampler needs at least one table")
    return np.asarray(sizes, dtype=np.int64)


# --------------------------------------------------------------------------- sampler
class BucketedTableSampler:
    """Plans batches of one shape per batch, balanced in cost across data-parallel ranks.

    tables: per-table sizes, as (n_rows, n_cols) pairs or objects with `n_rows` / `n_cols`
    (e.g. store headers). Iterating yields this rank's `BatchPlan`s for the rest of the
    current epoch; when the last one is handed out the sampler moves on to the next epoch,
    so a loop that never calls `set_epoch` still sees a new order every epoch. `len()` is
    the number of steps of the current epoch (the same on every rank; it can differ by a
    few between epochs because packing depends on the shuffle; once an epoch is used up,
    the current epoch is the next one). See the module docstring for the exact rules.
    """

    def __init__(
        self,
        tables: Any,
        cells_per_batch: int = 131072,
        max_batch: int = 64,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        growth: float = 1.25,
        rows: str = "pad",
        oversize: str = "subsample",
        drop_last: bool = True,
        min_rows: int = 2,
    ):
        self.sizes = table_sizes(tables)
        self.cells_per_batch = _int("cells_per_batch", cells_per_batch, 1)
        self.max_batch = _int("max_batch", max_batch, 1)
        self.world_size = _int("world_size", world_size, 1)
        self.rank = _int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        self.seed = _int("seed", seed, 0)
        self.min_rows = _int("min_rows", min_rows, 1)
        if isinstance(growth, bool) or not isinstance(growth, numbers.Real) or not growth > 1.0 or not math.isfinite(growth):
            raise ValueError(f"growth must be a finite number > 1 (bucket width factor), got {growth!r}")
        self.growth = float(growth)
        if rows not in ROW_POLICIES:
            raise ValueError(f"rows must be one of {ROW_POLICIES}, got {rows!r}")
        if oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {oversize!r}")
        self.rows, self.oversize, self.drop_last = rows, oversize, bool(drop_last)

        n_rows, n_cols = self.sizes[:, 0], self.sizes[:, 1]
        least = n_cols * np.minimum(self.min_rows, n_rows)  # cells of the fewest rows a table may keep
        wide = np.flatnonzero(least > self.cells_per_batch)
        if wide.size:
            i = int(wide[0])
            raise ValueError(
                f"table {i} ({n_rows[i]} rows x {n_cols[i]} cols) has too many columns for cells_per_batch="
                f"{self.cells_per_batch}: even {int(least[i] // n_cols[i])} rows need {int(least[i])} cells "
                f"(columns are never dropped; raise cells_per_batch to >= {int(least[i])})"
                + (f"; {wide.size - 1} more tables like it" if wide.size > 1 else "")
            )
        big = np.flatnonzero(n_rows * n_cols > self.cells_per_batch)
        if big.size and self.oversize == "error":
            i = int(big[0])
            raise ValueError(
                f"table {i} ({n_rows[i]} rows x {n_cols[i]} cols = {int(n_rows[i] * n_cols[i])} cells) exceeds "
                f"cells_per_batch={self.cells_per_batch}; raise cells_per_batch or pass oversize='subsample' to keep "
                f"{self.cells_per_batch // int(n_cols[i])} random rows"
                + (f" ({big.size - 1} more tables too large)" if big.size > 1 else "")
            )
        # rows each table can contribute (oversize tables: as many as fit the budget)
        self.kept_rows = np.minimum(n_rows, self.cells_per_batch // n_cols)
        log_g = math.log(self.growth)
        row_bin = np.floor(np.log(self.kept_rows) / log_g + 1e-9).astype(np.int64)
        col_bin = np.floor(np.log(n_cols) / log_g + 1e-9).astype(np.int64)
        self.buckets = row_bin * (int(col_bin.max()) + 1) + col_bin  # one id per (row bin, col bin)
        self._fingerprint = self._make_fingerprint()
        self._cache: tuple[int, list[list[BatchPlan]], list[int], list[int]] | None = None

        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        if len(self) == 0:
            raise ValueError(
                f"{len(self.sizes)} tables pack into {self._num_batches(0)} batches, fewer than world_size="
                f"{self.world_size}: with drop_last=True no rank gets a batch; lower cells_per_batch / max_batch "
                f"or pass drop_last=False"
            )

    # ------------------------------------------------------------ planning
    def _make_fingerprint(self) -> int:
        settings = (self.cells_per_batch, self.max_batch, self.world_size, self.growth, self.rows,
                    self.oversize, self.drop_last, self.min_rows)
        return zlib.crc32(repr(settings).encode(), zlib.crc32(self.sizes.tobytes()))

    def _pack(self, members: np.ndarray) -> list[tuple[list[int], int, int]]:
        """Greedy batches (indices, R, C) of one bucket's tables, in the given order."""
        kept, cols = self.kept_rows, self.sizes[:, 1]
        subsample = self.rows == "subsample"
        out: list[tuple[list[int], int, int]] = []
        cur: list[int] = []
        r = c = 0
        for i in members.tolist():
            ki, ci = int(kept[i]), int(cols[i])
            nr = (min(r, ki) if subsample else max(r, ki)) if cur else ki
            nc = max(c, ci)
            if cur and (len(cur) + 1 > self.max_batch or (len(cur) + 1) * nr * nc > self.cells_per_batch):
                out.append((cur, r, c))
                cur, nr, nc = [], ki, ci
            cur.append(i)
            r, c = nr, nc
        if cur:
            out.append((cur, r, c))
        return out

    def _batches(self, rng: np.random.Generator) -> list[tuple[list[int], int, int]]:
        perm = rng.permutation(len(self.sizes))
        order = perm[np.argsort(self.buckets[perm], kind="stable")]  # bucket by bucket, shuffled within
        bounds = np.flatnonzero(np.diff(self.buckets[order])) + 1
        batches: list[tuple[list[int], int, int]] = []
        for members in np.split(order, bounds):
            batches.extend(self._pack(members))
        return batches

    def _num_batches(self, epoch: int) -> int:
        return len(self._batches(self._rng(epoch)))

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_ORDER, epoch)))

    def _plan(self, epoch: int) -> tuple[list[list[BatchPlan]], list[int], list[int]]:
        """All ranks' plans of `epoch` as steps x ranks, plus dropped and repeated table indices."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1:]
        rng = self._rng(epoch)
        batches = self._batches(rng)
        w = self.world_size
        # shuffle before the stable sort so batches of equal cost pair up at random
        batches = [batches[k] for k in rng.permutation(len(batches))]
        costs = np.array([len(ix) * r * c for ix, r, c in batches], dtype=np.int64)
        batches = [batches[k] for k in np.argsort(-costs, kind="stable")]
        dropped: list[int] = []
        repeated: list[int] = []
        extra = len(batches) % w
        if extra and self.drop_last:
            for ix, _, _ in batches[len(batches) - extra:]:
                dropped.extend(ix)
            batches = batches[: len(batches) - extra]
        elif extra:
            last = batches[len(batches) - extra:]  # the last step's real batches; copies cost the same
            for k in range(w - extra):
                repeated.extend(last[k % extra][0])
                batches.append(last[k % extra])
        n_steps = len(batches) // w
        steps: list[list[BatchPlan]] = []
        for step, s in enumerate(rng.permutation(n_steps).tolist()):
            group = batches[s * w: (s + 1) * w]
            deal = rng.permutation(w).tolist()
            plans = []
            for rank in range(w):
                ix, r, c = group[deal[rank]]
                plans.append(BatchPlan(
                    epoch=epoch, step=step, rank=rank, indices=tuple(ix),
                    sizes=tuple((int(self.sizes[i, 0]), int(self.sizes[i, 1])) for i in ix),
                    keep=tuple(min(int(self.kept_rows[i]), r) for i in ix),
                    rows=r, cols=c, seed=self.seed,
                ))
            steps.append(plans)
        self._cache = (epoch, steps, sorted(dropped), sorted(repeated))
        return steps, self._cache[2], self._cache[3]

    def steps(self, epoch: int | None = None) -> list[list[BatchPlan]]:
        """Every rank's plans of `epoch` (default: the current one) as steps x ranks."""
        return self._plan(self.epoch if epoch is None else _int("epoch", epoch, 0))[0]

    def plans(self, epoch: int | None = None) -> list[BatchPlan]:
        """This rank's plans of a whole epoch (default: the current one), in order."""
        return [step[self.rank] for step in self.steps(epoch)]

    def dropped(self, epoch: int | None = None) -> list[int]:
        """Tables left out of `epoch` by drop_last (the cheapest N mod world_size batches)."""
        return list(self._plan(self.epoch if epoch is None else _int("epoch", epoch, 0))[1])

    def repeated(self, epoch: int | None = None) -> list[int]:
        """Extra appearances in `epoch` (one entry per copy) when drop_last=False completed the last step with copies."""
        return list(self._plan(self.epoch if epoch is None else _int("epoch", epoch, 0))[2])

    # ----------------------------------------------------------- iteration
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch; the current epoch keeps its position (so a
        resumed loop calling set_epoch(sampler.epoch) continues mid-epoch)."""
        epoch = _int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        return len(self.steps())

    def _advance(self, n: int) -> None:
        """Mark the batch at index n - 1 of the current epoch handed out; after the last, move to the next epoch."""
        if n >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        else:
            self.position = n

    def __iter__(self) -> Iterator[BatchPlan]:
        epoch, start = self.epoch, self.position
        plans = self.plans(epoch)
        for k in range(start, len(plans)):
            self._advance(k + 1)
            yield plans[k]

    # ------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, int]:
        """Where this sampler stands: epoch and batches of it handed out. The same on every rank."""
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "world_size": self.world_size, "num_tables": int(len(self.sizes)), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a state_dict() of a sampler with the same tables and settings (any rank's)."""
        for key, mine in (("seed", self.seed), ("world_size", self.world_size), ("num_tables", len(self.sizes))):
            if int(state[key]) != mine:
                raise ValueError(f"state was saved with {key}={state[key]}, this sampler has {key}={mine}")
        if int(state["fingerprint"]) != self._fingerprint:
            raise ValueError("state was saved for other table sizes or sampler settings (fingerprint differs): "
                             "resuming would repeat or skip tables")
        self.epoch = _int("epoch", state["epoch"], 0)
        position = _int("position", state["position"], 0)
        if position > len(self):
            raise ValueError(f"state position {position} is past the {len(self)} steps of epoch {self.epoch}")
        self.position = 0
        if position:
            self._advance(position)


def step_balance(costs: Any) -> dict[str, float]:
    """How evenly steps load the ranks, from a (steps, ranks) array of per-rank costs.

    max_over_mean_*: per-step max / mean rank cost (1 = perfectly even; mean, 95th percentile,
    worst step). efficiency: sum of mean / sum of max = the share of rank time not spent
    waiting for the slowest rank, if a step takes time proportional to its largest cost.
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"step_balance needs a non-empty (steps, ranks) array, got shape {c.shape}")
    ratio = c.max(1) / np.maximum(c.mean(1), 1e-12)
    return {"steps": int(c.shape[0]), "ranks": int(c.shape[1]),
            "max_over_mean_mean": float(ratio.mean()), "max_over_mean_p95": float(np.quantile(ratio, 0.95)),
            "max_over_mean_worst": float(ratio.max()), "efficiency": float(c.mean(1).sum() / c.max(1).sum())}


# --------------------------------------------------------------------------- applying a plan
def apply_plan(plan: BatchPlan, tables: Sequence[Any]) -> TableBatch:
    """One TableBatch of shape (B, plan.rows, C) from the plan's tables, in plan order.

    Each table is an EncodedTable-like object (x (n_rows, n_cols), kind, cardinality: all
    rows become context rows, no query cells) or a one-table TableBatch (its context and
    query rows are carried along). Rows are taken as `plan.row_indices(j)` says, then padded
    with zeros up to plan.rows; the row count must be the planned one. Columns are padded with
    padding columns up to C = plan.cols, or up to the widest table when encoding made a table
    wider than planned (sizes given in source columns: datetime and text columns expand).
    """
    if len(tables) != len(plan.indices):
        raise ValueError(f"plan has {len(plan.indices)} tables, got {len(tables)}")
    parts = []
    for j, t in enumerate(tables):
        if isinstance(t, TableBatch):
            if len(t) != 1 or not bool(t.row_valid.all()) or not bool(t.col_valid.all()):
                raise ValueError(f"table {plan.indices[j]}: apply_plan takes a one-table TableBatch without padding")
            tx, tkind, tcard, tctx, tq = t.x[0], t.kind[0], t.cardinality[0], t.context[0], t.query[0]
            tref = t.feature_ref[0]
        else:
            tx, tkind, tcard = torch.as_tensor(t.x, dtype=torch.float32), torch.as_tensor(t.kind), torch.as_tensor(t.cardinality)
            tctx = tq = tref = None
        if tx.dim() != 2 or tx.shape[0] != plan.sizes[j][0]:
            raise ValueError(f"table {plan.indices[j]} has shape {tuple(tx.shape)} but the plan was made for "
                             f"{plan.sizes[j][0]} rows (did the store change?)")
        take = plan.row_indices(j)
        if take is not None:
            idx = torch.from_numpy(take)
            tx, tctx, tq = tx[idx], None if tctx is None else tctx[idx], None if tq is None else tq[idx]
        parts.append((tx, tkind, tcard, tctx, tq, tref))
    b, r = len(parts), plan.rows
    c = max([plan.cols] + [int(p[0].shape[1]) for p in parts])
    x = torch.zeros(b, r, c, dtype=torch.float32)
    kind = torch.full((b, c), PAD, dtype=torch.int8)
    card = torch.zeros(b, c, dtype=torch.int64)
    row_valid = torch.zeros(b, r, dtype=torch.bool)
    col_valid = torch.zeros(b, c, dtype=torch.bool)
    context = torch.zeros(b, r, dtype=torch.bool)
    query = torch.zeros(b, r, c, dtype=torch.bool)
    ref = torch.full((b, c, 3), -1, dtype=torch.int64)
    for j, (tx, tkind, tcard, tctx, tq, tref) in enumerate(parts):
        k, w = tx.shape
        x[j, :k, :w] = tx
        kind[j, :w] = tkind.to(torch.int8)
        card[j, :w] = tcard.to(torch.int64)
        row_valid[j, :k] = True
        col_valid[j, :w] = True
        context[j, :k] = True if tctx is None else tctx
        if tq is not None:
            query[j, :k, :w] = tq
        if tref is not None:
            ref[j, :w] = tref
    return TableBatch(x=x, kind=kind, cardinality=card, row_valid=row_valid, col_valid=col_valid,
                      context=context, query=query, feature_ref=ref)


def encoded_cols(header_or_kinds: Any) -> int:
    """Columns a table will have after tabfm.data.encode, from its column kinds (a store header or a list).

    An upper bound: datetime 6 parts (5 without times of day), text 3, the others 1; it leaves
    out the rare "<name>.inf" column of numeric columns holding infinities.
    """
    kinds = getattr(header_or_kinds, "kinds", header_or_kinds)
    width = {DATETIME_T: len(DATETIME_PARTS), TEXT_T: len(TEXT_PARTS)}
    return sum(width.get(k, 1) for k in kinds)


# --------------------------------------------------------------------------- loader
class _PlanDataset(Dataset):
    """Map-style dataset whose keys are BatchPlans: loads the plan's tables and builds the batch (apply_plan)."""

    def __init__(self, load: Callable[[int], Any], build: Callable[[BatchPlan, list], Any] = apply_plan):
        self.load, self.build = load, build

    def __getitem__(self, plan: BatchPlan) -> TableBatch:
        return self.build(plan, [self.load(i) for i in plan.indices])


def _identity(item: Any) -> Any:
    return item


class BucketedTableLoader:
    """A torch DataLoader over this rank's plans: `load(index)` -> an encoded table, batched by `apply_plan`.

    Yields TableBatches (or (BatchPlan, TableBatch) with return_plans=True) for the rest of the
    sampler's current epoch, in plan order whatever num_workers is. It counts the batches it
    hands out (workers run ahead), so `state_dict()` resumes exactly, with any number of
    workers. `build(plan, tables)` turns a plan and its loaded tables into the batch (default
    `apply_plan`; it runs in the workers and must be a pure function of its arguments, e.g. to
    pose per-table training episodes seeded by the plan). Keyword arguments go to the
    DataLoader (num_workers, prefetch_factor, ...).
    """

    def __init__(self, sampler: BucketedTableSampler, load: Callable[[int], Any], return_plans: bool = False,
                 build: Callable[[BatchPlan, list], Any] = apply_plan, **loader_kwargs: Any):
        for key in ("batch_size", "collate_fn", "sampler", "batch_sampler", "shuffle"):
            if key in loader_kwargs:
                raise ValueError(f"BucketedTableLoader plans its own batches: do not pass {key}")
        if loader_kwargs.get("persistent_workers"):
            raise ValueError("BucketedTableLoader restarts workers at the resume point: persistent_workers is not supported")
        self.sampler, self.load, self.return_plans, self.loader_kwargs = sampler, load, return_plans, loader_kwargs
        self.build = build

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return len(self.sampler) - self.sampler.position

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        epoch, start = s.epoch, s.position
        plans = s.plans(epoch)[start:]
        if not plans:
            return
        kwargs = {"generator": torch.Generator().manual_seed(s.seed), **self.loader_kwargs}
        loader = DataLoader(_PlanDataset(self.load, self.build), sampler=plans, batch_size=None, collate_fn=_identity, **kwargs)
        for k, batch in enumerate(loader):
            s._advance(start + k + 1)
            yield (plans[k], batch) if self.return_plans else batch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
