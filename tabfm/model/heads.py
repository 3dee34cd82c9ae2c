"""Output heads, computed only on the gathered query cells, and the bar distribution.

- `CategoricalHead`: scores each code k of the cell's column by the dot product of a
  projection of the cell's final token with a projection of the code's random identity
  vector (the same vector the encoder used). The head is equivariant to relabelling codes
  and has no weights tied to a code index, so `max_categories` (its width K) is a free
  inference-time choice. Logits of codes >= the column's cardinality are -inf.
- `NumericHead`: logits over `n_bins` bins of a `BarDistribution` on the standardised scale.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SINH_ALPHA = 2.0  # inner bin edges are bin_range * sinh(alpha * t) / sinh(alpha), t uniform in [-1, 1]
TAIL_FRACTION = 0.25  # half-normal tail scale = TAIL_FRACTION * bin_range
_LOG_HALFNORMAL_CONST = 0.5 * math.log(2.0 / math.pi)


def bar_edges(n_bins: int, bin_range: float) -> torch.Tensor:
    """The n_bins - 1 boundaries between bins: fine near 0, wider towards +-bin_range."""
    t = torch.linspace(-1.0, 1.0, n_bins - 1, dtype=torch.float64)
    return (bin_range * torch.sinh(SINH_ALPHA * t) / math.sinh(SINH_ALPHA)).float()


class BarDistribution:
    """A density on the real line from logits over n bins (the "bar" / Riemann distribution).

    edges e_0 < ... < e_{n-2} split the line into bin 0 = (-inf, e_0], bin i = (e_{i-1}, e_i]
    for 0 < i < n-1, and bin n-1 = (e_{n-2}, inf). Inner bins are uniform; the outer two are
    half-normals of scale `tail_scale` leaving e_0 to the left and e_{n-2} to the right, so
    every real value has a finite NLL (extreme values get large, growing NLLs: useful for
    anomaly scores). All methods take logits (N, n) and work in float64 internally.
    """

    def __init__(self, edges: torch.Tensor, tail_scale: float) -> None:
        if edges.dim() != 1 or edges.numel() < 3:
            raise ValueError(f"BarDistribution needs >= 3 edges (>= 4 bins), got shape {tuple(edges.shape)}")
        self.edges = edges
        self.tail_scale = float(tail_scale)

    @classmethod
    def from_range(cls, n_bins: int, bin_range: float) -> "BarDistribution":
        return cls(bar_edges(n_bins, bin_range), TAIL_FRACTION * bin_range)

    @property
    def n_bins(self) -> int:
        return self.edges.numel() + 1

    def _edges(self, like: torch.Tensor) -> torch.Tensor:
        return self.edges.to(device=like.device, dtype=torch.float64)

    def centers(self, like: torch.Tensor) -> torch.Tensor:
        """Mean of each bin's density (n,), tails included."""
        e = self._edges(like)
        tail_mean = self.tail_scale * math.sqrt(2.0 / math.pi)
        return torch.cat([e[:1] - tail_mean, (e[1:] + e[:-1]) / 2, e[-1:] + tail_mean])

    def log_density(self, logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(z) (N,) for values z (N,) on the distribution's scale."""
        e = self._edges(logits)
        z = z.to(torch.float64)
        logp = F.log_softmax(logits.double(), dim=-1)
        idx = torch.bucketize(z.contiguous(), e, right=False)  # bin i holds (e_{i-1}, e_i]
        lp = logp.gather(-1, idx[:, None])[:, 0]
        widths = e[1:] - e[:-1]
        inner = lp - torch.log(widths[(idx - 1).clamp(0, widths.numel() - 1)])
        s = self.tail_scale
        tail_const = _LOG_HALFNORMAL_CONST - math.log(s)
        left = lp + tail_const - (e[0] - z) ** 2 / (2 * s * s)
        right = lp + tail_const - (z - e[-1]) ** 2 / (2 * s * s)
        n = self.n_bins
        return torch.where(idx == 0, left, torch.where(idx == n - 1, right, inner))

    def nll(self, logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """-log p(z) (N,)."""
        return -self.log_density(logits, z)

    def mean(self, logits: torch.Tensor) -> torch.Tensor:
        """E[z] (N,)."""
        return torch.softmax(logits.double(), dim=-1) @ self.centers(logits)

    def quantile(self, logits: torch.Tensor, q: torch.Tensor | float) -> torch.Tensor:
        """Quantiles (N, Q) for levels q (Q,) in (0, 1) (a float gives (N,))."""
        scalar = not torch.is_tensor(q) and not isinstance(q, (list, tuple))
        qs = torch.as_tensor(q, dtype=torch.float64, device=logits.device).reshape(-1)
        if ((qs <= 0) | (qs >= 1)).any():
            raise ValueError(f"quantile levels must lie in (0, 1), got {qs.tolist()}")
        p = torch.softmax(logits.double(), dim=-1)  # (N, n)
        cum = p.cumsum(-1)
        n = p.shape[-1]
        qn = qs[None, :].expand(p.shape[0], -1).contiguous()
        idx = torch.searchsorted(cum, qn, right=False).clamp(max=n - 1)  # first bin with cum >= q
        p_i = p.gather(-1, idx).clamp(min=1e-300)
        before = torch.where(idx > 0, cum.gather(-1, (idx - 1).clamp(min=0)), 0.0)
        e = self._edges(logits)
        lo = e[(idx - 1).clamp(0, n - 2)]
        hi = e[idx.clamp(0, n - 2)]
        frac = ((qn - before) / p_i).clamp(0.0, 1.0)
        inner = lo + frac * (hi - lo)
        s2 = self.tail_scale * math.sqrt(2.0)
        hi_arg = 1.0 - 1e-12
        left = e[0] - s2 * torch.erfinv((1.0 - qn / p_i).clamp(0.0, hi_arg))
        right = e[-1] + s2 * torch.erfinv(frac.clamp(0.0, hi_arg))
        out = torch.where(idx == 0, left, torch.where(idx == n - 1, right, inner))
        return out[:, 0] if scalar else out


class NumericHead(nn.Module):
    """Final token (N, d) -> bar-distribution logits (N, n_bins) on the standardised scale."""

    def __init__(self, d_model: int, n_bins: int, bin_range: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_model)
        self.fc2 = nn.Linear(d_model, n_bins)
        self.register_buffer("edges", bar_edges(n_bins, bin_range), persistent=False)
        self.tail_scale = TAIL_FRACTION * bin_range

    @property
    def bar(self) -> BarDistribution:
        return BarDistribution(self.edges, self.tail_scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class CategoricalHead(nn.Module):
    """Final token (N, d) and the column's code identity vectors (N, K, id_dim) -> logits (N, K).

    Logits of codes >= cardinality are -inf; rows of non-categorical cells (cardinality 0)
    are 0 (finite, to be ignored).
    """

    def __init__(self, d_model: int, id_dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(id_dim, d_model, bias=False)
        self.scale = d_model**-0.5

    def forward(self, h: torch.Tensor, code_vectors: torch.Tensor, cardinality: torch.Tensor) -> torch.Tensor:
        q = self.query(h)  # (N, d)
        k = self.key(code_vectors)  # (N, K, d)
        logits = torch.einsum("nd,nkd->nk", q, k.to(q.dtype)).float() * self.scale
        codes = torch.arange(logits.shape[-1], device=logits.device)
        card = cardinality[:, None]
        logits = logits.masked_fill(codes[None, :] >= card, float("-inf"))
        return logits.masked_fill(card == 0, 0.0)
