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
from .moe import MoEMLP
from tabfm.parallel import kernels as triton_kernels


class BlockNorm(nn.RMSNorm):
    """The pre-norm of a block's sublayer. Under bf16 autocast on CPU it returns bf16 straight
    from one fused pass (`cpu_kernels.rms_norm`), which is what the sublayer's first Linear
    would cast it to; on CUDA it is the Triton kernel of `tabfm.parallel.kernels.norm` (see
    `tabfm.parallel.kernels.dispatch`); elsewhere it is `nn.RMSNorm` (same parameters, same state dict).

    `norm(x, residual)` (only `TableBlock`'s Triton path passes one) returns
    `(x + residual, norm(x + residual))`, the add fused into the norm's pass on CUDA."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if triton_kernels.use(x, residual, self.weight):
            if residual is None:
                return triton_kernels.rms_norm(x, self.weight, self.eps)
            return triton_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return x, self.forward(x)
        if cpu_kernels.usable(cpu_rms_norm.supports(x, self.weight)):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return cpu_rms_norm.rms_norm_bf16(x, self.weight, eps)
        return super().forward(x)


class MLP(nn.Module):
    """Position-wise feed-forward: fc1 -> GELU (tanh) -> fc2 (fc1 column-, fc2 row-wise under TP).
    bf16 on CPU takes the fused GELU of `cpu_kernels.gelu`, CUDA the Triton one of `tabfm.parallel.kernels.gelu`."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if triton_kernels.use(h):
            return self.fc2(triton_kernels.bias_gelu(h, None, approximate="tanh"))
        h = cpu_gelu.gelu_tanh_bf16(h) if cpu_kernels.usable(cpu_gelu.supports(h)) else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class TableBlock(nn.Module):
    """x (B, R, C, d) -> same shape. Submodules: col_attn, row_attn, mlp and their norms.

    Block `layer` of a config with mixture of experts (`config.moe_layer(layer)`) has a `MoEMLP`
    for `mlp`. It routes every token, padding cells and rows included: the block's inputs carry no
    token mask (col_mask marks padded columns only, as keys; padded rows are not marked at all) and
    its signature is what engine plans, pipeline stages and activation checkpointing call, so a
    mask would have to be threaded through all of them, or smuggled in as module state. Routing
    padding is harmless where it matters: padded tokens' outputs are never read, and in eval mode
    a token's MoE output depends on that token alone. In training, padded tokens (rare: tables of a
    bucket share their shape) take capacity and count in the routing statistics.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d = config.d_model
        self.norm_col = BlockNorm(d, eps=config.norm_eps)
        self.col_attn = ColumnAttention(d, config.n_heads, config.dropout)
        self.norm_row = BlockNorm(d, eps=config.norm_eps)
        self.row_attn = RowAttention(d, config.n_heads, config.dropout)
        self.norm_mlp = BlockNorm(d, eps=config.norm_eps)
        if config.moe_layer(layer):
            self.mlp: MLP | MoEMLP = MoEMLP(d, config.mlp_hidden, config.moe_experts, config.moe_top_k,
                                            config.moe_capacity_factor)
        else:
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
        if triton_kernels.use(x) and self._fusable_norms():
            # the same sums, each residual add fused into the next sublayer's norm (Triton, CUDA)
            x, h = self.norm_row(x, self.drop(self.col_attn(self.norm_col(x), col_mask)))
            x, h = self.norm_mlp(x, self.drop(self.row_attn(h, n_keys, kv_mask, cache)))
            return x + self.drop(self.mlp(h))
        x = x + self.drop(self.col_attn(self.norm_col(x), col_mask))
        x = x + self.drop(self.row_attn(self.norm_row(x), n_keys, kv_mask, cache))
        return x + self.drop(self.mlp(self.norm_mlp(x)))

    def _fusable_norms(self) -> bool:
        """No hooks on the norms that take the residual (an engine's input-casting pre-hook,
        Gemini's, would otherwise cast the fp32 residual stream along with the norm's input)."""
        return not any(m._forward_pre_hooks or m._forward_hooks for m in (self.norm_row, self.norm_mlp))
