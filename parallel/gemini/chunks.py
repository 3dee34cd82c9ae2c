"""Chunks: parameters grouped in model order into fixed-size flat fp32 buffers.

Each chunk holds, for its parameters, the fp32 master data, the gradients and the Adam/AdamW
state (exp_avg, exp_avg_sq, per-parameter step counts) as flat buffers of `chunk_size`
elements (the tail past the last parameter is padding, reported as waste). Where each buffer
lives is a static placement decided per chunk:

  params on "device"   master + grad resident in the device budget for the whole run; the
                       parameters' `.data` are views of the master buffer.
  params on "host"     master + grad outside the budget; `acquire` copies the master into a
                       device buffer (reserved in the budget) and points the parameters at it;
                       `release` frees it and points them back at the host master, or (after a
                       forward with grad enabled) leaves it cached for the coming backward. Cached
                       copies are evicted LRU-first when a reservation would exceed the budget,
                       and all are flushed at the end of backward, before a step and around IO.
  optim on "device" / "host" / "disk"   where exp_avg/exp_avg_sq live and the step runs; disk
                       state is streamed through the DiskStore by a background thread.

Per-tensor state machine: HOLD (not in use) -> COMPUTE (its chunk is fetched for a forward
or backward) -> READY (its gradient was collected into the chunk) -> HOLD after the step or
zero_grad.
"""
from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from .tiers import DeviceBudget

F32 = 4  # bytes per element


class TensorState(enum.Enum):
    HOLD = "hold"
    COMPUTE = "compute"
    READY = "grad_ready"


@dataclass
class TensorInfo:
    param: nn.Parameter
    name: str
    chunk: "Chunk"
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.HOLD
    step: int = 0  # Adam step count of this tensor (0: no optimizer state yet)


@dataclass
class Chunk:
    index: int
    size: int                     # elements, padding included
    group: int                    # optimizer param group
    param_tier: str = "device"    # "device" | "host"
    optim_tier: str = "device"    # "device" | "host" | "disk"
    tensors: list[TensorInfo] = field(default_factory=list)
    used: int = 0                 # elements holding parameters
    master: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None      # None when on disk
    exp_avg_sq: torch.Tensor | None = None
    compute: torch.Tensor | None = None      # device copy of a host chunk while fetched
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return self.size * F32

    def view(self, flat: torch.Tensor, t: TensorInfo) -> torch.Tensor:
        return flat[t.offset:t.offset + t.numel].view(t.shape)

    @property
    def fetched(self) -> bool:
        return self.param_tier == "device" or self.compute is not None


