"""One table-transformer block: column attention -> row attention -> MLP, each pre-norm residual."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ColumnAttention, KVCache, RowAttention
from .config import ModelConfig
from .cpu_kernels import build as cpu_kernels
from .cpu_kernels import gelu as cpu_gelu
from .cpu_kernels import rms_norm as cpu_rms_norm


class BlockNorm(nn.RMSNorm):
    """The pre-norm of a block's sublayer. Under bf16 autocast on CPU it returns bf16 straight
    from one fused pass (`cpu_kernels.rms_norm`), which is what the sublayer's first Linear
    would cast it to; elsewhere it is `nn.RMSNorm` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(cpu_rms_norm.supports(x, self.weight)):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return cpu_rms_norm.rms_norm_bf16(x, self.weight, eps)
        return super().forward(x)


class MLP(nn.Module):
    """Position-wise feed-forward: fc1 -> GELU (tanh) -> fc2 (fc1 column-, fc2 row-wise under TP).
    bf16 on CPU takes the fused GELU of `cpu_kernels.gelu`."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = cpu_gelu.gelu_tanh_bf16(h) if cpu_kernels.usable(cpu_gelu.supports(h)) else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class TableBlock(nn.Module):
    """x (B, R, C, d) -> same shape. Submodules: col_attn, row_attn, mlp and their norms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.norm_col = BlockNorm(d, eps=config.norm_eps)
        self.col_attn = ColumnAttention(d, config.n_heads, config.dropout)
        self.norm_row = BlockNorm(d, eps=config.norm_eps)
        self.row_attn = RowAttention(d, config.n_heads, config.dropout)
        self.norm_mlp = BlockNorm(d, eps=config.norm_eps)
        self.mlp = MLP(d, config.mlp_hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        col_mask: torch.Tensor | None,
        n_keys: int,
        kv_mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x (B, R, C, d), key rows first; masks and cache as in ColumnAttention / RowAttention."""
        x = x + self.drop(self.col_attn(self.norm_col(x), col_mask))
        x = x + self.drop(self.row_attn(self.norm_row(x), n_keys, kv_mask, cache))
        return x + self.drop(self.mlp(self.norm_mlp(x)))
