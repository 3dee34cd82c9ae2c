"""Data-parallel collectives of the Gemini chunk manager (ZeRO-3 style chunk sharding).

`ShardComm` wraps a torch.distributed process group: every chunk's flat buffers are split into
`world` equal shards, rank r keeping elements [r*S, (r+1)*S). With world 1 (no process group)
every call is local, so the single-process manager runs the same code path without collectives.
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

    @classmethod
    def from_env(cls, group: Any = None) -> "ShardComm":
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(group), world=dist.get_world_size(group), group=group)
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return cls()

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[r*S:(r+1)*S] = rank r's shard, on every rank."""
        if self.world == 1:
            full.copy_(shard)
        else:
            dist.all_gather_single(full, shard, group=self.group)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard = sum over ranks of full[rank*S:(rank+1)*S]."""
        if self.world == 1:
            shard.copy_(full)
        else:
            dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if self.world > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                           group=self.group)
