"""Expert parallelism from a model's plan: experts sharded over an "ep" mesh dimension, tokens
exchanged with all_to_all; optionally each expert's width over "tp" too.

    names = parallelize_experts(model, mesh["ep"], model.parallel_plan())
    names = parallelize_experts(model, mesh["ep", "tp"], model.parallel_plan())   # experts over ep, width over tp

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

Over tp (ranks computing the same tokens) each parameter is also sharded on the dim
`plan.expert_tp` names (for an MLP expert: fc1's output features, fc2's input features), the
buffer enters as a replicated DTensor, DTensor's propagation keeps the hidden activations
sharded, and the output's partial sums are all-reduced after the forward: Megatron's MLP split,
per expert.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .plan import ParallelPlan

__all__ = ["check_expert_layout", "exchange", "parallelize_experts", "resolve_experts"]


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


def check_expert_layout(model: nn.Module, plan: ParallelPlan, ep: int, tp: int = 1) -> list[str]:
    """Check that `ep` ranks can split the planned experts, and `tp` ranks each expert's width
    (no communication); return the expert module names. Each module's parameters must share an
    expert count on dim 0 that ep divides; under tp every parameter needs a `plan.expert_tp` dim
    that tp divides."""
    if ep < 1 or tp < 1:
        raise ValueError(f"ep and tp must be >= 1, got ep={ep}, tp={tp}")
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
        for pname, p in params if tp > 1 else ():
            dim = plan.expert_tp.get(pname)
            if dim is None or not 0 < dim < p.dim():
                raise ValueError(f"tensor parallelism inside experts: ParallelPlan.expert_tp gives {name}.{pname} "
                                 f"{'no' if dim is None else f'dim {dim}, not a'} dim to split (its shape is "
                                 f"{tuple(p.shape)}; dim 0 is the expert)")
            if p.shape[dim] % tp:
                raise ValueError(f"tensor parallelism inside experts: {name}.{pname} has {p.shape[dim]} on dim {dim}, "
                                 f"not divisible by tp={tp}")
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
    """The pre- and post-forward functions of one grouped-experts module over its (ep, tp) mesh
    (module doc). One call's slot count is kept from the first to the second: a module's forward
    calls do not nest (a recomputed forward, under activation checkpointing, runs both again)."""

    def __init__(self, mesh: Any) -> None:
        names = mesh.mesh_dim_names
        self.ep_group = mesh.get_group("ep") if "ep" in names else None
        self.ep = mesh.size(names.index("ep")) if "ep" in names else 1
        self.placements = _placements(names, 0)
        self.tp = "tp" in names
        self.slots = 0

    def before(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor

        buffer, *rest = inputs
        if self.ep_group is not None:
            experts, slots, d = buffer.shape
            most = torch.tensor([max(slots, 1)], device=buffer.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ep_group)
            width = int(most.item())
            self.slots = slots
            if width > slots:
                buffer = torch.cat([buffer, buffer.new_zeros(experts, width - slots, d)], 1)
            buffer = exchange(buffer, self.ep_group)  # (ep * E/ep, width, d): chunk j = rank j's slots of my experts
            buffer = buffer.view(self.ep, experts // self.ep, width, d).transpose(0, 1).reshape(experts // self.ep, -1, d)
        return (DTensor.from_local(buffer, mesh, self.placements, run_check=False), *rest)

    def after(self, module: nn.Module, output: Any, mesh: Any) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        if self.tp:  # the tp ranks' partial sums of each expert's output
            output = output.redistribute(mesh, [Replicate() if p.is_partial() else p for p in output.placements])
        local = output.to_local()  # (E/ep, ep * width, d')
        if self.ep_group is None:
            return local
        per_expert, total, d = local.shape
        width = total // self.ep
        back = local.view(per_expert, self.ep, width, d).transpose(0, 1).reshape(per_expert * self.ep, width, d)
        return exchange(back, self.ep_group)[:, :self.slots]


def _placements(names: tuple[str, ...], tp_dim: int | None) -> list[Any]:
    """DTensor placements over an (ep, tp) mesh: the expert dim sharded over ep; over tp, `tp_dim`
    sharded (a parameter) or, with tp_dim 0, replicated (the dispatch buffer every tp rank holds)."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if n == "ep" else (Shard(tp_dim) if tp_dim else Replicate()) for n in names]


def parallelize_experts(model: nn.Module, mesh: Any, plan: ParallelPlan) -> list[str]:
    """Shard the planned experts over `mesh`, a DeviceMesh of dims "ep", "tp" or both ("ep" before
    "tp"): on their expert dim over ep, on `plan.expert_tp`'s dim over tp; route their buffers
    through all_to_all over ep. In place (`torch.distributed.tensor.distribute_module`); returns
    the module names. Parameters become DTensors scattered from the mesh's first rank: rebuild the
    optimizer on them."""
    from torch.distributed.tensor import distribute_module, distribute_tensor

    names = tuple(mesh.mesh_dim_names or ())
    if not names or set(names) - {"ep", "tp"} or list(names) != sorted(names):
        raise ValueError(f"parallelize_experts takes a mesh of dims ('ep',), ('tp',) or ('ep', 'tp'), got {names}")
    size = dict(zip(names, mesh.shape))
    experts = check_expert_layout(model, plan, size.get("ep", 1), size.get("tp", 1))

    def shard(module: nn.Module, mesh: Any) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            placements = _placements(names, plan.expert_tp.get(pname))
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, placements),
                                                          requires_grad=p.requires_grad))

    for name in experts:
        module = model.get_submodule(name)
        dispatch = _Dispatch(mesh)
        distribute_module(module, mesh, lambda n, m, mesh, top=module: shard(m, mesh) if m is top else None,
                          input_fn=dispatch.before, output_fn=dispatch.after)
    return experts
