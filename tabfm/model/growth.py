"""Growing a trained model into a larger or faster one without starting from scratch.

Depth (`grow_depth`): each trained block is repeated; the repeats keep its weights but start
with zero output projections (attention `out`, MLP `fc2`), so they add nothing to the residual
stream until training moves them (block expansion, as in LLaMA Pro). A CPU-trained `tiny` can
so continue as a deeper model, computing exactly its function at the start.

Cells per token (`group_cells`): a G = 1 model becomes a G > 1 one (tabfm/model/grouping.py)
whose blocks, encoder and heads keep their weights; a token starts as the sum of its cells'
embeddings and every cell reads its token's final state. Exact only where a token holds a
single cell (one-column tables); elsewhere it is a starting point that training must adapt.

Context references (`add_context_refs`): a model without `ModelConfig.context_refs` gains the
encoder's reference projections at zero, so it computes exactly its function at the start;
`drop_context_refs` removes them for a run that drops the context features they refer to.
"""
from __future__ import annotations

import re

import torch

# the projections whose output is added to the residual stream, per block
RESIDUAL_OUTPUTS = ("col_attn.out.weight", "row_attn.out.weight", "mlp.fc2.weight", "mlp.experts.w2")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def source_blocks(old_layers: int, new_layers: int) -> list[int]:
    """Which trained block each new block copies: each old block in turn, repeated in place."""
    if not 1 <= old_layers <= new_layers:
        raise ValueError(f"depth growth needs 1 <= old layers <= new layers (got {old_layers} -> {new_layers})")
    return [i * old_layers // new_layers for i in range(new_layers)]


def grow_depth(state: dict[str, torch.Tensor], old_layers: int, new_layers: int) -> dict[str, torch.Tensor]:
    """A state dict for `new_layers` blocks computing the same function as `state` (`old_layers` blocks)."""
    src = source_blocks(old_layers, new_layers)
    out: dict[str, torch.Tensor] = {}
    blocks: dict[int, dict[str, torch.Tensor]] = {}  # block index -> its parameters by name within the block
    for key, value in state.items():
        m = _BLOCK.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = value
        else:
            out[key] = value
    if set(blocks) != set(range(old_layers)):
        raise ValueError(f"the weights hold blocks {sorted(blocks)}, not 0..{old_layers - 1}")
    for i, j in enumerate(src):
        repeat = i > 0 and src[i - 1] == j
        for name, value in blocks[j].items():
            zero = repeat and name in RESIDUAL_OUTPUTS
            out[f"blocks.{i}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    return out


def group_cells(state: dict[str, torch.Tensor], d_model: int, cells_per_token: int) -> dict[str, torch.Tensor]:
    """A state dict for the same model with `cells_per_token` G > 1, from a G = 1 one: the grouper's
    pack map sums a token's cells, its unpack map copies the token's state to every slot."""
    if cells_per_token < 2:
        raise ValueError(f"group_cells needs cells_per_token >= 2 (got {cells_per_token})")
    if any(k.startswith("grouper.") for k in state):
        raise ValueError("the weights already pack cells into tokens (they hold grouper weights)")
    eye = torch.eye(d_model)
    return {**state,
            "grouper.pack_proj.weight": eye.repeat(1, cells_per_token),  # (d, G*d): sum of the G cells
            "grouper.unpack_proj.weight": eye.repeat(cells_per_token, 1)}  # (G*d, d): each slot = the token


def add_context_refs(state: dict[str, torch.Tensor], d_model: int, id_dim: int) -> dict[str, torch.Tensor]:
    """A state dict for the same model with `context_refs` on: the encoder's reference projections
    (tabfm/model/encoder.py) at zero."""
    from tabfm.data.context_features import MAX_ESTIMATORS

    if any(k.startswith("encoder.ref_") for k in state):
        raise ValueError("the weights already hold context-reference projections (encoder.ref_*)")
    return {**state,
            "encoder.ref_column.weight": torch.zeros(d_model, id_dim),
            "encoder.ref_code.weight": torch.zeros(d_model, id_dim),
            "encoder.ref_estimator.weight": torch.zeros(MAX_ESTIMATORS, d_model),
            "encoder.ref_value_class": torch.zeros(MAX_ESTIMATORS, d_model, id_dim),
            "encoder.ref_value_num": torch.zeros(MAX_ESTIMATORS, d_model)}


def drop_context_refs(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict without the encoder's reference projections: for a run that drops the context
    features they refer to (`--context-features none` from an init with them)."""
    return {k: v for k, v in state.items() if not k.startswith("encoder.ref_")}
