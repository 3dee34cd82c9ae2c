"""Chunks: parameters grouped in model order into fixed-size flat fp32 buffers, sharded over
the data-parallel ranks (ZeRO-3 style) when there are several.

A chunk of `size` elements (a multiple of the world size W) is split into W shards of
S = size/W elements; rank r keeps elements [r*S, (r+1)*S): the fp32 master, the gradient and
the Adam/AdamW state (exp_avg, exp_avg_sq) of that range (with W = 1 the shard is the chunk).
Under `shard_param_frac` < 1 only the last chunks are sharded; the others are replicated: every
rank keeps the whole chunk (S = size) and steps it identically. Per-tensor Adam step counts are
kept on every rank. Where each shard lives is decided per chunk:

  params "device"   master + grad shard resident in the device budget for the whole run.
  params "host"     master + grad shard outside the budget.
  optim  "device" / "host" / "disk"   where exp_avg/exp_avg_sq live and the step runs; disk state
                    is streamed through the DiskStore by a background thread.

Compute copies. A module's parameters must be whole while it runs. An fp32 chunk that is
replicated (W = 1, or not sharded under `shard_param_frac`) and whose params live on device has
its parameters as views of its master. Every other chunk (host params, a sharded chunk, or any
chunk when the compute dtype is bf16/fp16) is *fetched*: a full-size buffer of the compute
dtype is reserved in the budget (2 bytes per element in bf16/fp16, half of fp32's) and filled
(the master cast into it, or each rank's shard cast into its own slot of the buffer and then
all-gathered in place, so low precision also halves the all-gather), and the parameters are
pointed at views of it. `release`
frees it, or (after a forward with grad enabled) leaves it cached for the coming backward;
cached copies are evicted by the cache policy (LRU, or farthest-next-use under auto placement)
when a reservation would exceed the budget, and all are flushed at the end of backward and
before a step. A released W > 1 chunk leaves its parameters as empty tensors (reading one is
an error, not stale data); a replicated one points them back at the fp32 master. Autograd
does not keep freed copies alive: the saved-tensor hooks of the plugin store a reference
(chunk, offset, size, stride) for every tensor that lives in a compute copy and re-read it from
the re-fetched copy in backward.

Gradients arrive in the compute dtype and are added into fp32 buffers (so accumulation and
reduction run in fp32). With W = 1 each parameter's gradient is added into the chunk's grad
buffer. With W > 1 it goes into a full-size fp32 chunk gradient buffer (reserved in the budget)
that is reduce-scattered into the grad shard (a replicated chunk: all-reduced into its full
grad), divided by W (the data-parallel mean), as soon as every gradient of the chunk has
arrived, or at the end of backward for chunks some of whose parameters got none. Every rank
must use the same parameters in every backward (as for DDP without find_unused_parameters):
the collectives run in the order gradients complete.

CUDA (`DeviceTier` with a CUDA device). The device tier is CUDA memory: device-tier masters,
gradients and optimizer state, fetched compute copies and gradient buffers are CUDA tensors;
host-tier shards are pinned CPU tensors. A fetch fills its copy on the tier's h2d side stream
and records an event; the compute stream waits for it when the chunk is acquired, so a
prefetched chunk's copy overlaps the running module. A chunk whose gradient shard lives on
host (host params, or any chunk with W > 1) collects its gradients in a full-size CUDA fp32
buffer (the W > 1 buffer; with W = 1 it is reserved the same way), and once reduced the shard
goes back on the d2h side stream into pinned staging; `drain` adds it into the host gradient
when its event has completed (at the latest in `flush`, before norms and steps). On CPU none of
this happens: buffers are plain CPU tensors and copies are synchronous.

Per-tensor state machine: HOLD (not in use) -> COMPUTE (its chunk is fetched for a forward or
backward) -> READY (its gradient is in the chunk) -> REDUCED (W > 1: reduce-scattered into the
shards) -> HOLD after zero_grad.
"""
from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from .comm import ShardComm
from .placement import LRUPolicy
from .tiers import DeviceBudget, DeviceTier

