"""RMSNorm fused with the residual add before it, forward and backward, in Triton.

A block does ``x = x + sublayer(...)`` and then ``norm(x)``: torch reads x and the update,
writes the sum, reads it again for the norm and writes the normalised copy (and backward
re-reads them). `add_rms_norm(x, residual, weight, eps)` returns ``(s, y)`` with
``s = x + residual`` and ``y = s / sqrt(mean(s^2, -1) + eps) * weight`` from one pass over
the rows (one read of each input, one write of each output), keeping only ``s`` and the
per-row ``rstd`` for backward, whose one pass gives ``ds_total = dy-path + ds`` (the gradient
of both x and residual) and per-program partial sums of ``dweight``. `rms_norm` is the same
without a residual. Statistics are fp32 whatever the storage dtype; under CUDA autocast the
normalised output is fp32, as torch's autocast runs ``rms_norm`` in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(X, RES, W, S, Y, RSTD, n_rows, d, eps,
                HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < d
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * d + cols[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s = x + tl.load(RES + offs, mask=m, other=0.0).to(tl.float32)
        s_st = s.to(S.dtype.element_ty)
        tl.store(S + offs, s_st, mask=m)
        x = s_st.to(tl.float32)  # normalise the stored (rounded) sum, as torch does
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / d + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _bwd_kernel(S, W, RSTD, DY, DS, DX, DW, n_rows, d,
                HAS_DS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < d
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * d + cols[None, :]
    s = tl.load(S + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = s * rstd[:, None]
    g = dy * w[None, :]
    c = tl.sum(g * xhat, axis=1) / d
    dx = (g - xhat * c[:, None]) * rstd[:, None]
    if HAS_DS:
        dx += tl.load(DS + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
    tl.store(DW + pid.to(tl.int64) * d + cols, tl.sum(dy * xhat, axis=0), mask=cmask)


def _blocks(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return max(1, min(64, 4096 // block_d)), block_d


def _out_dtype(s: torch.Tensor) -> torch.dtype:
    return torch.float32 if s.device.type == "cuda" and torch.is_autocast_enabled("cuda") else s.dtype


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        rows = x2.shape[0]
        if residual is not None:
            res2 = residual.reshape(-1, d)
            s = torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
        else:
            res2, s = x2, x
        y = torch.empty(x.shape, dtype=_out_dtype(s), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block_r, block_d = _blocks(d)
        if rows:
            _fwd_kernel[(triton.cdiv(rows, block_r),)](x2, res2, weight, s, y, rstd, rows, d, eps,
                                                       HAS_RES=residual is not None, BLOCK_R=block_r, BLOCK_D=block_d)
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_res = residual is not None
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        if residual is None:
            return y
        return s, y

    @staticmethod
    def backward(ctx, *grads):
        s, weight, rstd = ctx.saved_tensors
        ds, dy = grads if ctx.has_res else (None, grads[0])
        d = s.shape[-1]
        rows = s.numel() // d if d else 0
        block_r, block_d = _blocks(d)
        n_prog = triton.cdiv(rows, block_r) if rows else 0
        if dy is None:
            dy = torch.zeros_like(s)
        dy = dy.contiguous()
        ds = ds.contiguous() if ds is not None else None
        dsum = torch.empty(s.shape, dtype=s.dtype, device=s.device)
        dw = torch.empty(max(n_prog, 1), d, dtype=torch.float32, device=s.device)
        if n_prog:
            _bwd_kernel[(n_prog,)](s, weight, rstd, dy, dy if ds is None else ds, dsum, dw, rows, d,
                                   HAS_DS=ds is not None, BLOCK_R=block_r, BLOCK_D=block_d)
        else:
            dw.zero_()
        dweight = dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        x_dtype, r_dtype = ctx.dtypes
        dx = dsum.to(x_dtype) if ctx.needs_input_grad[0] else None
        dres = dsum.to(r_dtype) if ctx.has_res and ctx.needs_input_grad[1] else None
        return dx, dres, dweight, None


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return float(eps) if eps is not None else float(torch.finfo(x.dtype).eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual) * weight) in one pass; eps None = finfo(dtype).eps
    as nn.RMSNorm. x, residual (..., d) of one shape; weight (d,)."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    s_dtype = torch.result_type(x, residual)
    return _AddRMSNorm.apply(x.contiguous(), residual.contiguous(), weight.contiguous(), _eps(torch.empty(0, dtype=s_dtype), eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim (as nn.RMSNorm with a weight)."""
    return _AddRMSNorm.apply(x.contiguous(), None, weight.contiguous(), _eps(x, eps))
