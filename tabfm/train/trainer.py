"""Trainer: the one step loop, written against parallel.Booster so any plugin drops in.

It owns accumulation, clipping, the schedule, logging, periodic evaluation, atomic
checkpoints that resume exactly (model, optimizer, scheduler, data position, RNG) and
the wall-clock budget. Pretraining and fine-tuning differ only in what they hand it.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from parallel import Booster, checkpoint_dir, latest_checkpoint
from tabfm.train.metrics_log import MetricsLog

Evaluator = Callable[[nn.Module], dict[str, float]]


def _nanmean(values: list[float]) -> float:
    """Mean over the finite entries (a micro-batch with no cells of a kind reports NaN for it)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


class ResumableData(Protocol):
    """An iterable of batches whose position can be saved and restored."""

    def __iter__(self): ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainResult:
    step: int
    stopped: str  # "steps" | "time"
    wall_s: float
    cells: int
    last: dict[str, float] = field(default_factory=dict)
    evals: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    export: Path | None = None


class Trainer:
    """Runs optimizer steps until `steps` (global) or `max_minutes` (this invocation)."""

    def __init__(
        self,
        booster: Booster,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        criterion: Callable[[Any, Any], tuple[torch.Tensor, dict[str, float]]],
        data: ResumableData,
        out_dir: str | Path,
        *,
        steps: int,
        grad_accum: int = 1,
        clip: float | None = 1.0,
        log_every: int = 10,
        ckpt_every: int = 250,
        keep_last: int = 3,
        max_minutes: float | None = None,
        evaluators: dict[str, Evaluator] | None = None,
        eval_every: int = 250,
        export_config: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> None:
        self.booster, self.model, self.optimizer, self.scheduler = booster, model, optimizer, scheduler
        self.criterion, self.data = criterion, data
        self.out_dir = Path(out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.steps, self.grad_accum, self.clip = steps, grad_accum, clip
        self.log_every, self.ckpt_every, self.keep_last = log_every, ckpt_every, keep_last
        self.max_minutes, self.eval_every = max_minutes, eval_every
        self.evaluators = evaluators or {}
        self.export_config = export_config
        self.progress = progress
        self.step = 0
        self.cells = 0
        self.log = MetricsLog(self.out_dir)

    # ------------------------------------------------------------------ state
    def resume(self) -> int:
        """Load the newest complete checkpoint under out_dir, if any; return the step reached."""
        ckpt = latest_checkpoint(self.ckpt_root)
        if ckpt is None:
            return 0
        extra = self.booster.load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.step, self.cells = int(extra["step"]), int(extra.get("cells", 0))
        self.data.load_state_dict(extra["data"])
        return self.step

    def save(self) -> Path:
        extra = {"step": self.step, "cells": self.cells, "data": self.data.state_dict()}
        return self.booster.save_checkpoint(
            checkpoint_dir(self.ckpt_root, self.step), model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.scheduler, extra=extra, keep_last=self.keep_last,
        )

    # -------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        module = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        was_training = module.training
        module.eval()
        results: dict[str, float] = {}
        try:
            # the evaluators draw no randomness from the training stream's generators
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for name, fn in self.evaluators.items():
                    results.update({f"{name}/{k}": v for k, v in fn(module).items()})
        finally:
            module.train(was_training)
        if results:
            self.log.log(self.step, "eval", results)
        return results

    # -------------------------------------------------------------------- loop
    def _micro_step(self, batch: Any, last: bool) -> dict[str, float]:
        sync = contextlib.nullcontext() if last else self.booster.no_sync(self.model, self.optimizer)
        with sync:
            output = self.model(batch)
            loss, metrics = self.criterion(output, batch)
            self.booster.backward(loss / self.grad_accum, self.optimizer)
        return {"loss": float(loss.detach()), **metrics}

    def fit(self) -> TrainResult:
        start = time.perf_counter()
        deadline = None if self.max_minutes is None else start + 60.0 * self.max_minutes
        batches = iter(self.data)
        window: dict[str, list[float]] = {}
        window_cells, window_t0 = 0, time.perf_counter()
        last: dict[str, float] = {}
        evals: dict[str, float] = {}
        stopped = "steps"
        saved_at = -1
        bar = tqdm(total=self.steps, initial=self.step, disable=not self.progress, desc="train", dynamic_ncols=True)
        self.model.train()
        while self.step < self.steps:
            if deadline is not None and time.perf_counter() >= deadline:
                stopped = "time"
                break
            for i in range(self.grad_accum):
                batch = next(batches).to(self.booster.device)
                cells = batch.num_cells
                for k, v in self._micro_step(batch, last=i == self.grad_accum - 1).items():
                    window.setdefault(k, []).append(v)
                self.cells += cells
                window_cells += cells
            grad_norm = self.booster.clip_grad_norm_(self.optimizer, self.clip if self.clip else math.inf)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1
            bar.update(1)
            if self.step % self.log_every == 0 or self.step == self.steps:
                dt = max(time.perf_counter() - window_t0, 1e-9)
                last = {k: _nanmean(v) for k, v in window.items()}
                last.update(lr=self.optimizer.param_groups[0]["lr"], grad_norm=float(grad_norm),
                            cells_per_s=window_cells / dt, elapsed_s=time.perf_counter() - start)
                self.log.log(self.step, "train", last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", cells_s=f"{last['cells_per_s']:.0f}")
                window, window_cells, window_t0 = {}, 0, time.perf_counter()
            if self.evaluators and self.step % self.eval_every == 0:
                evals = self.evaluate()
            if self.step % self.ckpt_every == 0:
                self.save()
                saved_at = self.step
        bar.close()
        ckpt = self.save() if saved_at != self.step else checkpoint_dir(self.ckpt_root, self.step)
        if self.evaluators and (not evals or self.step % self.eval_every != 0):
            evals = self.evaluate()
        export = None
        if self.export_config is not None:
            export = self.booster.export(self.model, self.out_dir / "export", config=self.export_config)
        self.log.close()
        return TrainResult(self.step, stopped, time.perf_counter() - start, self.cells, last, evals, ckpt, export)