def choose_chunk_size(numels: list[int], min_chunks: int = 4, align: int = 64) -> tuple[int, int]:
    """Chunk size (elements) with the least padding when `numels` are packed in order (a tensor
    never straddles two chunks). Candidates run from the largest tensor up to total/min_chunks
    (so static fractions have a few chunks to choose from). Returns (size, waste elements)."""
    if not numels:
        raise ValueError("no parameters to chunk")
    largest, total = max(numels), sum(numels)
    lo = -(-largest // align) * align
    hi = max(lo, -(-math.ceil(total / min_chunks) // align) * align)
    candidates = sorted({lo, hi, *range(lo, hi + 1, max(align, (hi - lo) // 256 // align * align or align))})
    best: tuple[int, int] | None = None
    for size in candidates:
        waste = pack_waste(numels, size)
        if best is None or waste < best[1]:
            best = (size, waste)
    return best  # type: ignore[return-value]


def pack_waste(numels: list[int], size: int) -> int:
    used, chunks, fill = 0, 1, 0
    for n in numels:
        if fill + n > size:
            chunks, fill = chunks + 1, 0
        fill += n
        used += n
    return chunks * size - used


class ChunkManager:
    """Owns the chunks of one model, their tiers and the device budget."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter, int]], chunk_size: int | None,
                 budget: DeviceBudget, disk=None) -> None:
        self.budget = budget
        self.disk = disk
        numels = [p.numel() for _, p, _ in named_params]
        if chunk_size is None:
            chunk_size, _ = choose_chunk_size(numels)
        elif chunk_size < max(numels):
            raise ValueError(f"chunk_size={chunk_size} is smaller than the largest parameter ({max(numels)} elements)")
        self.chunk_size = int(chunk_size)
        self.chunks: list[Chunk] = []
        self.tensors: dict[nn.Parameter, TensorInfo] = {}
        self.order: list[TensorInfo] = []
        self.cached: "OrderedDict[int, Chunk]" = OrderedDict()  # released host chunks still on device, LRU first
        self.fetches = 0
        self.evictions = 0
        for name, p, group in named_params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; Gemini keeps fp32 master chunks (give fp32 params)")
            c = self.chunks[-1] if self.chunks else None
            if c is None or c.group != group or c.used + p.numel() > self.chunk_size:
                c = Chunk(index=len(self.chunks), size=self.chunk_size, group=group)
                self.chunks.append(c)
            t = TensorInfo(param=p, name=name, chunk=c, offset=c.used, numel=p.numel(), shape=p.shape)
            c.tensors.append(t)
            c.used += p.numel()
            self.tensors[p] = t
            self.order.append(t)

    # --- placement ---------------------------------------------------------------------------
    def place(self, offload_param_frac: float, offload_optim_frac: float, disk_optim_frac: float) -> None:
        """Static placement: the last chunks' params go to host; of the optimizer states, the
        last `disk_optim_frac` go to disk, the `offload_optim_frac` before them to host."""
        n = len(self.chunks)
        n_host_p = round(offload_param_frac * n)
        n_disk = round(disk_optim_frac * n)
        n_host_o = min(round(offload_optim_frac * n), n - n_disk)
        for c in self.chunks:
            c.param_tier = "host" if c.index >= n - n_host_p else "device"
            if c.index >= n - n_disk:
                c.optim_tier = "disk"
            elif c.index >= n - n_disk - n_host_o:
                c.optim_tier = "host"
            else:
                c.optim_tier = "device"

    def resident_bytes_needed(self) -> int:
        """Bytes permanently on device: master+grad of device-param chunks, state of device-optim chunks."""
        return sum((2 * c.nbytes if c.param_tier == "device" else 0) + (2 * c.nbytes if c.optim_tier == "device" else 0)
                   for c in self.chunks)

    def materialize(self) -> None:
        """Move every parameter into its chunk's flat master buffer (reserving device bytes)."""
        for c in self.chunks:
            if c.param_tier == "device":
                self.budget.reserve(2 * c.nbytes, f"chunk {c.index} params+grads")
            if c.optim_tier == "device":
                self.budget.reserve(2 * c.nbytes, f"chunk {c.index} optimizer state")
            c.master = torch.zeros(c.size, dtype=torch.float32)
            c.grad = torch.zeros(c.size, dtype=torch.float32)
            for t in c.tensors:
                with torch.no_grad():
                    c.view(c.master, t).copy_(t.param.detach())
                t.param.data = c.view(c.master, t)
            if c.optim_tier == "disk":
                zeros = torch.zeros(2 * c.size, dtype=torch.float32)
                self.disk.write(self.disk_key(c), zeros).result()
            else:
                c.exp_avg = torch.zeros(c.size, dtype=torch.float32)
                c.exp_avg_sq = torch.zeros(c.size, dtype=torch.float32)

    @staticmethod
    def disk_key(c: Chunk) -> str:
        return f"chunk{c.index:05d}-optim"

    # --- fetch / release ---------------------------------------------------------------------
    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve device bytes, evicting cached (released, still resident) host-chunk copies,
        least recently used first, until the request fits; refuse if it still does not."""
        budget = self.budget
        while (budget.budget_bytes is not None and self.cached
               and budget.resident_bytes + nbytes > budget.budget_bytes):
            self.evict(next(iter(self.cached.values())))
        budget.reserve(nbytes, what)

    def acquire(self, c: Chunk) -> None:
        if c.param_tier == "host" and c.refs == 0:
            if self.cached.pop(c.index, None) is None:
                self.reserve(c.nbytes, f"fetching chunk {c.index} (params offloaded to host)")
                c.compute = c.master.clone()  # host -> device copy
                for t in c.tensors:
                    t.param.data = c.view(c.compute, t)
                self.fetches += 1
        c.refs += 1
        for t in c.tensors:
            if t.state is TensorState.HOLD:
                t.state = TensorState.COMPUTE

    def release(self, c: Chunk, keep: bool = False) -> None:
        """Drop one hold; at zero a host chunk's device copy is freed, or with `keep` stays
        cached (evictable) so a backward soon after the forward need not fetch it again."""
        if c.refs <= 0:
            return
        c.refs -= 1
        if c.refs == 0:
            for t in c.tensors:
                if t.state is TensorState.COMPUTE:
                    t.state = TensorState.HOLD
            if c.param_tier == "host":
                if keep:
                    self.cached[c.index] = c
                else:
                    self.evict(c)

    def evict(self, c: Chunk) -> None:
        """Free a released host chunk's device copy; its parameters read the host master again."""
        assert c.refs == 0 and c.param_tier == "host"
        self.cached.pop(c.index, None)
        if c.compute is None:
            return
        for t in c.tensors:
            t.param.data = c.view(c.master, t)
        c.compute = None
        self.budget.release(c.nbytes)
        self.evictions += 1

    def flush(self) -> None:
        """Evict every cached copy: parameters point at their masters (before steps and IO)."""
        for c in list(self.cached.values()):
            self.evict(c)

    def release_all(self) -> None:
        for c in self.chunks:
            while c.refs:
                self.release(c)
        self.flush()

    def collect_grad(self, p: nn.Parameter) -> None:
        t = self.tensors[p]
        if p.grad is None:
            return
        t.chunk.view(t.chunk.grad, t).add_(p.grad.detach().to(torch.float32))
        p.grad = None
        t.state = TensorState.READY

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.grad.zero_()
            for t in c.tensors:
                if t.state is TensorState.READY:
                    t.state = TensorState.HOLD

    def grad_views(self) -> list[torch.Tensor]:
        return [t.chunk.view(t.chunk.grad, t) for t in self.order if t.state is TensorState.READY]

    # --- reporting -----------------------------------------------------------------------------
    def report(self) -> dict:
        used = sum(c.used for c in self.chunks)
        total = sum(c.size for c in self.chunks)
        return {
            "chunk_size": self.chunk_size,
            "n_chunks": len(self.chunks),
            "param_elements": used,
            "padding_elements": total - used,
            "padding_bytes": (total - used) * F32,
            "padding_frac": (total - used) / total if total else 0.0,
            "param_tiers": [c.param_tier for c in self.chunks],
            "optim_tiers": [c.optim_tier for c in self.chunks],
            "device_budget_bytes": self.budget.budget_bytes,
            "device_resident_bytes": self.budget.resident_bytes,
            "device_peak_bytes": self.budget.peak_bytes,
            "fetches": self.fetches,
            "evictions": self.evictions,
        }
