"""TorchDDPPlugin: plain data parallelism with torch DDP (full replica of model and optimizer).

Gradients are averaged by DDP's bucketed allreduce during backward, so every rank holds the
same averaged gradients: the plain global norm on each rank is the true norm, and clipping
needs no extra communication. `no_sync` is DDP's own (really skips the allreduce).

Checkpoints are sharded (`ShardedCheckpointIO`, torch.distributed.checkpoint into safetensors
shards): every rank writes its part and its own trainer/RNG state, and any layout loads them.
`ReplicatedCheckpointReader` is kept to read "general" (full-copy, single-process) checkpoints
into a replicated run: rank 0's gathered copy, loaded by every rank.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ..checkpoint import GeneralCheckpointReader
from ..plugin import Plugin
from ..sharded_checkpoint import ShardedCheckpointIO
from ..precision import MixedPrecision
from ..wrappers import ModelWrapper, OptimizerWrapper


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("this plugin needs an initialised process group: call tabfm.parallel.launch.launch() first "
                           "(under torchrun), or use SingleProcessPlugin")


class ReplicatedCheckpointReader(GeneralCheckpointReader):
    """Reads a "general" (full-tensor, single-process) checkpoint into a distributed run: the
    fallback reader of the distributed plugins' ShardedCheckpointIO (which saves and exports).

    Every rank loads the full state (ZeroRedundancyOptimizer keeps its own partition of it;
    `FullStateFSDPReader` scatters it into FSDP2 shards)."""

    def __init__(self, group: "dist.ProcessGroup | None" = None) -> None:
        self.group = group


class TorchDDPPlugin(Plugin):
    """torch DistributedDataParallel over the default process group (or `process_group`).

    precision               "fp32" | "bf16" | "fp16" | MixedPrecision.
    bucket_cap_mb           DDP gradient bucket size.
    find_unused_parameters  set when some parameters get no gradient in a step.
    broadcast_buffers       sync buffers from rank 0 at each forward (DDP's default; False turns it off).
    static_graph            DDP's static-graph optimisation.
    device                  None -> cuda:LOCAL_RANK when the backend is NCCL, else cpu.
    """

    name = "ddp"

    def __init__(self, precision: "str | MixedPrecision | None" = None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True, static_graph: bool = False,
                 gradient_as_bucket_view: bool = False, device: "str | torch.device | None" = None,
                 process_group: "dist.ProcessGroup | None" = None) -> None:
        _require_process_group()
        super().__init__(precision)
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.process_group = process_group
        if device is None:
            from ..launch import current
            device = current().device
        self._device = torch.device(device)
        self._ddp: DDP | None = None
        self._checkpoint_io = ShardedCheckpointIO(process_group, fallback=ReplicatedCheckpointReader(process_group))

    # --- topology --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def dp_world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def is_main_process(self) -> bool:
        return dist.get_rank() == 0

    def layout(self) -> dict[str, int]:
        return {"world_size": dist.get_world_size(), "dp": self.dp_world_size, "tp": 1, "sp": 1, "pp": 1}

    # --- wrapping --------------------------------------------------------------------------
    def _wrap_ddp(self, model: nn.Module) -> DDP:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, process_group=self.process_group,
                   bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=self.find_unused_parameters,
                   static_graph=self.static_graph, gradient_as_bucket_view=self.gradient_as_bucket_view,
                   **self._buffer_sync_kwargs())

    def _buffer_sync_kwargs(self) -> dict[str, bool]:
        if self.broadcast_buffers:
            return {}  # DDP's default: buffers synced from rank 0 at init and every forward
        # torch >= 2.13 renames the per-forward buffer sync (init sync then always happens)
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            return {"forward_sync_buffers": False}
        return {"broadcast_buffers": False}

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        # DDP broadcasts rank 0's parameters and buffers in place, so `optimizer` stays valid.
        self.apply_block_options(model)
        self._ddp = self._wrap_ddp(model)
        wrapped_optimizer = self.wrap_optimizer(optimizer) if optimizer is not None else None
        return self.wrap_model(model, self._ddp), wrapped_optimizer, criterion, dataloader, lr_scheduler

    # --- gradients -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without the allreduce; the first
        backward outside syncs the accumulated sum (DDP semantics)."""
        ddp = self._ddp
        if model is not None:
            inner = getattr(model, "module", model)
            if isinstance(inner, DDP):
                ddp = inner
        if ddp is None:
            raise RuntimeError("no_sync() before boost(): there is no DDP module yet")
        with ddp.no_sync():
            yield
