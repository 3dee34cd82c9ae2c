"""TabFM: the row/column-attention table transformer (encoder -> blocks -> heads on query cells).

Invariances that hold exactly in eval mode (and are tested):
- hidden (query) cell values never reach the forward pass (`TableBatch.visible_x`);
- padding rows/columns influence nothing (masked out of attention and statistics);
- a non-context row influences no other row (row attention keys are context rows only);
- column order does not matter (no column positions; column identities derive from content).

Rows carry no position either: `forward` reorders each table's rows so the key rows (valid
context rows) come first, which lets row attention read its keys as a prefix slice; the
output refers to the caller's row numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tabfm.data.batch import TableBatch
from tabfm.parallel.plan import ParallelPlan

from .attention import KVCache
from .block import TableBlock
from .config import ModelConfig
from .encoder import CellEncoder, ColumnFacts
from .grouping import CellGrouper
from .heads import BarDistribution, CategoricalHead, NumericHead
from .moe import MoEMLP, MoEStats


@dataclass
class ModelOutput:
    """Predictions for the N query cells of a batch, in `batch.query.nonzero()` order.

    index        long (N, 3)       (table, row, column) of each query cell
    cat_logits   float32 (N, K)    categorical logits over codes 0..K-1 (K = max_categories);
                                   -inf beyond the column's cardinality; 0 rows for numeric cells
    num_logits   float32 (N, n_bins) bar-distribution logits on the standardised scale
                                   (meaningful for numeric cells only)
    mean, std    float64 (N,)      context mean/std of the cell's column: x = mean + std * z
    kind         int8 (N,)         1 numeric, 2 categorical
    cardinality  long (N,)         categories of the cell's column (0 for numeric)
    bar          BarDistribution   the bins behind num_logits

    moe          MoEStats or None  a mixture-of-experts model's routing statistics of this forward
                                   (aux and z losses averaged over its MoE blocks, counts summed,
                                   the config's weights of the losses); None for dense models.
                                   An attribute, not a dataclass field: pipeline stages ship the
                                   fields as one positional tuple of tensors.
    """

    index: torch.Tensor
    cat_logits: torch.Tensor
    num_logits: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    kind: torch.Tensor
    cardinality: torch.Tensor
    bar: BarDistribution

    def __post_init__(self) -> None:
        self.moe: MoEStats | None = None

    def __len__(self) -> int:
        return int(self.index.shape[0])


@dataclass
class ContextCache:
    """A context encoded once (`TabFM.encode_context`): its column facts and, per block, the
    row attention's keys/values. Query rows then cost only their own cells (`forward_queries`)."""

    facts: ColumnFacts
    kv: list[KVCache]
    n_tables: int
    n_columns: int


def _keys_first(batch: TableBatch) -> tuple[TableBatch, torch.Tensor | None]:
    """Reorder each table's rows so key rows (valid context rows) come first, keeping their
    order. Rows carry no position in this model, so this changes nothing but memory layout:
    row attention then reads its keys as a prefix slice. Returns the reordered batch and
    `pos` (B, R), the new position of each original row (None when already in order)."""
    keys = batch.context & batch.row_valid
    if bool((keys[:, 1:] <= keys[:, :-1]).all()):  # already a prefix in every table
        return batch, None
    order = torch.argsort((~keys).to(torch.int8), dim=1, stable=True)  # original row at each new position
    pos = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    idx3 = order[:, :, None].expand_as(batch.x)
    moved = TableBatch(
        x=batch.x.gather(1, idx3),
        kind=batch.kind,
        cardinality=batch.cardinality,
        row_valid=batch.row_valid.gather(1, order),
        col_valid=batch.col_valid,
        context=batch.context.gather(1, order),
        query=batch.query.gather(1, idx3),
        feature_ref=batch.feature_ref,
    )
    return moved, pos


def _attention_masks(batch: TableBatch, n_thinking: int, col_valid: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
    """For a keys-first batch: the column-attention key mask (B*R', 1, 1, C) over R' = T + R
    rows, the number of leading key rows n_keys, and the row-attention key mask (B, n_keys).
    `col_valid` (B, C): which token columns are real (default the batch's columns).

    Masks are None where nothing needs masking. The row-attention mask marks real keys only:
    a table with none (a fully padded table, or under row-sequence parallelism a table whose
    context rows all live on other ranks) has an all-False row, and `RowAttention` gives it
    one arbitrary key after gathering so attention stays finite (its outputs are unused).
    """
    col_ok = (batch.col_valid if col_valid is None else col_valid).clone()
    b, r, c = batch.shape[0], batch.shape[1], col_ok.shape[1]
    rows = n_thinking + r
    col_ok[:, 0] |= ~col_ok.any(1)
    col_mask = None
    if not bool(col_ok.all()):
        col_mask = col_ok[:, None, :].expand(b, rows, c).reshape(b * rows, 1, 1, c)

    counts = (batch.context & batch.row_valid).sum(1) + n_thinking
    n_keys = max(int(counts.max()), 1)
    kv_mask = torch.arange(n_keys, device=counts.device)[None, :] < counts[:, None]
    return col_mask, n_keys, (None if bool(kv_mask.all()) else kv_mask)


class TabFM(nn.Module):
    """Table foundation model. `forward(batch) -> ModelOutput` for the batch's query cells.

    Submodule names (used by `parallel_plan`): `encoder` (with `encoder.stats`),
    `blocks.{i}.{col_attn,row_attn,mlp}`, `norm`, `num_head`, `cat_head`, and with
    `cells_per_token` > 1 `grouper` (tabfm/model/grouping.py).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.encoder = CellEncoder(config)
        self.grouper = CellGrouper(config.d_model, config.cells_per_token) if config.cells_per_token > 1 else None
        self.blocks = nn.ModuleList(TableBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.num_head = NumericHead(config.d_model, config.n_bins, config.bin_range)
        self.cat_head = CategoricalHead(config.d_model, config.id_dim)
        self._scale_residual_outputs()

    def _scale_residual_outputs(self) -> None:
        """GPT-2 style: shrink the last projection of every residual branch by 1/sqrt(2 * n_layers)."""
        factor = (2 * self.config.n_layers) ** -0.5
        with torch.no_grad():
            for block in self.blocks:
                mlp_out = block.mlp.experts.w2 if isinstance(block.mlp, MoEMLP) else block.mlp.fc2.weight
                for weight in (block.col_attn.out.weight, block.row_attn.out.weight, mlp_out):
                    weight.mul_(factor)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def forward(self, batch: TableBatch, id_seed: int = 0) -> ModelOutput:
        """Predictions for the query cells; `id_seed` salts eval-mode column identities (ensembles)."""
        cfg = self.config
        t = cfg.n_thinking_rows
        index = batch.query.nonzero()  # (N, 3): b, r, c in the caller's row order
        bi, ri, ci = index.unbind(1)
        batch, pos = _keys_first(batch)
        if pos is not None:
            ri = pos[bi, ri]
        x, facts = self.encoder(batch, id_seed)
        x, col_valid, slots = self._tokens(x, batch, facts)
        col_mask, n_keys, kv_mask = _attention_masks(batch, t, col_valid)
        for block in self.blocks:
            x = block(x, col_mask, n_keys, kv_mask)
        out = self._heads(self._query_states(x, bi, ri + t, ci, slots), index, batch, facts)
        out.moe = self._take_moe_stats()
        return out

    def _take_moe_stats(self) -> MoEStats | None:
        """The MoE blocks' routing statistics of the forward just run, combined (None: a dense model);
        the blocks let go of theirs, so no module keeps this forward's graph alive."""
        moe = [b.mlp for b in self.blocks if isinstance(b.mlp, MoEMLP)]
        if not moe:
            return None
        stats = MoEStats.combine([m.stats for m in moe], self.config.moe_aux_weight, self.config.moe_z_weight)
        for m in moe:
            m.stats = None
        return stats

    def _tokens(self, x: torch.Tensor, batch: TableBatch, facts: ColumnFacts
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Cell tokens -> the blocks' tokens: (tokens, which token columns are real, each column's
        slot (B, C) or None when every cell is its own token)."""
        if self.grouper is None:
            return x, batch.col_valid, None
        order, slots = self.grouper.layout(facts.col_vec, batch.col_valid)
        tokens, valid = self.grouper.pack(x, order, batch.col_valid)
        return tokens, valid, slots

    def _query_states(self, x: torch.Tensor, bi: torch.Tensor, ri: torch.Tensor, ci: torch.Tensor,
                      slots: torch.Tensor | None) -> torch.Tensor:
        """(N, d) final states of the cells (bi, ri, ci), ri counting the thinking rows."""
        if slots is None:
            return x[bi, ri, ci]
        slot = slots[bi, ci]
        return self.grouper.unpack(x[bi, ri, slot // self.config.cells_per_token], slot)

    def _heads(self, h: torch.Tensor, index: torch.Tensor, batch: TableBatch, facts: ColumnFacts) -> ModelOutput:
        """ModelOutput from the final tokens h (N, d) of the query cells at `index`."""
        bi, ci = index[:, 0], index[:, 2]
        h = self.norm(h)  # heads only on query cells
        card = batch.cardinality[bi, ci].long()
        k = self.config.max_categories
        cat_logits = self.cat_head(h, facts.code_vectors[bi, ci, :k], card)
        num_logits = self.num_head(h).float()
        return ModelOutput(
            index=index,
            cat_logits=cat_logits,
            num_logits=num_logits,
            mean=facts.mean[bi, ci],
            std=facts.std[bi, ci],
            kind=batch.kind[bi, ci],
            cardinality=card,
            bar=self.num_head.bar,
        )

    # ------------------------------------------------------------------ cached inference
    def encode_context(self, batch: TableBatch, id_seed: int = 0) -> ContextCache:
        """Run a batch of context rows only (eval mode) and keep what query rows need of it.

        `forward_queries(rows, cache)` on any rows then equals `forward` on the context and
        those rows together (query rows never influence other rows), at the cost of the query
        rows alone: the context is not recomputed for every chunk of queries.
        """
        if self.training:
            raise RuntimeError("encode_context is for inference: call model.eval() first")
        if bool(batch.query.any()) or not bool((batch.context | ~batch.row_valid).all()):
            raise ValueError("encode_context takes context rows only (no query cells, every valid row context)")
        x, facts = self.encoder(batch, id_seed)
        x, col_valid, _ = self._tokens(x, batch, facts)
        col_mask, n_keys, kv_mask = _attention_masks(batch, self.config.n_thinking_rows, col_valid)
        caches = [KVCache() for _ in self.blocks]
        for block, cache in zip(self.blocks, caches):
            x = block(x, col_mask, n_keys, kv_mask, cache)
        return ContextCache(facts=facts, kv=caches, n_tables=batch.shape[0], n_columns=batch.shape[2])

    def forward_queries(self, batch: TableBatch, cache: ContextCache) -> ModelOutput:
        """Predictions for the query cells of `batch`, rows attending to the cached context.

        `batch` holds non-context rows only, with the same tables and columns (kind,
        cardinality, col_valid) as the batch the cache was encoded from.
        """
        b, _, c = batch.shape
        if (b, c) != (cache.n_tables, cache.n_columns):
            raise ValueError(f"query batch has {b} tables x {c} columns; the cached context has "
                             f"{cache.n_tables} x {cache.n_columns}")
        if bool((batch.context & batch.row_valid).any()):
            raise ValueError("forward_queries takes non-context rows only; put context rows in encode_context")
        index = batch.query.nonzero()
        x = self.encoder.embed(batch, cache.facts, thinking=False)
        x, col_valid, slots = self._tokens(x, batch, cache.facts)
        col_mask = _attention_masks(batch, 0, col_valid)[0]
        for block, kv in zip(self.blocks, cache.kv):
            x = block(x, col_mask, 0, None, kv)
        return self._heads(self._query_states(x, index[:, 0], index[:, 1], index[:, 2], slots), index, batch, cache.facts)

    def parallel_plan(self) -> ParallelPlan:
        """How the engine may split this model (see parallel/plan.py; pipeline stages: .pipeline).

        Mixture-of-experts MLPs: expert parallelism splits the experts of each MoE block's
        GroupedExperts (`experts`), tensor parallelism each expert's hidden width (`expert_tp`). A
        model with them declares no pipeline: the stages would not carry the routing losses to
        the criterion."""
        from .pipeline import pipeline_plan  # imports this module

        n = self.config.n_layers
        moe = any(self.config.moe_layer(i) for i in range(n))
        dense_mlps = not all(self.config.moe_layer(i) for i in range(n))
        return ParallelPlan(
            blocks=[f"blocks.{i}" for i in range(n)],
            tp_plan={
                "blocks.*.col_attn.qkv": "colwise",
                "blocks.*.col_attn.out": "rowwise",
                "blocks.*.row_attn.qkv": "colwise",
                "blocks.*.row_attn.out": "rowwise",
                **({"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"} if dense_mlps else {}),
            },
            row_attention=[f"blocks.{i}.row_attn.keys" for i in range(n)],
            shared_row_keys=self.config.n_thinking_rows,  # the thinking rows lead every rank's keys
            row_statistics=["encoder.stats"],
            num_heads=self.config.n_heads,
            experts=["blocks.*.mlp.experts"] if moe else [],
            expert_tp={"w1": 1, "w2": 2} if moe else {},  # (E, hidden, d) and (E, d, hidden)
            pipeline=None if moe else pipeline_plan(self),
        )