F32 = 4  # bytes per element of masters, gradients and optimizer state
LOW_PRECISION = (torch.bfloat16, torch.float16)


class TensorState(enum.Enum):
    HOLD = "hold"
    COMPUTE = "compute"
    READY = "grad_ready"
    REDUCED = "reduced"


GRAD_STATES = (TensorState.READY, TensorState.REDUCED)


@dataclass(eq=False)  # identity: used as a dict key
class TensorInfo:
    param: nn.Parameter
    name: str
    chunk: "Chunk"
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.HOLD
    step: int = 0  # Adam step count of this tensor (0: no optimizer state yet)
    has_grad: bool = False  # a gradient arrived for it since the last zero_grad


@dataclass(eq=False)
class Chunk:
    index: int
    size: int                     # elements, padding included (a multiple of the world size)
    group: int                    # optimizer param group
    compute_dtype: torch.dtype = torch.float32  # dtype of the fetched copy the modules run with
    param_tier: str = "device"    # "device" | "host"
    optim_tier: str = "device"    # "device" | "host" | "disk"
    tensors: list[TensorInfo] = field(default_factory=list)
    used: int = 0                 # elements holding parameters
    shard_size: int = 0           # S = size / world
    shard_offset: int = 0         # rank * S
    sharded: bool = False         # False: every rank holds the whole chunk (W = 1, or replicated)
    master: torch.Tensor | None = None       # local shard (S)
    grad: torch.Tensor | None = None         # local shard (S)
    exp_avg: torch.Tensor | None = None      # local shard (S); None when on disk
    exp_avg_sq: torch.Tensor | None = None
    compute: torch.Tensor | None = None      # full-size copy while fetched
    grad_full: torch.Tensor | None = None    # W > 1: full-size gradient buffer during backward
    grads_expected: int = 0                  # tensors of this chunk that require grad
    grads_seen: int = 0                      # gradients collected since the last reduce-scatter
    refs: int = 0
    prefetched: bool = False
    ready: object = None                     # CUDA: event of the copy still filling `compute`

    @property
    def nbytes(self) -> int:
        """Bytes of a full-size fp32 buffer of the chunk (the W > 1 gradient buffer)."""
        return self.size * F32

    @property
    def compute_nbytes(self) -> int:
        """Bytes of a fetched compute copy (half of `nbytes` in bf16/fp16)."""
        return self.size * self.compute_dtype.itemsize

    @property
    def shard_nbytes(self) -> int:
        return self.shard_size * F32

    @property
    def needs_fetch(self) -> bool:
        """Its parameters are not views of a resident master: they are fetched to run."""
        return self.sharded or self.param_tier == "host" or self.compute_dtype != torch.float32

    @property
    def fetched(self) -> bool:
        return not self.needs_fetch or self.compute is not None

    @property
    def local_used(self) -> int:
        """Elements of the local shard that hold parameters (the rest is padding)."""
        return min(max(self.used - self.shard_offset, 0), self.shard_size)

    def view(self, flat: torch.Tensor, t: TensorInfo) -> torch.Tensor:
        """The tensor's view in a full-size buffer."""
        return flat[t.offset:t.offset + t.numel].view(t.shape)

    def local_range(self, t: TensorInfo) -> tuple[int, int, int] | None:
        """(start in the shard, start in the flattened tensor, length) of the part of `t` this
        rank's shard holds, or None."""
        lo = max(t.offset, self.shard_offset)
        hi = min(t.offset + t.numel, self.shard_offset + self.shard_size)
        if hi <= lo:
            return None
        return lo - self.shard_offset, lo - t.offset, hi - lo


ADD_BLOCK = 1 << 16  # elements per block of a mixed-dtype add


