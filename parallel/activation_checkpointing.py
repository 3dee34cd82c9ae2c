"""Activation checkpointing over the blocks a model's ParallelPlan names (`tabfm pretrain --activation-checkpointing`).

Each block keeps only its input in the forward pass and recomputes its activations in backward:
activation memory of the blocks falls to one block's worth at ~1/3 more compute. Applied by the
engine, after tensor and row-sequence parallelism and before compiling and data-parallel
wrapping (torchtitan's order), in place: the module tree and parameter names stay as they are
(parallel.torch_internals.checkpoint_module), so a run can resume with it on or off.
"""
from __future__ import annotations

from torch import nn

from .plan import ParallelPlan
from .torch_internals import checkpoint_module

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """Checkpoint the activations of every module of `plan.blocks`, in place; returns their names."""
    if not plan.blocks:
        raise ValueError(f"{type(model).__name__}.parallel_plan() names no blocks to checkpoint")
    for name in plan.blocks:
        checkpoint_module(model.get_submodule(name))
    return list(plan.blocks)
