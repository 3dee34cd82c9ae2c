"""The two attentions of a block, each over one axis of the (B, R, C, d) cell grid.

Both use one fused qkv Linear whose output features are laid out head-major
(head, {q,k,v}, head_dim): a column-wise tensor-parallel shard of it then holds whole heads,
and the module infers its local head count from the width it receives. Attention itself is
`F.scaled_dot_product_attention` with a boolean key mask broadcast over heads and queries
(see `attend` for the CPU exceptions in bf16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cpu_kernels import attention as cpu_attention
from .cpu_kernels import build as cpu_kernels


CPU_BF16_EXPLICIT_MAX_KEYS = 128


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Attention (N, H, L, hd) x (N, H, S, hd) -> (N, H, L, hd); mask broadcastable to (N, H, L, S).

    `F.scaled_dot_product_attention` everywhere, except on CPU in reduced precision: there
    torch has no fast bf16 attention (its flash kernel computes in fp32 and its backward is
    slow; measured on torch 2.13), so bf16 runs the fused kernel of `cpu_kernels.attention`
    (AVX512-BF16; 1.8-2.0x fp32 SDPA on long key sets, as fast as `explicit_attention` on
    16 keys inside a train step with half its error; BENCHMARKS.md). Where that kernel cannot
    run (with a warning, once): short key sets use `explicit_attention`, long ones SDPA in fp32.
    """
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if cpu_kernels.usable(cpu_attention.supports(q, k, mask, dropout_p)):
        return cpu_attention.fused_attention(q, k, v, mask)
    if k.shape[-2] > CPU_BF16_EXPLICIT_MAX_KEYS:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p)
        return out.to(q.dtype)
    return explicit_attention(q, k, v, mask, dropout_p)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """The formula in reduced-precision matmuls with an fp32 softmax (its backward is plain
    matmuls, much faster than CPU SDPA's in bf16 for short key sets)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


@dataclass
class KVCache:
    """Keys/values of one row attention's key rows, after its `RowKeys` seam: recorded by a pass over
    a context alone, then read by passes over query rows only (eval-time inference)."""

    k: torch.Tensor | None = None  # (B*C, H, Rk, hd)
    v: torch.Tensor | None = None
    kv_mask: torch.Tensor | None = None  # (B, Rk) bool or None (all real)


class _FusedAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0


class ColumnAttention(_FusedAttention):
    """Each cell attends to the cells of its own row (all valid columns). No positions: the
    operation is equivariant to column order."""

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, R, C, d); key_mask (B*R, 1, 1, C) bool (True = valid column) or None for all."""
        b, r, c, _ = x.shape
        qkv = self.qkv(x).view(b * r, c, -1, 3, self.head_dim)  # local heads under tensor parallel
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # (B*R, H, C, hd)
        o = attend(q, k, v, key_mask, self._dropout_p())
        return self.out(o.transpose(1, 2).reshape(b, r, c, -1))


class RowKeys(nn.Module):
    """The row attention's keys, values and key mask: identity on one device.

    The seam for row-sequence parallelism, declared in `ParallelPlan.row_attention`: the engine
    registers a forward hook on it that returns the keys of every rank's rows (an all-gather), so
    the model holds no engine code and nothing on it is replaced."""

    def forward(self, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k, v (B*C, H, Rk, hd); kv_mask (B, Rk) bool or None (all keys real)."""
        return k, v, kv_mask


class RowAttention(_FusedAttention):
    """Each cell attends to the cells of its own column in the key rows (thinking rows and
    context rows); queries are all rows. The model orders rows so the key rows come first:
    keys/values are the prefix of `n_keys` rows, a view, no gather. Non-key rows therefore
    never influence any other row.

    Keys, values and key mask pass through `self.keys` (`RowKeys`), the seam where row-sequence
    parallelism gathers them over the ranks holding the table's other rows (a hook may return a
    mask of 1 row, the same for every table, and leave a table no key on a rank).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keys = RowKeys()

    def forward(self, x: torch.Tensor, n_keys: int, kv_mask: torch.Tensor | None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x (B, R, C, d) with the key rows first; n_keys: how many leading rows are keys (the
        longest key set in the batch); kv_mask (B, n_keys) bool, False where a table has fewer
        keys (None = all real).

        cache: an empty KVCache records this call's keys/values; a filled one supplies them
        instead, and then every row of x is a query row (n_keys and kv_mask are ignored)."""
        b, r, c, _ = x.shape
        if cache is not None and cache.k is not None:
            w = self.qkv.weight
            if hasattr(w, "to_local"):  # tensor parallel: this rank's heads, as self.qkv(x) computes them
                w = w.to_local()
            h = w.shape[0] // (3 * self.head_dim)
            w_q = w.view(h, 3, self.head_dim, -1)[:, 0].reshape(h * self.head_dim, -1)  # head-major layout
            q = F.linear(x, w_q).view(b, r, c, h, self.head_dim).permute(0, 2, 3, 1, 4).reshape(b * c, h, r, self.head_dim)
            k, v, kv_mask = cache.k, cache.v, cache.kv_mask
        else:
            qkv = self.qkv(x).view(b, r, c, -1, 3, self.head_dim)
            h = qkv.shape[3]
            q, k, v = qkv.unbind(4)  # (B, R, C, H, hd); unbind keeps the backward to one stack
            if n_keys < r:
                k, v = k[:, :n_keys], v[:, :n_keys]
            q, k, v = (t.permute(0, 2, 3, 1, 4).reshape(b * c, h, t.shape[1], self.head_dim) for t in (q, k, v))
            k, v, kv_mask = self.keys(k, v, kv_mask)
            if cache is not None:
                cache.k, cache.v, cache.kv_mask = k, v, kv_mask
        mask = None
        if kv_mask is not None:
            rk = kv_mask.shape[1]
            kv_mask = kv_mask.clone()
            kv_mask[:, 0] |= ~kv_mask.any(1)  # a table without keys gets one arbitrary key (outputs unused)
            mask = kv_mask[:, None, :].expand(b, c, rk).reshape(b * c, 1, 1, rk)
        o = attend(q, k, v, mask, self._dropout_p())
        o = o.view(b, c, h, r, self.head_dim).permute(0, 3, 1, 2, 4).reshape(b, r, c, h * self.head_dim)
        return self.out(o)
