"""Trainer: the one step loop, written against tabfm.parallel.Booster so any plugin drops in.

It owns accumulation, clipping, the schedule, logging, periodic evaluation, atomic
checkpoints that resume exactly (model, optimizer, scheduler, data position, RNG) and
the wall-clock budget. Pretraining and fine-tuning differ only in what they hand it.

Under torchrun every rank runs this loop in lock step. Collective work (the step, evaluation
forwards, checkpoints, export) runs on every rank; logs, the progress bar and metrics files
are written by the main process only, with losses averaged and cell counts summed over ranks.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from tabfm.parallel import Booster, checkpoint_dir, seed_for_rank
from tabfm.parallel.checkpoint import read_manifest, remove_leftovers, resumable_checkpoint
from tabfm.errors import RunDiverged
from tabfm.train.metrics_log import MetricsLog

Evaluator = Callable[[nn.Module], dict[str, float]]


class Ranks:
    """This process's place in the process group, and the few collectives the loop needs
    (sums for logging, agreement on stopping, pickle-free gathers for resuming). In a single
    process every method is the identity and nothing is communicated."""

    def __init__(self, dp_world_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1
        if self.world % dp_world_size:
            raise ValueError(f"dp_world_size={dp_world_size} does not divide the world size {self.world}")
        # ranks of one data-parallel replica (tensor/pipeline peers) see the same batch: count it once
        self.replicas_per_dp = self.world // dp_world_size
        self.device = torch.device(device)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over all ranks."""
        if not self.active or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (so all ranks stop at the same step)."""
        return bool(self.sum([float(flag)])[0]) if self.active else flag

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-serialisable `obj`, by rank (sent as JSON bytes, never pickled)."""
        if not self.active:
            return [obj]
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
        longest = int(max(int(s) for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, padded)
        return [json.loads(bytes(o[: int(n)].cpu().tolist()).decode()) for o, n in zip(out, sizes)]


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


def _finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


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
        microbatches: int = 1,
        clip: float | None = 1.0,
        log_every: int = 10,
        ckpt_every: int = 250,
        keep_last: int = 3,
        max_minutes: float | None = None,
        evaluators: dict[str, Evaluator] | None = None,
        eval_every: int = 250,
        export_config: dict[str, Any] | None = None,
        progress: bool = True,
        seed: int | None = None,
        max_bad_steps: int = 10,
        bar: bool | None = None,
        save_frozen: bool = True,
    ) -> None:
        self.booster, self.model, self.optimizer, self.scheduler = booster, model, optimizer, scheduler
        self.criterion, self.data = criterion, data
        self.out_dir = Path(out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.steps, self.grad_accum, self.microbatches, self.clip = steps, grad_accum, microbatches, clip
        self.pipeline = booster.plugin.layout().get("pp", 1) > 1
        self.log_every, self.ckpt_every, self.keep_last = log_every, ckpt_every, keep_last
        self.save_frozen = save_frozen  # False: checkpoints hold what trains (the run rebuilds the frozen rest)
        self.max_minutes, self.eval_every = max_minutes, eval_every
        self.evaluators = evaluators or {}
        self.export_config = export_config
        self.seed = seed
        self.max_bad_steps, self.bad_steps, self.bad_in_row = max_bad_steps, 0, 0
        self.ranks = Ranks(booster.plugin.dp_world_size, booster.device)
        self.is_main = booster.plugin.is_main_process
        self.progress = progress and self.is_main
        # the bar: `bar` when given (tabfm --progress / --no-progress), else with progress in a terminal;
        # without it (outside a terminal a redrawn bar is noise in a log file) plain lines every log step
        self.show_bar = self.is_main and (self.progress and sys.stderr.isatty() if bar is None else bool(bar))
        self.plain_log = self.progress and not self.show_bar
        self.step = 0
        self.cells = 0  # global: summed over data-parallel ranks at every log step and checkpoint
        self._unsynced_cells = 0  # this rank's cells since the last sum
        self.resumed_from: Path | None = None
        self.log = MetricsLog(self.out_dir) if self.is_main else None

    def record(self, kind: str, values: dict[str, Any]) -> None:
        """One metrics record (main process only)."""
        if self.log is not None:
            self.log.log(self.step, kind, values)

    def _sync_cells(self) -> int:
        """Collective: add every rank's cells since the last call to the global count; return them."""
        local = self._unsynced_cells
        self._unsynced_cells = 0
        new = int(round(self.ranks.sum([float(local)])[0] / self.ranks.replicas_per_dp))
        self.cells += new
        return new

    # ------------------------------------------------------------------ state
    def resume(self) -> int:
        """Load the newest checkpoint under out_dir that passes its manifest's sizes and sha256s,
        if any; return the step reached.

        A damaged newer checkpoint is passed over with a warning naming what is wrong; a run
        directory whose checkpoints are all damaged is refused (ValueError: `--restart` starts
        over on purpose), never silently restarted. Leftovers of a killed save are removed and
        the metrics log loses the records after the resumed step, so no step is logged twice.
        Collective: the main process verifies and decides, every rank loads that checkpoint
        (one shared --out directory)."""
        chosen, problems = resumable_checkpoint(self.ckpt_root) if self.is_main else (None, [])
        if self.is_main:
            for leftover in remove_leftovers(self.ckpt_root):
                print(f"removed {leftover}: a checkpoint save that never finished", flush=True)
        name, problems = self.ranks.gather_json([None if chosen is None else chosen.name, problems])[0]
        if name is None and problems:
            raise ValueError(f"{self.ckpt_root} holds checkpoints but none is intact, so the run cannot resume: "
                             + "; ".join(problems) + ". Restore them, or pass --restart to start the run over")
        for problem in problems if self.is_main else ():
            warnings.warn(f"skipping damaged checkpoint {problem}; resuming from {name}", stacklevel=2)
        if name is None:  # a fresh start, or a run killed before its first checkpoint: its logged steps go
            if self.log is not None:
                self.log.truncate_after(0)
            return 0
        ckpt = self.ckpt_root / name
        try:
            read_manifest(ckpt)
        except ValueError as err:
            raise RuntimeError(f"rank {self.ranks.rank} cannot read the checkpoint the main process chose ({err}); "
                               "every rank must read the same --out directory (a shared filesystem across nodes)")
        extra = self.booster.load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.step, self.cells = int(extra["step"]), int(extra.get("cells", 0))
        self.data.load_state_dict(self._own_data_state(extra, ckpt))
        self.resumed_from = ckpt
        if self.log is not None:
            self.log.truncate_after(self.step)
        return self.step

    def _own_data_state(self, extra: dict[str, Any], ckpt: Path) -> dict[str, Any]:
        """This rank's data-stream state from a checkpoint written by any number of ranks.

        Same world size: each rank gets its own saved state. Another world size is fine when
        all ranks stood at the same state (a lock-step stream such as SynthLoader, whose tables
        depend on the rank, so new ranks draw tables nobody drew before): every rank takes it."""
        states = extra.get("data_ranks")
        if not isinstance(states, list) or not states:
            return extra["data"]  # written before per-rank data states were recorded
        if len(states) == self.ranks.world:
            return states[self.ranks.rank]
        if any(s != states[0] for s in states):
            raise ValueError(f"{ckpt} was written by {len(states)} ranks whose data streams stood at different "
                             f"states; it resumes only at world size {len(states)}, not {self.ranks.world}")
        return states[0]

    def save(self) -> Path:
        """Collective: checkpoint everything needed to resume exactly, each rank's data state included."""
        self._sync_cells()
        state = self.data.state_dict()
        extra = {"step": self.step, "cells": self.cells, "data": state, "data_ranks": self.ranks.gather_json(state)}
        return self.booster.save_checkpoint(
            checkpoint_dir(self.ckpt_root, self.step), model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.scheduler, extra=extra, keep_last=self.keep_last, frozen=self.save_frozen,
        )

    # -------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Run the evaluators on the user's model (`booster.evaluation`: whole tables on every
        rank) on every rank; the main process logs.

        Every rank runs them because with sharded parameters (FSDP, ZeRO-2, tensor parallel)
        a forward is a collective; the evaluation data and the eval-mode model are
        deterministic, so every rank computes the same numbers."""
        results: dict[str, float] = {}
        with self.booster.evaluation(self.model) as module:
            was_training = module.training
            module.eval()
            try:
                # the evaluators draw no randomness from the training stream's generators
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    for name, fn in self.evaluators.items():
                        results.update({f"{name}/{k}": v for k, v in fn(module).items()})
            finally:
                module.train(was_training)
        if results:
            self.record("eval", results)
            if self.progress:
                shown = ", ".join(f"{k} {v:.4f}" for k, v in results.items()
                                  if k.endswith(("/loss", "/mean_auc", "/cat_acc")) or k == "holdout/score")
                tqdm.write(f"step {self.step} eval: {shown or ', '.join(f'{k} {v:.4f}' for k, v in results.items())}")
        return results

    # -------------------------------------------------------------------- loop
    def _micro_step(self, batch: Any, last: bool) -> dict[str, float]:
        """Forward and backward of one accumulation micro-batch: through the pipeline's stages, or
        as `microbatches` equal parts of whole tables in turn; returns the mean of the parts'
        metrics (as the pipeline does)."""
        if self.pipeline:
            sync = contextlib.nullcontext() if last else self.booster.no_sync(self.model, self.optimizer)
            with sync:
                result = self.booster.execute_pipeline(iter([batch]), self.model, self.criterion, self.optimizer)
            return {**result["metrics"], "loss": float(result["loss"])}
        m = self.microbatches
        if len(batch) % m:
            raise ValueError(f"microbatches={m} cuts each batch into equal parts of whole tables, but this batch holds "
                             f"{len(batch)} tables; the data must yield a multiple of {m}")
        size = len(batch) // m
        parts: dict[str, list[float]] = {}
        for j in range(m):
            part = batch[j * size:(j + 1) * size] if m > 1 else batch
            final = last and j == m - 1
            sync = contextlib.nullcontext() if final else self.booster.no_sync(self.model, self.optimizer)
            with sync:
                output = self.model(part)
                loss, metrics = self.criterion(output, part)
                self.booster.backward(loss / (self.grad_accum * m), self.optimizer)
            for k, v in {**metrics, "loss": float(loss.detach())}.items():
                parts.setdefault(k, []).append(float(v))
        return {k: _finite_mean(v) for k, v in parts.items()}

    def _non_finite(self, loss: float, grad_norm: float) -> bool:
        """Collective: whether any rank's loss or the global gradient norm is NaN or infinite; then
        the step is skipped (gradients dropped, weights and schedule untouched), counted and logged.
        `max_bad_steps` in a row stop the run (RunDiverged) after a checkpoint of the weights from
        before the divergence. Under fp16 the loss scaler owns infinite gradients (it skips the
        step and lowers the scale), so only the loss counts there."""
        fp16 = self.booster.precision.dtype == "fp16"
        bad = self.ranks.any(not math.isfinite(loss) or (not fp16 and not math.isfinite(grad_norm)))
        if not bad:
            self.bad_in_row = 0
            return False
        self.optimizer.zero_grad()
        self.bad_steps += 1
        self.bad_in_row += 1
        self.record("skipped", {"loss": loss, "grad_norm": grad_norm, "in_a_row": self.bad_in_row,
                                "skipped_steps": self.bad_steps})
        if self.progress:
            tqdm.write(f"step {self.step + 1}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not finite, step skipped "
                       f"({self.bad_in_row} in a row, {self.bad_steps} in all)")
        if self.bad_in_row >= self.max_bad_steps:
            ckpt = self.save()
            raise RunDiverged(f"{self.bad_in_row} steps in a row had a non-finite loss or gradient norm (last: loss "
                              f"{loss:.4g}, gradient norm {grad_norm:.4g}) after step {self.step}; stopped. {ckpt} holds "
                              "the weights from before; resume from it with a lower --lr, or raise --max-bad-steps")
        return True

    def _seed_micro_batch(self, i: int) -> None:
        """Seed torch's RNG (the model's random column identities) from (seed, step, global
        micro-batch index i * dp + dp_rank): a step's randomness depends on the global batch, not on
        how ranks and accumulation split it, and a resumed run draws what the uninterrupted one did."""
        if self.seed is not None:
            plugin = self.booster.plugin
            index = i * plugin.dp_world_size + plugin.dp_rank
            torch.manual_seed(seed_for_rank(seed_for_rank(self.seed, self.step), index))

    def _window_means(self, window: dict[str, list[float]]) -> dict[str, float]:
        """Collective: mean of each metric over the finite values of all micro-batches on all ranks
        (a micro-batch with no cells of a kind reports NaN for it). Every rank must pass the same keys."""
        keys = sorted(window)
        sums = [sum(v for v in window[k] if math.isfinite(v)) for k in keys]
        counts = [float(sum(1 for v in window[k] if math.isfinite(v))) for k in keys]
        total = self.ranks.sum(sums + counts)
        n = len(keys)
        return {k: total[i] / total[n + i] if total[n + i] else float("nan") for i, k in enumerate(keys)}

    def fit(self) -> TrainResult:
        start = time.perf_counter()
        deadline = None if self.max_minutes is None else start + 60.0 * self.max_minutes
        batches = iter(self.data)
        window: dict[str, list[float]] = {}
        window_cells, window_t0, window_wait = 0, time.perf_counter(), 0.0
        last: dict[str, float] = {}
        evals: dict[str, float] = {}
        stopped = "steps"
        saved_at = -1
        bar = tqdm(total=self.steps, initial=self.step, disable=not self.show_bar, desc="train",
                   dynamic_ncols=True)
        self.model.train()
        while self.step < self.steps:
            if deadline is not None and self.ranks.any(time.perf_counter() >= deadline):
                stopped = "time"
                break
            step_loss = 0.0
            for i in range(self.grad_accum):
                self._seed_micro_batch(i)
                t0 = time.perf_counter()
                batch = next(batches).to(self.booster.device)
                window_wait += time.perf_counter() - t0  # waiting for the data (loader, host-to-device copy)
                cells = batch.num_cells
                for k, v in self._micro_step(batch, last=i == self.grad_accum - 1).items():
                    window.setdefault(k, []).append(v)
                    step_loss += v if k == "loss" else 0.0
                self._unsynced_cells += cells
            grad_norm = self.booster.clip_grad_norm_(self.optimizer, self.clip if self.clip else math.inf)
            if self._non_finite(step_loss, float(grad_norm)):
                continue
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1
            bar.update(1)
            if self.step % self.log_every == 0 or self.step == self.steps:
                window_cells += self._sync_cells()
                dt = max(time.perf_counter() - window_t0, 1e-9)
                last = self._window_means(window)
                last.update(lr=self.optimizer.param_groups[0]["lr"], grad_norm=float(grad_norm),
                            cells_per_s=window_cells / dt, data_wait=min(1.0, window_wait / dt),
                            elapsed_s=time.perf_counter() - start)
                self.record("train", last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", cells_s=f"{last['cells_per_s']:.0f}",
                                data=f"{last['data_wait']:.0%}")
                if self.plain_log:
                    print(f"step {self.step}/{self.steps}  loss {last['loss']:.4f}  lr {last['lr']:.3g}  "
                          f"cells/s {last['cells_per_s']:.0f}  data {last['data_wait']:.0%}  "
                          f"elapsed {last['elapsed_s'] / 60:.1f} min", flush=True)
                window, window_cells, window_t0, window_wait = {}, 0, time.perf_counter(), 0.0
            if self.evaluators and self.step % self.eval_every == 0:
                evals = self.evaluate()
            if self.step % self.ckpt_every == 0:
                window_cells += self._sync_cells()  # save() sums them; keep the window's rate right
                self.save()
                saved_at = self.step
        bar.close()
        ckpt = self.save() if saved_at != self.step else checkpoint_dir(self.ckpt_root, self.step)
        if self.evaluators and (not evals or self.step % self.eval_every != 0):
            evals = self.evaluate()
        export = None
        if self.export_config is not None:
            export = self.booster.export(self.model, self.out_dir / "export", config=self.export_config)
        if self.log is not None:
            self.log.close()
        return TrainResult(self.step, stopped, time.perf_counter() - start, self.cells, last, evals, ckpt, export)
