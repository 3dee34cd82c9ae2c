"""Bias + GELU, forward and backward, in Triton: ``y = gelu(h + bias)`` in one elementwise pass.

`bias_gelu(h, bias, approximate)` takes the MLP's first Linear output (computed without its
bias, if it has one) and its bias (or None: the blocks' MLP has none), with ``approximate``
``"tanh"`` (the model's GELU) or ``"none"`` (exact erf), as `F.gelu`. It keeps ``h`` (and
the bias) for backward, whose one pass gives ``dh``; ``dbias`` is its sum over rows (torch).
Math in fp32 whatever the storage dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# constants written out in the kernels: sqrt(2/pi) = 0.7978845608028654, 1/sqrt(2) = 0.7071067811865476,
# 1/sqrt(2 pi) = 0.3989422804014327; tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


@triton.jit
def _tanh_and_sech2(u):
    # with e = exp(-2|u|) in (0, 1]: tanh(u) = sign(u) (1 - e) / (1 + e), 1 - tanh(u)^2 = 4e / (1 + e)^2
    # (no overflow, and no cancellation in 1 - t^2 where |t| is close to 1)
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0, -t, t)
    return t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _fwd_kernel(H, B, Y, n, d, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(H + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % d, mask=m, other=0.0).to(tl.float32)
    if TANH:
        t, _ = _tanh_and_sech2(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = 0.5 * x * (1.0 + t)
    else:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_kernel(H, B, DY, DH, n, d, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(H + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % d, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
    if TANH:
        x2 = x * x
        t, sech2 = _tanh_and_sech2(0.7978845608028654 * (x + 0.044715 * x2 * x))
        g = 0.5 * (1.0 + t) + 0.5 * x * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x2)
    else:
        g = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    tl.store(DH + offs, (dy * g).to(DH.dtype.element_ty), mask=m)


BLOCK = 1024


def _approx(approximate: str) -> bool:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"bias_gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return approximate == "tanh"


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, tanh):
        n, d = h.numel(), h.shape[-1] if h.dim() else 1
        out_dtype = h.dtype if bias is None else torch.result_type(h, bias)
        y = torch.empty(h.shape, dtype=out_dtype, device=h.device)
        if n:
            _fwd_kernel[(triton.cdiv(n, BLOCK),)](h, h if bias is None else bias, y, n, d,
                                                 HAS_BIAS=bias is not None, TANH=tanh, BLOCK=BLOCK)
        ctx.save_for_backward(h, bias)
        ctx.tanh = tanh
        return y

    @staticmethod
    def backward(ctx, dy):
        h, bias = ctx.saved_tensors
        dy = dy.contiguous()
        n, d = h.numel(), h.shape[-1] if h.dim() else 1
        dh = torch.empty(h.shape, dtype=dy.dtype, device=h.device)
        if n:
            _bwd_kernel[(triton.cdiv(n, BLOCK),)](h, h if bias is None else bias, dy, dh, n, d,
                                                 HAS_BIAS=bias is not None, TANH=ctx.tanh, BLOCK=BLOCK)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dh.reshape(-1, d).sum(0, dtype=torch.float32).to(bias.dtype)
        dh_out = dh.to(h.dtype) if ctx.needs_input_grad[0] else None
        return dh_out, dbias, None


def bias_gelu(h: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """F.gelu(h + bias, approximate=approximate) in one pass; bias (h.shape[-1],) or None."""
    tanh = _approx(approximate)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != h.shape[-1]):
        raise ValueError(f"bias_gelu: bias must have shape ({h.shape[-1]},), got {tuple(bias.shape)}")
    return _BiasGelu.apply(h.contiguous(), None if bias is None else bias.contiguous(), tanh)
