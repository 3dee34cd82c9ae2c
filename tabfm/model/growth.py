"""Depth growth: a deeper model that starts as exactly the function of a trained shallower one.

Each trained block is repeated; the repeats keep its weights but start with zero output
projections (attention `out`, MLP `fc2`), so they add nothing to the residual stream until
training moves them (block expansion, as in LLaMA Pro). A CPU-trained `tiny` can so continue
as a deeper model without losing what it has learned.
"""
from __future__ import annotations

import re

import torch

# the projections whose output is added to the residual stream, per block
RESIDUAL_OUTPUTS = ("col_attn.out.weight", "row_attn.out.weight", "mlp.fc2.weight")
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
