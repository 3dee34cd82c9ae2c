"""Cells -> tokens of G cells (`ModelConfig.cells_per_token`), and back for the query cells.

With G > 1 the blocks run on tokens that each hold G cells of one row, so attention and MLPs
cost about 1/G per cell (TabPFN v2 packs 2 features per token). A token is a learned linear
map of its G cell embeddings laid side by side (`pack`); a query cell's final representation
is its slot of a learned linear map of its token (`unpack`).

Which cells share a token: the valid columns sorted by the first component of their identity
vectors, then cut into runs of G. In eval mode identities are a hash of column content, so the
grouping -- and every prediction -- still does not depend on column order; in training they are
drawn afresh every step, so the model sees every column next to every other. Padding columns
sort last and their cells enter tokens as zeros, so padding still influences nothing.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn


class CellGrouper(nn.Module):
    """pack: (B, R, C, d) cell tokens -> (B, R, T, d), T = ceil(C / G); unpack: token -> cell."""

    def __init__(self, d_model: int, cells_per_token: int) -> None:
        super().__init__()
        self.g = cells_per_token
        self.pack_proj = nn.Linear(cells_per_token * d_model, d_model, bias=False)
        self.unpack_proj = nn.Linear(d_model, cells_per_token * d_model, bias=False)

    def layout(self, col_vec: torch.Tensor, col_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """long (B, C) each: (the column at each slot, each column's slot); valid columns first, in
        identity order (stable)."""
        key = torch.where(col_valid, col_vec[..., 0].float(), float("inf"))
        order = torch.argsort(key, dim=1, stable=True)
        ar = torch.arange(order.shape[1], device=order.device).expand_as(order)
        return order, torch.empty_like(order).scatter_(1, order, ar)

    def pack(self, x: torch.Tensor, order: torch.Tensor, col_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, R, T, d), token_valid (B, T)) from cell tokens x (B, R, C, d), columns in `order`."""
        b, r, c, d = x.shape
        t = math.ceil(c / self.g)
        valid = col_valid.gather(1, order)  # (B, C) in slot order
        cells = x.gather(2, order[:, None, :, None].expand(b, r, c, d)) * valid[:, None, :, None].to(x.dtype)
        pad = t * self.g - c
        if pad:
            cells = torch.nn.functional.pad(cells, (0, 0, 0, pad))
            valid = torch.nn.functional.pad(valid, (0, pad))
        tokens = self.pack_proj(cells.reshape(b, r, t, self.g * d)).to(x.dtype)  # the residual stream keeps x's dtype
        return tokens, valid.view(b, t, self.g).any(-1)

    def unpack(self, h: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """(N, d) representation of N cells from their tokens' final states h (N, d) and slots (N,)."""
        n, d = h.shape
        out = self.unpack_proj(h).to(h.dtype).view(n, self.g, d)
        return out[torch.arange(n, device=h.device), slot % self.g]
