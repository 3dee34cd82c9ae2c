"""Expert parallelism from a model's plan: experts sharded over a 1-D "ep" mesh, tokens exchanged
with all_to_all.

    names = parallelize_experts(model, mesh["ep"], model.parallel_plan())

The plan's `experts` lists (fnmatch patterns of) grouped-expert modules: modules whose
parameters all hold the expert on dim 0 and whose forward maps a dispatch buffer (E, slots, d)
to (E, slots, d'), row e through expert e (the model's router fills the buffer and reads it
back; the engine never sees the router). Over ep ranks each such module:

- holds E / ep experts: its parameters become DTensors `Shard(0)` over the ep mesh, so DCP
  checkpoints save whole tensors and reshard them to any ep size (or to one process);
- before its forward, pads the buffer's slots to the largest of the ep group (one all-reduce of
  a number), and all_to_all sends buffer rows of rank j's experts to rank j: rank j then holds
  (E / ep, ep * slots, d), its experts' tokens from every peer, which its forward computes as a
  `Shard(0)` DTensor (a local batched matmul: no communication inside);
- after its forward, sends each peer's slots back (the inverse all_to_all) and drops the padding.

The exchange is differentiable (its backward is the same exchange of the gradients), so an
expert's gradient on its rank sums the contributions of every ep peer's tokens. The engine then
reduces expert gradients over the ranks holding the same experts (data-parallel ranks outside
ep) and everything else over all data-parallel ranks (HybridParallelPlugin). The ep peers
compute on different tables (ep is part of data parallelism for everything but the experts),
so every rank must run each forward with its peers: the routing of each rank stays its own.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .plan import ParallelPlan

__all__ = ["check_ep_layout", "exchange", "parallelize_experts", "resolve_experts"]


def resolve_experts(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """The submodule names `plan.experts` patterns match, in module order; a pattern matching
    nothing is an error (a typo must not leave experts replicated)."""
    names = [n for n, _ in model.named_modules() if n]
    hits: list[str] = []
    for pattern in plan.experts:
        found = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not found:
            raise ValueError(f"ParallelPlan.experts pattern {pattern!r} matches no submodule of {type(model).__name__}")
        hits += [n for n in found if n not in hits]
    order = {n: i for i, n in enumerate(names)}
    return sorted(hits, key=order.__getitem__)


def check_ep_layout(model: nn.Module, plan: ParallelPlan, ep: int) -> list[str]:
    """Check that `ep` ranks can split the planned experts (no communication); return their module
    names. Each module's parameters must share an expert count on dim 0 that ep divides."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    names = resolve_experts(model, plan)
    if ep > 1 and not names:
        raise ValueError(f"expert parallelism (ep={ep}) splits mixture-of-experts layers, and "
                         f"{type(model).__name__} has none (for tabfm: --moe-experts E)")
    for name in names:
        params = list(model.get_submodule(name).named_parameters(recurse=False))
        if not params:
            raise ValueError(f"ParallelPlan.experts: {name!r} holds no parameters of its own")
        counts = {p.shape[0] if p.dim() else None for _, p in params}
        if len(counts) != 1 or None in counts:
            raise ValueError(f"ParallelPlan.experts: {name!r}'s parameters must all hold the expert on dim 0; "
                             f"dim 0 sizes {[tuple(p.shape) for _, p in params]}")
        experts = counts.pop()
        if experts % ep:
            raise ValueError(f"expert parallelism: {name} has {experts} experts, not divisible by ep={ep}")
    return names


class _Exchange(torch.autograd.Function):
    """all_to_all of equal chunks along dim 0; its backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk j of `x` along dim 0 (of world equal chunks) goes to rank j of `group`; the result's
    chunk j came from rank j. Differentiable."""
    return _Exchange.apply(x, group)


class _Dispatch:
    """The pre- and post-forward functions of one grouped-experts module under ep (module doc).
    One call's slot count is kept from the first to the second: a module's forward calls do not
    nest (a recomputed forward, under activation checkpointing, runs both again in turn)."""

    def __init__(self, mesh: Any) -> None:
        self.group, self.ep = mesh.get_group(), mesh.size()
        self.slots = 0

    def before(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Shard

        buffer, *rest = inputs
        experts, slots, d = buffer.shape
        most = torch.tensor([max(slots, 1)], device=buffer.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        width = int(most.item())
        self.slots = slots
        if width > slots:
            buffer = torch.cat([buffer, buffer.new_zeros(experts, width - slots, d)], 1)
        mine = exchange(buffer, self.group)  # (ep * E/ep, width, d): chunk j = rank j's slots of my experts
        mine = mine.view(self.ep, experts // self.ep, width, d).transpose(0, 1).reshape(experts // self.ep, -1, d)
        return (DTensor.from_local(mine, mesh, [Shard(0)], run_check=False), *rest)

    def after(self, module: nn.Module, output: Any, mesh: Any) -> torch.Tensor:
        local = output.to_local()  # (E/ep, ep * width, d')
        per_expert, total, d = local.shape
        width = total // self.ep
        back = local.view(per_expert, self.ep, width, d).transpose(0, 1).reshape(per_expert * self.ep, width, d)
        return exchange(back, self.group)[:, :self.slots]


def parallelize_experts(model: nn.Module, ep_mesh: Any, plan: ParallelPlan) -> list[str]:
    """Shard the planned experts over `ep_mesh` and route their buffers through all_to_all (in
    place, `torch.distributed.tensor.distribute_module`); return the module names. Parameters
    become `Shard(0)` DTensors scattered from the mesh's rank 0: rebuild the optimizer on them."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    names = check_ep_layout(model, plan, ep_mesh.size())

    def shard(_: str, module: nn.Module, mesh: Any) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                          requires_grad=p.requires_grad))

    for name in names:
        module = model.get_submodule(name)
        dispatch = _Dispatch(ep_mesh)
        distribute_module(module, ep_mesh, lambda n, m, mesh, top=module: shard(n, m, mesh) if m is top else None,
                          input_fn=dispatch.before, output_fn=dispatch.after)
    return names
