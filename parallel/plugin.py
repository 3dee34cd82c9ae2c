"""Plugin: one parallelisation strategy behind one interface, so the training loop never changes.

A plugin decides where the model lives and how it is wrapped (`configure`), how data is
split over data-parallel ranks (`prepare_dataloader`), how gradients are reduced and
clipped (`no_sync`, `clip_grad_norm_`), and how state reaches disk (`checkpoint_io`).
Distributed plugins (DDP, ZeRO, FSDP2, hybrid TP/SP/PP, Gemini) subclass this and override
what differs; the base class holds the behaviour that is right for a single replica.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .checkpoint import CheckpointIO, GeneralCheckpointReader
from .parallelize import parallelize
from .plan import plan_of
from .precision import MixedPrecision
from .wrappers import ModelWrapper, OptimizerWrapper, plain_grad_norm


class Plugin(ABC):
    """Base class of all strategies.

    supported_precisions (class attribute): the `MixedPrecision.dtype` values this plugin accepts.
    A plugin that runs pipeline parallelism also defines `execute_pipeline` (see Booster).
    """

    name: ClassVar[str] = "plugin"
    supported_precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16")

    def __init__(self, precision: "str | MixedPrecision | None" = None) -> None:
        self._precision_given = precision is not None
        self.precision = self._check_precision(MixedPrecision.of(precision))
        # one checkpoint IO for every layout (DCP); older full-tensor "general" checkpoints still load
        from .sharded_checkpoint import ShardedCheckpointIO

        self._checkpoint_io: CheckpointIO = ShardedCheckpointIO(None, fallback=GeneralCheckpointReader())

    # --- topology --------------------------------------------------------------------------
    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_world_size(self) -> int:
        return 1

    @property
    def is_main_process(self) -> bool:
        """The process that logs and writes rank-0-only files."""
        return True

    def layout(self) -> dict[str, int]:
        """Process layout recorded in checkpoint manifests."""
        return {"world_size": 1, "dp": 1, "tp": 1, "sp": 1, "pp": 1}

    # --- precision -------------------------------------------------------------------------
    def _check_precision(self, precision: MixedPrecision) -> MixedPrecision:
        if precision.dtype not in self.supported_precisions:
            raise ValueError(f"{type(self).__name__} supports precision {self.supported_precisions}, "
                             f"not {precision.dtype!r}")
        return precision

    def set_precision(self, precision: "str | MixedPrecision") -> None:
        """Set the precision before `configure` (used by `Booster(precision=...)`)."""
        wanted = MixedPrecision.of(precision)
        if self._precision_given and wanted != self.precision:
            raise ValueError(f"precision given twice: plugin has {self.precision.dtype!r}, booster asks "
                             f"{wanted.dtype!r}; set it in one place")
        self.precision = self._check_precision(wanted)
        self._precision_given = True

    def autocast(self) -> ContextManager[Any]:
        """Autocast context for compute outside the boosted model (e.g. a loss head)."""
        return self.precision.autocast(self.device)

    # --- wrapping --------------------------------------------------------------------------
    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        """Move/shard/wrap the objects; return them in the same order."""

    # --- what is done to the model's blocks (Booster(activation_checkpointing=..., compile=...)) ---------
    activation_checkpointing: bool = False
    compile: bool = False

    def set_block_options(self, *, activation_checkpointing: bool = False, compile: bool = False) -> None:
        """Recompute (activation checkpointing) and / or torch.compile the blocks the model's plan
        names, at their place in `parallel.parallelize`'s order, when `configure` runs. Plugins
        that cannot do one refuse it here, before anything is built."""
        self.activation_checkpointing, self.compile = bool(activation_checkpointing), bool(compile)

    def apply_block_options(self, model: nn.Module) -> None:
        """Activation checkpointing and compiling for plugins without tensor or row-sequence
        parallelism: the first thing their `configure` does (parallelize's steps 3 and 4)."""
        if self.activation_checkpointing or self.compile:
            parallelize(model, plan_of(model, "activation checkpointing and torch.compile of the blocks"),
                        activation_checkpointing=self.activation_checkpointing, compile=self.compile)

    def wrap_model(self, module: nn.Module, distributed: nn.Module | None = None) -> ModelWrapper:
        """ModelWrapper around `distributed` (e.g. a DDP module) or `module`; unwrap() gives `module`."""
        return ModelWrapper(distributed if distributed is not None else module, self.precision, self.device,
                            unwrapped=module)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerWrapper:
        return OptimizerWrapper(optimizer, scaler=self.precision.make_scaler(), grad_norm_fn=self.grad_norm)

    # --- data ------------------------------------------------------------------------------
    def prepare_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable | None = None,
        **kwargs: Any,
    ) -> DataLoader:
        """A DataLoader yielding this data-parallel rank's share of `dataset`.

        Map-style datasets get a `DistributedSampler(num_replicas=dp_world_size, rank=dp_rank,
        seed=seed)` at every world size, so the order depends only on (seed, epoch): call
        `loader.sampler.set_epoch(epoch)` each epoch. Iterable datasets are passed through and
        must shard themselves using `dp_rank` / `dp_world_size`.
        """
        generator = torch.Generator().manual_seed(seed)  # seeds worker processes
        if isinstance(dataset, IterableDataset):
            return DataLoader(dataset, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
                              collate_fn=collate_fn, generator=generator, **kwargs)
        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size, rank=self.dp_rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          num_workers=num_workers, collate_fn=collate_fn, generator=generator, **kwargs)

    # --- gradients -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        optimizer.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        """Skip gradient synchronisation for accumulation micro-batches (no-op by default)."""
        yield

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Total gradient norm over the whole model. Sharded plugins override this to reduce
        across ranks (and handle DTensor grads); the wrapped optimizer calls it for clipping
        and fp16 overflow detection."""
        return plain_grad_norm(grads, norm_type)

    def clip_grad_norm_(self, optimizer: OptimizerWrapper, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients to global norm `max_norm`; return the norm before clipping."""
        return optimizer.clip_grad_by_norm(max_norm, norm_type)

    # --- checkpoints -----------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> CheckpointIO:
        return self._checkpoint_io

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, precision={self.precision.dtype!r})"
