"""Mixture-of-experts MLP: a drop-in for `block.MLP` that sends each token to k of E expert MLPs.

Routing is token choice, top-k: a learned linear router (d_model -> E, no bias) scores the
experts, a softmax turns the scores into probabilities, each token picks its k most probable
experts, and for k >= 2 their k probabilities are renormalised to sum to 1 to give the gates.
With k = 1 the gate is the router probability itself (Switch Transformer): a renormalised lone
gate would be the constant 1, and the router would then learn nothing from the model's loss,
only from the auxiliary losses. The output is the gate-weighted sum of the chosen experts'
outputs. Each expert is the dense MLP (fc1 -> GELU (tanh) -> fc2, no bias).

Capacity: in training an expert takes at most ceil(capacity_factor * tokens * k / E) token
assignments. Assignments queue in a fixed order: every token's first choice, by token position
(the flattened (..., d) order; in TabFM thinking rows, then context rows, then the other rows),
then every second choice, and so on, so a first choice is never crowded out by a second one. An
assignment past its expert's capacity is dropped: it contributes zero and the block's residual
carries the token. In eval mode nothing is dropped, so a token's output depends on that token
alone (TabFM's eval-mode invariances, and cached-context inference, hold as for the dense MLP).

Tokens: `forward(x, mask)` takes a boolean mask (True = a real token) or None (all real). Masked
tokens are not routed, not counted and output zero. TabFM's blocks pass None: they route every
token, padding included (tabfm/model/block.py says why).

Statistics of the last forward are kept in `stats` (`MoEStats`): the Switch / GShard
load-balancing loss, the router z-loss and the dropped-assignment count. `TabFM` collects them
from its MoE blocks into `ModelOutput.moe`; `masked_cell_loss` adds the weighted losses.

The experts are one module, `GroupedExperts` (`MoEMLP.experts`): stacked parameters with the
expert on dim 0, `w1` (E, hidden, d) and `w2` (E, d, hidden) (each expert's [out, in] as
nn.Linear stores it), applied by one batched matmul to an (E, slots, d) dispatch buffer (slots =
the fullest expert's load, at most its capacity) that the router fills and reads back with
index_add: no Python loop over tokens or experts, and every expert's weights take part in every
forward (data-parallel gradient reduction expects that). That buffer is the seam expert
parallelism cuts at (`parallel.expert_parallel`, named in the model's `ParallelPlan.experts`): it
shards the experts' parameters on dim 0 over the ep ranks and exchanges the buffer's expert rows
between them (all_to_all); the router and everything around it stay as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GroupedExperts", "MoEMLP", "MoEStats"]


@dataclass
class MoEStats:
    """What one forward of MoE MLPs reports (one module's, or several combined by `combine`).

    aux          0-d float32: load-balancing loss E * sum_e f_e * P_e (f_e: fraction of the
                 token assignments routed to expert e, before capacity; P_e: mean router
                 probability of e); 1 when routing is uniform. Gradient through P_e only.
    z            0-d float32: router z-loss, mean over tokens of logsumexp(router logits)^2.
    dropped      token assignments dropped for capacity.
    assignments  token assignments made (tokens * k).
    tokens       tokens routed (padding masked out is not counted).
    aux_weight, z_weight
                 their weights in the training objective (`penalty`); a module reports 0, TabFM
                 sets its config's moe_aux_weight and moe_z_weight.
    """

    aux: torch.Tensor
    z: torch.Tensor
    dropped: int
    assignments: int
    tokens: int
    aux_weight: float = 0.0
    z_weight: float = 0.0

    def penalty(self) -> torch.Tensor:
        """aux_weight * aux + z_weight * z: what the routing adds to the loss."""
        return self.aux_weight * self.aux + self.z_weight * self.z

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0

    @staticmethod
    def combine(stats: list["MoEStats"], aux_weight: float = 0.0, z_weight: float = 0.0) -> "MoEStats":
        """Several MoE blocks of one forward: aux and z averaged over blocks, counts summed."""
        return MoEStats(
            aux=torch.stack([s.aux for s in stats]).mean(),
            z=torch.stack([s.z for s in stats]).mean(),
            dropped=sum(s.dropped for s in stats),
            assignments=sum(s.assignments for s in stats),
            tokens=sum(s.tokens for s in stats),
            aux_weight=aux_weight,
            z_weight=z_weight,
        )


class GroupedExperts(nn.Module):
    """E expert MLPs (fc1 -> GELU (tanh) -> fc2, no bias) over a dispatch buffer:
    (E, slots, d) -> (E, slots, d), row e of the buffer through expert e."""

    def __init__(self, d_model: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        with torch.no_grad():  # nn.Linear's default initialisation, per expert
            self.w1.uniform_(-d_model ** -0.5, d_model ** -0.5)
            self.w2.uniform_(-hidden ** -0.5, hidden ** -0.5)

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.bmm(buffer, self.w1.transpose(1, 2)), approximate="tanh")  # (E, slots, hidden)
        return torch.bmm(h, self.w2.transpose(1, 2))


class MoEMLP(nn.Module):
    """x (..., d_model) -> same shape: top-k routed mixture of `n_experts` MLPs (module doc)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int = 1,
                 capacity_factor: float = 1.25) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoEMLP: top_k = {top_k} must be in [1, n_experts = {n_experts}]")
        if capacity_factor <= 0:
            raise ValueError(f"MoEMLP: capacity_factor = {capacity_factor} must be > 0")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = GroupedExperts(d_model, hidden, n_experts)
        self.stats: MoEStats | None = None

    def capacity(self, tokens: int) -> int:
        """Assignments an expert takes in training: ceil(capacity_factor * tokens * k / E)
        (rounded to 9 digits first, so 1.1 * 10 / 1 is 11, not 12)."""
        return math.ceil(round(self.capacity_factor * tokens * self.top_k / self.n_experts, 9))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., d); mask (...) bool, True = a real token (None: all). Sets `self.stats`."""
        shape, d = x.shape, x.shape[-1]
        flat = x.reshape(-1, d)
        real = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
        tokens = flat if real is None else flat[real]
        n, e, k = tokens.shape[0], self.n_experts, self.top_k

        logits = self.router(tokens).float()  # (n, E), routing in fp32
        probs = logits.softmax(-1)
        gates, choice = probs.topk(k, dim=-1)  # (n, k)
        if k > 1:
            gates = gates / gates.sum(-1, keepdim=True)

        # assignments in queue order: every token's 1st choice by position, then every 2nd choice, ...
        expert = choice.t().reshape(-1)  # (k n,)
        gate = gates.t().reshape(-1)
        token = torch.arange(n, device=x.device).repeat(k)
        onehot = F.one_hot(expert, e)  # (k n, E)
        position = (onehot.cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)  # place in its expert's queue
        load = onehot.sum(0)  # (E,) assignments per expert, before capacity
        capacity = self.capacity(n) if self.training else n  # n: no expert can get more; nothing dropped
        fullest, dropped = (torch.stack([load.max(), (load - capacity).clamp_min(0).sum()]).tolist()
                            if n else (0, 0))
        slots = min(capacity, fullest)
        keep = (position < capacity).nonzero().squeeze(1)
        slot = expert[keep] * slots + position[keep]  # row of the (E * slots, d) dispatch buffer
        src = token[keep]

        buffer = tokens.new_zeros(e * slots, d).index_add(0, slot, tokens[src]).view(e, slots, d)
        y = self.experts(buffer).reshape(e * slots, d)
        y = y[slot] * gate[keep, None].to(y.dtype)
        out = y.new_zeros(n, d).index_add(0, src, y)
        if real is not None:
            out = out.new_zeros(flat.shape[0], d).index_add(0, real, out)

        share = load.to(probs.dtype) / max(n * k, 1)  # f_e
        mean_prob = probs.sum(0) / max(n, 1)  # P_e
        self.stats = MoEStats(
            aux=e * (share * mean_prob).sum(),
            z=torch.logsumexp(logits, -1).square().sum() / max(n, 1),
            dropped=int(dropped), assignments=n * k, tokens=n,
        )
        return out.view(shape)
