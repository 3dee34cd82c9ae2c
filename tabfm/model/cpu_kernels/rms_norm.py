"""RMSNorm with a bf16 output for bf16 autocast on CPU (`rms_norm.cpp`), as an autograd function.

Why: under CPU autocast torch runs RMSNorm as several fp32 passes and the next Linear casts
the result to bf16 in another; one fused pass does both. The result equals
`F.rms_norm(x, ...).bfloat16()` up to float rounding; `tabfm.model.block.BlockNorm` uses it.
"""
from __future__ import annotations

import torch

from . import build


def supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """fp32 CPU input under CPU bf16 autocast, with a plain fp32 weight (not a DTensor shard)."""
    return (type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype == torch.float32 and weight is not None
            and type(weight.data) is torch.Tensor and weight.dtype == torch.float32
            and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)


class _RMSNormBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        lib = build.library()
        d = x.shape[-1]
        rows = x.numel() // d
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        rstd = torch.empty(rows, dtype=torch.float32)
        p = build.ptr
        build.split(rows, lambda _, b, e: lib.tabfm_rms_norm_bf16_fwd(p(x), p(weight), p(y), p(rstd), b, e, d, eps))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        lib = build.library()
        x, weight, rstd = ctx.saved_tensors
        dy = dy.to(torch.bfloat16).contiguous()
        d = x.shape[-1]
        rows = x.numel() // d
        dx = torch.empty_like(x)
        dw = torch.zeros(build.chunks(rows), d, dtype=torch.float32)  # one partial sum per thread
        p = build.ptr
        build.split(rows, lambda t, b, e: lib.tabfm_rms_norm_bf16_bwd(
            p(x), p(weight), p(rstd), p(dy), p(dx), p(dw[t]), b, e, d))
        return dx, dw.sum(0), None


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(x / sqrt(mean(x^2, -1) + eps) * weight) for an fp32 CPU x (see `supports`)."""
    return _RMSNormBF16.apply(x.contiguous(), weight.contiguous(), float(eps))
