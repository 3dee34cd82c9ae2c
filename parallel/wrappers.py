"""ModelWrapper and OptimizerWrapper: what `Booster.boost` hands back to the training loop.

They hide precision (autocast, fp32 outputs, loss scaling) and distribution (the plugin's
grad-norm and the wrapped DDP/FSDP module) behind the plain nn.Module / Optimizer surface,
so the loop is the same for every plugin.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from .precision import DynamicLossScaler, MixedPrecision

GradNormFn = Callable[[list[torch.Tensor], float], torch.Tensor]
FoundInfFn = Callable[[torch.Tensor], torch.Tensor]
StepFn = Callable[..., Any]  # (inner optimizer, *step args) -> what optimizer.step returns


def plain_grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Global norm of local, unsharded gradients (what torch.nn.utils.clip_grad_norm_ computes)."""
    return torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False)


def _to_fp32(obj: Any) -> Any:
    """Cast floating tensors in a nest of dict/list/tuple/dataclass outputs to fp32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() and obj.dtype != torch.float32 else obj
    if isinstance(obj, dict):
        return type(obj)((k, _to_fp32(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_fp32(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_fp32(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _to_fp32(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


class ModelWrapper(nn.Module):
    """The boosted model. `forward` runs the (possibly DDP/FSDP-wrapped) module under autocast.

    module      what forward calls (the user's module, or a distributed wrapper around it).
    unwrapped   the user's module, returned by `unwrap()` (defaults to `module`).
    """

    def __init__(
        self,
        module: nn.Module,
        precision: MixedPrecision,
        device: torch.device,
        unwrapped: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.precision = precision
        self.device = torch.device(device)
        object.__setattr__(self, "_unwrapped", unwrapped if unwrapped is not None else module)

    def unwrap(self) -> nn.Module:
        """The user's own module (for its attributes, plans and full state dicts)."""
        return self._unwrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast(self.device):
            out = self.module(*args, **kwargs)
        if self.precision.torch_dtype is not None and self.precision.output_fp32:
            out = _to_fp32(out)
        return out


class OptimizerWrapper:
    """The boosted optimizer: `backward`, `clip_grad_by_norm`, `step`, `zero_grad`, state dicts.

    With fp16 it scales the loss in `backward`, unscales gradients (plain or DTensor) once
    before clipping or stepping, and skips `step()` when some gradient is inf/NaN
    (`last_step_skipped` says so). Every rank must reach the same decision:

    grad_norm_fn      from the plugin; returns the norm over *all* ranks' shards, so clipping
                      agrees everywhere (a non-finite norm also counts as an overflow).
    found_inf_fn      from sharded plugins; agrees this rank's found-inf flag across ranks
                      (an all-reduce MAX), since each rank only sees its own gradient shards.
                      None: the flag is local (right when gradients are replicated, as in DDP).
    step_fn           from sharded plugins; how to step the inner optimizer, called as
                      `step_fn(optim, *args, **kwargs)` (e.g. the same update run over the local
                      shards of DTensor parameters, skipping DTensor dispatch). It must compute
                      exactly what `optim.step` would. None: `optim.step(*args, **kwargs)`.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        scaler: DynamicLossScaler | None = None,
        grad_norm_fn: GradNormFn = plain_grad_norm,
        found_inf_fn: FoundInfFn | None = None,
        step_fn: StepFn | None = None,
    ) -> None:
        self.optim = optim
        self.scaler = scaler
        self.grad_norm_fn = grad_norm_fn
        self.found_inf_fn = found_inf_fn
        self.step_fn = step_fn
        self.last_step_skipped = False
        self._unscaled = False
        self._found_inf: bool | None = None

    # --- the torch.optim.Optimizer surface the loop and schedulers use -------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._unscaled, self._found_inf = False, None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.scaler is not None:
            if self._unscaled:
                raise RuntimeError("backward() after gradients were unscaled; call step()/zero_grad() first")
            loss = self.scaler.scale_loss(loss)
        loss.backward(retain_graph=retain_graph)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients in place to total norm `max_norm`; return the norm before clipping."""
        params = self._params_with_grad()
        norm = self._unscale_and_norm(params, norm_type)
        if self._found_inf:  # the step will be skipped; leave the gradients alone
            return norm
        sharded = [p for p in params if callable(getattr(p.grad, "full_tensor", None))]
        plain = [p for p in params if not callable(getattr(p.grad, "full_tensor", None))]
        for group in (sharded, plain):  # foreach kernels refuse DTensor and plain tensors mixed
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.scaler is None:
            self.last_step_skipped = False
            self._step_inner(*args, **kwargs)
            return
        if self._found_inf is None:  # not yet decided by clip_grad_by_norm
            self._unscale_once(self._params_with_grad())
        found_inf = bool(self._found_inf)
        self.scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if not found_inf:
            self._step_inner(*args, **kwargs)
        self._unscaled, self._found_inf = False, None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any]:
        state = self.optim.state_dict()
        if self.scaler is not None:
            state = {**state, "loss_scaler": self.scaler.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        scaler_state = state.pop("loss_scaler", None)
        self.optim.load_state_dict(state)
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)

    # --- internals -------------------------------------------------------------------------
    def _step_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.step_fn is not None:
            return self.step_fn(self.optim, *args, **kwargs)
        return self.optim.step(*args, **kwargs)

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"] if p.grad is not None]

    def _unscale_once(self, params: list[torch.Tensor]) -> None:
        """fp16: unscale the gradients once per step and decide, on every rank alike, whether
        some gradient overflowed."""
        if self.scaler is None or self._unscaled:
            return
        found = self.scaler.unscale_([p.grad for p in params])
        if self.found_inf_fn is not None:
            found = self.found_inf_fn(found)
        self._found_inf = bool(found.item() > 0)
        self._unscaled = True

    def _unscale_and_norm(self, params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Unscale once per step (fp16), then compute the global gradient norm."""
        self._unscale_once(params)
        norm = self.grad_norm_fn([p.grad for p in params], norm_type)
        if self.scaler is not None:  # the norm is global, so this agrees across ranks too
            self._found_inf = bool(self._found_inf) or not bool(torch.isfinite(norm))
        return norm

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r}, loss_scale={self.loss_scale})"
