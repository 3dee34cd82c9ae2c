"""One table-transformer block: column attention -> row attention -> MLP, each pre-norm residual."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ColumnAttention, KVCache, RowAttention
from .config import ModelConfig


class MLP(nn.Module):
    """Position-wise feed-forward: fc1 -> GELU -> fc2 (fc1 column-, fc2 row-wise under TP)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TableBlock(nn.Module):
    """x (B, R, C, d) -> same shape. Submodules: col_attn, row_attn, mlp and their norms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.norm_col = nn.RMSNorm(d, eps=config.norm_eps)
        self.col_attn = ColumnAttention(d, config.n_heads, config.dropout)
        self.norm_row = nn.RMSNorm(d, eps=config.norm_eps)
        self.row_attn = RowAttention(d, config.n_heads, config.dropout)
        self.norm_mlp = nn.RMSNorm(d, eps=config.norm_eps)
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
