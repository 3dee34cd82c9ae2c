"""Optimizers and the learning-rate schedule for training the table transformer."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm gains, biases and embedding-like vectors are not weight-decayed."""
    return p.dim() < 2 or "norm" in name or "embed" in name


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one (Muon for hidden matrices, AdamW for the rest).

    param_groups is the concatenation of the children's groups (the same dicts), so an
    LR scheduler built on this object drives every child.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def state(self):  # type: ignore[override]
        merged: dict = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    @torch.no_grad()
    def step(self, closure: Callable | None = None):  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        states = state_dict["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"optimizer state holds {len(states)} optimizers, this one has {len(self.optimizers)}")
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)
        # loading replaces each child's group dicts: point at the new ones so schedulers reach them
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def build_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.95), muon_lr: float = 0.02,
) -> torch.optim.Optimizer:
    """AdamW with decay only on matrices, or Muon on the blocks' hidden matrices + AdamW elsewhere."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "muon":
        hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        hidden_ids = {id(p) for p in hidden}
        rest = [(n, p) for n, p in named if id(p) not in hidden_ids]
        adam = torch.optim.AdamW(_groups(rest, weight_decay), lr=lr, betas=betas)
        if not hidden:
            return adam
        muon = torch.optim.Muon(hidden, lr=muon_lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        return CombinedOptimizer([muon, adam])
    return torch.optim.AdamW(_groups(named, weight_decay), lr=lr, betas=betas)


def _groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for n, p in named if not _no_decay(n, p)]
    keep = [p for n, p in named if _no_decay(n, p)]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}) if g["params"]]


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
