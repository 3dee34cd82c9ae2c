"""SingleProcessPlugin: one process, one device — the reference every other plugin is tested against."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..plugin import Plugin
from ..precision import MixedPrecision
from ..wrappers import ModelWrapper, OptimizerWrapper


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """None -> cuda if available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class SingleProcessPlugin(Plugin):
    """Moves the model to `device` and wraps it for mixed precision; nothing is distributed."""

    name = "single"

    def __init__(self, device: "str | torch.device | None" = None,
                 precision: "str | MixedPrecision | None" = None) -> None:
        self._device = resolve_device(device)
        super().__init__(precision)

    @property
    def device(self) -> torch.device:
        return self._device

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        self.apply_block_options(model)
        # Module.to moves parameter data in place, so `optimizer` keeps pointing at them.
        model.to(self.device)
        wrapped_optimizer = self.wrap_optimizer(optimizer) if optimizer is not None else None
        return self.wrap_model(model), wrapped_optimizer, criterion, dataloader, lr_scheduler
