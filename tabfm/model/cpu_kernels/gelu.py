"""GELU (tanh approximation) on bf16 CPU tensors (`gelu.cpp`), as an autograd function.

Why: torch's bf16 GELU on CPU costs ~8 ns per element each way; the MLP of every block runs
it on its widest activation. Equal to `F.gelu(x, approximate="tanh")` up to float rounding.
"""
from __future__ import annotations

import torch

from . import build


def supports(x: torch.Tensor) -> bool:
    """A plain (not DTensor) bf16 CPU tensor."""
    return type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype == torch.bfloat16


class _GeluBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        lib = build.library()
        y = torch.empty_like(x)
        p = build.ptr
        build.split(x.numel(), lambda _, b, e: lib.tabfm_gelu_bf16_fwd(p(x), p(y), b, e))
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        lib = build.library()
        (x,) = ctx.saved_tensors
        dy = dy.to(torch.bfloat16).contiguous()
        dx = torch.empty_like(x)
        p = build.ptr
        build.split(x.numel(), lambda _, b, e: lib.tabfm_gelu_bf16_bwd(p(x), p(dy), p(dx), b, e))
        return dx


def gelu_tanh_bf16(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, of a bf16 CPU tensor (see `supports`)."""
    return _GeluBF16.apply(x.contiguous())
