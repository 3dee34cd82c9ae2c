"""ParallelPlan: how a model tells the engine to split it, without the engine importing the model."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelPlan:
    """Declared by a model (e.g. `model.parallel_plan()`); applied generically by plugins.

    blocks          fully-qualified names of the repeated blocks, in order: the units for
                    FSDP wrapping, activation checkpointing and pipeline stage splits.
    tp_plan         module-name pattern (fnmatch style, e.g. "blocks.*.mlp.fc1") ->
                    "colwise" | "rowwise": the DTensor tensor-parallel plan.
    row_attention   names of modules that attend along the row axis (keys/values gathered
                    across the row-sequence-parallel group).
    row_statistics  names of modules that reduce statistics over context rows (all-reduced
                    across the row-sequence-parallel group).
    num_heads       attention heads per attention module (tensor-parallel divisibility check).
    """

    blocks: list[str] = field(default_factory=list)
    tp_plan: dict[str, str] = field(default_factory=dict)
    row_attention: list[str] = field(default_factory=list)
    row_statistics: list[str] = field(default_factory=list)
    num_heads: int = 1

    def __post_init__(self) -> None:
        for name, style in self.tp_plan.items():
            if style not in ("colwise", "rowwise"):
                raise ValueError(f"tp_plan[{name!r}] = {style!r}; expected 'colwise' or 'rowwise'")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
