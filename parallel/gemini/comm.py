"""Data-parallel collectives of the Gemini chunk manager (ZeRO-3 style chunk sharding).

`ShardComm` wraps a torch.distributed process group: every chunk's flat buffers are split into
`world` equal shards, rank r keeping elements [r*S, (r+1)*S). With world 1 (no process group)
every call is local, so the single-process manager runs the same code path without collectives.

Backends: the group's backend decides where collective tensors must live: NCCL (chosen by
`tabfm.parallel.launch` when CUDA is available) reduces CUDA tensors only, gloo CPU tensors. `device`
is that place; a tensor elsewhere (a host-tier shard under NCCL, a CUDA chunk under gloo) is
staged through a temporary copy there and the result copied back, so callers never need to
know the backend. The hot paths (fetch all-gathers, gradient reduce-scatters) already pass
tensors on `device` when the device tier is CUDA under NCCL; staging serves checkpoints, norms
and flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ShardComm:
    """rank/world of the data-parallel group (None: the default group, or no group at all)."""

    rank: int = 0
    world: int = 1
    group: Any = None
    device: torch.device = torch.device("cpu")  # where the backend wants collective tensors

    @classmethod
    def from_env(cls, group: Any = None) -> "ShardComm":
        if dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend(group)).lower()
            device = torch.device("cpu")
            if "nccl" in backend and "gloo" not in backend:  # NCCL: CUDA tensors only
                device = torch.device("cuda", torch.cuda.current_device())
            return cls(rank=dist.get_rank(group), world=dist.get_world_size(group), group=group, device=device)
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return cls()

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself if it lives where the backend wants it, else a staged copy there."""
        return t if t.device == self.device else t.to(self.device)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[r*S:(r+1)*S] = rank r's shard, on every rank."""
        if self.world == 1:
            full.copy_(shard)
            return
        out = self._here(full)
        dist.all_gather_single(out, self._here(shard), group=self.group)
        if out is not full:
            full.copy_(out)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard = sum over ranks of full[rank*S:(rank+1)*S]."""
        if self.world == 1:
            shard.copy_(full)
            return
        out = self._here(shard)
        dist.reduce_scatter_single(out, self._here(full), op=dist.ReduceOp.SUM, group=self.group)
        if out is not shard:
            shard.copy_(out)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            x = self._here(t)
            dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
            if x is not t:
                t.copy_(x)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if self.world > 1:
            x = self._here(t)
            dist.broadcast(x, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                           group=self.group)
            if x is not t:
                t.copy_(x)
