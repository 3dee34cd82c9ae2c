"""LowLevelZeroPlugin: ZeRO data parallelism composed from torch.

stage 1   DDP for gradients + torch `ZeroRedundancyOptimizer` (each rank keeps and updates
          only its partition of the optimizer state, then broadcasts its parameters).
stage 2   FSDP2 `fully_shard(reshard_after_forward=False)`: gradients are reduce-scattered
          (each rank keeps its gradient and optimizer-state shard); parameters stay gathered
          between forward and backward, so there is one all-gather per step, as in ZeRO-2.

Checkpoints keep the GeneralCheckpointIO format (full tensors, index-keyed optimizer state):
rank 0 writes the gathered state, every rank loads the full state and keeps its shard — so a
checkpoint reshards to any world size and loads into a single process.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader

from ..checkpoint import unwrap_model
from ..precision import MixedPrecision
from ..state_io import load_weights
from ..wrappers import ModelWrapper, OptimizerWrapper, plain_grad_norm
from .ddp import ReplicatedCheckpointIO, TorchDDPPlugin


def _optimizer_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


class FullStateFSDPCheckpointIO(ReplicatedCheckpointIO):
    """Gathers FSDP2 (DTensor) model and optimizer state to full tensors on rank 0, and loads
    full state back into the shards, in the GeneralCheckpointIO format."""

    def __init__(self, plugin: "LowLevelZeroPlugin") -> None:
        super().__init__(plugin.process_group)
        self._plugin = plugin

    @staticmethod
    def _options(**kw: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def full_model_state(self, model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(unwrap_model(model), options=self._options(cpu_offload=True))
        return state if self._rank_world()[0] == 0 else None

    def full_optimizer_state(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if model is None:
            raise ValueError("saving a stage-2 optimizer needs model= as well (its state is keyed by parameter)")
        state = get_optimizer_state_dict(unwrap_model(model), optimizer.unwrap(),
                                         options=self._options(cpu_offload=True))
        if self._rank_world()[0] != 0:
            return None
        index = {name: i for i, name in enumerate(self._plugin._param_names)}
        return {"state": {index[k]: v for k, v in state["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}

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
            raise ValueError("loading a stage-2 optimizer needs model= as well (its state is keyed by parameter)")
        names = self._plugin._param_names
        state = dict(state)
        state.pop("loss_scaler", None)
        by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(unwrap_model(model), optimizer.unwrap(), by_name, options=self._options())


class LowLevelZeroPlugin(TorchDDPPlugin):
    """ZeRO stage 1 (DDP + ZeroRedundancyOptimizer) or stage 2 (FSDP2, parameters kept
    gathered between forward and backward). Takes TorchDDPPlugin's keyword arguments (stage 1
    uses them all; stage 2 ignores the DDP-only ones)."""

    name = "zero"

    def __init__(self, stage: int = 1, precision: "str | MixedPrecision | None" = None, **ddp_kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin stage must be 1 or 2, got {stage} (stage 3 is the FSDP plugin)")
        self.stage = stage
        if stage == 2:  # no fp16 loss scaling over DTensor gradients yet
            self.supported_precisions = ("fp32", "bf16")
        super().__init__(precision=precision, **ddp_kwargs)
        self._param_names: list[str] = []
        self._fsdp_module: nn.Module | None = None
        if stage == 2:
            self._checkpoint_io = FullStateFSDPCheckpointIO(self)

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        if self.stage == 2:
            return self._configure_fsdp(model, optimizer, criterion, dataloader, lr_scheduler)
        self._ddp = self._wrap_ddp(model)
        wrapped = None
        if optimizer is not None:
            self._check_fresh(optimizer)
            zero = self._to_zero(optimizer)
            self._rebind_scheduler(lr_scheduler, optimizer, zero)
            wrapped = self.wrap_optimizer(zero)
        return self.wrap_model(model, self._ddp), wrapped, criterion, dataloader, lr_scheduler

    # --- stage 1 ---------------------------------------------------------------------------
    @staticmethod
    def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
        if any(optimizer.state.values()):
            raise ValueError("LowLevelZeroPlugin needs a fresh optimizer (no state yet): it rebuilds it around "
                             "the shards; load optimizer state through booster.load_checkpoint")

    @staticmethod
    def _rebind_scheduler(lr_scheduler: Any, old: torch.optim.Optimizer, new: Any) -> None:
        if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is old:
            lr_scheduler.optimizer = new  # the scheduler now drives the rebuilt optimizer's param groups

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
        zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)
        return zero

    # --- stage 2 ---------------------------------------------------------------------------
    def _configure_fsdp(self, model, optimizer, criterion, dataloader, lr_scheduler):
        from torch.distributed.fsdp import fully_shard

        if self.process_group is not None:
            raise NotImplementedError("LowLevelZeroPlugin(stage=2) runs over the default process group only")
        model.to(self.device)
        name_of = {id(p): n for n, p in model.named_parameters()}
        group_names = []
        if optimizer is not None:
            self._check_fresh(optimizer)
            for g in optimizer.param_groups:
                try:
                    group_names.append([name_of[id(p)] for p in g["params"]])
                except KeyError:
                    raise ValueError("the optimizer holds parameters that are not the model's") from None
        # like DDP: rank 0's parameters and buffers are the model (fully_shard keeps each rank's own)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        fully_shard(model, reshard_after_forward=False)
        self._fsdp_module = model
        wrapped = None
        if optimizer is not None:
            params = dict(model.named_parameters())
            self._param_names = [n for names in group_names for n in names]
            new_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in names]}
                          for g, names in zip(optimizer.param_groups, group_names)]
            sharded = type(optimizer)(new_groups, **_optimizer_kwargs(optimizer))
            self._rebind_scheduler(lr_scheduler, optimizer, sharded)
            wrapped = self.wrap_optimizer(sharded)
        return self.wrap_model(model), wrapped, criterion, dataloader, lr_scheduler

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        if self.stage == 1:
            with super().no_sync(model, optimizer):
                yield
            return
        module = unwrap_model(model) if model is not None else self._fsdp_module
        if module is None or not hasattr(module, "set_requires_gradient_sync"):
            raise RuntimeError("no_sync() before boost(): there is no FSDP module yet")
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        norm = plain_grad_norm(grads, norm_type)
        full = getattr(norm, "full_tensor", None)  # DTensor grads -> norm reduced over the shards
        return full() if callable(full) else norm
