"""Row-sequence parallelism: the rows of every table are split over an "sp" group of ranks.

torch has nothing for this axis, so it is ours. A table model whose rows interact only
through (a) attention along the row axis and (b) statistics summed over rows declares those
modules in its `ParallelPlan` (`row_attention`, `row_statistics`); then

    each sp rank runs the model on a contiguous slice of every table's rows  (`shard_rows`)
    row attention: keys, values and key mask are all-gathered over the group,
        and the gradients of the gathered K/V are reduce-scattered back       (`RowKVGather`)
    row statistics: their outputs (sums) are all-reduced over the group     (`reduce_statistics`)
    the loss: the group's global mean, each rank back-propagating its share (`RowShardedCriterion`)

and the sharded forward equals the unsharded one: every query row sees every key row,
wherever it lives (attention is invariant to the order of its keys). Keys a model repeats
on every rank (`plan.shared_row_keys`, e.g. learned thinking rows) are kept from sp rank 0 only. The
gradients of replicated parameters are partial sums per rank; the plugin all-reduces them.

Inputs to shard are duck-typed: anything with `slice_rows(start, stop)` and `shape[1]` = rows
(e.g. a padded batch of tables). Every rank of a group must be given the same full input.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .plan import ParallelPlan

__all__ = ["shard_rows", "gather_rows", "all_reduce_sum", "RowKVGather", "reduce_statistics", "sync_rng_state",
           "RowShardedModule", "RowShardedCriterion", "parallelize_rows"]


# --- inputs --------------------------------------------------------------------------------

def is_row_sharded_input(obj: Any) -> bool:
    return callable(getattr(obj, "slice_rows", None)) and hasattr(obj, "shape")


def shard_rows(batch: Any, rank: int, world: int) -> Any:
    """Rows [rank * R / world, (rank + 1) * R / world) of every table of `batch`.

    Raises ValueError naming the numbers when the row count R is not divisible by `world`."""
    rows = int(batch.shape[1])
    if rows % world:
        raise ValueError(f"row-sequence parallelism splits each table's rows over sp={world} ranks, but this "
                         f"batch has {rows} rows ({rows} % {world} = {rows % world}); pad or bucket tables to a "
                         f"multiple of {world} rows")
    step = rows // world
    return batch.slice_rows(rank * step, (rank + 1) * step)


# --- collectives with autograd --------------------------------------------------------------

def _pad_rows(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    if t.shape[dim] == rows:
        return t
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def _all_gather_padded(t: torch.Tensor, dim: int, rows: int, group: Any) -> torch.Tensor:
    """Every rank's `t` padded with zeros to `rows` along `dim`, concatenated in rank order."""
    world = dist.get_world_size(group)
    x = _pad_rows(t, dim, rows).movedim(dim, 0).contiguous()
    out = x.new_empty((world * rows, *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather (zero-padded to `rows`); backward: reduce-scatter (SUM) the
    gradient and keep this rank's unpadded part."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, dim: int, rows: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.local, ctx.group = dim, t.shape[dim], group
        return _all_gather_padded(t, dim, rows, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        world = dist.get_world_size(ctx.group)
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = g.new_empty((g.shape[0] // world, *g.shape[1:]))
        dist.reduce_scatter_single(out, g, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim).narrow(ctx.dim, 0, ctx.local), None, None, None


def gather_rows(t: torch.Tensor, dim: int, rows: int, group: Any) -> torch.Tensor:
    """All-gather `t` along `dim` over `group`, each rank's part zero-padded to `rows`
    (result: world * rows along `dim`, rank order). Differentiable: the backward
    reduce-scatters the gradient, so each rank gets the sum over ranks for its own rows."""
    return _GatherRows.apply(t, dim, rows, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of `t` over `group`. Differentiable: every rank uses the sum for its own rows, so
    the gradient of each part is the sum of all ranks' gradients. A tensor that needs no
    gradient is reduced in place (and returned)."""
    if t.requires_grad:
        return _AllReduceSum.apply(t, group)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


# --- the model seams ---------------------------------------------------------------------

class RowKVGather:
    """A forward hook for a row attention's key seam (`plan.row_attention`, a module returning
    (k, v, kv_mask)): it returns the keys, values and key mask of all ranks of `group`,
    concatenated along the row axis.

    k, v (N, H, Rk, hd) with Rk this rank's key rows; kv_mask (B, Rk) bool or None (all real).
    Ranks may hold different Rk: each part is padded to the longest (pads are masked out).
    The first `shared_keys` keys are the same on every rank and are kept from rank 0 only.
    Returns k, v (N, H, world * Rmax, hd) and a mask (B or 1, world * Rmax)."""

    def __init__(self, group: Any, shared_keys: int = 0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shared_keys = int(shared_keys)
        # sizes are exchanged and read on the host: under --compile it runs eagerly (wrapped here, not
        # with a decorator: torch.compiler.disable imports dynamo, seconds for every process)
        self.gather = torch.compiler.disable(self._gather)

    def __call__(self, module: nn.Module, args: Any, output: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gather(*output)

    def _gather(self, k: torch.Tensor, v: torch.Tensor,
               kv_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rk = k.shape[2]
        mine = torch.tensor([rk, 1 if kv_mask is None else kv_mask.shape[0]], dtype=torch.int64, device=k.device)
        sizes = mine.new_empty(2 * self.world)
        dist.all_gather_single(sizes, mine, group=self.group)
        rows, tables = (int(s) for s in sizes.view(self.world, 2).amax(0))
        mask = kv_mask if kv_mask is not None else torch.ones(1, rk, dtype=torch.bool, device=k.device)
        mask = mask.expand(tables, rk)
        if self.rank > 0 and self.shared_keys:
            mask = mask.clone()
            mask[:, : self.shared_keys] = False
        masks = _all_gather_padded(mask.to(torch.uint8), 1, rows, self.group).bool()
        kv = gather_rows(torch.stack([k, v]), 3, rows, self.group)
        return kv[0], kv[1], masks

    def __repr__(self) -> str:
        return f"RowKVGather(rank={self.rank}, world={self.world}, shared_keys={self.shared_keys})"


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


def reduce_statistics(group: Any) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook that all-reduces (SUM) every tensor a statistics module returns: the
    module must return plain sums over its rows (e.g. count, sum, sum of squares)."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return _map_tensors(output, lambda t: all_reduce_sum(t, group))

    return hook


def sync_rng_state(group: Any, device: torch.device) -> None:
    """Give every rank of `group` the RNG state of its first rank (torch CPU, and CUDA on
    CUDA devices): ranks that compute on one table must draw the same random numbers
    (e.g. per-table random identities) however much randomness their own rows consumed."""
    src = dist.get_global_rank(group, 0)
    comm = torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    state = torch.get_rng_state().to(comm)
    dist.broadcast(state, src=src, group=group)
    torch.set_rng_state(state.cpu())
    if torch.device(device).type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(comm)
        dist.broadcast(cuda_state, src=src, group=group)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


class RowShardedModule(nn.Module):
    """Runs `module` on this rank's rows: inputs with `slice_rows` are cut by `shard_rows`.

    sp_group    the row-sequence-parallel group (None: inputs are passed whole).
    rng_group   ranks that must draw the same random numbers (all ranks computing on the
                same tables, tensor-parallel peers included); synced before each training forward.
    """

    def __init__(self, module: nn.Module, sp_group: Any = None, rng_group: Any = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.module = module
        self.sp_group = sp_group
        self.rng_group = rng_group
        self.device = torch.device(device)
        self.sp_rank = dist.get_rank(sp_group) if sp_group is not None else 0
        self.sp_size = dist.get_world_size(sp_group) if sp_group is not None else 1

    def shard(self, obj: Any) -> Any:
        """This rank's rows of `obj` (unchanged if it has none to shard or sp is 1)."""
        if self.sp_size > 1 and is_row_sharded_input(obj):
            return shard_rows(obj, self.sp_rank, self.sp_size)
        return obj

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.rng_group is not None and self.module.training:
            sync_rng_state(self.rng_group, self.device)
        args = tuple(self.shard(a) for a in args)
        kwargs = {k: self.shard(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)


class RowShardedCriterion:
    """The criterion over a row-sharded model: called with the full inputs, like the model.

    The criterion must be a mean over items (e.g. scored cells); `count` says how many items
    this rank averaged: a key of the metrics dict the criterion returns with the loss
    (`loss, metrics = criterion(...)`), or a function `(output, *inputs) -> count`, or None
    (every rank weighs the same). The result's value is the group's global mean
    sum_r n_r * loss_r / sum_r n_r on every rank; its gradient is this rank's share
    (n_r / N) * d loss_r, so summing gradients over the group gives the global mean's.
    `metrics["loss"]` and `metrics[count]` become the global values; other metrics stay local.
    """

    def __init__(self, criterion: Callable[..., Any], module: RowShardedModule,
                 count: str | Callable[..., float] | None = "cells") -> None:
        self.criterion = criterion
        self.module = module
        self.count = count

    def __call__(self, output: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self.module.shard(a) for a in args)
        kwargs = {k: self.module.shard(v) for k, v in kwargs.items()}
        result = self.criterion(output, *args, **kwargs)
        loss, metrics = (result if isinstance(result, tuple) else (result, None))
        if self.module.sp_size == 1:
            return result
        if self.count is None:
            n = 1.0
        elif callable(self.count):
            n = float(self.count(output, *args, **kwargs))
        else:
            if not isinstance(metrics, dict) or self.count not in metrics:
                raise ValueError(f"row-sharded loss: the criterion must return (loss, metrics) with "
                                 f"metrics[{self.count!r}] = the number of items it averaged; pass "
                                 "loss_count=<key | function | None> to the plugin")
            n = float(metrics[self.count])
        total = torch.tensor([float(loss.detach()) * n, n], dtype=torch.float64, device=loss.device)
        dist.all_reduce(total, group=self.module.sp_group)
        count = float(total[1])
        share = loss * (n / count) if count > 0 else loss * 0.0
        value = float(total[0]) / count if count > 0 else 0.0
        loss = share + (value - share.detach())  # value: the global mean; gradient: this rank's share
        if metrics is None:
            return loss
        metrics = dict(metrics)
        metrics["loss"] = value
        if isinstance(self.count, str):
            metrics[self.count] = count
        return loss, metrics


# --- installing it -----------------------------------------------------------------------

def parallelize_rows(model: nn.Module, plan: ParallelPlan, sp_group: Any) -> list[Any]:
    """Install row-sequence parallelism on `model` from its plan, by forward hooks only: every
    `plan.row_attention` key seam returns the keys of all ranks (`RowKVGather`, the first
    `plan.shared_row_keys` from one rank), every `plan.row_statistics` module its outputs
    all-reduced. Returns the hook handles (removing them restores the one-device model)."""
    handles = []
    for name in plan.row_attention:
        module = _submodule(model, name, "row_attention")
        handles.append(module.register_forward_hook(RowKVGather(sp_group, shared_keys=plan.shared_row_keys)))
    for name in plan.row_statistics:
        module = _submodule(model, name, "row_statistics")
        handles.append(module.register_forward_hook(reduce_statistics(sp_group)))
    return handles


def _submodule(model: nn.Module, name: str, field: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"plan.{field}: the model has no submodule {name!r}") from None
