"""LowLevelZeroPlugin: ZeRO data parallelism composed from torch.

stage 1   DDP for gradients + torch `ZeroRedundancyOptimizer` (each rank keeps and updates
          only its partition of the optimizer state, then broadcasts its parameters).
stage 2   FSDP2 `fully_shard(reshard_after_forward=False)`: gradients are reduce-scattered
          (each rank keeps its gradient and optimizer-state shard); parameters stay gathered
          between forward and backward, so there is one all-gather per step, as in ZeRO-2.

`FullyShardPlugin` holds what every plugin built on FSDP2 shares (ZeRO-2 here, ZeRO-3 in
`fsdp.py`): sharding the model and rebuilding the optimizer around the DTensor parameters,
`no_sync` through `set_requires_gradient_sync`, the global norm of DTensor gradients, and
fp16 overflow flags agreed across ranks. Two speed paths, each computing what torch's default
would: torch Adam/AdamW steps over the local shards (`adam_step_on_local_shards`, no DTensor
dispatch per op; the state stays the optimizer's own DTensors), and on gloo FSDP2's all-gather
and reduce-scatter run as rings of point-to-point exchanges (`RingAllGather`,
`RingReduceScatter`), which cost less CPU than gloo's own collectives. See BENCHMARKS.md,
"Booster overhead and step time".

Checkpoints are sharded (`ShardedCheckpointIO`): each rank writes its own shards through
torch.distributed.checkpoint, and a checkpoint reshards on load to any plugin and world size,
a single process included. "General" (full-tensor) checkpoints load too: at stage 1 through
`ReplicatedCheckpointReader`, at stage 2 / FSDP through `FullStateFSDPReader`, which
scatters the full state into the shards.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader

from ..checkpoint import unwrap_model
from ..parallelize import parallelize, resolve_blocks
from ..plan import ParallelPlan
from ..precision import MixedPrecision
from ..state_io import load_weights
from ..wrappers import ModelWrapper, OptimizerWrapper, plain_grad_norm
from ..sharded_checkpoint import ShardedCheckpointIO
from ..torch_internals import (adam_init_group, dtensor_storage, mark_optimizer_stepped, rebind_scheduler,
                               step_hooks_registered, sync_zero_param_groups)
from .ddp import ReplicatedCheckpointReader, TorchDDPPlugin


def _optimizer_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    if any(optimizer.state.values()):
        raise ValueError("sharding plugins need a fresh optimizer (no state yet): they rebuild it around the "
                         "shards; load optimizer state through booster.load_checkpoint")


def _rebind_scheduler(lr_scheduler: Any, old: torch.optim.Optimizer, new: Any) -> None:
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is old:
        rebind_scheduler(lr_scheduler, new)  # the scheduler now drives the rebuilt optimizer's param groups


def rebuild_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, group_names: list[list[str]],
                      lr_scheduler: Any = None) -> torch.optim.Optimizer:
    """The same optimizer (type, hyperparameters, groups) over the model's current parameters
    (after sharding or tensor-parallel replaced them), found by name; a scheduler that drove
    the old optimizer now drives the new one."""
    params = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in names]}
              for g, names in zip(optimizer.param_groups, group_names)]
    rebuilt = type(optimizer)(groups, **_optimizer_kwargs(optimizer))
    _rebind_scheduler(lr_scheduler, optimizer, rebuilt)
    return rebuilt


def sharded_grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Global gradient norm when gradients may be DTensor shards: the per-shard norms are
    reduced over the shards' mesh (`full_tensor`); plain gradients give the plain norm."""
    sharded = [g for g in grads if callable(getattr(g, "full_tensor", None))]
    plain = [g for g in grads if not callable(getattr(g, "full_tensor", None)) and g.numel()]
    norms = [plain_grad_norm(sharded, norm_type).full_tensor()] if sharded else []
    if plain:  # parameters left unsharded (replicated): their norm counts once
        norms.append(plain_grad_norm(plain, norm_type).to(norms[0].device if norms else plain[0].device))
    if not norms:
        return torch.zeros(())
    return norms[0] if len(norms) == 1 else plain_grad_norm(norms, norm_type)


def local_shard_step_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `adam_step_on_local_shards` can step `optimizer`: torch's own Adam or AdamW
    (not a subclass, whose step may differ), not in differentiable mode."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and not any(g.get("differentiable", False) for g in optimizer.param_groups))


