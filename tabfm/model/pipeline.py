"""TabFM as pipeline stages: what `TabFM.parallel_plan().pipeline` hands the engine.

Stage k of n holds layers [k L/n, (k+1) L/n) of the L blocks; stage 0 also the cell encoder,
the last stage also the final norm and the heads. Every stage receives the batch as tensors
(`batch_tensors`, the fields of `TableBatch`, cut into micro-batches by the engine) and rebuilds
from them what is cheap and deterministic: the keys-first row order, the attention masks and the
query index. Only what cannot be rebuilt travels between stages, as tensors with the tables on
dim 0 and shapes fixed by the batch's shape:

    tokens        float (B, T + R, C, d)   the residual stream (the only one with a gradient)
    mean, std     float64 (B, C)            context statistics of each column (for the heads)
    code_vectors  float32 (B, C, K, id_dim) code identity vectors, K = max_categories (drawn
                                            at random in train mode, so not recomputable)

The last stage returns the fields of `ModelOutput` (`model_output` rebuilds it). The forward of
the stages in sequence equals `TabFM.forward` (`tests/test_pipeline.py` checks it). Under tp, sp
and ZeRO the same stages run unchanged: the engine splits their planned layers, hands them this
rank's rows of the batch, and shards their parameters.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import nn

from tabfm.data.batch import TableBatch
from tabfm.parallel.plan import PipelinePlan

from .encoder import ColumnFacts
from .transformer import ModelOutput, TabFM, _attention_masks, _keys_first

__all__ = ["TabFMStage", "pipeline_plan", "batch_tensors"]


def batch_tensors(batch: TableBatch) -> dict[str, torch.Tensor]:
    """The batch as named tensors, tables on dim 0 (the engine cuts micro-batches along it)."""
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


class TabFMStage(nn.Module):
    """Stage `k` of `n` of `model`, sharing its submodules under the model's names
    (`encoder`, `blocks.{i}`, `norm`, `num_head`, `cat_head`), so its state dict is the
    model's restricted to the stage."""

    def __init__(self, model: TabFM, k: int, n: int) -> None:
        super().__init__()
        layers = model.config.n_layers
        if model.config.cells_per_token > 1:
            raise ValueError(f"pipeline stages need one token per cell; this model packs "
                             f"cells_per_token = {model.config.cells_per_token} cells per token")
        if not 0 <= k < n or layers % n:
            raise ValueError(f"stage {k} of {n}: the model's {layers} layers do not split into {n} equal stages")
        self.config = model.config
        self.first, self.last = k == 0, k == n - 1
        per = layers // n
        if self.first:
            self.encoder = model.encoder
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(k * per, (k + 1) * per)})
        if self.last:
            self.norm, self.num_head, self.cat_head = model.norm, model.num_head, model.cat_head

    def forward(self, *received: torch.Tensor, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`received`: the previous stage's (tokens, mean, std, code_vectors), nothing for stage 0;
        `tensors`: the micro-batch (`batch_tensors`)."""
        cfg = self.config
        t = cfg.n_thinking_rows
        batch = TableBatch(**tensors)
        index = batch.query.nonzero()  # (N, 3) in the caller's row order
        batch, pos = _keys_first(batch)
        if self.first:
            x, facts = self.encoder(batch)
            mean, std, code_vectors = facts.mean, facts.std, facts.code_vectors[:, :, :cfg.max_categories]
        else:
            x, mean, std, code_vectors = received
        col_mask, n_keys, kv_mask = _attention_masks(batch, t)
        for block in self.blocks.values():
            x = block(x, col_mask, n_keys, kv_mask)
        if not self.last:
            return x, mean, std, code_vectors
        bi, ri, ci = index.unbind(1)
        if pos is not None:
            ri = pos[bi, ri]
        facts = ColumnFacts(mean=mean, std=std, col_vec=code_vectors[:, :, 0], code_vectors=code_vectors)
        out = TabFM._heads(self, x[bi, ri + t, ci], index, batch, facts)  # type: ignore[arg-type]
        return tuple(getattr(out, f.name) for f in fields(out) if f.name != "bar")


def model_output(model: TabFM, tensors: tuple[torch.Tensor, ...]) -> ModelOutput:
    """The last stage's tensors as the `ModelOutput` the loss takes."""
    return ModelOutput(*tensors, bar=model.num_head.bar)


def pipeline_plan(model: TabFM) -> PipelinePlan:
    """The pipeline part of `model.parallel_plan()`."""

    def build_stage(k: int, n: int) -> TabFMStage:
        return TabFMStage(model, k, n)

    def output(tensors: tuple[torch.Tensor, ...]) -> Any:
        return model_output(model, tensors)

    return PipelinePlan(n_layers=model.config.n_layers, build_stage=build_stage, batch_tensors=batch_tensors,
                        output=output)
