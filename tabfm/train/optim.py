"""Optimizers and the learning-rate schedule for training the table transformer."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm gains, biases and embedding-like vectors are not weight-decayed."""
    return p.dim() < 2 or "norm" in name or "embed" in name


MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz iteration of Keller Jordan's Muon


def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of a matrix's SVD U S V^T (Muon's Newton-Schulz iteration), in `dtype`.

    A DTensor (FSDP / ZeRO-2 shards, tensor-parallel pieces) is orthogonalized as the whole
    matrix, then laid out as it came: the iteration is not elementwise."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(update, DTensor):
        full = orthogonalize(update.full_tensor(), steps, dtype, eps)
        return distribute_tensor(full, update.device_mesh, update.placements)
    a, b, c = MUON_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon=True` (2-D hidden matrices), AdamW on the others, as one
    torch optimizer: its state_dict has torch's layout, so torch.distributed.checkpoint, ZeRO-1's
    ZeroRedundancyOptimizer and every plugin that rebuilds an optimizer by type handle it like AdamW.

    Muon groups follow `torch.optim.Muon` (momentum 0.95, Nesterov, decoupled weight decay, step
    scaled 0.2 * sqrt(max(rows, cols)) to match AdamW's update RMS). The orthogonalization runs in
    `ns_dtype` ("bfloat16", "float32"; a name, so state dicts stay plain): None picks bfloat16 on CUDA (as torch's Muon does everywhere) and float32 on other
    devices, where CPUs without native bf16 emulate it at many times the cost of fp32.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.01, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype: str | None = None, muon: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, muon=muon)
        super().__init__(params, defaults)
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if group["muon"] and p.dim() != 2]
            if bad:
                raise ValueError(f"Muon groups take 2-D matrices only; got parameters of shape {bad}")

    @torch.no_grad()
    def step(self, closure: Callable | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if group["muon"]:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(grad)
                    buf, mu = state["momentum_buffer"], group["momentum"]
                    buf.lerp_(grad, 1 - mu)
                    dtype = getattr(torch, group["ns_dtype"] or ("bfloat16" if p.device.type == "cuda" else "float32"))
                    update = orthogonalize(grad.lerp(buf, mu), group["ns_steps"], dtype)
                    p.mul_(1 - lr * wd)
                    p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape[0], p.shape[1])))
                    continue
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                beta1, beta2 = group["betas"]
                state["step"] += 1
                t = float(state["step"])
                p.mul_(1 - lr * wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))
        return loss


def build_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.95), muon_lr: float = 0.02, lr_scale: Mapping[str, float] | None = None,
) -> torch.optim.Optimizer:
    """AdamW with decay only on matrices, or Muon on the blocks' hidden matrices + AdamW elsewhere.

    `lr_scale` maps a name fragment to a learning-rate factor: parameters whose name contains it
    (the first fragment that matches) learn at factor x their group's rate, e.g. new projections
    added to a trained model (`{"encoder.ref_": 10}`) that would barely move at its rate."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    scale = _scale_of(named, lr_scale or {})
    if name == "muon":
        hidden = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
        hidden_ids = {id(p) for _, p in hidden}
        rest = [(n, p) for n, p in named if id(p) not in hidden_ids]
        muon = [{"params": [p for n, p in hidden if scale[n] == f], "lr": muon_lr * f, "weight_decay": weight_decay,
                 "muon": True} for f in sorted({scale[n] for n, _ in hidden})]
        return MuonAdamW(muon + _groups(rest, weight_decay, scale, lr), lr=lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(_groups(named, weight_decay, scale, lr), lr=lr, betas=betas)


def _scale_of(named: list[tuple[str, torch.Tensor]], lr_scale: Mapping[str, float]) -> dict[str, float]:
    """Each parameter's learning-rate factor; a fragment that names no parameter is an error (a typo
    would otherwise train at the plain rate)."""
    for fragment, factor in lr_scale.items():
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"lr_scale[{fragment!r}] = {factor!r}: the factor must be a number > 0")
        if not any(fragment in n for n, _ in named):
            raise ValueError(f"lr_scale fragment {fragment!r} is in no trainable parameter's name "
                             f"(names look like {named[0][0]!r})")
    return {n: next((float(f) for frag, f in lr_scale.items() if frag in n), 1.0) for n, _ in named}


def _groups(named: list[tuple[str, torch.Tensor]], weight_decay: float, scale: Mapping[str, float] | None = None,
            lr: float | None = None) -> list[dict[str, Any]]:
    """Decayed and not-decayed groups, one pair per learning-rate factor (plain rate first)."""
    scale = scale or {}
    groups = []
    for f in sorted({scale.get(n, 1.0) for n, _ in named}, key=lambda f: (f != 1.0, f)):
        part = [(n, p) for n, p in named if scale.get(n, 1.0) == f]
        extra = {} if f == 1.0 else {"lr": lr * f}
        groups += [{"params": [p for n, p in part if not _no_decay(n, p)], "weight_decay": weight_decay, **extra},
                   {"params": [p for n, p in part if _no_decay(n, p)], "weight_decay": 0.0, **extra}]
    return [g for g in groups if g["params"]]


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
