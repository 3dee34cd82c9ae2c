"""GeminiPlugin: chunk-based heterogeneous memory over device, host and disk, on one process or
sharded ZeRO-3 style over the data-parallel ranks (torchrun; gloo on CPU).

    booster = Booster(GeminiPlugin(device_budget_bytes=256 << 20, offload_param_frac=0.5,
                                   offload_optim_frac=0.25, disk_optim_frac=0.5))
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ... the usual loop: booster.backward, booster.clip_grad_norm_, optimizer.step/zero_grad ...
    booster.plugin.close()        # joins the disk thread, removes the disk tier's files

Parameters are packed into chunks (`chunks.py`), sharded over the ranks of the default process
group when there are several; module hooks (`hooks.py`) fetch (copy or all-gather) a chunk into
the device tier before a module runs forward or backward and release it afterwards; gradients
are reduce-scattered per chunk; the optimizer (`optim.py`, torch Adam/AdamW, fp32) steps each
rank's shards in the tier where their state lives. Placement is `static` (fractions) or `auto`
(`placement.py`: a warm-up step records the chunk order and the activation bytes; afterwards
the budget minus those bytes holds the optimizer state of as many chunks as fit beside the
parameter cache the schedule needs, and that cache is managed by farthest-next-use eviction
with prefetch).
Checkpoints go through the layout-free DCP checkpoint IO (`checkpoint_io.py`): Gemini, FSDP,
DDP, ZeRO and single-process runs resume each other's at any world size.

Precision: "fp32", or "bf16"/"fp16" compute copies: every chunk keeps its fp32 master (and fp32
gradient and Adam state) in its tier; the copy a module runs with is fetched in bf16/fp16 (half
the device bytes and half the all-gather of an fp32 fetch), under autocast, with each module's
fp32 inputs cast to match; gradients arrive in bf16/fp16 and are accumulated and reduced in
fp32; AdamW steps the fp32 masters. fp16 adds dynamic loss scaling folded into the chunk
optimizer (`optim.py`).

Device: `device="cpu"` (the default) keeps every tier in CPU memory and accounts the device
tier against the budget (CPU-only machines). `device="cuda"` (or "cuda:N"; "auto": CUDA when
available, else CPU) puts the device tier in CUDA memory: fetched compute copies, gradient
buffers, device-tier masters/gradients/Adam state (stepped with torch's fused CUDA Adam); the
host tier in pinned CPU memory (Adam state there stepped on CPU); fetches on a side stream
fenced by events, so `auto`'s prefetch overlaps the running module; gradient write-backs to the
host tier on another side stream (`tiers.DeviceTier`). Collectives use the process group's
backend (NCCL when `tabfm.parallel.launch` saw CUDA). The budget keeps its meaning (bytes the manager
holds in the device tier); `memory_report()` adds torch.cuda.memory_allocated/
max_memory_allocated as a cross-check. Feed the model inputs on `plugin.device`. Asking for
CUDA without it is an error, never a CPU run.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..plugin import Plugin
from ..precision import MixedPrecision
from ..wrappers import ModelWrapper, OptimizerWrapper
from .checkpoint_io import GeminiCheckpointIO
from .chunks import ChunkManager
from .comm import ShardComm
from ..plan import plan_of
from .hooks import ChunkHooks, GeminiModule, hook_units
from .optim import GeminiOptimizer
from .placement import AutoPolicy, LRUPolicy, device_optim_chunks
from .tiers import DeviceBudget, DeviceBudgetError, DeviceTier, DiskStore, resolve_device

__all__ = ["GeminiOptimizer", "GeminiPlugin"]


class GeminiPlugin(Plugin):
    """Chunk-based heterogeneous memory over device, host and disk tiers.

    placement            "static": the fractions below decide each chunk's tiers for the whole
                         run. "auto": every chunk's parameters live on host (their shards, with
                         several ranks) and the device budget is a cache: the first step (warm-up,
                         LRU) records the order chunks are used in and the activation bytes saved
                         for backward; those bytes are then reserved, and chunks are evicted
                         farthest-next-use first and prefetched `prefetch_depth` ahead.
                         Optimizer state starts off device (host; disk for the last
                         `disk_optim_frac` of the chunks); at the end of the warm-up the bytes
                         the budget has left after the activations and the parameter cache the
                         schedule needs (`param_cache_bytes`: the largest module's backward
                         working set plus `prefetch_depth` copies, or one step copy) take the
                         optimizer state of as many chunks as fit, disk chunks first, then host,
                         in step order (`placement.device_optim_chunks`).
    device_budget_bytes  bytes the device tier may hold (resident shards + fetched copies +
                         gradient buffers [+ auto: measured activations]); None: unbounded (still
                         accounted).
    offload_param_frac   static: fraction of chunks (the last ones) whose params + grads live on
                         host and are fetched into the device tier only while their modules run.
    offload_optim_frac   static: fraction of chunks whose Adam state lives on host (stepped
                         there). auto: must be 0 (the budget decides).
    disk_optim_frac      fraction of chunks (the last ones) whose Adam state lives on disk (auto:
                         unless the budget has room for it on device).
    disk_dir             where the disk tier puts its files (a fresh subdirectory per process,
                         removed at close/exit); None: a temporary directory.
    chunk_size           elements per chunk; None: chosen to minimise padding (rounded up to a
                         multiple of the world size).
    prefetch_depth       auto: chunks fetched ahead of use.
    precision            "fp32", "bf16" or "fp16" (or a MixedPrecision: its loss-scaling fields
                         apply to fp16): the dtype of the fetched compute copies; masters,
                         gradients and optimizer state stay fp32.

    device               "cpu" (default): the device tier is CPU memory accounted against the budget.
                         "cuda" / "cuda:N": CUDA memory (see the module docstring); "cuda" means
                         the current CUDA device (torchrun + tabfm.parallel.launch: cuda:LOCAL_RANK).
                         "auto": "cuda" when torch.cuda.is_available(), else "cpu". CUDA asked
                         for but unavailable: RuntimeError naming the torch build.
    shard_param_frac     static, several ranks: fraction of chunks (the last ones) sharded over the
                         ranks; the others are replicated (each rank holds the whole chunk, its
                         gradients are all-reduced, its optimizer step runs on every rank). 1.0:
                         ZeRO-3 for every chunk; 0.0: every chunk replicated (DDP-like). No effect
                         with one process.

    With several ranks (torch.distributed initialised) each sharded chunk is split over all of
    them: each rank keeps 1/W of its master, gradient and optimizer state; give each rank its
    share of the global batch (the gradients are averaged).
    """

    name = "gemini"
    supported_precisions = ("fp32", "bf16", "fp16")

    def __init__(self, placement: str = "static", device_budget_bytes: int | None = None,
                 offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0, disk_optim_frac: float = 0.0,
                 disk_dir: "str | os.PathLike | None" = None, chunk_size: int | None = None,
                 prefetch_depth: int = 1, precision: "str | MixedPrecision | None" = None,
                 shard_param_frac: float = 1.0, device: "str | torch.device" = "cpu") -> None:
        if placement not in ("static", "auto"):
            raise ValueError(f"placement={placement!r}: expected 'static' or 'auto'")
        if placement == "auto" and offload_param_frac:
            raise ValueError("placement='auto' decides where parameters live; leave offload_param_frac at 0")
        if placement == "auto" and offload_optim_frac:
            raise ValueError("placement='auto' decides where optimizer state lives (the device bytes left after the "
                             "warm-up step, the rest on host); leave offload_optim_frac at 0 (disk_optim_frac picks "
                             "the chunks whose state falls back to disk instead of host)")
        if placement == "auto" and shard_param_frac != 1.0:
            raise ValueError("placement='auto' shards every chunk; shard_param_frac is for placement='static'")
        for name, frac in (("offload_param_frac", offload_param_frac), ("offload_optim_frac", offload_optim_frac),
                           ("disk_optim_frac", disk_optim_frac), ("shard_param_frac", shard_param_frac)):
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"{name}={frac} must lie in [0, 1]")
        if offload_optim_frac + disk_optim_frac > 1.0 + 1e-9:
            raise ValueError(f"offload_optim_frac + disk_optim_frac = {offload_optim_frac + disk_optim_frac} > 1")
        super().__init__(precision)
        self._device = resolve_device(device)
        self.comm = ShardComm.from_env()
        self._checkpoint_io = GeminiCheckpointIO(self)
        self.placement = placement
        self.device_budget_bytes = device_budget_bytes
        self.offload_param_frac = 1.0 if placement == "auto" else offload_param_frac
        self.offload_optim_frac = 1.0 if placement == "auto" else offload_optim_frac  # auto: starts off device
        self.disk_optim_frac = disk_optim_frac
        self.shard_param_frac = shard_param_frac
        self.disk_dir = disk_dir
        self.chunk_size = chunk_size
        self.prefetch_depth = prefetch_depth
        self.manager: ChunkManager | None = None
        self.disk: DiskStore | None = None
        self.optimizer: GeminiOptimizer | None = None
        self.module: GeminiModule | None = None
        self._hooks: ChunkHooks | None = None

    def set_block_options(self, *, activation_checkpointing: bool = False, compile: bool = False) -> None:
        if activation_checkpointing or compile:
            raise ValueError("GeminiPlugin moves each block's parameters in and out of the device budget with "
                             "module hooks, which do not yet handle a block recomputed in backward (activation "
                             "checkpointing: its losses left one process's) or compiled; use TorchFSDPPlugin or "
                             "LowLevelZeroPlugin for activation memory")
        super().set_block_options()

    # --- topology ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where modules compute and inputs belong: the device tier's device."""
        return self._device

    @property
    def dp_rank(self) -> int:
        return self.comm.rank

    @property
    def dp_world_size(self) -> int:
        return self.comm.world

    @property
    def is_main_process(self) -> bool:
        return self.comm.rank == 0

    def layout(self) -> dict[str, int]:
        return {"world_size": self.comm.world, "dp": self.comm.world, "tp": 1, "sp": 1, "pp": 1}

    # --- boost ---------------------------------------------------------------------------------
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        if self.manager is not None:
            raise RuntimeError("a GeminiPlugin manages one model; make a new plugin for another")
        manager = self._plan(model, optimizer)
        hooks = ChunkHooks(model, manager, plan_of(model).blocks)
        need = self.estimate(model, optimizer, manager=manager)
        if self.device_budget_bytes is not None and need["device_bytes"] > self.device_budget_bytes:
            hooks.remove()
            raise DeviceBudgetError(
                f"device budget {self.device_budget_bytes} bytes cannot hold what a step needs: "
                f"{need['device_bytes']} bytes = {need['device_resident_bytes']} resident (params+grads of "
                f"{need['device_param_chunks']} device chunks, optimizer state of {need['device_optim_chunks']} "
                f"device chunks) + {need['device_working_bytes']} working (largest module fetch "
                f"{need['largest_fetch_bytes']}, its fresh gradients {need['grad_landing_bytes']}, gradient "
                f"buffers {need['grad_buffer_bytes']}, device step copy "
                f"{need['step_copy_bytes']}); {len(manager.chunks)} chunks of {manager.chunk_size} elements "
                f"({manager.chunk_size * 4} bytes fp32) over {self.comm.world} rank(s). Raise device_budget_bytes or "
                "offload more")
        if any(c.optim_tier == "disk" for c in manager.chunks):
            self.disk = DiskStore(self.disk_dir)
            manager.disk = self.disk
        with torch.no_grad():
            for module in model.modules():  # buffers (not chunked) live where the modules compute
                for key, b in list(module.named_buffers(recurse=False)):
                    if b.device != self._device:
                        setattr(module, key, b.to(self._device))  # nn.Module keeps it a buffer (persistence too)
            for b in model.buffers():  # like DDP: rank 0's buffers are the model's
                self.comm.broadcast(b.data, src=0)
        manager.materialize()
        self.manager, self._hooks = manager, hooks
        self.module = GeminiModule(model, manager)
        self.module.measure = self.placement == "auto"
        self.optimizer = GeminiOptimizer(optimizer, manager, self.disk, on_step=self._on_step,
                                         scaler=self.precision.make_scaler())
        self.optimizer.grad_norm_fn = self.grad_norm
        return self.wrap_model(model, self.module), self.optimizer, criterion, dataloader, lr_scheduler

    def _plan(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> ChunkManager:
        if optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(f"GeminiPlugin steps torch.optim.Adam/AdamW on its chunks; got {type(optimizer).__name__}")
        group_of = {p: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = []
        for name, p in model.named_parameters():
            if p not in group_of:
                raise ValueError(f"parameter {name} is not in the optimizer; Gemini chunks only optimised parameters")
            named.append((name, p, group_of[p]))
        policy = AutoPolicy(self.prefetch_depth) if self.placement == "auto" else LRUPolicy()
        manager = ChunkManager(named, self.chunk_size, DeviceBudget(self.device_budget_bytes), comm=self.comm,
                               policy=policy, compute_dtype=self.precision.torch_dtype or torch.float32,
                               tier=DeviceTier(self._device))
        manager.place(self.offload_param_frac, self.offload_optim_frac, self.disk_optim_frac, self.shard_param_frac)
        return manager

    def _on_step(self) -> None:
        """Auto placement: the first step ends the warm-up: freeze the chunk schedule and reserve
        the measured activation bytes (the largest over ranks, so every rank caches alike)."""
        policy = self.manager.policy if self.manager is not None else None
        if not isinstance(policy, AutoPolicy) or policy.warm:
            return
        self.manager.flush()
        measured = torch.tensor([float(self.module.peak_saved_bytes)])
        nbytes = int(self.comm.all_reduce(measured, "max")[0])
        self.module.measure = False
        self.manager.reserve(nbytes, "non-model memory (activations saved for backward, measured in the warm-up step)")
        self.manager.non_model_bytes = nbytes
        self._place_optimizer_state()
        policy.end_warmup()

    def param_cache_bytes(self) -> int:
        """Auto: device bytes the recorded schedule needs for parameters after the warm-up: the
        largest module's backward working set (its fetched copies, its fresh gradients, gradient
        buffers) plus `prefetch_depth` fetched copies ahead of it, or, during the optimizer step,
        the copy of one host chunk's master + gradient next to its device optimizer state."""
        m = self._boosted()
        est = self.estimate(self.module.module, self.optimizer.optim, manager=m)
        fetch = max(c.compute_nbytes for c in m.chunks)
        step_copy = max(2 * c.shard_nbytes for c in m.chunks)
        return max(est["module_working_bytes"] + self.prefetch_depth * fetch, step_copy)

    def _place_optimizer_state(self) -> None:
        """Auto, end of warm-up: move the optimizer state of as many chunks as the budget's
        leftover holds into the device tier (after the activations are reserved)."""
        m = self.manager
        m.param_cache_bytes = self.param_cache_bytes()
        budget = m.budget.budget_bytes
        free = None if budget is None else budget - m.budget.resident_bytes - m.param_cache_bytes
        for c in device_optim_chunks(m.chunks, free):
            m.move_optim(c, "device")

    # --- sizing ----------------------------------------------------------------------------------
    def estimate(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 manager: ChunkManager | None = None) -> dict[str, int]:
        """Bytes this placement needs per tier and rank, without allocating (the model may live on
        the meta device): device = resident + working set (the largest module fetch plus the
        gradients its backward produces, plus, with several ranks (or on CUDA, for chunks whose
        gradient shard lives on host), the full-size fp32 gradient buffers of the chunks that can
        be incomplete at once; or a device step copy); host =
        host-tier shards + the disk stream's bounded buffers (3 chunk shards). Auto placement
        adds the activation bytes it measures in its warm-up."""
        manager = manager if manager is not None else self._plan(model, optimizer)
        resident = manager.resident_bytes_needed()
        fetch, landing, module_bwd, grad_bufs = 0, 0, 0, 0
        units = hook_units(model, manager.tensors, plan_of(model).blocks)
        # the root unit's chunks stay fetched through the whole forward and backward, so they are
        # part of every other module's working set (shared chunks are counted once)
        root = {manager.tensors[p].chunk.index: manager.tensors[p].chunk for p in units.get(model, [])}
        for module, params in units.items():
            chunks = {manager.tensors[p].chunk.index: manager.tensors[p].chunk for p in params} | root
            here = sum(c.compute_nbytes for c in chunks.values() if c.needs_fetch)
            # sizes from the chunk records: a boosted sharded model's parameters are empty between uses
            grads = sum(manager.tensors[p].numel for p in params if p.requires_grad) * manager.compute_dtype.itemsize
            fetch, landing = max(fetch, here), max(landing, grads)
            module_bwd = max(module_bwd, here + grads)  # a module's backward: its copies + its fresh grads
            if any(manager.buffered(c) for c in chunks.values()):  # several ranks, or CUDA with host
                # grads: the module's chunks plus the one before them may be partial
                grad_bufs = max(grad_bufs, (len(chunks) + 1) * manager.chunk_size * 4)
        step = max((2 * c.shard_nbytes for c in manager.chunks if c.optim_tier == "device" and c.param_tier == "host"),
                   default=0)
        working = max(module_bwd + grad_bufs, step)
        disk_chunks = [c for c in manager.chunks if c.optim_tier == "disk"]
        host = sum((2 * c.shard_nbytes if c.param_tier == "host" else 0)
                   + (2 * c.shard_nbytes if c.optim_tier == "host" else 0) for c in manager.chunks) \
            + 3 * 2 * max((c.shard_nbytes for c in disk_chunks), default=0)
        return {
            "device_bytes": resident + working,
            "device_resident_bytes": resident,
            "device_working_bytes": working,
            "module_working_bytes": module_bwd + grad_bufs,
            "largest_fetch_bytes": fetch,
            "grad_landing_bytes": landing,
            "grad_buffer_bytes": grad_bufs,
            "step_copy_bytes": step,
            "device_param_chunks": sum(c.param_tier == "device" for c in manager.chunks),
            "device_optim_chunks": sum(c.optim_tier == "device" for c in manager.chunks),
            "host_bytes": host,
            "disk_bytes": sum(2 * c.shard_nbytes for c in disk_chunks),
            "n_chunks": len(manager.chunks),
            "chunk_size": manager.chunk_size,
            "padding_bytes": manager.report()["padding_bytes"],
        }

    # --- gradients -----------------------------------------------------------------------------
    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        if self.manager is not None and self.comm.sharded:
            return self.manager.grad_norm(norm_type)
        return super().grad_norm(grads, norm_type)

    # --- full state ------------------------------------------------------------------------------
    def full_state_dict(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The model's full state dict (parameters gathered from the chunks: collective when
        sharded; buffers as they are), on every rank."""
        m = self._boosted()
        module = module if module is not None else self.module.module
        m.flush()
        full: dict[nn.Parameter, torch.Tensor] = {}
        for c in m.chunks:
            buf = m.gather(c, c.master)
            for t in c.tensors:
                full[t.param] = c.view(buf, t).clone()
        return {k: (full[v] if isinstance(v, nn.Parameter) and v in full else v.detach().clone())
                for k, v in module.state_dict(keep_vars=True).items()}

    def load_full_model_state(self, module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True,
                              where: Any = "state dict") -> None:
        """Load full tensors (a state dict) into the chunks: each rank keeps its slices."""
        m = self._boosted()
        m.flush()
        own = module.state_dict(keep_vars=True)
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        if strict and (missing or unexpected):
            raise ValueError(f"{where}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        with torch.no_grad():
            for key, v in own.items():
                if key not in state:
                    continue
                t = m.tensors.get(v) if isinstance(v, nn.Parameter) else None
                shape = tuple(t.shape) if t is not None else tuple(v.shape)
                if tuple(state[key].shape) != shape:
                    raise ValueError(f"{where}: key {key!r} has shape {list(state[key].shape)}, model expects "
                                     f"{list(shape)}")
                if t is None:
                    v.copy_(state[key])
                else:
                    m.copy_in(t.chunk, t, t.chunk.master, state[key])

    def _boosted(self) -> ChunkManager:
        if self.manager is None:
            raise RuntimeError("boost a model first")
        return self.manager

    # --- reporting -------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Chunk layout, padding waste, tiers, device bytes resident and peak, traffic counters;
        on CUDA also `cuda_allocated_bytes` / `cuda_max_allocated_bytes` (torch's allocator: the
        manager's device bytes plus activations, inputs and workspaces it does not hold)."""
        rep = self._boosted().report()
        rep["placement"] = self.placement
        rep["disk_dir"] = str(self.disk.root) if self.disk is not None else None
        rep["disk_bytes_read"] = self.disk.bytes_read if self.disk is not None else 0
        rep["disk_bytes_written"] = self.disk.bytes_written if self.disk is not None else 0
        rep["cached_chunks"] = len(self.manager.cached)
        rep["max_disk_buffers"] = self.optimizer.max_disk_buffers if self.optimizer is not None else 0
        rep.update(self.manager.tier.memory())  # CUDA: torch's allocated bytes, to set beside the accounting
        return rep

    def close(self) -> None:
        """Join the disk thread and remove the disk tier's files (also done at interpreter exit)."""
        if self.disk is not None:
            self.disk.close()

    def __repr__(self) -> str:
        return (f"GeminiPlugin(placement={self.placement!r}, device_budget_bytes={self.device_budget_bytes}, "
                f"offload_param_frac={self.offload_param_frac}, offload_optim_frac={self.offload_optim_frac}, "
                f"disk_optim_frac={self.disk_optim_frac}, shard_param_frac={self.shard_param_frac}, "
                f"world_size={self.comm.world}, device={str(self._device)!r}, "
                f"precision={self.precision.dtype!r})")
