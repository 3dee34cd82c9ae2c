"""Log-probability of each row's target class / bin, forward and backward, in Triton.

``target_log_prob(logits, target)[i] = log_softmax(logits[i])[target[i]]``: the categorical
cross-entropy (its negative) and the bin term of the bar-distribution NLL
(`tabfm.model.heads.BarDistribution.log_density` adds the bin width / tail terms to it).
torch computes the whole (N, K) log-softmax, keeps it, gathers from it, and backward builds
the (N, K) softmax again; here forward keeps only the per-row log-sum-exp (N,) and backward
writes ``g * (onehot - exp(logits - lse))`` in one pass. ``-inf`` logits (codes beyond a
column's cardinality) get probability 0 and gradient 0. fp32 math; targets must lie in
``[0, K)`` (not checked on the device, as `torch.gather` would). Not wired into the loss yet:
the loss computes the bar NLL in float64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(Z, T, OUT, LSE, n_rows, k, stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < n_rows
    m = rmask[:, None] & (cols < k)[None, :]
    z = tl.load(Z + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=m, other=float("-inf")).to(tl.float32)
    zmax = tl.max(z, axis=1)
    lse = zmax + tl.log(tl.sum(tl.exp(z - zmax[:, None]), axis=1))
    t = tl.load(T + rows, mask=rmask, other=0)
    zt = tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
    tl.store(OUT + rows, zt - lse, mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)


@triton.jit
def _bwd_kernel(Z, T, LSE, G, DZ, n_rows, k, stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < n_rows
    m = rmask[:, None] & (cols < k)[None, :]
    offs = rows[:, None].to(tl.int64) * stride + cols[None, :]
    z = tl.load(Z + offs, mask=m, other=float("-inf")).to(tl.float32)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    g = tl.load(G + rows, mask=rmask, other=0.0)
    t = tl.load(T + rows, mask=rmask, other=0)
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(cols[None, :] == t[:, None], 1.0, 0.0)
    tl.store(DZ + offs, (g[:, None] * (onehot - p)).to(DZ.dtype.element_ty), mask=m)


MAX_K = 16384


def _blocks(k: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(max(k, 1))
    return max(1, min(64, 4096 // block_k)), block_k


class _TargetLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        n, k = logits.shape
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        block_r, block_k = _blocks(k)
        if n:
            _fwd_kernel[(triton.cdiv(n, block_r),)](logits, target, out, lse, n, k, logits.stride(0),
                                                    BLOCK_R=block_r, BLOCK_K=block_k)
        ctx.save_for_backward(logits, target, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        logits, target, lse = ctx.saved_tensors
        n, k = logits.shape
        dz = torch.empty_like(logits)
        block_r, block_k = _blocks(k)
        if n:
            _bwd_kernel[(triton.cdiv(n, block_r),)](logits, target, lse, g.float().contiguous(), dz, n, k,
                                                    logits.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
        return dz, None


def target_log_prob(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1).gather(-1, target[:, None])[:, 0] in fp32; logits (N, K), target (N,) int."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"target_log_prob: logits (N, K) and target (N,), got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    if logits.shape[1] > MAX_K:
        raise ValueError(f"target_log_prob: at most {MAX_K} classes / bins in one row tile, got {logits.shape[1]}")
    return _TargetLogProb.apply(logits.contiguous(), target.contiguous().long())
