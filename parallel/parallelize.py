"""parallelize(): a model's ParallelPlan applied to it, in torchtitan's order, in one place.

    done = parallelize(model, plan, tp_mesh=mesh["tp"], sp_group=sp, activation_checkpointing=True,
                       fully_shard_kwargs={"mesh": mesh["dp_sp"], "reshard_after_forward": True})

applies, each step only when asked for, in place:

1. tensor parallel      the plan's `tp_plan` layers become DTensor shards over `tp_mesh`
                        (`parallelize_module`; parallel.tensor_parallel)
   expert parallel      the plan's `experts` are sharded on their expert dim over the "ep" dim of
                        `expert_mesh` (and their width over its "tp" dim), their dispatch buffers
                        exchanged by all_to_all (`distribute_module`; parallel.expert_parallel)
2. row-sequence         forward hooks on the plan's row-attention key seams and row-statistics
                        modules gather / reduce over `sp_group` (parallel.sequence_parallel)
3. activation ckpt      every `plan.blocks` module recomputed in backward (parallel.activation_checkpointing)
4. torch.compile        every `plan.blocks` module compiled (parallel.compile)
5. data parallel        FSDP2 `fully_shard` on every block, innermost first, then the root
                        (ZeRO-2/3; `fully_shard_kwargs`: mesh, precision policy, resharding);
                        experts sharded over ep stay out of it (FSDP's ignored parameters)

Every plugin builds its model through this function (the plugin decides the meshes and
options), then builds or rebuilds the optimizer on the parameters that result. Replicated data
parallelism (DDP, or the hybrid plugin's bucketed all-reduce) wraps or hooks the result.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from torch import nn

from .activation_checkpointing import checkpoint_blocks
from .compile import compile_blocks
from .expert_parallel import parallelize_experts
from .plan import ParallelPlan
from .sequence_parallel import parallelize_rows
from .tensor_parallel import parallelize_tensor

__all__ = ["Parallelized", "parallelize", "resolve_blocks", "unsharded"]


@dataclass
class Parallelized:
    """What `parallelize` did: the tensor-parallel styles by layer, the row hooks (removing them
    restores the one-device forward, e.g. for evaluation on whole tables), the FSDP units."""

    tp_styles: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)
    row_hooks: list[Any] = field(default_factory=list)
    fsdp_units: list[nn.Module] = field(default_factory=list)


def resolve_blocks(model: nn.Module, blocks: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) for each block name, innermost first (fully_shard wraps children before parents)."""
    units = []
    for name in blocks:
        if not name:
            raise ValueError("blocks: the root module is always sharded; list only submodules")
        try:
            units.append((name, model.get_submodule(name)))
        except AttributeError:
            raise ValueError(f"blocks: the model has no submodule {name!r}") from None
    if len({id(m) for _, m in units}) != len(units):
        raise ValueError(f"blocks name the same module twice: {list(blocks)}")
    return sorted(units, key=lambda u: -u[0].count("."))


def parallelize(model: nn.Module, plan: ParallelPlan, *, tp_mesh: Any = None, expert_mesh: Any = None,
                sp_group: Any = None, activation_checkpointing: bool = False, compile: bool = False,
                fully_shard_kwargs: dict[str, Any] | None = None) -> Parallelized:
    """Apply tensor parallel (over `tp_mesh`) and expert parallel (over `expert_mesh`, dims "ep"
    and / or "tp"), row-sequence parallel (over `sp_group`), activation checkpointing,
    torch.compile and FSDP2 (`fully_shard_kwargs`, None: not sharded) to `model`, in that order
    and in place."""
    done = Parallelized()
    if tp_mesh is not None and tp_mesh.size() > 1:
        done.tp_styles = parallelize_tensor(model, tp_mesh, plan)
    if expert_mesh is not None and expert_mesh.size() > 1:
        done.experts = parallelize_experts(model, expert_mesh, plan)
    if sp_group is not None:
        done.row_hooks = parallelize_rows(model, plan, sp_group)
    if activation_checkpointing:
        checkpoint_blocks(model, plan)
    if compile:
        compile_blocks(model, plan)
    if fully_shard_kwargs is not None:
        from torch.distributed.fsdp import fully_shard

        if done.experts:
            experts = {p for name in done.experts for p in model.get_submodule(name).parameters()}
            fully_shard_kwargs = {**fully_shard_kwargs,
                                  "ignored_params": set(fully_shard_kwargs.get("ignored_params", ())) | experts}
        blocks = resolve_blocks(model, plan.blocks)
        for _, block in blocks:
            fully_shard(block, **fully_shard_kwargs)
        fully_shard(model, **fully_shard_kwargs)
        done.fsdp_units = [b for _, b in blocks] + [model]
    return done


@contextlib.contextmanager
def unsharded(module: nn.Module) -> Iterator[nn.Module]:
    """`module` with its outermost FSDP2 units' parameters gathered (`FSDPModule.unshard`, public)
    until the context ends: code that calls the model's submodules or methods other than `forward`
    (the estimators' cached-context inference) then reads whole parameters of the root's own
    modules (encoder, heads), which only the root's forward would gather; inner units (the blocks)
    gather in their own forwards as always. Only outermost units: unsharding an inner one first
    would make it a root of its own (hence the root's set-up first). Collective: every rank enters it together."""
    from torch.distributed.fsdp import FSDPModule

    from .torch_internals import fsdp_lazy_init

    units, inside = [], set()
    for m in module.modules():  # parents before children
        if isinstance(m, FSDPModule) and id(m) not in inside:
            fsdp_lazy_init(m)
            units.append(m)
            inside.update(id(c) for c in m.modules())
    for unit in units:
        unit.unshard()
    try:
        yield module
    finally:
        for unit in units:
            unit.reshard()
