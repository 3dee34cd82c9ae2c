"""Booster: the one object a training loop talks to. Switching strategy = switching the plugin.

    booster = Booster(plugin=SingleProcessPlugin(), precision="bf16")
    model, optimizer, criterion, loader, scheduler = booster.boost(model, optimizer, criterion, loader, scheduler)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    booster.clip_grad_norm_(optimizer, 1.0)
    optimizer.step(); optimizer.zero_grad(); scheduler.step()
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .checkpoint import CheckpointMeta
from .parallelize import unsharded
from .plugin import Plugin
from .plugins.single import SingleProcessPlugin
from .precision import MixedPrecision
from .wrappers import ModelWrapper, OptimizerWrapper

_STEP = re.compile(r"step_(\d+)$")


class Booster:
    """Front door of the engine; every call delegates to the plugin.

    plugin      the strategy (default: `SingleProcessPlugin()` on the best local device).
    precision   "fp32" | "bf16" | "fp16" | MixedPrecision; may instead be given to the plugin.
    activation_checkpointing, compile
                recompute / torch.compile the blocks the model's ParallelPlan names, applied by
                the plugin in `boost` at their place in `tabfm.parallel.parallelize`'s order.
    """

    def __init__(self, plugin: Plugin | None = None, precision: "str | MixedPrecision | None" = None, *,
                 activation_checkpointing: bool = False, compile: bool = False) -> None:
        self.plugin = plugin if plugin is not None else SingleProcessPlugin()
        if precision is not None:
            self.plugin.set_precision(precision)
        if activation_checkpointing or compile:
            self.plugin.set_block_options(activation_checkpointing=activation_checkpointing, compile=compile)

    @property
    def device(self) -> torch.device:
        return self.plugin.device

    @property
    def precision(self) -> MixedPrecision:
        return self.plugin.precision

    # --- setup -----------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        """Place/shard/wrap the training objects; returns them in the same order.

        Create the optimizer and scheduler on the plain model's parameters first; plugins that
        shard parameters rebuild the optimizer around the shards.
        """
        if isinstance(model, ModelWrapper):
            raise ValueError("model is already boosted")
        if isinstance(optimizer, OptimizerWrapper):
            raise ValueError("optimizer is already boosted")
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 0,
                           **kwargs: Any) -> DataLoader:
        """This data-parallel rank's DataLoader over `dataset` (see `Plugin.prepare_dataloader`)."""
        return self.plugin.prepare_dataloader(dataset, batch_size, shuffle=shuffle, seed=seed, **kwargs)

    # --- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """loss.backward(), with loss scaling and gradient reduction as the plugin requires."""
        self.plugin.backward(loss, optimizer)

    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> ContextManager[None]:
        """Wrap all but the last accumulation micro-batch: gradients accumulate without syncing."""
        return self.plugin.no_sync(model, optimizer)

    def clip_grad_norm_(self, optimizer: OptimizerWrapper, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip to global norm `max_norm` (over all shards/ranks); return the pre-clip norm."""
        return self.plugin.clip_grad_norm_(optimizer, max_norm, norm_type)

    def autocast(self) -> ContextManager[Any]:
        """Autocast for compute outside the boosted model (the model's forward already uses it)."""
        return self.plugin.autocast()

    @contextlib.contextmanager
    def evaluation(self, model: ModelWrapper) -> Iterator[nn.Module]:
        """A context giving the user's module to call on whole batches for evaluation (every rank
        must enter it together when the plugin's forward is collective), under the precision's
        autocast as in training (sharded plugins hold compute-dtype parameters). Plugins that cut
        the model's inputs (row-sequence parallel) suspend the cut meanwhile; for the others the
        module is simply `model.unwrap()`. FSDP units stay gathered meanwhile (`unsharded`), so
        methods other than forward (cached-context inference) see whole parameters."""
        hook = getattr(self.plugin, "evaluation", None)
        inner = hook(model) if hook is not None else contextlib.nullcontext(
            model.unwrap() if hasattr(model, "unwrap") else model)
        with inner as module, unsharded(module), self.plugin.autocast():
            yield module

    def execute_pipeline(self, data_iter: Iterator[Any], model: ModelWrapper, criterion: Callable,
                         optimizer: OptimizerWrapper | None = None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict[str, Any]:
        """Forward + backward of the next batch of `data_iter` through a pipeline-parallel model
        (`HybridParallelPlugin(pp_size=2)`), as gradient accumulation over the plugin's
        micro-batches; `optimizer.step()` stays the caller's. Returns {"loss", "metrics",
        "outputs"} (see the plugin)."""
        run = getattr(self.plugin, "execute_pipeline", None)
        if run is None:
            raise TypeError(f"{type(self.plugin).__name__} does not run pipeline parallelism: call the boosted model "
                            "and booster.backward() directly, or use HybridParallelPlugin(pp_size > 1)")
        return run(data_iter, model, criterion, optimizer, return_loss, return_outputs)

    # --- state -----------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        *,
        model: nn.Module | None = None,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any | None = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        keep_last: int | None = None,
        frozen: bool = True,
    ) -> Path:
        """Atomically write a checkpoint directory (e.g. `checkpoint_dir(root, step)`).

        `extra` holds trainer state (step, data-stream state, ...) as a nest of python values
        and tensors; RNG states are added automatically. The step recorded in the manifest is
        `step`, else `extra["step"]`, else the number in the directory name. With `keep_last`
        only the newest K complete checkpoints beside `path` survive. `frozen=False` leaves the model's
        frozen parameters out (the run that loads it rebuilds them, e.g. a LoRA run's base weights from
        its init); loading then checks that only those are missing.
        """
        path = Path(path)
        step = self._resolve_step(path, step, extra)
        meta = CheckpointMeta(step=step, plugin=self.plugin.name, precision=self.plugin.precision.dtype,
                              layout=self.plugin.layout(), frozen=frozen)
        return self.plugin.checkpoint_io.save_checkpoint(
            path, meta, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, extra=extra,
            keep_last=keep_last)

    def load_checkpoint(
        self,
        path: str | Path,
        *,
        model: nn.Module | None = None,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any | None = None,
        strict: bool = True,
        restore_rng: bool = True,
    ) -> dict[str, Any]:
        """Load into the (boosted) objects given; restore RNG states; return `extra`."""
        return self.plugin.checkpoint_io.load_checkpoint(
            path, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, strict=strict,
            restore_rng=restore_rng)

    def export(self, model: nn.Module, out_dir: str | Path, config: dict[str, Any],
               transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Path:
        """Write exactly `model.safetensors` + `config.json` to `out_dir` (atomically); `transform`
        maps the gathered full state dict to what is written (e.g. adapters merged into weights)."""
        return self.plugin.checkpoint_io.export(model, out_dir, config, transform)

    @staticmethod
    def _resolve_step(path: Path, step: int | None, extra: dict[str, Any] | None) -> int:
        if step is None and extra is not None and isinstance(extra.get("step"), int):
            step = extra["step"]
        if step is None and (m := _STEP.search(path.name)):
            step = int(m.group(1))
        if step is None:
            raise ValueError(f"cannot tell the step of checkpoint {path}: pass step= or extra={{'step': ...}}")
        return int(step)

    def __repr__(self) -> str:
        return f"Booster({self.plugin!r})"