def _shard_of(t: torch.Tensor, param: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's shard of `t` (gradient or optimizer state of `param`): the local tensor when
    both are DTensors laid out alike, `t` when both are plain. Anything else would make an
    elementwise update over local tensors wrong (e.g. a Partial gradient), so it raises."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        if not (isinstance(t, DTensor) and t.placements == param.placements and t.device_mesh == param.device_mesh):
            layout = f"{t.placements} on {t.device_mesh}" if isinstance(t, DTensor) else "a plain tensor"
            raise RuntimeError(f"local-shard step: the {what} of a DTensor parameter ({param.placements} on "
                               f"{param.device_mesh}) is {layout}; it must be laid out like the parameter")
        return dtensor_storage(t)
    if isinstance(t, DTensor):
        raise RuntimeError(f"local-shard step: the {what} of a plain parameter is a DTensor")
    return t


def adam_step_on_local_shards(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """One `optimizer.step()` of torch Adam/AdamW, run over the local shards of DTensor
    parameters, gradients and state.

    Why: Adam is elementwise, so each rank's update of its shards is the whole update of its
    part of the model; running torch's functional `adam` (the group's own foreach / fused
    choice, resolved for the local tensors) on the shards gives what `optimizer.step()` gives,
    without DTensor's per-op dispatch (which made the FSDP2 step ~1.75x slower than DDP's step
    over twice the elements). The state stays the optimizer's own DTensors (created on the first
    step by the optimizer itself, updated in place through their local tensors), so
    `state_dict()`, DCP checkpoints and resharding see nothing different.

    With step hooks registered on the optimizer (or globally), it calls `optimizer.step()`
    instead, which runs them (same update, through DTensor dispatch).
    """
    from torch.optim.adam import adam

    if step_hooks_registered(optimizer):
        return optimizer.step(closure)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            # the optimizer's own bookkeeping: lazy state init (DTensors like the parameters), checks
            has_complex = adam_init_group(optimizer, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adam(
                [_shard_of(p, p, "parameter") for p in params],
                [_shard_of(g, p, "gradient") for g, p in zip(grads, params)],
                [_shard_of(m, p, "exp_avg") for m, p in zip(exp_avgs, params)],
                [_shard_of(v, p, "exp_avg_sq") for v, p in zip(exp_avg_sqs, params)],
                [_shard_of(v, p, "max_exp_avg_sq") for v, p in zip(max_exp_avg_sqs, params)],
                steps,  # plain scalar tensors, one per parameter
                amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
                found_inf=getattr(optimizer, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
    mark_optimizer_stepped(optimizer)  # a step ran, though not through optimizer.step(): tell its scheduler
    return loss


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: Any) -> None:
    """Send `send` to the next rank of `group` and receive `recv` from the previous one."""
    rank, world = group.rank(), group.size()
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class RingAllGather:
    """FSDP2 all-gather as a ring of point-to-point exchanges (`FSDPModule.set_custom_all_gather`).

    Why: on CPU, gloo's `all_gather_single` costs ~1.5x the CPU time of exchanging the same
    bytes point to point (BENCHMARKS.md, "Booster overhead and step time"), and ZeRO-2 runs one
    all-gather of the whole model per step. The result is the same bytes in the same places.
    Synchronous (returns None, whatever `async_op`): FSDP2 then treats the gather as done; on
    CPU, where these run, there is no second stream to overlap with anyway.
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        rank, world = group.rank(), group.size()
        chunks = output_tensor.view(world, -1)
        if chunks[rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 copies in place; others may not
            chunks[rank].copy_(input_tensor.view(-1))
        for step in range(world - 1):  # pass on the chunk received last (our own first)
            _ring_exchange(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], group)


class RingReduceScatter:
    """FSDP2 reduce-scatter as a ring of point-to-point exchanges (`set_custom_reduce_scatter`).

    Why: on CPU, gloo's `reduce_scatter_single` costs 2-3x the CPU time of the ring below.
    Each of the `world - 1` steps sends a running partial sum of one chunk to the next rank
    and adds this rank's contribution to the partial received; after the last step each rank
    holds the sum of its own chunk. Sums run in ring order (bitwise what gloo gives at two
    ranks; at more ranks the order, and so the last bits, may differ). ReduceOp.AVG divides
    by the world size afterwards; other ops than SUM/AVG are refused. Extra memory: one chunk
    to receive into (and one partial sum per step beyond two ranks). Synchronous, like
    RingAllGather.
    """

    allocate = RingAllGather.allocate

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"RingReduceScatter: reduce op {op} (only SUM and AVG)")
        rank, world = group.rank(), group.size()
        chunks = input_tensor.view(world, -1)
        out = output_tensor.view(-1)
        if world == 1:
            out.copy_(chunks[0])
        send, recv = chunks[(rank - 1) % world], torch.empty_like(out)
        for step in range(world - 1):
            _ring_exchange(send, recv, group)
            mine = chunks[(rank - step - 2) % world]  # the chunk whose partial sum just arrived
            if step == world - 2:
                torch.add(recv, mine, out=out)
            else:
                send = recv + mine
        if op == dist.ReduceOp.AVG:
            out.div_(world)


class FullStateFSDPReader(ReplicatedCheckpointReader):
    """Reads a "general" (full-tensor) checkpoint into FSDP2 (DTensor) shards: the fallback
    reader of the sharded plugins' ShardedCheckpointIO."""

    def __init__(self, plugin: "FullyShardPlugin") -> None:
        super().__init__(plugin.process_group)
        self._plugin = plugin

    @staticmethod
    def _options(**kw: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def load_full_model_state(self, model, path: Path, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        module = unwrap_model(model)
        loaded = load_weights(path)
        own = module.state_dict()
        missing, unexpected = sorted(own.keys() - loaded.keys()), sorted(loaded.keys() - own.keys())
        if strict and (missing or unexpected):
            raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        for key in own:
            if key in loaded and tuple(own[key].shape) != tuple(loaded[key].shape):
                raise ValueError(f"{path}: key {key!r} has shape {list(loaded[key].shape)}, "
                                 f"model expects {list(own[key].shape)}")
        set_model_state_dict(module, loaded, options=self._options(strict=strict))

    def load_full_optimizer_state(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if model is None:
            raise ValueError("loading a sharded (FSDP2) optimizer needs model= as well (its state is keyed by parameter)")
        names = self._plugin._param_names
        state = dict(state)
        state.pop("loss_scaler", None)
        by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(unwrap_model(model), optimizer.unwrap(), by_name, options=self._options())


class FullyShardPlugin(TorchDDPPlugin):
    """Base of the plugins that shard with FSDP2 `fully_shard` (ZeRO-2, FSDP/ZeRO-3).

    Takes TorchDDPPlugin's keyword arguments (the DDP-only ones are unused when sharding).
    Subclasses call `_shard` from `configure`; the rest (no_sync, grad norm, fp16 overflow
    agreement, full-state checkpoints) is shared here.
    """

    def __init__(self, precision: "str | MixedPrecision | None" = None, **ddp_kwargs: Any) -> None:
        super().__init__(precision=precision, **ddp_kwargs)
        self._param_names: list[str] = []  # the rebuilt optimizer's parameters, in order (checkpoint keys)
        self._fsdp_module: nn.Module | None = None
        self.fsdp_units: list[str] = []  # names of the modules given to fully_shard ("" = the root)
        self._checkpoint_io = ShardedCheckpointIO(fallback=FullStateFSDPReader(self))

    def _shard(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
               blocks: Sequence[str] = (), **fully_shard_kwargs: Any) -> tuple[ModelWrapper, OptimizerWrapper | None]:
        """The model through `parallelize` (the block options, then `fully_shard` on each module
        named in `blocks`, innermost first, and the root), and `optimizer` rebuilt (same type,
        hyperparameters and groups) on the sharded parameters."""
        if self.process_group is not None:
            raise NotImplementedError(f"{type(self).__name__} runs over the default process group only")
        model.to(self.device)
        group_names = _param_names_by_group(model, optimizer) if optimizer is not None else []
        units = resolve_blocks(model, blocks)
        # like DDP: rank 0's parameters and buffers are the model (fully_shard keeps each rank's own)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        # empty parameters (e.g. a 0-row embedding) cannot be reduce-scattered: leave them plain
        empty = {p for p in model.parameters() if p.numel() == 0}
        if empty:
            fully_shard_kwargs = {**fully_shard_kwargs, "ignored_params": empty}
        self.apply_block_options(model)  # over the model's planned blocks; the FSDP units may be others
        parallelize(model, ParallelPlan(blocks=[name for name, _ in units]), fully_shard_kwargs=fully_shard_kwargs)
        if dist.get_backend() == "gloo":  # gloo's own all-gather / reduce-scatter cost more CPU (see RingAllGather)
            for module in [m for _, m in units] + [model]:
                module.set_custom_all_gather(RingAllGather())
                module.set_custom_reduce_scatter(RingReduceScatter())
        self._fsdp_module = model
        self.fsdp_units = [name for name, _ in units] + [""]
        wrapped = None
        if optimizer is not None:
            self._param_names = [n for names in group_names for n in names]
            wrapped = self.wrap_optimizer(rebuild_optimizer(model, optimizer, group_names, lr_scheduler))
        return self.wrap_model(model), wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerWrapper:
        """torch Adam/AdamW step over the local shards (`adam_step_on_local_shards`: the same
        update, without DTensor dispatch); other optimizers step themselves over the DTensors."""
        step_fn = adam_step_on_local_shards if local_shard_step_supported(optimizer) else None
        return OptimizerWrapper(optimizer, scaler=self.precision.make_scaler(), grad_norm_fn=self.grad_norm,
                                found_inf_fn=self._found_inf_anywhere, step_fn=step_fn)

    def _found_inf_anywhere(self, found: torch.Tensor) -> torch.Tensor:
        """All-reduce (MAX) this rank's fp16 overflow flag: each rank sees only its own gradient
        shards, and all ranks must skip the same steps."""
        flag = found.to(self.device, torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return flag

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients without the reduce-scatter;
        the first backward outside reduces the accumulated sum."""
        module = unwrap_model(model) if model is not None else self._fsdp_module
        if module is None or not hasattr(module, "set_requires_gradient_sync"):
            raise RuntimeError("no_sync() before boost(): there is no FSDP module yet")
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        return sharded_grad_norm(grads, norm_type)


def _param_names_by_group(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The model's parameter names in each optimizer param group (the optimizer must be fresh)."""
    _check_fresh(optimizer)
    name_of = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds parameters that are not the model's") from None


class LowLevelZeroPlugin(FullyShardPlugin):
    """ZeRO stage 1 (DDP + ZeroRedundancyOptimizer) or stage 2 (FSDP2, parameters kept
    gathered between forward and backward). Takes TorchDDPPlugin's keyword arguments (stage 1
    uses them all; stage 2 ignores the DDP-only ones). fp16 loss scaling works at both stages.
    Stage 1 keeps DDP's no_sync and the replicated checkpoint IO; the shared grad norm and
    overflow agreement are exact (if redundant) on its replicated gradients."""

    name = "zero"

    def __init__(self, stage: int = 1, precision: "str | MixedPrecision | None" = None, **ddp_kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin stage must be 1 or 2, got {stage} (stage 3 is the FSDP plugin)")
        self.stage = stage
        super().__init__(precision=precision, **ddp_kwargs)
        if stage == 1:
            self._checkpoint_io = ShardedCheckpointIO(self.process_group,
                                                      fallback=ReplicatedCheckpointReader(self.process_group))

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        if self.stage == 2:
            wrapped_model, wrapped = self._shard(model, optimizer, lr_scheduler, reshard_after_forward=False)
            return wrapped_model, wrapped, criterion, dataloader, lr_scheduler
        self.apply_block_options(model)
        self._ddp = self._wrap_ddp(model)
        wrapped = None
        if optimizer is not None:
            _check_fresh(optimizer)
            zero = self._to_zero(optimizer)
            _rebind_scheduler(lr_scheduler, optimizer, zero)
            wrapped = self.wrap_optimizer(zero)
        return self.wrap_model(model, self._ddp), wrapped, criterion, dataloader, lr_scheduler

    # --- stage 1 ---------------------------------------------------------------------------
    def _to_zero(self, optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        groups = optimizer.param_groups
        zero = ZeroRedundancyOptimizer(list(groups[0]["params"]), optimizer_class=type(optimizer),
                                       process_group=self.process_group, **_optimizer_kwargs(optimizer))
        for group in groups[1:]:
            zero.add_param_group({"params": list(group["params"])})
        # every group's own hyperparameters (and e.g. a scheduler's initial_lr) on ZeRO's global
        # param groups; ZeRO copies them to its local optimizer at each step
        for mine, theirs in zip(zero.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        sync_zero_param_groups(zero)
        return zero

    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> ContextManager[None]:
        if self.stage == 1:  # DDP's own no_sync
            return TorchDDPPlugin.no_sync(self, model, optimizer)
        return super().no_sync(model, optimizer)