def add_in_blocks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src. When src has another dtype (bf16/fp16 gradients into fp32 buffers) torch's
    CPU add first casts all of src to dst's dtype (a full-size temporary the budget would not
    see); adding block by block bounds that temporary at ADD_BLOCK elements. (CUDA casts inside
    the kernel: one add.)"""
    if src.dtype == dst.dtype or src.numel() <= ADD_BLOCK or dst.is_cuda:
        dst.add_(src)
        return
    d, s = dst.view(-1), src.reshape(-1)
    for i in range(0, d.numel(), ADD_BLOCK):
        d[i:i + ADD_BLOCK].add_(s[i:i + ADD_BLOCK])


def choose_chunk_size(numels: list[int], min_chunks: int = 4, align: int = 64,
                      groups: list[int] | None = None) -> tuple[int, int]:
    """Chunk size (elements) with the least padding when `numels` are packed in order, each
    into the open chunk of its optimizer group (`groups`, default all 0; a tensor never
    straddles two chunks). Candidates run from the largest tensor up to total/min_chunks (so
    static fractions have a few chunks to choose from). Returns (size, waste elements)."""
    if not numels:
        raise ValueError("no parameters to chunk")
    largest, total = max(numels), sum(numels)
    lo = -(-largest // align) * align
    hi = max(lo, -(-math.ceil(total / min_chunks) // align) * align)
    candidates = sorted({lo, hi, *range(lo, hi + 1, max(align, (hi - lo) // 256 // align * align or align))})
    best: tuple[int, int] | None = None
    for size in candidates:
        waste = pack_waste(numels, size, groups)
        if best is None or waste < best[1]:
            best = (size, waste)
    return best  # type: ignore[return-value]


def pack_waste(numels: list[int], size: int, groups: list[int] | None = None) -> int:
    """Padding elements when `numels` are packed in order, one open chunk per group."""
    fill: dict[int, int] = {}
    chunks = 0
    for n, g in zip(numels, groups if groups is not None else [0] * len(numels)):
        if g not in fill or fill[g] + n > size:
            chunks, fill[g] = chunks + 1, 0
        fill[g] += n
    return chunks * size - sum(numels)


class ChunkManager:
    """Owns the chunks of one model, their shards, tiers, compute copies and the device budget."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter, int]], chunk_size: int | None,
                 budget: DeviceBudget, disk=None, comm: ShardComm | None = None, policy=None,
                 compute_dtype: torch.dtype = torch.float32, tier: DeviceTier | None = None) -> None:
        if compute_dtype != torch.float32 and compute_dtype not in LOW_PRECISION:
            raise ValueError(f"compute_dtype {compute_dtype}: expected float32, bfloat16 or float16")
        self.compute_dtype = compute_dtype
        self.budget = budget
        self.tier = tier if tier is not None else DeviceTier(torch.device("cpu"))
        self.pending: list = []  # CUDA: gradient write-backs in flight (event, staging, chunk, bytes to release)
        self.disk = disk
        self.comm = comm if comm is not None else ShardComm()
        self.policy = policy if policy is not None else LRUPolicy()
        numels = [p.numel() for _, p, _ in named_params]
        if chunk_size is None:
            chunk_size, _ = choose_chunk_size(numels, groups=[g for _, _, g in named_params])
        elif chunk_size < max(numels):
            raise ValueError(f"chunk_size={chunk_size} is smaller than the largest parameter ({max(numels)} elements)")
        world = self.comm.world
        self.chunk_size = -(-int(chunk_size) // world) * world  # W equal shards
        self.chunks: list[Chunk] = []
        self.tensors: dict[nn.Parameter, TensorInfo] = {}
        self.order: list[TensorInfo] = []
        self.cached: "OrderedDict[int, Chunk]" = OrderedDict()  # released copies still on device, LRU first
        self.compute_ptrs: dict[int, Chunk] = {}  # storage pointer of a compute copy -> its chunk
        self.master_ptrs: set[int] = set()        # storage pointers of the masters (model memory)
        self.fetches = 0
        self.evictions = 0
        self.prefetches = 0
        self.prefetch_hits = 0
        self.reduce_scatters = 0
        self.all_reduces = 0
        self.non_model_bytes = 0  # reserved after an auto warm-up: activations saved for backward
        self.param_cache_bytes = 0  # auto: device bytes kept free for fetched copies (not given to optimizer state)
        S = self.chunk_size // world
        open_chunk: dict[int, Chunk] = {}  # one chunk being filled per optimizer group (groups interleave in model order)
        for name, p, group in named_params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; Gemini keeps fp32 master chunks (give fp32 params)")
            c = open_chunk.get(group)
            if c is None or c.used + p.numel() > self.chunk_size:
                c = Chunk(index=len(self.chunks), size=self.chunk_size, group=group, shard_size=S,
                          shard_offset=self.comm.rank * S, sharded=self.comm.sharded, compute_dtype=compute_dtype)
                self.chunks.append(c)
                open_chunk[group] = c
            t = TensorInfo(param=p, name=name, chunk=c, offset=c.used, numel=p.numel(), shape=p.shape)
            c.tensors.append(t)
            c.used += p.numel()
            c.grads_expected += int(p.requires_grad)
            self.tensors[p] = t
            self.order.append(t)

    # --- placement ---------------------------------------------------------------------------
    def place(self, offload_param_frac: float, offload_optim_frac: float, disk_optim_frac: float,
              shard_param_frac: float = 1.0) -> None:
        """Static placement: the last chunks' params go to host; of the optimizer states, the
        last `disk_optim_frac` go to disk, the `offload_optim_frac` before them to host. With
        several ranks the last `shard_param_frac` of the chunks are sharded; the others are
        replicated: every rank holds the whole master, gradient and optimizer state (stepped
        redundantly, identically), and their gradients are all-reduced instead of reduce-scattered."""
        n = len(self.chunks)
        n_sharded = round(shard_param_frac * n) if self.comm.sharded else 0
        for c in self.chunks:
            c.sharded = c.index >= n - n_sharded
            c.shard_size = self.chunk_size // self.comm.world if c.sharded else self.chunk_size
            c.shard_offset = self.comm.rank * c.shard_size if c.sharded else 0
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

    def buffered(self, c: Chunk) -> bool:
        """Its gradients are collected in a full-size fp32 buffer in the device tier before they
        reach the grad shard: always with several ranks (to reduce them), and on CUDA when the
        shard lives on host (gradients are made on the GPU and cross PCIe once per chunk)."""
        return self.comm.world > 1 or (self.tier.cuda and c.param_tier == "host")

    def resident_bytes_needed(self) -> int:
        """Bytes permanently on device: master+grad shards of device-param chunks, state shards of
        device-optim chunks (plus the non-model reservation of an auto placement)."""
        return sum((2 * c.shard_nbytes if c.param_tier == "device" else 0)
                   + (2 * c.shard_nbytes if c.optim_tier == "device" else 0) for c in self.chunks)

    def materialize(self) -> None:
        """Move every parameter into its chunk: rank 0's values (broadcast) are the model; each
        rank keeps its shard of master, grad and optimizer state (reserving device bytes)."""
        for c in self.chunks:
            if c.param_tier == "device":
                self.budget.reserve(2 * c.shard_nbytes, f"chunk {c.index} params+grads")
            if c.optim_tier == "device":
                self.budget.reserve(2 * c.shard_nbytes, f"chunk {c.index} optimizer state")
            full = torch.zeros(c.size, dtype=torch.float32)
            with torch.no_grad():
                for t in c.tensors:
                    c.view(full, t).copy_(t.param.detach())
            self.comm.broadcast(full, src=0)
            on_host = c.param_tier == "host"
            if self.tier.cuda:  # device-tier shards in CUDA memory, host-tier ones pinned
                c.master = self.tier.to_tier(full[c.shard_offset:c.shard_offset + c.shard_size], on_host)
            else:
                c.master = full if not c.sharded else full[c.shard_offset:c.shard_offset + c.shard_size].clone()
            c.grad = self.tier.zeros(c.shard_size, host=on_host)
            self.master_ptrs.add(c.master.untyped_storage().data_ptr())
            for t in c.tensors:
                t.param.data = self._released_view(c, t)
            if c.optim_tier == "disk":
                self.disk.write(self.disk_key(c), torch.zeros(2 * c.shard_size, dtype=torch.float32)).result()
            else:
                c.exp_avg = self.tier.zeros(c.shard_size, host=c.optim_tier == "host")
                c.exp_avg_sq = self.tier.zeros(c.shard_size, host=c.optim_tier == "host")

    @staticmethod
    def disk_key(c: Chunk) -> str:
        return f"chunk{c.index:05d}-optim"

    def move_optim(self, c: Chunk, tier: str) -> None:
        """Move a chunk's Adam state shards (exp_avg, exp_avg_sq) to `tier`, values kept: entering
        the device tier reserves their bytes (refused if the budget cannot hold them), leaving it
        releases them; disk state is read back (and its files removed) or written out. Used by
        the auto placement after its warm-up step."""
        if tier not in ("device", "host", "disk"):
            raise ValueError(f"optimizer tier {tier!r}: expected 'device', 'host' or 'disk'")
        if tier == c.optim_tier:
            return
        if tier == "disk" and self.disk is None:
            raise RuntimeError(f"chunk {c.index}: no disk store to move optimizer state to")
        nbytes = 2 * c.shard_nbytes
        if tier == "device":
            self.budget.reserve(nbytes, f"chunk {c.index} optimizer state (moved to device by auto placement)")
        if c.optim_tier == "disk":
            buf = self.disk.read(self.disk_key(c)).result()
            self.disk.remove(self.disk_key(c)).result()
            exp_avg, exp_avg_sq = buf[:c.shard_size], buf[c.shard_size:]
        else:
            exp_avg, exp_avg_sq = c.exp_avg, c.exp_avg_sq
        if c.optim_tier == "device":
            self.budget.release(nbytes)
        if tier == "disk":
            self.disk.write(self.disk_key(c), torch.cat([exp_avg, exp_avg_sq])).result()
            c.exp_avg = c.exp_avg_sq = None
        else:  # a fresh buffer in the new tier (on CUDA: the host <-> device copy)
            host = tier == "host"
            c.exp_avg, c.exp_avg_sq = self.tier.to_tier(exp_avg, host), self.tier.to_tier(exp_avg_sq, host)
        c.optim_tier = tier

    def _released_view(self, c: Chunk, t: TensorInfo) -> torch.Tensor:
        """What a parameter holds while its chunk is not fetched: a view of the master (W = 1;
        on CUDA a host-tier master is pinned CPU memory), or an empty tensor on the device
        (W > 1: the full value exists only while gathered)."""
        if not c.sharded:
            return c.view(c.master, t)
        return torch.empty(0, dtype=torch.float32, device=self.tier.device)

    # --- fetch / release ---------------------------------------------------------------------
    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve device bytes, evicting cached (released, still resident) copies in the
        policy's order until the request fits; refuse if it still does not."""
        budget = self.budget
        if self.pending and budget.budget_bytes is not None and budget.resident_bytes + nbytes > budget.budget_bytes:
            self.drain()  # CUDA: finish gradient write-backs before evicting what may be used again
        while (budget.budget_bytes is not None and self.cached
               and budget.resident_bytes + nbytes > budget.budget_bytes):
            self.evict(self.cached[self.policy.victim(self.cached)])
        budget.reserve(nbytes, what)

    def _fetch(self, c: Chunk) -> None:
        """Reserve a full-size device buffer of the compute dtype and fill it: the master cast
        into it (a host -> device copy), or, sharded, this rank's shard cast into its own slot
        and the buffer all-gathered in place (in the compute dtype: no fp32 temporary)."""
        why = ("all-gathering its shards" if c.sharded else "params offloaded to host" if c.param_tier == "host"
               else f"{c.compute_dtype} compute copy")
        self.reserve(c.compute_nbytes, f"fetching chunk {c.index} ({why})")
        buf = self.tier.empty(c.size, c.compute_dtype)  # on CUDA: the compute stream's memory
        with self.tier.fetch_stream():  # CUDA: filled on the h2d side stream
            if c.sharded:
                mine = buf[c.shard_offset:c.shard_offset + c.shard_size]
                self.tier.copy_in(mine, c.master)
                self.comm.all_gather(buf, mine)
            else:
                self.tier.copy_in(buf, c.master)
            c.ready = self.tier.record(self.tier.h2d)
        c.compute = buf
        self.compute_ptrs[buf.untyped_storage().data_ptr()] = c
        for t in c.tensors:
            t.param.data = c.view(buf, t)
        self.fetches += 1

    def acquire(self, c: Chunk) -> None:
        if c.needs_fetch and c.refs == 0:
            if c.index in self.cached:
                del self.cached[c.index]
                if c.prefetched:
                    self.prefetch_hits += 1
            elif c.compute is None:
                self._fetch(c)
            c.prefetched = False
        if c.ready is not None:  # CUDA: kernels of this module wait for the copy, not the CPU
            self.tier.wait(c.ready)
            c.ready = None
        if c.needs_fetch:
            self.policy.on_acquire(c.index)
        c.refs += 1
        for t in c.tensors:
            if t.state is TensorState.HOLD:
                t.state = TensorState.COMPUTE
        if c.needs_fetch:
            self._prefetch()

    def _prefetch(self) -> None:
        """Fetch the policy's next chunks ahead of use while they fit (auto placement), evicting
        only copies whose next use lies beyond theirs."""
        for index in self.policy.prefetch(lambda i: self.chunks[i].refs > 0 or self.chunks[i].compute is not None):
            c = self.chunks[index]
            budget = self.budget
            if self.pending:
                self.drain(block=False)
            while budget.budget_bytes is not None and budget.resident_bytes + c.compute_nbytes > budget.budget_bytes:
                if not self.cached:
                    return
                victim = self.policy.victim(self.cached)
                if self.policy.next_use(victim) <= self.policy.next_use(index):
                    return
                self.evict(self.cached[victim])
            self._fetch(c)
            c.prefetched = True
            self.cached[c.index] = c
            self.prefetches += 1

    def release(self, c: Chunk, keep: bool = False) -> None:
        """Drop one hold; at zero a fetched copy is freed, or with `keep` stays cached (evictable)
        so a backward soon after the forward need not fetch it again."""
        if c.refs <= 0:
            return
        c.refs -= 1
        if c.refs == 0:
            for t in c.tensors:
                if t.state is TensorState.COMPUTE:
                    t.state = TensorState.HOLD
            if c.needs_fetch:
                if keep:
                    self.cached[c.index] = c
                    self.cached.move_to_end(c.index)
                else:
                    self.evict(c)

    def evict(self, c: Chunk) -> None:
        """Free a released chunk's compute copy; its parameters read the master (W = 1) or are
        empty (W > 1) again."""
        assert c.refs == 0 and c.needs_fetch
        self.cached.pop(c.index, None)
        c.prefetched = False
        if c.compute is None:
            return
        if c.ready is not None:  # CUDA: a prefetch never used; its block is reused only after the copy
            self.tier.wait(c.ready)
            c.ready = None
        del self.compute_ptrs[c.compute.untyped_storage().data_ptr()]
        for t in c.tensors:
            t.param.data = self._released_view(c, t)
        c.compute = None
        self.budget.release(c.compute_nbytes)
        self.evictions += 1

    def flush(self) -> None:
        """Evict every cached copy (before steps and IO: parameters read their masters); on CUDA
        also finish the gradient write-backs and wait for the side streams, so host masters and
        gradients may be read and changed in place."""
        self.drain()
        for c in list(self.cached.values()):
            self.evict(c)
        self.tier.synchronize()

    def drain(self, block: bool = True) -> None:
        """CUDA: add completed gradient write-backs into their host grad shards, in the order they
        were issued (so sums are those of the CPU path), releasing their device buffers' bytes;
        `block=False` stops at the first still in flight."""
        while self.pending:
            event, staging, c, nbytes = self.pending[0]
            if not block and not event.query():
                return
            event.synchronize()
            c.grad.add_(staging)
            self.budget.release(nbytes)
            self.pending.pop(0)

    def release_all(self) -> None:
        for c in self.chunks:
            while c.refs:
                self.release(c)
        self.flush()

    # --- saved tensors (autograd) ------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        """Saved-tensor hook: a tensor living in a compute copy is saved as a reference, so the
        copy can be freed between forward and backward."""
        try:
            c = self.compute_ptrs.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. subclasses)
            return t
        if c is None:
            return t
        return (c, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.requires_grad)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        c, offset, size, stride, _ = saved
        if c.compute is None:
            raise RuntimeError(
                f"Gemini: backward needs chunk {c.index}, but it is not fetched: a module used parameters in "
                "forward that its own hooks do not fetch (e.g. another module's weight); give each module its "
                "own parameters")
        return c.compute.as_strided(size, stride, offset)

    # --- gradients ---------------------------------------------------------------------------
    def collect_grad(self, p: nn.Parameter) -> None:
        t = self.tensors[p]
        if p.grad is None:
            return
        c = t.chunk
        g = p.grad.detach()  # the compute dtype; added into fp32 below (no fp32 temporary)
        p.grad = None
        t.state, t.has_grad = TensorState.READY, True
        if not self.buffered(c):
            add_in_blocks(c.view(c.grad, t), g)
            return
        if c.grad_full is None:
            how = ("reduce-scattered" if c.sharded else "all-reduced") if self.comm.world > 1 else "copied to host"
            self.reserve(c.nbytes, f"fp32 gradient buffer of chunk {c.index} ({how} when complete)")
            c.grad_full = self.tier.zeros(c.size)
        add_in_blocks(c.view(c.grad_full, t), g)
        c.grads_seen += 1
        if c.grads_seen >= c.grads_expected:
            self.reduce_chunk(c)

    def reduce_chunk(self, c: Chunk) -> None:
        """Reduce a chunk's fp32 gradient buffer over the ranks (mean) into its grad and free it:
        reduce-scatter into the shard, or all-reduce for a replicated chunk (W = 1 on CUDA: no
        collective, the buffer only carries the gradients to the host shard)."""
        held = c.nbytes  # budget bytes this chunk's buffers hold until its gradient is in the shard
        if c.sharded:
            shard = self.tier.empty(c.shard_size)
            self.comm.reduce_scatter(shard, c.grad_full)
            self.budget.release(c.nbytes)  # the full buffer is done; the shard is what moves on
            shard.mul_(1.0 / self.comm.world)
            held = 0
            self.reduce_scatters += 1
        else:
            shard = c.grad_full
            if self.comm.world > 1:
                self.comm.all_reduce(shard)
                shard.mul_(1.0 / self.comm.world)
                self.all_reduces += 1
        if not (self.tier.cuda and c.param_tier == "host"):
            c.grad.add_(shard)
            self.budget.release(held)
        else:  # CUDA, host grad shard: copied back on the d2h stream, added in `drain`
            staging, event = self.tier.write_back(shard)
            self.pending.append((event, staging, c, held))
            self.drain(block=False)
        c.grad_full = None
        c.grads_seen = 0
        for t in c.tensors:
            if t.state is TensorState.READY and self.comm.world > 1:
                t.state = TensorState.REDUCED

    def finish_backward(self) -> None:
        """End of a backward: reduce-scatter chunks some of whose parameters got no gradient (in
        chunk order, the same on every rank), then flush cached copies."""
        for c in self.chunks:
            if c.grad_full is not None:
                self.reduce_chunk(c)
        self.flush()

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.grad.zero_()
            for t in c.tensors:
                t.has_grad = False
                if t.state in GRAD_STATES:
                    t.state = TensorState.HOLD

    def grad_views(self) -> list[torch.Tensor]:
        """W = 1: the gradient of every tensor that has one (for the global norm)."""
        return [t.chunk.view(t.chunk.grad, t) for t in self.order if t.has_grad]

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """W > 1: the global gradient norm over all ranks' shards (padding is zero); replicated
        chunks (the same full gradient on every rank) are counted once, after the all-reduce."""
        shards = [c.grad[:c.local_used] for c in self.chunks if c.local_used and c.sharded]
        whole = [c.grad[:c.used] for c in self.chunks if c.used and not c.sharded]
        cpu = torch.device("cpu")  # shards may sit in either tier; the sums meet on CPU
        if math.isinf(norm_type):
            local = max((s.abs().max().to(cpu) for s in shards + whole if s.numel()), default=torch.tensor(0.0))
            return self.comm.all_reduce(torch.as_tensor(local, dtype=torch.float32).reshape(1), "max")[0]
        total = torch.zeros(1, dtype=torch.float64)
        for s in shards:
            total += s.double().abs().pow(norm_type).sum().to(cpu)
        total = self.comm.all_reduce(total)
        for s in whole:
            total += s.double().abs().pow(norm_type).sum().to(cpu)
        return total[0].pow(1.0 / norm_type).float()

    # --- full tensors --------------------------------------------------------------------------
    def gather(self, c: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """The full-size buffer of a per-chunk shard (collective when W > 1)."""
        if not c.sharded:
            return shard
        full = torch.empty(c.size, dtype=torch.float32, device=shard.device)
        self.comm.all_gather(full, shard)
        return full

    def copy_in(self, c: Chunk, t: TensorInfo, shard: torch.Tensor, value: torch.Tensor) -> None:
        """Write this rank's part of the full tensor `value` of `t` into a chunk shard buffer."""
        r = c.local_range(t)
        if r is not None:
            dst, src, n = r
            shard[dst:dst + n].copy_(value.detach().reshape(-1)[src:src + n])

    # --- reporting -----------------------------------------------------------------------------
    def report(self) -> dict:
        used = sum(c.used for c in self.chunks)
        total = sum(c.size for c in self.chunks)
        return {
            "chunk_size": self.chunk_size,
            "n_chunks": len(self.chunks),
            "world_size": self.comm.world,
            "device": str(self.tier.device),
            "shard_size": self.chunk_size // self.comm.world,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "fetch_bytes": self.chunk_size * self.compute_dtype.itemsize,  # one fetched compute copy
            "sharded_chunks": sum(c.sharded for c in self.chunks),
            "param_elements": used,
            "padding_elements": total - used,
            "padding_bytes": (total - used) * F32,
            "padding_frac": (total - used) / total if total else 0.0,
            "param_tiers": [c.param_tier for c in self.chunks],
            "optim_tiers": [c.optim_tier for c in self.chunks],
            "device_budget_bytes": self.budget.budget_bytes,
            "device_resident_bytes": self.budget.resident_bytes,
            "device_peak_bytes": self.budget.peak_bytes,
            "non_model_bytes": self.non_model_bytes,
            "param_cache_bytes": self.param_cache_bytes,
            "device_optim_chunks": sum(c.optim_tier == "device" for c in self.chunks),
            "fetches": self.fetches,
            "evictions": self.evictions,
            "prefetches": self.prefetches,
            "prefetch_hits": self.prefetch_hits,
            "reduce_scatters": self.reduce_scatters,
            "all_reduces": self.all_reduces,
            "policy": self.policy.name,
        }
