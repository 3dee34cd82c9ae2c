"""Fused bf16 attention on CPU (`attention.cpp`), as an autograd function.

Why: torch has no fast bf16 attention on CPU (its flash kernel computes in fp32, and its
backward reaches a quarter of the bf16 matmul peak), and attention was the largest op of a
bf16 train step. The kernel keeps one (sequence, head) slice in cache and does both
products in bf16 with fp32 accumulation and an fp32 softmax, as GPU flash attention does;
`tabfm.model.attention.attend` calls it for bf16 CPU tensors.
"""
from __future__ import annotations

import torch

from . import build


def supports(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Shapes and settings the kernel handles: bf16 CPU tensors (N, H, L, hd) with an even
    head dim, no dropout, a key mask broadcast over heads and queries (N or 1, 1, 1, S) or none."""
    if any(type(t) is not torch.Tensor for t in (q, k)):  # e.g. DTensor
        return False
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or dropout_p > 0 or q.dim() != 4 or q.shape[-1] % 2:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                             or mask.shape[0] not in (1, q.shape[0]) or mask.dtype != torch.bool):
        return False
    return True


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_u8):
        lib = build.library()
        n, h, l, d = q.shape
        s = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty(n, h, l, dtype=torch.float32)
        p = build.ptr
        build.split(n * h, lambda _, b, e: lib.tabfm_attn_bf16_fwd(
            p(q), p(k), p(v), p(mask_u8), p(o), p(lse), b, e, h, l, s, d, d ** -0.5))
        ctx.save_for_backward(q, k, v, lse)
        ctx.mask_u8 = mask_u8
        return o

    @staticmethod
    def backward(ctx, do):
        lib = build.library()
        q, k, v, lse = ctx.saved_tensors
        mask_u8 = ctx.mask_u8
        do = do.to(torch.bfloat16).contiguous()
        n, h, l, d = q.shape
        s = k.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        p = build.ptr
        build.split(n * h, lambda _, b, e: lib.tabfm_attn_bf16_bwd(
            p(q), p(k), p(v), p(mask_u8), p(lse), p(do), p(dq), p(dk), p(dv), b, e, h, l, s, d, d ** -0.5))
        return dq, dk, dv, None


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v for bf16 CPU tensors (see `supports`); q (N, H, L, hd),
    k / v (N, H, S, hd), mask (N, 1, 1, S) bool (True = visible) or None. A query without any
    visible key gets zeros (SDPA gives NaN there)."""
    n = q.shape[0]
    s = k.shape[2]
    mask_u8 = None
    if mask is not None:
        mask_u8 = mask.reshape(mask.shape[0], s).expand(n, s).to(torch.uint8).contiguous()
    return _FusedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mask_u8)
