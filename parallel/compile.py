"""torch.compile over the blocks a model's ParallelPlan names (`tabfm pretrain --compile`).

Each block is compiled in place (`nn.Module.compile`): the module tree, its parameters and its
state-dict keys stay as they are, so checkpoints, exports and every plugin see the same model,
and the compiled code is what runs whenever a block is called. Blocks, not the whole model: the
encoder's data-dependent branches (missing cells, categorical columns) would break one graph
into many, while every block runs the same few ops on any table. Shapes are dynamic because
the stream's tables change size from batch to batch (BENCHMARKS.md measures what it buys).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .plan import ParallelPlan

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, plan: ParallelPlan, **compile_kwargs: Any) -> list[str]:
    """Compile every module of `plan.blocks` in place (dynamic shapes unless given); returns their names."""
    if not plan.blocks:
        raise ValueError(f"{type(model).__name__}.parallel_plan() names no blocks to compile")
    kwargs = {"dynamic": True, **compile_kwargs}
    for name in plan.blocks:
        model.get_submodule(name).compile(**kwargs)
    return list(plan.blocks)
