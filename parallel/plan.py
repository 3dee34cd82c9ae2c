"""ParallelPlan: how a model tells the engine to split it, without the engine importing the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor, nn


@dataclass
class PipelinePlan:
    """How a model runs as a pipeline of stages (`torch.distributed.pipelining`).

    n_layers        the repeated layers that stages divide (pp must divide it).
    build_stage     (k, n) -> stage k of n: an nn.Module holding the model's own submodules
                    under their model names (its state dict is the model's, restricted to the
                    stage), so that checkpoints of any pp layout name tensors alike. Its
                    forward takes the previous stage's outputs positionally (nothing for
                    stage 0) and the batch tensors as keyword arguments (every stage gets
                    them), and returns a tuple of tensors only: before the last stage each
                    with the micro-batch on dim 0 and a shape that depends only on the batch
                    tensors' shapes (they travel point-to-point into preallocated buffers).
    batch_tensors   batch -> {name: tensor}, every tensor with the batch's items on dim 0
                    (micro-batches are cut along it; the criterion sees `batch[start:stop]`).
                    Under row-sequence parallelism it is given this rank's rows of the batch
                    (`shard_rows`), so a stage's row seams see local rows as without stages.
    output          the last stage's tensors -> what the criterion takes as the model output
                    (None: the tuple itself).
    """

    n_layers: int
    build_stage: Callable[[int, int], nn.Module]
    batch_tensors: Callable[[Any], dict[str, Tensor]]
    output: Callable[[tuple[Tensor, ...]], Any] | None = None

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"PipelinePlan.n_layers must be >= 1, got {self.n_layers}")


@dataclass
class ParallelPlan:
    """Declared by a model (e.g. `model.parallel_plan()`); applied generically by plugins.

    blocks          fully-qualified names of the repeated blocks, in order: the units for
                    FSDP wrapping, activation checkpointing and pipeline stage splits.
    tp_plan         module-name pattern (fnmatch style, e.g. "blocks.*.mlp.fc1") ->
                    "colwise" | "rowwise": the DTensor tensor-parallel plan.
    row_attention   names of the row attentions' key seams: modules (k, v, kv_mask) -> (k, v,
                    kv_mask) whose outputs are the keys a row attention attends to; the engine
                    hooks them to return every row-sequence-parallel rank's keys (an all-gather).
    shared_row_keys leading keys that are the same on every rank (e.g. learned rows every
                    table starts with): kept from one rank only when keys are gathered.
    row_statistics  names of modules that reduce statistics over context rows (all-reduced
                    across the row-sequence-parallel group).
    num_heads       attention heads per attention module (tensor-parallel divisibility check).
    experts         module-name patterns (fnmatch) of grouped-expert modules: parameters with
                    the expert on dim 0, forward (E, slots, d) dispatch buffer -> (E, slots, d');
                    expert parallelism shards them over ep ranks (parallel.expert_parallel).
    expert_tp       parameter name (of an experts module) -> the dim tensor parallelism splits
                    inside each expert (e.g. {"w1": 1, "w2": 2}: the hidden width); empty: the
                    experts stay whole on every tp rank.
    pipeline        how to cut the model into pipeline stages (None: it cannot be pipelined).
    """

    blocks: list[str] = field(default_factory=list)
    tp_plan: dict[str, str] = field(default_factory=dict)
    row_attention: list[str] = field(default_factory=list)
    shared_row_keys: int = 0
    row_statistics: list[str] = field(default_factory=list)
    num_heads: int = 1
    experts: list[str] = field(default_factory=list)
    expert_tp: dict[str, int] = field(default_factory=dict)
    pipeline: PipelinePlan | None = None

    def __post_init__(self) -> None:
        for name, style in self.tp_plan.items():
            if style not in ("colwise", "rowwise"):
                raise ValueError(f"tp_plan[{name!r}] = {style!r}; expected 'colwise' or 'rowwise'")
        if self.shared_row_keys < 0:
            raise ValueError(f"shared_row_keys must be >= 0, got {self.shared_row_keys}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")


def plan_of(model: nn.Module, needed_for: str | None = None) -> ParallelPlan:
    """`model.parallel_plan()`, checked; an empty plan for a model without one, unless `needed_for`
    names what cannot run without it (then a ValueError saying so)."""
    plan_fn = getattr(model, "parallel_plan", None)
    if plan_fn is None:
        if needed_for:
            raise ValueError(f"{type(model).__name__} declares no parallel_plan(): {needed_for} need one "
                             "(tabfm.parallel.ParallelPlan)")
        return ParallelPlan()
    plan = plan_fn()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"{type(model).__name__}.parallel_plan() returned {type(plan).__name__}, "
                        "expected tabfm.parallel.plan.ParallelPlan")
    return plan
