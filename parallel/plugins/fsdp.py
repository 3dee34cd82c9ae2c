"""TorchFSDPPlugin: fully sharded data parallelism (ZeRO-3) with FSDP2 `fully_shard`.

Parameters, gradients and optimizer state are all sharded over the data-parallel ranks.
Each block the model names in its `parallel_plan()` (or the `blocks=` given) becomes its own
FSDP unit, then the root takes the remaining parameters: a unit's parameters are all-gathered
just before it runs and, with `reshard_after_forward=True`, freed again right after, so at
most about one block is unsharded at a time. The engine never imports the model: it only
reads the `tabfm.parallel.plan.ParallelPlan` the model returns.

Mixed precision. Under bf16/fp16 the units get `MixedPrecisionPolicy(param_dtype=<compute
dtype>, reduce_dtype=fp32)`: parameters are all-gathered in the compute dtype (half the
traffic and unsharded memory) and gradients reduce-scattered in fp32 into the fp32 shards
(the master weights). The ModelWrapper's autocast stays on, as with every other plugin, so
each op runs in the dtype autocast picks (fp32 for its fp32-list ops such as layer norm and
softmax, which see the parameters rounded to the compute dtype). The two do not double up:
autocast's cast of an already-bf16/fp16 parameter is a no-op, so no second copy is made.
`cast_params=False` keeps fp32 all-gathers and leaves all casting to autocast (the
single-process recipe op for op, at twice the traffic). fp16 adds dynamic loss scaling
with an overflow flag agreed across ranks (see FullyShardPlugin).

Checkpoints are sharded (`ShardedCheckpointIO`, see zero.py): each rank writes only its
shards, and they load into a single process, DDP, ZeRO or FSDP at any world size.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..plan import plan_of
from ..precision import MixedPrecision
from ..wrappers import ModelWrapper, OptimizerWrapper
from .zero import FullyShardPlugin


class TorchFSDPPlugin(FullyShardPlugin):
    """FSDP2 over the default process group (ZeRO-3 semantics).

    precision               "fp32" | "bf16" | "fp16" | MixedPrecision.
    blocks                  submodule names to shard as separate units; None -> the model's
                            `parallel_plan().blocks` (or only the root if it has no plan).
    reshard_after_forward   free each unit's gathered parameters after its forward (ZeRO-3);
                            False keeps them until backward (ZeRO-2-like memory, less traffic).
    cpu_offload             keep the parameter, gradient and optimizer-state shards in host
                            memory (`CPUOffloadPolicy(pin_memory=False)`: pinning needs CUDA).
    cast_params             bf16/fp16: all-gather parameters in the compute dtype (see module doc).
    device                  None -> cuda:LOCAL_RANK when the backend is NCCL, else cpu.
    """

    name = "fsdp"

    def __init__(self, precision: "str | MixedPrecision | None" = None, *, blocks: Sequence[str] | None = None,
                 reshard_after_forward: bool = True, cpu_offload: bool = False, cast_params: bool = True,
                 device: "str | torch.device | None" = None) -> None:
        super().__init__(precision=precision, device=device)
        self.blocks = list(blocks) if blocks is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.cast_params = cast_params

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """The `fully_shard` keyword arguments every unit gets (from precision and options)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        compute = self.precision.torch_dtype
        if compute is not None and self.cast_params:
            # inputs stay as given: a table's values must not be rounded to the compute dtype
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                                       cast_forward_inputs=False)
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        return kwargs

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        blocks = self.blocks if self.blocks is not None else plan_of(model).blocks
        wrapped_model, wrapped = self._shard(model, optimizer, lr_scheduler, blocks, **self.fully_shard_kwargs())
        return wrapped_model, wrapped, criterion, dataloader, lr_scheduler

    def __repr__(self) -> str:
        return (f"TorchFSDPPlugin(device={self.device}, precision={self.precision.dtype!r}, "
                f"reshard_after_forward={self.reshard_after_forward}, cpu_offload={self.cpu_offload})")
