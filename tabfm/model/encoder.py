"""Cell encoder: a TableBatch -> one d_model token per cell (plus learned thinking rows).

What a token carries, and why:
- numeric cells: the value standardised with NaN-aware mean/std over the *context rows* of
  its column (query cells are blanked first, so hidden values never leak into the
  statistics), then squashed robustly (identity on |z| <= 3, logarithmic beyond), so
  outliers stay ordered but bounded.
- categorical cells: a random Gaussian identity vector per (table, column, code), projected
  by a learned linear map. Codes carry identity, never order: code 3 is not "between" codes
  2 and 4, and relabelling the codes of a column only relabels the vectors. No vocabulary
  limit on inputs, and distinct codes never collide. (A learned slot table with a random
  code -> slot permutation per column learned no faster on toy in-context classification,
  2 seeds, and caps the vocabulary.)
- a state embedding: observed / missing (NaN) / hidden (query cell), per kind.
- a column identity: a random Gaussian vector per (table, column), projected, added to
  every cell of the column; it tells columns apart without any notion of column position.
- with `context_refs`, a context-feature column's identity also says what it estimates
  (TableBatch.feature_ref): the estimated column's identity vector, the class code's identity
  vector (the one the categorical head scores that class with), and its estimator, each
  projected; and the estimate itself reaches the cell it estimates: the column's value times a
  learned map of its estimator and class (a direct path from "share of class k" to the target
  cell, which the head scores against class k's identity). All of them start at zero.

Random vectors come from a counter-based integer hash (vectorised, same on every device)
of a per-column seed. In eval mode the seed is a hash of the column's visible context content (kind, cardinality, values), so predictions are
an exact function of the table and do not depend on column order, query rows or padding.
In train mode seeds are drawn from torch's RNG instead (fresh identities every step, even
for repeated tables; ranks that share a table, e.g. under row-sequence parallelism, must
share the RNG state).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.data.context_features import MAX_ESTIMATORS

from .config import FIXED_CODE_SEED, ModelConfig

_M32 = 0xFFFFFFFF
_TWO32 = float(2**32)
SQUASH_LINEAR = 3.0  # |z| below this passes unchanged; beyond it grows logarithmically
Z_LIMIT = 1e6  # standardised values are clamped here before squashing (keeps inf out)

# states of a cell (index into the state embedding, offset by 3 for categorical cells)
OBSERVED, MISSING, HIDDEN = 0, 1, 2


# ---------------------------------------------------------------------------- hashing
def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixing hash on int64 tensors holding values in [0, 2**32).

    Products stay below 2**63, so no signed overflow, and results agree on every device.
    """
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def hash_normal(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Standard normal float32 samples, a pure function of (seed, counter) (broadcast, int64).

    Box-Muller on two hashed uniforms; different counters give independent-looking draws.
    """
    base = mix32((seed ^ mix32((counter * 2 + 0x1B873593) & _M32)) & _M32)
    h1 = mix32(base ^ 0x68E31DA4)
    h2 = mix32(base ^ 0x3C6EF372)
    u1 = (h1.double() + 0.5) / _TWO32
    u2 = (h2.double() + 0.5) / _TWO32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float()


def _value_bits(x: torch.Tensor) -> torch.Tensor:
    """Canonical 32-bit patterns of float32 values (one NaN, one zero) as int64."""
    x = torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x + 0.0)  # -0.0 -> +0.0
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


# ------------------------------------------------------------------------ statistics
class ColumnSums(NamedTuple):
    """Per-column sums over context rows; every field is a plain sum over rows.

    A row-sequence-parallel plugin all-reduces (SUM) each field across its row group.
    """

    total: torch.Tensor  # float64 (B, C): sum of observed values
    total_sq: torch.Tensor  # float64 (B, C): sum of squared observed values
    count: torch.Tensor  # float64 (B, C): number of observed values
    content_hash: torch.Tensor  # int64 (B, C): sum of per-cell hashes (visible values, NaN included)


class ContextStatistics(nn.Module):
    """Sums over the context rows of each column; the one place that reduces over rows.

    Kept as its own parameter-free module (`encoder.stats`) so a row-sequence-parallel
    plugin can hook its output and all-reduce it (all fields are sums).
    """

    def forward(self, x_visible: torch.Tensor, context_rows: torch.Tensor, with_hash: bool = True) -> ColumnSums:
        """x_visible (B, R, C) with hidden/padding cells NaN; context_rows (B, R) bool.
        with_hash=False skips the content hash (zeros), as training does not use it."""
        ctx = context_rows[:, :, None]
        observed = ~torch.isnan(x_visible) & ctx
        x0 = torch.where(observed, x_visible, 0.0).double()
        if with_hash:
            content_hash = torch.where(ctx, mix32(_value_bits(x_visible) ^ 0x5BD1E995), 0).sum(1)
        else:
            content_hash = torch.zeros(x0.shape[0], x0.shape[2], dtype=torch.int64, device=x0.device)
        return ColumnSums(total=x0.sum(1), total_sq=(x0 * x0).sum(1), count=observed.sum(1).double(), content_hash=content_hash)


def mean_std(sums: ColumnSums) -> tuple[torch.Tensor, torch.Tensor]:
    """Context mean and (unbiased) std per column, float64; std=1 for constant/empty columns."""
    n = sums.count
    mean = torch.where(n > 0, sums.total / n.clamp(min=1), 0.0)
    var = (sums.total_sq - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1)
    std = var.sqrt()
    degenerate = (n < 2) | (std <= 1e-7 * mean.abs() + 1e-12)
    return mean, torch.where(degenerate, 1.0, std)


def squash(z: torch.Tensor) -> torch.Tensor:
    """Identity on |z| <= 3, then sign(z) * (3 + log1p(|z| - 3)): smooth, monotone, bounded growth."""
    a = z.abs()
    return torch.where(a <= SQUASH_LINEAR, z, torch.sign(z) * (SQUASH_LINEAR + torch.log1p((a - SQUASH_LINEAR).clamp(min=0))))


# ----------------------------------------------------------------------------- encoder
class ColumnRefs(NamedTuple):
    """TableBatch.feature_ref, read: which columns are context features and what they estimate."""

    marked: torch.Tensor  # bool (B, C): a context-feature column
    target: torch.Tensor  # long (B, C): the column it estimates (0 where unmarked)
    estimator: torch.Tensor  # long (B, C): its estimator slot (0 where unmarked)
    is_class: torch.Tensor  # bool (B, C): it estimates a class share
    is_num: torch.Tensor  # bool (B, C): it estimates a numeric value
    code_id: torch.Tensor  # float (B, C, id_dim): the estimated class code's identity vector


class ColumnFacts(NamedTuple):
    """What the context rows fix about each column: the same for every row that is encoded."""

    mean: torch.Tensor  # float64 (B, C) context mean used for standardisation
    std: torch.Tensor  # float64 (B, C) context std used for standardisation
    col_vec: torch.Tensor  # float32 (B, C, id_dim) column identity vector
    code_vectors: torch.Tensor  # float32 (B, C, K_table, id_dim) identity vector of each code


def _visible(batch: TableBatch) -> torch.Tensor:
    """(B, R, C) values with hidden and padding cells NaN."""
    cell_valid = batch.row_valid[:, :, None] & batch.col_valid[:, None, :]
    return batch.visible_x().masked_fill(~cell_valid, float("nan"))


class CellEncoder(nn.Module):
    """TableBatch -> per-cell tokens. See the module docstring for what a token carries.

    `forward` = `columns` (what the context rows fix: statistics and identities) then `embed`
    (tokens of any rows given those facts), returning both. Split so a context can be described
    once and query rows embedded later against it (`TabFM.forward_queries`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, e = config.d_model, config.id_dim
        self.config = config
        self.stats = ContextStatistics()
        self.value = nn.Parameter(torch.randn(d))  # token direction of the squashed standardised value
        self.code = nn.Linear(e, d, bias=False)  # categorical code identity vector
        self.column = nn.Linear(e, d, bias=False)  # column identity vector
        self.state = nn.Embedding(6, d)  # (numeric, categorical) x (observed, missing, hidden)
        self.thinking = nn.Parameter(torch.empty(config.n_thinking_rows, d))
        nn.init.normal_(self.state.weight, std=0.5)
        nn.init.normal_(self.thinking, std=0.5)
        if config.context_refs:  # what a context-feature column estimates; zero: a no-op until trained
            self.ref_column = nn.Linear(e, d, bias=False)
            self.ref_code = nn.Linear(e, d, bias=False)
            self.ref_estimator = nn.Embedding(MAX_ESTIMATORS, d)
            # the estimate itself, into the estimated cell: value x (estimator's map of the class identity)
            self.ref_value_class = nn.Parameter(torch.zeros(MAX_ESTIMATORS, d, e))
            self.ref_value_num = nn.Parameter(torch.zeros(MAX_ESTIMATORS, d))
            for w in (self.ref_column.weight, self.ref_code.weight, self.ref_estimator.weight):
                nn.init.zeros_(w)

    def column_seeds(self, batch: TableBatch, sums: ColumnSums, id_seed: int = 0) -> torch.Tensor:
        """int64 (B, C) seeds in [0, 2**32): a hash of content (eval) or a random draw (train).

        `id_seed` salts the eval-mode hash: ensemble members pass different salts to average
        over column identities while each member stays column-order invariant."""
        if self.training:
            return torch.randint(0, 2**32, batch.col_valid.shape, device=batch.x.device, dtype=torch.int64)
        h = sums.content_hash & _M32
        seeds = mix32(h ^ mix32((batch.kind.long() * 0x27D4EB2F + batch.cardinality.long() * 0x165667B1 + 7) & _M32))
        if id_seed:
            seeds = mix32(seeds ^ mix32(torch.tensor(int(id_seed) & _M32, device=seeds.device)))
        return seeds

    def columns(self, batch: TableBatch, id_seed: int = 0, x: torch.Tensor | None = None) -> ColumnFacts:
        """Statistics and identities of each column, from the batch's context rows
        (x: the batch's visible values when already computed)."""
        b, _, c = batch.shape
        e = self.config.id_dim
        x = _visible(batch) if x is None else x
        sums = self.stats(x, batch.context & batch.row_valid, with_hash=not self.training)
        mean, std = mean_std(sums)
        seeds = self.column_seeds(batch, sums, id_seed)
        # random identities: counter 0..e-1 -> column vector, (k+1)*e + j -> code k
        k_table = max(self.config.max_categories, int(batch.cardinality.max()) if batch.cardinality.numel() else 0)
        counters = torch.arange((k_table + 1) * e, device=x.device)
        if self.config.code_ids == "fixed":  # one shared vector per code index, random per column
            col_vec = hash_normal(seeds[:, :, None], counters[:e])  # (B, C, e)
            shared = hash_normal(torch.tensor(FIXED_CODE_SEED, device=x.device), counters[e:]).view(k_table, e)
            code_vec = shared.expand(b, c, k_table, e)  # (B, C, K, e)
        else:
            vecs = hash_normal(seeds[:, :, None], counters).view(b, c, k_table + 1, e)
            col_vec, code_vec = vecs[:, :, 0], vecs[:, :, 1:]  # (B, C, e), (B, C, K, e)
        return ColumnFacts(mean=mean, std=std, col_vec=col_vec, code_vectors=code_vec)

    def embed(self, batch: TableBatch, facts: ColumnFacts, thinking: bool = True,
              x: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (B, T + R, C, d) of the batch's rows given the column facts; `thinking` prepends
        the thinking rows (x: the batch's visible values when already computed)."""
        b, r, c = batch.shape
        x = _visible(batch) if x is None else x
        mean, std, col_vec, code_vec = facts
        kind = batch.kind.long()[:, None, :]  # (B, 1, C)
        missing = torch.isnan(x)
        hidden = batch.query
        state = torch.where(hidden, HIDDEN, torch.where(missing, MISSING, OBSERVED)) + 3 * (kind == CATEGORICAL)
        tokens = self.state(state)  # (B, R, C, d)

        is_num = (kind == NUMERIC) & ~missing
        z = ((x.double() - mean[:, None, :]) / std[:, None, :]).clamp(-Z_LIMIT, Z_LIMIT)
        z = torch.where(is_num, squash(z), 0.0).float()
        tokens = tokens + z[..., None] * self.value

        col_tok = self.column(col_vec)[:, None]  # (B, 1, C, d)
        if self.config.context_refs:
            refs = self.refs(batch.feature_ref, code_vec)
            col_tok = col_tok + self.reference(refs, col_vec)[:, None]
        code_tok = self.code(code_vec)  # (B, C, K, d)
        is_cat = (kind == CATEGORICAL) & ~missing
        codes = torch.where(is_cat, x, 0.0).long()  # (B, R, C); every cell looks up a code, numeric ones masked out
        bi = torch.arange(b, device=x.device)[:, None, None]
        ci = torch.arange(c, device=x.device)[None, None, :]
        tokens = tokens + code_tok[bi, ci, codes] * is_cat[..., None].to(code_tok.dtype)

        if self.config.context_refs:
            tokens = tokens + self.estimates(refs, x, mean, std).to(tokens.dtype)

        if thinking:  # the thinking rows lead; with n_thinking_rows = 0 an empty block (still in the graph)
            think = self.thinking[None, :, None, :] + col_tok  # (B, T, C, d)
            tokens = torch.cat([think.to(tokens.dtype), tokens + col_tok], dim=1)
        else:
            tokens = tokens + col_tok
        return tokens

    @staticmethod
    def refs(feature_ref: torch.Tensor, code_vec: torch.Tensor) -> "ColumnRefs":
        """TableBatch.feature_ref read once for `reference` and `estimates`."""
        col, code, est = feature_ref.unbind(-1)
        marked = col >= 0
        target = col.clamp(min=0)
        bi = torch.arange(col.shape[0], device=col.device)[:, None]
        code_id = code_vec[bi, target, code.clamp(min=0, max=code_vec.shape[2] - 1)]  # (B, C, e)
        return ColumnRefs(marked, target, est.clamp(min=0), marked & (code >= 0), marked & (code < 0), code_id)

    def reference(self, refs: "ColumnRefs", col_vec: torch.Tensor) -> torch.Tensor:
        """(B, C, d) what each context-feature column estimates (zero for every other column): the
        estimated column's identity, the estimated class code's identity, the estimator's vector."""
        bi = torch.arange(col_vec.shape[0], device=col_vec.device)[:, None]
        tok = self.ref_column(col_vec[bi, refs.target]) + self.ref_estimator(refs.estimator)
        tok = tok + self.ref_code(refs.code_id) * refs.is_class[..., None].to(tok.dtype)
        return tok * refs.marked[..., None].to(tok.dtype)

    def estimates(self, refs: "ColumnRefs", x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """(B, R, C, d) what the context features say, added to the cells they estimate: each feature
        column's value times a vector of its estimator and class (a share of class k moves the target
        cell towards class k's identity); a numeric target's estimate standardised and squashed on
        the target column's own scale. Zero where no feature column points."""
        b, r, c = x.shape
        d = self.state.weight.shape[1]
        marked, target, est, is_class, is_num = refs.marked, refs.target, refs.estimator, refs.is_class, refs.is_num
        proj = torch.einsum("bcde,bce->bcd", self.ref_value_class[est], refs.code_id.to(self.ref_value_class.dtype))
        proj = proj * is_class[..., None].to(proj.dtype) + self.ref_value_num[est] * is_num[..., None].to(proj.dtype)
        value = torch.nan_to_num(x, nan=0.0)
        t_mean, t_std = mean.gather(1, target)[:, None, :], std.gather(1, target)[:, None, :]
        z = squash(((value.double() - t_mean) / t_std).clamp(-Z_LIMIT, Z_LIMIT)).float()
        value = torch.where(is_num[:, None, :], z, value) * marked[:, None, :].to(value.dtype)  # (B, R, C)
        contrib = value[..., None] * proj[:, None].to(value.dtype)  # (B, R, C, d)
        index = target[:, None, :, None].expand(b, r, c, d)
        return torch.zeros_like(contrib).scatter_add(2, index, contrib)

    def forward(self, batch: TableBatch, id_seed: int = 0) -> tuple[torch.Tensor, ColumnFacts]:
        """(tokens with the thinking rows first, the column facts) of a batch."""
        x = _visible(batch)
        facts = self.columns(batch, id_seed, x)
        return self.embed(batch, facts, x=x), facts
