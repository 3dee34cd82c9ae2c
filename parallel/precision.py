"""Mixed precision: which dtype autocast computes in, and dynamic loss scaling for fp16.

Parameters (master weights) always stay fp32; only the forward's compute runs in bf16/fp16.
fp16 additionally needs loss scaling so small gradients do not flush to zero; the scaler
lives inside the `OptimizerWrapper`, so the training loop never sees it. Gradients may be
DTensors (FSDP2 shards): the scaler unscales and checks each rank's local shard, and the
plugin agrees the overflow flag across ranks (see `OptimizerWrapper`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from .torch_internals import foreach_unscale_

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """A precision policy. `MixedPrecision.of("bf16")` accepts the short names.

    dtype           "fp32" | "bf16" | "fp16": the autocast compute dtype ("fp32": no autocast).
    output_fp32     cast floating-point model outputs back to fp32 so losses are computed
                    in full precision outside autocast.
    init_scale ...  dynamic loss scaling (fp16 only): start at `init_scale`; on overflow skip
                    the step and multiply by `backoff_factor`; after `growth_interval` clean
                    steps multiply by `growth_factor`; never go below `min_scale`.
    """

    dtype: str = "fp32"
    output_fp32: bool = True
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise ValueError(f"precision {self.dtype!r} is not one of {sorted(PRECISIONS)}")
        if not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0 and self.growth_interval >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")

    @classmethod
    def of(cls, precision: "str | MixedPrecision | None") -> "MixedPrecision":
        if precision is None:
            return cls()
        if isinstance(precision, MixedPrecision):
            return precision
        return cls(dtype=precision)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.dtype]

    def autocast(self, device: torch.device) -> ContextManager[Any]:
        """Autocast context for `device` (a no-op for fp32)."""
        if self.torch_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.torch_dtype)

    def make_scaler(self) -> "DynamicLossScaler | None":
        if self.dtype != "fp16":
            return None
        return DynamicLossScaler(
            scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
        )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor (sharing its storage), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling (the torch.amp.GradScaler algorithm, made rank-agnostic).

    `unscale_` reports whether *this rank's* gradients (local shards of DTensors) hold an
    inf/NaN; the OptimizerWrapper then agrees that flag across ranks (the plugin's
    all-reduce) and, when clipping, also treats a non-finite global norm as an overflow,
    so every rank skips the same steps and keeps the same scale.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide `grads` (plain or DTensor) by the scale in place; return this rank's
        found-inf flag: a one-element float32 tensor, 1.0 if any local element is inf/NaN."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            local = local_shard(g)
            by_device.setdefault(local.device, []).append(local)
        flags = []
        for device, tensors in by_device.items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
            foreach_unscale_(tensors, found, inv_scale)
            flags.append(found.cpu())
        return torch.stack(flags).amax(0) if flags else torch.zeros(1, dtype=torch.float32)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
