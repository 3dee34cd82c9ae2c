"""Fine-tuning on the user's own tables: episodes of their rows, scored on rows it never trains on.

`finetune(cfg, out_dir)` starts from exported weights (the shipped "tabfm-tiny-cf" by default, or
any export), reads the tables `cfg.data` names (a CSV, a Parquet file, a directory or a table
store: anything `tabfm.data.readers.read_tables` accepts), holds out a share of each table's rows
(stratified by class for classification), and trains on episodes cut from the remaining rows
(`tabfm.data.table_episodes`): random context / query splits predicting the target, and random cell
masking (imputation). Optionally a share of the batches replays, to limit forgetting: the synthetic prior
stream, or episodes of earlier tables (`replay_data`, posed by the same sampler), or both.
With `holdout_tables` K, K whole tables of `data` (chosen from the seed) are never trained on:
they are scored in context on their own held-out rows beside the training tables, a measure of
what fine-tuning does to tables it has not seen.

Held-out rows are scored in context the way the estimators will use the result
(`TabFMClassifier` / `TabFMRegressor` with the training rows as context): before training and
every `eval_every` steps. Every improvement of the held-out score (log-loss for classification,
RMSE / std(y) for regression, averaged over tables) exports the weights to OUT/export; after
`patience` evaluations without one, training stops. The engine is the pretraining one: the
same plugins (`build_plugin`), the same `Trainer` (logs, checkpoints, exact resume; rerunning
the same call resumes from OUT/checkpoints). The early-stopping record travels inside the data
state of every checkpoint, so it resumes with the weights it belongs to.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import torch
from torch import nn

from tabfm.data.encode import encode_frame
from tabfm.data.readers import read_tables
from tabfm.data.table_episodes import (
    CATEGORICAL_MODES, CLASSIFICATION, IMPUTATION, PREDICTION_TASKS, EpisodeConfig, EpisodeInfo, EpisodeTable,
    TableEpisodeSampler, fold_split, holdout_split, infer_task,
)
from tabfm.parallel import Booster, Plugin, latest_checkpoint
from tabfm.parallel.launch import barrier
from tabfm.parallel.state_io import read_json, write_json
from tabfm.synth.stream import StreamConfig, SynthStream
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.model.lora import DEFAULT_TARGETS, LoraConfig, add_adapters, adapter_parameters, merge_adapters
from tabfm.train.config import FINETUNE_PLUGINS, PRECISIONS, resolve_precision
from tabfm.train.optim import OPTIMIZERS, build_optimizer, warmup_cosine
from tabfm.train.pretrain import TRAIN_CONFIG, announce_resume, build_plugin, export_config, start_over, warm_start
from tabfm.train.trainer import Trainer, TrainResult
from tabfm.weights import DEFAULT_MODEL

SUMMARY_FILE = "finetune_summary.json"
FOLD_STEPS, FOLD_LOSSES = "steps", "holdout_losses.jsonl"  # a fold run's evaluated weights and per-row losses
HOLDOUT_FILE = "holdout_rows.json"
RUN_KEYS = ("target", "task", "init", "seed", "holdout", "holdout_tables", "folds", "fold", "optimizer", "categorical",
            "lora")  # must match to resume
_RUN_DEFAULTS = {"holdout_tables": 0, "folds": 1, "fold": None}  # what a record written before a key existed meant by it
_REPLAY = 3  # spawn-key domain of the per-position replay draw
_HOLDOUT_TABLES = 4  # spawn-key domain of the choice of held-out tables
NO_STREAM = "none"  # replay_stream: no synthetic replay
FULL_LR, LORA_LR = 1e-4, 1e-3  # the default peak learning rates (FinetuneConfig.peak_lr)


# --------------------------------------------------------------------------- configuration

@dataclass
class FinetuneConfig:
    """A fine-tuning run on real tables. The command line overrides any field.

    data           what to read (CSV, Parquet, directory or store); `finetune(data=...)` may pass a DataFrame
    target, task   target column (a store's header may supply it) and "classification" | "regression"
                   (None: inferred, as `tabfm predict` does)
    init           starting weights: a shipped model name or an export directory (default tabfm-tiny-cf,
                   whose estimator defaults show it exactly what its training episodes carry)
    steps          optimizer steps of the whole run (and of the cosine schedule); max_minutes: this invocation
    holdout        share of each table's rows held out for evaluation (stratified for classification);
                   they never enter a training episode
    folds          K >= 2: cross-fitted fine-tuning: K runs (OUT/fold-k), fold k's rows held out in run k (a
                   stratified K-fold split: `holdout` is then 1/K), each for max_minutes / K; the held-out rows'
                   losses pooled over the folds (every row scored once) pick the step, tested as `significance`
                   says on all the rows instead of a fifth, and OUT/export is the average of the K runs'
                   weights at that step (or the starting weights). 1: one run, `holdout` held out
    fold           set by the K-fold run for each of its runs: the fold held out (None: not a fold run)
    holdout_tables K >= 1: K whole tables of `data` (chosen from the seed) are never trained on; they are
                   scored in context on their own held-out rows (`holdout_tables/...`), not for early stopping
    replay         share of batches replayed against forgetting (drawn per position from the seed, the same
                   on every rank): from the synthetic prior stream `replay_stream`, and / or from episodes of
                   the tables `replay_data` names (paths read as `data` is; a store's headers supply each
                   table's target, --target the others'; their training rows only, split as `holdout` splits)
    replay_stream  the prior's StreamConfig preset, or "none"; None: "pretrain" without `replay_data`,
                   "none" with it. A preset together with `replay_data` replays both, half the replayed
                   batches each (a second draw of the same position)
    report         other tables (read as `data` is, same target) scored in context on their own held-out rows
                   with the starting weights and with the exported ones after the run: forgetting, measured
    min_rows .. categorical   episode shapes and mix (see tabfm.data.table_episodes.EpisodeConfig)
    eval_every     steps between held-out evaluations; patience: evaluations without an improvement of
                   more than min_delta before stopping (0: never stop early)
    significance   an evaluation improves on the best (and is exported) only when its held-out rows' losses
                   are also lower than the starting weights' by more than `significance` standard errors of
                   the paired per-row differences (log-loss per row; squared error / var(y) for regression):
                   a step that fits the holdout's noise is not exported. 0: any improvement beyond min_delta
    eval_estimators, eval_rows, eval_context_rows   the evaluation's ensemble size, held-out rows scored per
                   table (a fixed random subset beyond), and context rows (the estimators' max_context_rows)
    plugin         engine plugin: single | ddp | zero | fsdp | hybrid (the distributed ones under torchrun);
                   zero_stage: zero 1 (default) or 2, hybrid 2 or 3 (default replicated); tp, sp: hybrid's
                   tensor- and row-sequence-parallel ranks per table
    lora_rank      None: full fine-tuning; r: low-rank adapters of rank r on `lora_targets` (the blocks'
                   attention and MLP projections by default), everything else frozen, merged into the
                   weights at export (tabfm.model.lora); lora_alpha scales the update by alpha / r (None: r).
                   Every plugin trains them: ZeRO and FSDP shard adapters as they shard weights, tp splits
                   each adapter beside its weight (B's rows of a colwise layer, A's columns of a rowwise one)
    """

    data: str | None = None
    target: str | None = None
    task: str | None = None
    init: str = "tabfm-tiny-cf"
    steps: int = 300
    max_minutes: float | None = None
    threads: int | None = None
    optimizer: str = "adamw"
    lr: float | None = None  # None: FULL_LR, or LORA_LR with adapters (see peak_lr)
    muon_lr: float = 0.002
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    precision: str = "auto"
    grad_accum: int = 1
    seed: int = 0
    holdout: float = 0.2
    holdout_tables: int = 0
    folds: int = 1
    fold: int | None = None
    replay: float = 0.0
    replay_stream: str | None = None
    replay_data: tuple[str, ...] | None = None
    report: str | None = None
    min_rows: int = 32
    max_rows: int = 512
    cells_per_batch: int = 16384
    max_batch: int = 32
    max_columns: int = 100
    context_fraction: tuple[float, float] = (0.3, 0.9)
    mask_fraction: tuple[float, float] = (0.05, 0.3)
    imputation: float = 0.2
    categorical: str = "ordinal"
    eval_every: int = 25
    patience: int = 4
    min_delta: float = 1e-4
    significance: float = 2.0
    eval_estimators: int = 4
    eval_rows: int = 2048
    eval_context_rows: int = 2048
    log_every: int = 5
    ckpt_every: int = 25
    keep_last: int = 2
    device: str | None = None
    plugin: str = "single"
    zero_stage: int | None = None
    tp: int = 1
    sp: int = 1
    pp = 1  # not fields: fine-tuning runs no pipeline stages and no expert parallelism (build_plugin reads these)
    microbatches = 1
    ep = 1
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS

    PRESETS = {
        # a few hundred steps of ~16k cells: minutes on 2 CPU cores for the tiny model
        "default": {},
        # tables larger than the estimators' context: more steps, episodes as long as that context (the
        # default's 512-row episodes found nothing on such tables), sparser evaluation on 512 held-out rows
        "long": dict(steps=2000, eval_every=100, ckpt_every=100, warmup_steps=50, patience=5, max_rows=2048,
                     eval_rows=512),
        # seconds: tests and a first look
        "smoke": dict(steps=8, warmup_steps=1, eval_every=4, ckpt_every=4, log_every=2, min_rows=8, max_rows=64,
                      cells_per_batch=1024, max_batch=8, eval_estimators=1, precision="fp32"),
    }

    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> "FinetuneConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown FinetuneConfig preset {name!r}; choose from {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "FinetuneConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replay_prior(self) -> str | None:
        """The StreamConfig preset synthetic replay batches come from (None: no synthetic replay)."""
        if self.replay <= 0:
            return None
        stream = self.replay_stream
        if stream is None:  # the default: the prior without replay tables, none with them
            stream = NO_STREAM if self.replay_data else "pretrain"
        return None if stream == NO_STREAM else stream

    @property
    def peak_lr(self) -> float:
        """`lr`, or its default: 1e-4 for full fine-tuning, 1e-3 for adapters, whose B starts at zero and
        which at 1e-4 barely moved in the measurements (BENCHMARKS.md, "LoRA at lr 1e-3")."""
        if self.lr is not None:
            return self.lr
        return FULL_LR if self.lora_rank is None else LORA_LR

    def lora(self) -> LoraConfig | None:
        """The adapters this run trains (None: full fine-tuning)."""
        if self.lora_rank is None:
            return None
        return LoraConfig(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))

    def episode_config(self, max_classes: int, context_features: str = "none") -> EpisodeConfig:
        """The episode settings, for a model whose categorical head scores `max_classes` codes and
        that reads `context_features` (its ModelConfig's: fine-tuning trains on what inference shows,
        so half the regression episodes ask for the ridge residual, as half the regressor's members
        do by default, linear_residual="mixed"); rows in multiples
        of sp (row-sequence parallel ranks split them evenly)."""
        return EpisodeConfig(min_rows=self.min_rows, max_rows=self.max_rows, cells_per_batch=self.cells_per_batch,
                             max_batch=self.max_batch, max_columns=self.max_columns, max_classes=max_classes,
                             context_fraction=self.context_fraction, mask_fraction=self.mask_fraction,
                             imputation=self.imputation, categorical=self.categorical,
                             context_features=context_features, row_multiple=self.sp,
                             residual_targets=0.5)  # TabFMRegressor's mixed members: residual and target

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"FinetuneConfig.{name} = {getattr(self, name)!r}: {what}")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("steps", "grad_accum", "log_every", "eval_every", "ckpt_every", "keep_last", "eval_estimators",
                     "eval_rows", "eval_context_rows"):
            need(integer(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        need(integer(self.folds) and self.folds >= 1, "folds", "must be an integer >= 1 (1: one held-out share; "
             "K >= 2: K-fold cross-fitting)")
        need(self.fold is None or (integer(self.fold) and self.folds >= 2 and 0 <= self.fold < self.folds), "fold",
             f"must be None or an integer in [0, folds) with folds >= 2 (folds = {self.folds!r})")
        need(self.folds == 1 or self.holdout_tables == 0, "folds",
             "K-fold fine-tuning holds out rows of every table; with holdout_tables (--holdout-tables) use folds = 1")
        for name in ("warmup_steps", "seed", "patience", "holdout_tables"):
            need(integer(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        need(self.task is None or self.task in PREDICTION_TASKS, "task", f"must be one of {PREDICTION_TASKS} or None")
        need(isinstance(self.init, str) and bool(self.init), "init", "must name a shipped model or an export directory")
        need(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        need(self.precision in PRECISIONS, "precision", f"must be one of {', '.join(PRECISIONS)}")
        need(self.plugin in FINETUNE_PLUGINS, "plugin", f"must be one of {', '.join(FINETUNE_PLUGINS)}")
        stages = {"zero": (1, 2), "hybrid": (2, 3)}.get(self.plugin, ())
        need(self.zero_stage is None or self.zero_stage in stages, "zero_stage",
             f"with plugin {self.plugin!r} must be None" + (f" or one of {stages}" if stages else ""))
        need(self.plugin == "hybrid" or (self.tp, self.sp) == (1, 1), "tp", "tp and sp apply to plugin 'hybrid'")
        need(integer(self.tp) and self.tp >= 1 and integer(self.sp) and self.sp >= 1, "tp", "tp and sp must be integers >= 1")
        need(self.categorical in CATEGORICAL_MODES, "categorical", f"must be one of {CATEGORICAL_MODES}")
        need((self.lr is None or self.lr > 0) and self.muon_lr > 0, "lr", "learning rates must be > 0")
        need(0.0 < self.holdout < 1.0, "holdout", "must be a fraction in (0, 1): fine-tuning is judged on held-out rows")
        need(0.0 <= self.replay < 1.0, "replay", "must be a fraction in [0, 1)")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.clip > 0, "clip", "must be > 0")
        need(self.min_delta >= 0, "min_delta", "must be >= 0")
        need(self.significance >= 0, "significance", "must be >= 0 (standard errors; 0: no test)")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes", "must be > 0")
        need(self.threads is None or (integer(self.threads) and self.threads >= 1), "threads", "must be None or an integer >= 1")
        if self.replay_stream not in (None, NO_STREAM):
            try:
                StreamConfig.preset(self.replay_stream)
            except ValueError as err:
                raise ValueError(f"FinetuneConfig.replay_stream = {self.replay_stream!r}: {err} "
                                 f"(or {NO_STREAM!r})") from None
        if isinstance(self.replay_data, (str, os.PathLike)):
            self.replay_data = (os.fspath(self.replay_data),)
        elif self.replay_data is not None:
            need(isinstance(self.replay_data, (list, tuple)) and len(self.replay_data) > 0
                 and all(isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in self.replay_data),
                 "replay_data", "must be None, a path or a non-empty list of paths")
            self.replay_data = tuple(os.fspath(p) for p in self.replay_data)
        need(self.replay_data is None or self.replay > 0, "replay_data",
             "needs replay > 0 (--replay F: the share of batches replayed from these tables)")
        need(self.replay <= 0 or self.replay_prior() is not None or self.replay_data is not None, "replay_stream",
             f"with replay = {self.replay!r} leaves nothing to replay: give replay_data (--replay-data) "
             "or a stream preset")
        need(self.lora_rank is not None or self.lora_alpha is None, "lora_alpha", "needs lora_rank (--lora-rank)")
        try:
            self.lora()
        except ValueError as err:
            raise ValueError(f"FinetuneConfig: {err}") from None
        try:
            self.episode_config(max_classes=10)
        except ValueError as err:
            raise ValueError(f"FinetuneConfig: {err}".replace("EpisodeConfig.", "")) from None


# --------------------------------------------------------------------------- the user's tables

@dataclass
class FinetuneTable:
    """One user table, split: training rows (as episodes) and held-out rows (for evaluation only)."""

    name: str
    source: str
    target: str
    task: str
    classes: list | None               # classification: the labels, code i <-> classes[i]
    train_rows: np.ndarray             # row positions in the table as read (rows without a target excluded)
    holdout_rows: np.ndarray
    eval_rows: np.ndarray              # the held-out rows scored (all, or a fixed subset of eval_rows)
    train_X: pd.DataFrame
    train_y: np.ndarray
    eval_X: pd.DataFrame
    eval_y: np.ndarray
    episodes: EpisodeTable
    dropped: int                       # rows without a target value (used nowhere)
    fingerprint: str


def _fingerprint(frame: pd.DataFrame) -> str:
    """A short content hash of a table (shape, columns and cells), so a resumed run sees the same data."""
    h = hashlib.sha1(json.dumps([list(map(str, frame.columns)), list(frame.shape)]).encode())
    try:
        h.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    except TypeError:  # unhashable cells (lists, dicts): fall back to their text
        h.update(frame.astype(str).to_csv(index=False).encode())
    return h.hexdigest()[:16]


def _prepare(t: Any, cfg: FinetuneConfig) -> FinetuneTable:
    """Split one SourceTable into training episodes and held-out evaluation rows; errors name the file."""
    frame = t.frame.reset_index(drop=True)
    if t.target is None:
        names = ", ".join(map(str, frame.columns[:40])) + (f", ... ({frame.shape[1] - 40} more)" if frame.shape[1] > 40 else "")
        raise ValueError(f"{t.source}: no target column given; pass --target (columns: {names})")
    y_all = frame[t.target]
    known = np.flatnonzero(y_all.notna().to_numpy())
    if known.size == 0:
        raise ValueError(f"{t.source}: target column {t.target!r} has no values (all {len(frame)} missing)")
    y = y_all.iloc[known]
    task = t.task or infer_task(y)
    if task not in PREDICTION_TASKS:
        raise ValueError(f"{t.source}: task {task!r}: fine-tuning needs a classification or regression target")
    features = frame.drop(columns=[t.target])
    if features.shape[1] == 0:
        raise ValueError(f"{t.source}: no feature columns besides the target {t.target!r}")

    classes, strata = None, None
    if task == CLASSIFICATION:
        try:
            labels, codes = np.unique(y.to_numpy(), return_inverse=True)
        except TypeError:
            raise ValueError(f"{t.source}: target column {t.target!r} mixes label types that cannot be sorted; "
                             "cast it to one type") from None
        if len(labels) < 2:
            raise ValueError(f"{t.source}: target column {t.target!r} has a single class {labels[0]!r}: nothing to learn")
        values, classes, strata = codes.astype(np.float64), labels.tolist(), codes
    else:
        numeric = pd.to_numeric(y, errors="coerce")
        if numeric.isna().any():
            bad = y[numeric.isna()].iloc[0]
            raise ValueError(f"{t.source}: regression target {t.target!r} holds {bad!r}, which is not a number "
                             "(use --task classification for labels)")
        values = numeric.to_numpy(dtype=np.float64)
        if not np.isfinite(values).all() or np.abs(values).max() > np.finfo(np.float32).max:
            raise ValueError(f"{t.source}: regression target {t.target!r} holds infinite or huge values")

    stream = zlib.crc32(t.name.encode())
    if cfg.fold is not None:
        if len(known) < 2 * cfg.folds:
            raise ValueError(f"{t.source}: {len(known)} rows with a target are too few for {cfg.folds} folds "
                             f"(--folds): at least {2 * cfg.folds} are needed")
        train_i, hold_i = fold_split(len(known), cfg.folds, cfg.fold, cfg.seed, strata, stream=stream)
    else:
        train_i, hold_i = holdout_split(len(known), cfg.holdout, cfg.seed, strata, stream=stream)
    if len(train_i) < 2 or len(hold_i) < 1:
        share = f"fold {cfg.fold} of {cfg.folds}" if cfg.fold is not None else f"{cfg.holdout:.0%}"
        raise ValueError(f"{t.source}: {len(known)} rows with a target are too few to hold out {share} "
                         "of them and train on the rest")
    eval_i = hold_i
    if len(hold_i) > cfg.eval_rows:
        rng = np.random.default_rng([cfg.seed, zlib.crc32(t.name.encode()), 1])
        eval_i = np.sort(rng.choice(hold_i, cfg.eval_rows, replace=False))
    train_X = features.iloc[known[train_i]].reset_index(drop=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            episodes, _ = EpisodeTable.encode(t.name, train_X, values[train_i], task, known[train_i],
                                              n_classes=len(classes) if classes else None)
    except ValueError as err:
        raise ValueError(f"{t.source}: {err}") from None
    raw_y = y.to_numpy()
    return FinetuneTable(
        name=t.name, source=t.source, target=t.target, task=task, classes=classes,
        train_rows=known[train_i], holdout_rows=known[hold_i], eval_rows=known[eval_i],
        train_X=train_X, train_y=raw_y[train_i] if task == CLASSIFICATION else values[train_i],
        eval_X=features.iloc[known[eval_i]].reset_index(drop=True),
        eval_y=raw_y[eval_i] if task == CLASSIFICATION else values[eval_i],
        episodes=episodes, dropped=int(len(frame) - known.size), fingerprint=_fingerprint(frame),
    )


def load_tables(source: Any, cfg: FinetuneConfig) -> list[FinetuneTable]:
    """Read every table of `source` and split it for fine-tuning (see `FinetuneConfig`)."""
    return [_prepare(t, cfg) for t in read_tables(source, target=cfg.target, task=cfg.task)]


def _describe(source: Any, cfg: FinetuneConfig) -> str:
    """What --data names, for records and messages."""
    if cfg.data is not None:
        return str(cfg.data)
    return str(source) if isinstance(source, (str, os.PathLike)) else f"<{type(source).__name__}>"


def holdout_table_names(names: list[str], k: int, seed: int) -> list[str]:
    """The K tables held out whole: a seeded draw over the sorted names (so the order in which a
    directory or a list yields them does not matter), returned sorted."""
    order = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_HOLDOUT_TABLES,))).permutation(len(names))
    ranked = sorted(names)
    return sorted(ranked[i] for i in order[:k])


def split_tables(tables: list[FinetuneTable], cfg: FinetuneConfig, data: str = "--data"
                 ) -> tuple[list[FinetuneTable], list[FinetuneTable]]:
    """(tables trained on, tables held out whole): `cfg.holdout_tables` of them held out, or none."""
    k, n = cfg.holdout_tables, len(tables)
    if k == 0:
        return tables, []
    if n == 1:
        raise ValueError(f"--holdout-tables {k} holds out whole tables, but --data {data} is a single table "
                         f"({tables[0].name}); pass a table store or a directory of several tables, or hold out "
                         "rows only (--holdout)")
    if k >= n:
        raise ValueError(f"--holdout-tables {k} leaves no table to train on: --data {data} holds {n} tables "
                         f"({', '.join(t.name for t in tables[:10])}{', ...' if n > 10 else ''}); hold out at "
                         f"most {n - 1}")
    held = set(holdout_table_names([t.name for t in tables], k, cfg.seed))
    return [t for t in tables if t.name not in held], [t for t in tables if t.name in held]


@dataclass
class ReplayTable:
    """One table of `replay_data`: the episodes it replays (its training rows) and what identifies it."""

    name: str
    source: str
    target: str | None                 # None: an imputation table (a store header's task "imputation")
    task: str
    episodes: EpisodeTable
    fingerprint: str

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "target": self.target, "task": self.task,
                "rows": self.episodes.n_rows, "fingerprint": self.fingerprint}


def load_replay_tables(cfg: FinetuneConfig) -> list[ReplayTable]:
    """The tables `cfg.replay_data` names, ready to replay.

    Each is read as `--data` is (CSV, Parquet, directory, store). Its target is its store header's
    (it may differ from --target); a table without one (plain CSV / Parquet) uses --target and
    --task when it has that column, and is refused otherwise. A prediction table is split exactly
    as a fine-tuning table (`--holdout`, stratified, seeded by its name) and replays its training
    rows only, so `--report` on the same tables (same target) scores rows replay never trained on. A store table
    whose header says task "imputation" (no target) replays all its rows as imputation episodes."""
    if not cfg.replay_data:
        return []
    out = []
    for t in read_tables(list(cfg.replay_data)):  # no target / task forced: the headers' own
        if t.target is None and t.task == IMPUTATION:
            frame = t.frame.reset_index(drop=True)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    enc, _ = encode_frame(frame)
                episodes = EpisodeTable(t.name, enc.x.numpy(), enc.kind.numpy().astype(np.int8),
                                        enc.cardinality.numpy().astype(np.int64), IMPUTATION,
                                        np.arange(len(frame), dtype=np.int64))
            except ValueError as err:
                raise ValueError(f"--replay-data: {t.source}: cannot encode the table for imputation: {err}") from None
            out.append(ReplayTable(t.name, t.source, None, IMPUTATION, episodes, _fingerprint(frame)))
            continue
        if t.target is None:
            if cfg.target is None or cfg.target not in t.frame.columns:
                why = (f"and has no --target column {cfg.target!r}" if cfg.target is not None
                       else "and no --target is given")
                names = ", ".join(map(str, t.frame.columns[:40])) + (", ..." if t.frame.shape[1] > 40 else "")
                raise ValueError(f"--replay-data: {t.source}: no target column: it is not a store table whose "
                                 f"header names one {why} (columns: {names})")
            t = t._replace(target=cfg.target, task=cfg.task)
        try:
            prepared = _prepare(t, cfg)
        except ValueError as err:
            raise ValueError(f"--replay-data: {err}") from None
        out.append(ReplayTable(t.name, t.source, prepared.target, prepared.task, prepared.episodes,
                               prepared.fingerprint))
    return out


def _check_replay_apart(replay: list[ReplayTable], tables: list[FinetuneTable]) -> None:
    """Refuse a replay table with the content of a --data table: replaying it would train on that
    table's held-out rows (or on a held-out table)."""
    mine = {t.fingerprint: t for t in tables}
    for r in replay:
        if r.fingerprint in mine:
            raise ValueError(f"--replay-data: {r.source} holds the same table as --data's {mine[r.fingerprint].source} "
                             f"({mine[r.fingerprint].name!r}); replaying it would train on rows fine-tuning holds "
                             "out. Replay other tables")


def replay_tables_seed(seed: int) -> int:
    """The seed of the replay tables' episode sampler: from the run's seed, apart from the
    fine-tuning tables' sampler (the two never draw correlated shapes at one position)."""
    return int(np.random.SeedSequence(seed, spawn_key=(_REPLAY, 1)).generate_state(1)[0])


# --------------------------------------------------------------------------- held-out evaluation

def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


class HoldoutEval:
    """Scores a model in context on each table's held-out rows exactly as the estimators will use
    the exported weights: `TabFMClassifier` / `TabFMRegressor` with their defaults (ensemble of
    `eval_estimators` members, `eval_context_rows` context rows: the estimators' defaults unless
    changed) fitted on the training rows, predicting the held-out rows. A model with context
    features sees at inference exactly the columns its training episodes carry. A model without
    (the legacy `tabfm-tiny`) would get the estimators' neighbour and linear columns, which
    fine-tuning episodes do not carry: it is scored with them off and one n-way pass for classes
    (`estimator_params`, which reproduce the scores), with a warning.
    Metrics per table: log-loss, accuracy, ROC-AUC (one-vs-rest for multiclass) or RMSE, R^2;
    `score` = mean over tables of log-loss or RMSE / std(training y). Lower is better.
    `rows` holds the last call's per-row losses per table (the row's log-loss, or its squared error
    / var(training y)), for BestKeeper's paired test."""

    def __init__(self, tables: list[FinetuneTable], cfg: FinetuneConfig, context_features: str = "none") -> None:
        from tabfm.estimators import TabFMClassifier, TabFMRegressor  # sklearn-heavy: only when evaluating

        self.tables = tables
        self.rows: dict[str, np.ndarray] = {}
        self.estimator_params = self.params_for(cfg, context_features)
        self.estimators = []
        for t in tables:
            kind = TabFMClassifier if t.task == CLASSIFICATION else TabFMRegressor
            params = {k: v for k, v in self.estimator_params.items() if k != "multiclass" or kind is TabFMClassifier}
            est = kind(**params)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.estimators.append(est.fit(t.train_X, t.train_y))  # encodes the context once; no model yet

    @staticmethod
    def params_for(cfg: FinetuneConfig, context_features: str) -> dict[str, Any]:
        """The estimator parameters the held-out scores are computed with (and reproduced by)."""
        params: dict[str, Any] = dict(n_estimators=cfg.eval_estimators, random_state=cfg.seed,
                                      max_context_rows=cfg.eval_context_rows)
        if context_features == "none":
            params.update(n_neighbors=0, linear_features=False, multiclass="native")
        return params

    def __call__(self, model: nn.Module) -> dict[str, float]:
        from sklearn.metrics import accuracy_score, log_loss, r2_score, roc_auc_score

        device = str(next(model.parameters()).device)
        out: dict[str, float] = {}
        scores = []
        for t, est in zip(self.tables, self.estimators):
            est.set_params(model=model, device=device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                if t.task == CLASSIFICATION:
                    proba = est.predict_proba(t.eval_X)
                    labels = est.classes_
                    clipped = np.clip(proba, 1e-15, 1.0)
                    ll = float(log_loss(t.eval_y, clipped, labels=labels))
                    clipped = clipped / clipped.sum(1, keepdims=True)  # as log_loss renormalises
                    self.rows[t.name] = -np.log(clipped[np.arange(len(proba)), np.searchsorted(labels, t.eval_y)])
                    auc = float("nan")
                    present = np.unique(t.eval_y)
                    if len(present) == len(labels) == 2:
                        auc = float(roc_auc_score(t.eval_y == labels[1], proba[:, 1]))
                    elif len(present) == len(labels):
                        auc = float(roc_auc_score(t.eval_y, proba, multi_class="ovr", labels=labels))
                    out.update({f"{t.name}/logloss": ll, f"{t.name}/accuracy": float(accuracy_score(
                        t.eval_y, labels[proba.argmax(1)])), f"{t.name}/roc_auc": auc})
                    scores.append(ll)
                else:
                    pred = est.predict(t.eval_X)
                    rmse = float(np.sqrt(np.mean((pred - t.eval_y) ** 2)))
                    scale = float(np.std(t.train_y)) or 1.0
                    self.rows[t.name] = ((pred - t.eval_y) / scale) ** 2
                    out.update({f"{t.name}/rmse": rmse, f"{t.name}/nrmse": rmse / scale,
                                f"{t.name}/r2": float(r2_score(t.eval_y, pred)) if len(t.eval_y) > 1 else float("nan")})
                    scores.append(rmse / scale)
            est.set_params(model=DEFAULT_MODEL)  # do not keep a reference to the training module
        out["score"] = float(np.mean(scores))
        return out


# --------------------------------------------------------------------------- early stopping

def paired_z(ref: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> float:
    """How many standard errors lower `new`'s per-row losses are than `ref`'s, on the same rows:
    the mean over tables of each table's mean paired difference, over its standard error (tables
    independent). +inf when every difference is equal and positive, 0 when there are none."""
    means, var = [], 0.0
    for name, b in ref.items():
        d = np.asarray(b, dtype=np.float64) - np.asarray(new[name], dtype=np.float64)
        means.append(float(d.mean()) if len(d) else 0.0)
        var += float(d.var(ddof=1)) / len(d) if len(d) > 1 else 0.0
    if not means:
        return 0.0
    diff, se = float(np.mean(means)), math.sqrt(var) / len(means)
    if se == 0.0:
        return math.inf if diff > 0 else (0.0 if diff == 0 else -math.inf)
    return diff / se


class BestKeeper:
    """Keeps the best held-out score: exports the weights at every improvement, and stops the
    Trainer (by ending its run at the current step) after `patience` evaluations without one.
    An improvement is a score lower than the best's by more than `min_delta` and, with `significance`
    > 0 and the per-row losses given, per-row losses lower than the *starting weights'* (the first
    evaluation's) by more than `significance` paired standard errors (`paired_z`): a few hundred
    held-out rows are noisy, and a step selected on their noise exports weights that predict new
    rows worse than the starting ones. Tested against the start, not the best: the question a user
    asks is whether the export beats the weights they started from, and each later step that passes
    that test and scores lower is exported (a test against the best step asked a second, stricter
    question of every later step and kept real gains out, BENCHMARKS.md).

    The held-out tables' scores (`holdout_tables`) are noted beside it (`note_tables`): those of
    the first evaluation and of the best step's, never used to choose or stop.

    Its state is small and JSON-only; `FinetuneData` carries it inside every checkpoint."""

    def __init__(self, patience: int, min_delta: float, significance: float = 0.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.patience, self.min_delta, self.significance, self.log = patience, min_delta, significance, log
        self.trainer: Trainer | None = None
        self.export: Callable[[int, dict[str, float]], None] | None = None
        self.initial: dict[str, float] | None = None
        self.best: dict[str, float] | None = None
        self.best_step = -1
        self.initial_rows: dict[str, np.ndarray] | None = None
        self.bad_evals = 0
        self.stopped = False
        self.last_step = -1
        self.tables_initial: dict[str, float] | None = None
        self.tables_best: dict[str, float] | None = None

    def bind(self, trainer: Trainer, export: Callable[[int, dict[str, float]], None]) -> None:
        self.trainer, self.export = trainer, export

    def update(self, metrics: dict[str, float], rows: dict[str, np.ndarray] | None = None) -> dict[str, float]:
        """Record one evaluation (its metrics, and its per-row losses for the paired test) at the
        Trainer's current step; return what to log beside it."""
        step = self.trainer.step if self.trainer is not None else 0
        score = metrics["score"]
        if self.initial is None:
            self.initial = dict(metrics)
            self.initial_rows = None if rows is None else {k: np.asarray(v, dtype=np.float64) for k, v in rows.items()}
        z = math.nan
        if self.best is None:
            improved = True
        else:
            improved = score < self.best["score"] - self.min_delta
            if rows is not None and self.initial_rows is not None:
                z = paired_z(self.initial_rows, rows)
                improved = improved and (self.significance == 0 or z > self.significance)
        if improved:
            self.best, self.best_step, self.bad_evals = dict(metrics), step, 0
            if self.export is not None:
                self.export(step, metrics)
        else:
            self.bad_evals += 1
            if self.patience and self.bad_evals >= self.patience:
                self.stopped = True
                if self.trainer is not None:
                    self.trainer.steps = self.trainer.step  # the loop ends after this step; the Trainer then saves
        self.last_step = step
        if self.log is not None:
            flag = " *" if improved else (f"  (stopping: {self.bad_evals} evaluations without improvement)"
                                          if self.stopped else "")
            zs = "" if math.isnan(z) else f"  ({z:+.1f} SE vs the start)"
            self.log(f"step {step:>5}: held-out score {score:.4f}{zs}  best {self.best['score']:.4f} "
                     f"at step {self.best_step}{flag}")
        return {"best_score": self.best["score"], "best_step": float(self.best_step), "improved": float(improved),
                "z_vs_start": z}

    def note_tables(self, metrics: dict[str, float]) -> None:
        """The held-out tables' scores at the Trainer's current step, evaluated after `update`: kept
        when they are the first, and when this step is the best one (the weights exported)."""
        step = self.trainer.step if self.trainer is not None else 0
        if self.tables_initial is None:
            self.tables_initial = dict(metrics)
        if step == self.best_step:
            self.tables_best = dict(metrics)

    def state_dict(self) -> dict[str, Any]:
        def clean(d: dict[str, float] | None) -> dict[str, float | None] | None:
            return None if d is None else {k: _finite(v) for k, v in d.items()}

        return {"initial": clean(self.initial), "best": clean(self.best), "best_step": self.best_step,
                "bad_evals": self.bad_evals, "stopped": self.stopped, "last_step": self.last_step,
                "tables_initial": clean(self.tables_initial), "tables_best": clean(self.tables_best),
                "initial_rows": None if self.initial_rows is None else {k: v.tolist() for k, v in self.initial_rows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def restore(d: dict[str, Any] | None) -> dict[str, float] | None:
            return None if d is None else {k: float("nan") if v is None else float(v) for k, v in d.items()}

        self.initial, self.best = restore(state["initial"]), restore(state["best"])
        self.best_step, self.bad_evals = int(state["best_step"]), int(state["bad_evals"])
        self.last_step = int(state["last_step"])
        self.tables_initial = restore(state.get("tables_initial"))  # absent in checkpoints of older runs
        self.tables_best = restore(state.get("tables_best"))
        rows = state.get("initial_rows")  # absent in checkpoints of older runs: their next step is judged by score only
        self.initial_rows = None if rows is None else {k: np.asarray(v, dtype=np.float64) for k, v in rows.items()}
        # judged by this run's patience: rerunning an early-stopped run with a larger --patience continues it
        self.stopped = bool(self.patience) and self.bad_evals >= self.patience


# --------------------------------------------------------------------------- the batches

DATA, PRIOR, REPLAY_TABLES = "data", "prior", "replay"  # FinetuneData.source_at


class FinetuneData:
    """The batches fine-tuning trains on: episodes of the user's tables, and with probability
    `replay` a replayed batch instead: from the synthetic prior stream `replay_stream`, or from the
    episode sampler of the replay tables `replay_tables`; with both, each with probability 1/2.

    Both draws are those of position p's own generator, SeedSequence(seed, spawn_key=(3, p)): its
    first uniform u < replay makes p a replay position, its second v picks the replay tables when
    v < 1/2. So they depend on (seed, p) only: the same on every data-parallel rank (whose
    batches at p then come from the same source, with the same shape) and in a resumed run.
    Resumable by position; the early-stopping record rides in the state so every checkpoint holds
    the record that belongs to its weights."""

    def __init__(self, sampler: TableEpisodeSampler, keeper: BestKeeper, replay: float = 0.0,
                 replay_stream: SynthStream | None = None, seed: int = 0,
                 replay_tables: TableEpisodeSampler | None = None) -> None:
        if replay > 0 and replay_stream is None and replay_tables is None:
            raise ValueError("replay > 0 needs a replay_stream or replay_tables")
        self.sampler, self.keeper, self.replay, self.replay_stream, self.seed = sampler, keeper, replay, replay_stream, seed
        self.replay_tables = replay_tables
        self.position = 0

    def source_at(self, position: int) -> str:
        """Where the batch at `position` comes from: DATA (the fine-tuning tables), PRIOR or REPLAY_TABLES."""
        if self.replay <= 0:
            return DATA
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_REPLAY, position)))
        if not rng.random() < self.replay:
            return DATA
        if self.replay_tables is None:
            return PRIOR
        if self.replay_stream is None:
            return REPLAY_TABLES
        return REPLAY_TABLES if rng.random() < 0.5 else PRIOR

    def is_replay(self, position: int) -> bool:
        return self.source_at(position) != DATA

    def episode_at(self, position: int) -> tuple[Any, str, EpisodeInfo | None]:
        """(batch, source, what it holds): the EpisodeInfo of a table batch (its table and rows), None for the prior."""
        source = self.source_at(position)
        if source == PRIOR:
            return self.replay_stream.batch_at(position), source, None
        batch, info = (self.replay_tables if source == REPLAY_TABLES else self.sampler).episode_at(position)
        return batch, source, info

    def batch_at(self, position: int):
        return self.episode_at(position)[0]

    def __iter__(self) -> Iterator[Any]:
        while True:
            batch = self.batch_at(self.position)
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position, "early_stopping": self.keeper.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this run has seed {self.seed}")
        self.position = int(state["position"])
        self.keeper.load_state_dict(state["early_stopping"])


def finetune_data(cfg: FinetuneConfig, tables: list[FinetuneTable], replay_tables: list[ReplayTable],
                  keeper: BestKeeper, model_cfg: ModelConfig, rank: int = 0, world_size: int = 1) -> FinetuneData:
    """The batches of a run on `tables` for one data-parallel rank: the fine-tuning tables' episodes,
    and `cfg.replay` of them replayed from `cfg.replay_prior()` and / or `replay_tables`. The replay
    tables go through the same sampler with the same EpisodeConfig (the model's context features and
    head width), so their episodes show what the model sees; their sampler's seed is
    `replay_tables_seed(cfg.seed)`."""
    episodes = cfg.episode_config(model_cfg.max_categories, model_cfg.context_features)
    sampler = TableEpisodeSampler([t.episodes for t in tables], episodes, seed=cfg.seed, rank=rank,
                                  world_size=world_size)
    prior = replayed = None
    if cfg.replay_prior() is not None:
        prior_cfg = StreamConfig.preset(cfg.replay_prior(), context_features=model_cfg.context_features)
        prior = SynthStream(prior_cfg, seed=cfg.seed, rank=rank, world_size=world_size)
    if cfg.replay > 0 and replay_tables:
        replayed = TableEpisodeSampler([t.episodes for t in replay_tables], episodes, seed=replay_tables_seed(cfg.seed),
                                       rank=rank, world_size=world_size)
    return FinetuneData(sampler, keeper, cfg.replay, prior, cfg.seed, replay_tables=replayed)


# --------------------------------------------------------------------------- the run

@dataclass
class FinetuneResult:
    """What a fine-tuning run reached; `summary` is what OUT/finetune_summary.json holds."""

    out_dir: Path
    step: int
    stopped: str  # "steps" | "time" | "early_stop" | "finished" (an earlier invocation had ended the run)
    best_step: int
    initial: dict[str, float]
    best: dict[str, float]
    export: Path
    wall_s: float
    summary: dict[str, Any] = field(default_factory=dict)
    train: TrainResult | None = None
    holdout_tables: dict[str, Any] | None = None  # --holdout-tables: summary["holdout_tables"] (before / best)

    def table(self) -> str:
        return format_summary(self.summary)


def _init_model(init: str) -> tuple[ModelConfig, str | None]:
    """The model config of the starting weights and its preset name (None for a custom config)."""
    from tabfm.weights import CONFIG_FILE, ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(init)
    except ModelNotFoundError as err:
        raise ValueError(f"--init {init}: {err}") from None
    header = json.loads((path / CONFIG_FILE).read_text())
    if not isinstance(header, dict) or not isinstance(header.get("model"), dict):
        raise ValueError(f"--init {init}: {path / CONFIG_FILE} has no 'model' section; is it a tabfm export?")
    model_cfg = ModelConfig.from_dict(header["model"])
    preset = header.get("preset")
    try:
        same = isinstance(preset, str) and ModelConfig.preset(preset).to_dict() == model_cfg.to_dict()
    except ValueError:
        same = False
    return model_cfg, preset if same else None


def checkpoint_model(train: dict[str, Any], state: dict[str, torch.Tensor], ckpt: Path
                     ) -> tuple[TabFM, ModelConfig, Callable | None]:
    """The model a fine-tuning checkpoint's weights belong to (its init's config), loaded; with LoRA
    the init's weights plus the checkpoint's adapters, and the transform that merges them at export."""
    from tabfm.parallel.checkpoint import check_frozen_left_out

    model_cfg, _ = _init_model(train["init"])
    model = TabFM(model_cfg)
    lora = train.get("lora")
    if lora is None:
        model.load_state_dict(state, strict=True)
        return model, model_cfg, None
    _check_init_unchanged(train)
    warm_start(model, train["init"])
    config = LoraConfig(lora["rank"], lora["alpha"], tuple(lora["targets"]))
    add_adapters(model, config)
    check_frozen_left_out(model, set(state), ckpt)
    model.load_state_dict(state, strict=False)
    return model, model_cfg, lambda full: merge_adapters(full, config.scale)


def _init_sha256(init: str) -> str | None:
    from tabfm.weights import CONFIG_FILE, resolve_model_path

    return json.loads((resolve_model_path(init) / CONFIG_FILE).read_text()).get("weights_sha256")


def _check_init_unchanged(saved: dict[str, Any]) -> None:
    """A LoRA run's checkpoints hold adapters on top of its init's weights: refuse an init whose
    weights changed since (the adapters would sit on other weights)."""
    want, got = saved.get("init_weights_sha256"), _init_sha256(saved["init"])
    if want is not None and got != want:
        raise ValueError(f"--init {saved['init']}: its weights changed since this LoRA run started (sha256 {got}, "
                         f"the run recorded {want}); its checkpoints hold adapters of the old weights only")


def _table_ids(tables: list[Any]) -> list[dict[str, Any]]:
    return [{"name": t.name, "source": t.source, "target": t.target, "task": t.task, "fingerprint": t.fingerprint}
            for t in tables]


def _run_record(cfg: FinetuneConfig, source: Any, tables: list[FinetuneTable], preset: str | None,
                held_out: list[FinetuneTable] = (), replay: list[ReplayTable] = ()) -> dict[str, Any]:
    """train_config.json: the config, the data it read, and "model" (the preset name, as `tabfm export` reads).
    "tables" are the tables trained on; "held_out_tables" those held out whole; "replay_tables" those replayed."""
    record = cfg.to_dict()
    lora = cfg.lora()
    record.update(recipe="finetune", model=preset, lora=None if lora is None else lora.to_dict(), lr=cfg.peak_lr,
                  init_weights_sha256=_init_sha256(cfg.init), data=_describe(source, cfg),
                  tables=_table_ids(tables), held_out_tables=_table_ids(list(held_out)),
                  replay_tables=_table_ids(list(replay)))
    return record


def _check_same_run(out: Path, record: dict[str, Any]) -> None:
    """Refuse to resume a run in `out` that read other data or used another split, init or optimizer."""
    path = out / TRAIN_CONFIG
    if not path.exists():
        return
    saved = read_json(path)
    if saved.get("recipe") != "finetune":
        raise ValueError(f"{out} holds a run that is not a fine-tuning run; use another --out")

    def content(r: dict[str, Any], key: str) -> list:  # the tables by content, wherever the files now lie
        return [{k: t.get(k) for k in ("name", "target", "task", "fingerprint")} for t in r.get(key) or []]

    if record.get("lora") is not None:
        _check_init_unchanged(saved)
    tables = {"tables": "the tables' content", "held_out_tables": "other held-out tables (--holdout-tables)",
              "replay_tables": "other replay tables' content (--replay-data)"}
    for key in (*RUN_KEYS, *tables):
        differs = (content(saved, key) != content(record, key)) if key in tables else (
            saved.get(key, _RUN_DEFAULTS.get(key)) != record.get(key))
        if differs:
            if key in tables:
                was, has = (", ".join(t["name"] for t in content(r, key)) or "none" for r in (saved, record))
                what, now = f"{tables[key]} ({was})", f", this one has {has}"
            else:
                what = f"{key}={saved.get(key, _RUN_DEFAULTS.get(key))!r}"
                now = f", this one has {key}={record.get(key)!r}"
            raise ValueError(f"{out} holds a fine-tuning run with {what}{now}; use another --out or the same "
                             "settings and data to resume")


def _tables_info(tables: list[FinetuneTable]) -> list[dict[str, Any]]:
    return [{"name": t.name, "source": t.source, "target": t.target, "task": t.task,
             "classes": None if t.classes is None else [str(c) for c in t.classes],
             "train_rows": int(len(t.train_rows)), "holdout_rows": int(len(t.holdout_rows)),
             "eval_rows": int(len(t.eval_rows)), "dropped_rows_without_target": t.dropped,
             "columns": int(t.train_X.shape[1])} for t in tables]


def finetune(cfg: FinetuneConfig, out_dir: str | Path, data: Any = None, plugin: Plugin | None = None,
             progress: bool = True, restart: bool = False, bar: bool | None = None) -> FinetuneResult:
    """Fine-tune (or resume, when out_dir holds checkpoints), export the best weights to out_dir/export,
    write out_dir/finetune_summary.json and return the result.

    `data` overrides `cfg.data` (a path, DataFrame, {name: DataFrame} or list: whatever
    `tabfm.data.readers.read_tables` reads). `plugin` defaults to `build_plugin(cfg)`. `restart`
    removes out_dir's checkpoints and logs first. `progress` prints status messages and the training
    log; `bar` draws the progress bar (None: with `progress`, when stderr is a terminal; see Trainer).
    Under torchrun call this on every rank. With `cfg.folds` K >= 2 it runs the K fold runs and
    exports their pooled choice (`finetune_folds`)."""
    if cfg.folds > 1 and cfg.fold is None:
        return finetune_folds(cfg, out_dir, data=data, plugin=plugin, progress=progress, restart=restart, bar=bar)
    start = time.perf_counter()
    out = Path(out_dir)
    source = data if data is not None else cfg.data
    if source is None:
        raise ValueError("no data to fine-tune on: pass --data PATH (FinetuneConfig.data) or finetune(data=...)")
    plug = plugin if plugin is not None else build_plugin(cfg)
    main = plug.is_main_process
    talk = main and progress
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)

    tables, held_out = split_tables(load_tables(source, cfg), cfg, _describe(source, cfg))  # every rank alike
    replay_tables = load_replay_tables(cfg)
    _check_replay_apart(replay_tables, tables + held_out)
    model_cfg, preset = _init_model(cfg.init)
    record = _run_record(cfg, source, tables, preset, held_out, replay_tables)
    if restart:
        if main:
            removed = start_over(out)
            for p in (out / FOLD_STEPS, out / FOLD_LOSSES) if cfg.fold is not None else ():  # a fold run's records
                if p.exists():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                    removed.append(p)
            for p in removed:
                print(f"--restart: removed {p}", flush=True)
    else:
        _check_same_run(out, record)  # every rank reads the old train_config.json ...
    barrier()  # ... before the main process replaces it
    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / TRAIN_CONFIG, record)  # atomic: a kill mid-write must not block the resume
        rows = {t.name: {"source": t.source, "rows": t.holdout_rows.tolist()} for t in tables}
        rows.update({t.name: {"source": t.source, "rows": t.holdout_rows.tolist(), "held_out_table": True,
                              "context_rows": t.train_rows.tolist()} for t in held_out})
        write_json(out / HOLDOUT_FILE, rows)
    if talk:
        for info in _tables_info(tables) + _tables_info(held_out):
            classes = f", {len(info['classes'])} classes" if info["classes"] else ""
            if info["name"] in {t.name for t in held_out}:
                print(f"{info['name']}: held out whole (--holdout-tables), never trained on; {info['task']} of "
                      f"{info['target']!r}{classes}, scored on {info['eval_rows']} of its rows with "
                      f"{info['train_rows']} as context", flush=True)
                continue
            print(f"{info['name']}: {info['task']} of {info['target']!r}{classes}; {info['train_rows']} training rows, "
                  f"{info['holdout_rows']} held out ({info['eval_rows']} scored), {info['columns']} feature columns"
                  + (f"; {info['dropped_rows_without_target']} rows without a target skipped"
                     if info["dropped_rows_without_target"] else ""), flush=True)
        if cfg.replay > 0:
            where = [f"the synthetic prior ({cfg.replay_prior()})"] if cfg.replay_prior() else []
            if replay_tables:
                where.append(f"{len(replay_tables)} replay tables ({', '.join(t.name for t in replay_tables[:5])}"
                             f"{', ...' if len(replay_tables) > 5 else ''}; "
                             f"{sum(t.episodes.n_rows for t in replay_tables)} rows)")
            print(f"replay: {cfg.replay:.0%} of the batches from {' and '.join(where)}"
                  + (", half each" if len(where) == 2 else ""), flush=True)

    torch.manual_seed(cfg.seed)
    model = TabFM(model_cfg)
    lora = cfg.lora()
    if lora is not None or latest_checkpoint(out / "checkpoints") is None:
        warm_start(model, cfg.init)  # a LoRA run's checkpoints hold the adapters only: the base is the init
    if lora is not None:  # before the engine wraps the model: it and the optimizer see only the adapters
        adapted = add_adapters(model, lora)
        if talk:
            n = adapter_parameters(model)
            print(f"LoRA rank {lora.rank} (scale {lora.scale:g}) on {len(adapted)} layers: {n['adapter']:,} trainable "
                  f"parameters of {n['total']:,} ({n['adapter'] / n['total']:.1%}); the rest frozen, adapters "
                  "merged into the weights at export", flush=True)
    if talk and model_cfg.context_features == "none":
        params = HoldoutEval.params_for(cfg, "none")
        print(f"--init {cfg.init} has no context features: the estimators' defaults would add neighbour and linear "
              "columns that fine-tuning episodes do not carry, so held-out rows are scored (and the export is best "
              f"used) with {', '.join(f'{k}={params[k]!r}' for k in ('n_neighbors', 'linear_features', 'multiclass'))}",
              flush=True)
    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.peak_lr, weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    booster = Booster(plug, precision=resolve_precision(cfg.precision, plug.device))
    # the criterion goes through the booster: under row-sequence parallelism it reduces the ranks' row-sharded losses
    model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, masked_cell_loss, lr_scheduler=scheduler)

    from tqdm.auto import tqdm

    keeper = BestKeeper(cfg.patience, cfg.min_delta, cfg.significance, log=tqdm.write if talk else None)
    stream = finetune_data(cfg, tables, replay_tables, keeper, model_cfg, rank=plug.dp_rank,
                           world_size=plug.dp_world_size)
    holdout = HoldoutEval(tables, cfg, model_cfg.context_features)

    def evaluate(module: nn.Module) -> dict[str, float]:
        metrics = holdout(module)
        if cfg.fold is not None:  # a fold run keeps every evaluated step: the pooled choice comes after all folds
            keep_step(trainer.step, metrics)
        return {**metrics, **keeper.update(metrics, holdout.rows)}

    evaluators: dict[str, Callable[[nn.Module], dict[str, float]]] = {"holdout": evaluate}
    if held_out:  # after "holdout": the keeper has judged (and exported) the step when they are noted
        unseen = HoldoutEval(held_out, cfg, model_cfg.context_features)

        def evaluate_tables(module: nn.Module) -> dict[str, float]:
            metrics = unseen(module)
            keeper.note_tables(metrics)
            return metrics

        evaluators["holdout_tables"] = evaluate_tables

    trainer = Trainer(
        booster, model, optimizer, scheduler, criterion, stream, out,
        steps=cfg.steps, grad_accum=cfg.grad_accum, clip=cfg.clip, log_every=cfg.log_every,
        ckpt_every=cfg.ckpt_every, keep_last=cfg.keep_last, max_minutes=cfg.max_minutes,
        evaluators=evaluators, eval_every=cfg.eval_every, export_config=None, progress=progress,
        seed=cfg.seed, bar=bar, save_frozen=lora is None,
    )

    def export(step: int, metrics: dict[str, float], where: Path | None = None) -> None:
        """The weights of this step, adapters merged, as an export (OUT/export unless `where`)."""
        info = {"step": step, "holdout": {k: _finite(v) for k, v in metrics.items()}, "init": cfg.init,
                "lora": record["lora"], "estimator_params": {k: v for k, v in holdout.estimator_params.items()}}
        merge = None if lora is None else (lambda state: merge_adapters(state, lora.scale))
        booster.export(trainer.model, where or out / "export",
                       export_config(model_cfg, record, preset=preset, finetune=info), transform=merge)

    def keep_step(step: int, metrics: dict[str, float]) -> None:
        """A fold run's record of one evaluation: the weights (OUT/steps/step_N, an export) and the
        held-out rows' per-row losses (a line of OUT/holdout_losses.jsonl)."""
        export(step, metrics, out / FOLD_STEPS / f"step_{step}")  # replaced when a resumed run evaluates it again
        if main:
            line = {"step": step, "metrics": {k: _finite(v) for k, v in metrics.items()},
                    "rows": {k: v.tolist() for k, v in holdout.rows.items()}}
            with open(out / FOLD_LOSSES, "a") as f:
                f.write(json.dumps(line) + "\n")

    keeper.bind(trainer, export)
    if trainer.resume():
        announce_resume(out, trainer, plug)
    if keeper.initial is None:  # a fresh run: score (and export, as the first best) the starting weights
        trainer.evaluate()

    train_result = None
    if keeper.stopped or trainer.step >= trainer.steps:
        stopped = "finished"
        if trainer.log is not None:
            trainer.log.close()  # fit() would have closed it
        if talk:
            print(f"{out}: the run had already ended at step {trainer.step}; nothing to train", flush=True)
    else:
        train_result = trainer.fit()
        if keeper.last_step == trainer.step and trainer.step % cfg.eval_every:
            trainer.save()  # the final evaluation ran after the last checkpoint: keep its record with it
        stopped = "early_stop" if keeper.stopped else train_result.stopped

    report = _forgetting_report(cfg, out / "export", model_cfg.context_features) if main and cfg.report else None
    summary = {
        "out": str(out), "init": cfg.init, "data": record["data"], "tables": _tables_info(tables),
        "step": trainer.step, "steps": cfg.steps, "stopped": stopped, "best_step": keeper.best_step,
        "before": {"step": 0, **{k: _finite(v) for k, v in keeper.initial.items()}},
        "best": {"step": keeper.best_step, **{k: _finite(v) for k, v in keeper.best.items()}},
        "export": str(out / "export"), "wall_s": time.perf_counter() - start, "significance": cfg.significance,
    }
    if held_out:
        summary["holdout_tables"] = {
            "tables": _tables_info(held_out),
            "before": {"step": 0, **{k: _finite(v) for k, v in (keeper.tables_initial or {}).items()}},
            "best": {"step": keeper.best_step, **{k: _finite(v) for k, v in (keeper.tables_best or {}).items()}},
        }
    if cfg.replay > 0:
        summary["replay"] = {"share": cfg.replay, "stream": cfg.replay_prior(),
                             "tables": [t.info() for t in replay_tables]}
    if report is not None:
        summary["report"] = report
    if main:
        write_json(out / SUMMARY_FILE, summary)
    result = FinetuneResult(out, trainer.step, stopped, keeper.best_step, keeper.initial, keeper.best,
                            out / "export", summary["wall_s"], summary, train_result, summary.get("holdout_tables"))
    if talk:
        print(result.table(), flush=True)
    return result


# --------------------------------------------------------------------------- K-fold cross-fitting

def read_fold_losses(run: Path) -> dict[int, dict[str, np.ndarray]]:
    """A fold run's per-row held-out losses by evaluated step (a step evaluated twice, as a resumed
    run does, keeps its last line)."""
    steps: dict[int, dict[str, np.ndarray]] = {}
    with open(run / FOLD_LOSSES) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                steps[int(rec["step"])] = {k: np.asarray(v, dtype=np.float64) for k, v in rec["rows"].items()}
    return steps


def pool_folds(histories: list[dict[int, dict[str, np.ndarray]]], tasks: dict[str, str], significance: float,
               min_delta: float) -> dict[str, Any]:
    """The K fold runs' held-out losses pooled per evaluated step (the steps every fold reached): each
    table's rows of all folds together, so every row is scored once. Per step the metrics HoldoutEval
    reports ("TABLE/logloss", or "TABLE/nrmse" = sqrt of the mean scaled squared error; "score" their
    mean over tables) and z, the paired test of `paired_z` against step 0 on all the rows. The chosen
    step is BestKeeper's rule on the pooled rows: the lowest score that beats step 0's by more than
    min_delta and, with significance > 0, by more than `significance` standard errors; else 0."""
    common = sorted(set.intersection(*(set(h) for h in histories)))
    if not common or common[0] != 0:
        raise ValueError("the fold runs share no evaluation of the starting weights (step 0)")
    pooled_steps = []
    for step in common:
        rows = {t: np.concatenate([h[step][t] for h in histories]) for t in histories[0][step]}
        metrics = {}
        for t, r in rows.items():
            metrics[f"{t}/logloss" if tasks[t] == CLASSIFICATION else f"{t}/nrmse"] = (
                float(r.mean()) if tasks[t] == CLASSIFICATION else float(np.sqrt(r.mean())))
        metrics["score"] = float(np.mean(list(metrics.values())))
        pooled_steps.append((step, rows, metrics))
    start_rows, best = pooled_steps[0][1], 0
    best_score = pooled_steps[0][2]["score"]
    table = []
    for step, rows, metrics in pooled_steps:
        z = paired_z(start_rows, rows) if step else math.nan
        passed = step > 0 and metrics["score"] < best_score - min_delta and (significance == 0 or z > significance)
        if passed:
            best, best_score = step, metrics["score"]
        table.append({"step": step, "z_vs_start": _finite(z), "rows": int(sum(len(r) for r in rows.values())),
                      **{k: _finite(v) for k, v in metrics.items()}})
    return {"steps": table, "best_step": best}


def average_exports(paths: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The element-wise mean of several exports' weights (float64 sums, stored in each tensor's dtype)
    and the first one's config: runs from one init, averaged, as one ordinary export."""
    from tabfm.parallel.export import load_exported

    state, config = load_exported(paths[0])
    if len(paths) == 1:
        return state, config
    sums = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    for p in paths[1:]:
        other, _ = load_exported(p)
        if other.keys() != state.keys():
            raise ValueError(f"{p}: its weights do not match {paths[0]}'s; the fold runs must share one model")
        for k, v in other.items():
            if v.is_floating_point():
                sums[k] += v.double()
    return {k: (v / len(paths)).to(state[k].dtype) if state[k].is_floating_point() else v
            for k, v in sums.items()}, config


def _check_finished_fold(cfg: FinetuneConfig, run: Path, source: Any) -> None:
    """Refuse a finished fold run that read other data or used other settings (`_check_same_run`),
    as its resume would: a finished fold is kept, not run again."""
    tables, held_out = split_tables(load_tables(source, cfg), cfg, _describe(source, cfg))
    record = _run_record(cfg, source, tables, _init_model(cfg.init)[1], held_out, load_replay_tables(cfg))
    _check_same_run(run, record)


def finetune_folds(cfg: FinetuneConfig, out_dir: str | Path, data: Any = None, plugin: Plugin | None = None,
                   progress: bool = True, restart: bool = False, bar: bool | None = None) -> FinetuneResult:
    """K-fold cross-fitted fine-tuning (`cfg.folds` = K >= 2): K runs, OUT/fold-k holding out fold k of
    each table (`fold_split`), each for max_minutes / K, with no early stop and every evaluation kept;
    then `pool_folds` picks one step on every row, and OUT/export is the average of the K runs' weights
    at that step (each row trained on by K - 1 of them), or the starting weights when no step passes.
    A fold run with a summary is finished and is not run again; a killed one resumes where it stopped."""
    from tabfm.parallel.export import export_model
    from tabfm.weights import build_model

    start = time.perf_counter()
    out = Path(out_dir)
    plug = plugin if plugin is not None else build_plugin(cfg)
    main = plug.is_main_process
    talk = main and progress
    k_folds = cfg.folds
    per_fold = cfg.replace(patience=0, significance=0.0, report=None,
                           max_minutes=None if cfg.max_minutes is None else cfg.max_minutes / k_folds)
    runs, summaries = [out / f"fold-{k}" for k in range(k_folds)], []
    for k, run in enumerate(runs):
        if not restart and (run / SUMMARY_FILE).exists():
            _check_finished_fold(per_fold.replace(fold=k), run, data if data is not None else cfg.data)
            summaries.append(read_json(run / SUMMARY_FILE))
            if talk:
                print(f"fold {k + 1} of {k_folds}: {run} finished before (step {summaries[-1]['step']}); kept", flush=True)
            continue
        if talk:
            print(f"fold {k + 1} of {k_folds}: {run}, fold {k}'s rows held out", flush=True)
        summaries.append(finetune(per_fold.replace(fold=k), run, data=data, plugin=plug, progress=progress,
                                  restart=restart, bar=bar).summary)
    tasks = {t["name"]: t["task"] for t in summaries[0]["tables"]}
    summary_path = out / SUMMARY_FILE
    if main:
        choice = pool_folds([read_fold_losses(r) for r in runs], tasks, cfg.significance, cfg.min_delta)
        best_step = choice["best_step"]
        by_step = {row["step"]: {k: v for k, v in row.items() if k not in ("step", "rows", "z_vs_start")}
                   for row in choice["steps"]}
        snapshots = [r / FOLD_STEPS / f"step_{best_step}" for r in (runs if best_step else runs[:1])]
        state, config = average_exports(snapshots)
        config = {k: v for k, v in config.items() if k != "weights_sha256"}
        config["finetune"] = {**config.get("finetune", {}), "step": best_step, "folds": k_folds,
                              "holdout": by_step[best_step], "averaged": [str(p) for p in snapshots]}
        export_model(build_model(state, config, where=str(snapshots[0])), out / "export", config)
        summary = {
            "out": str(out), "init": cfg.init, "data": summaries[0]["data"], "tables": summaries[0]["tables"],
            "folds": k_folds, "fold_runs": [{"out": str(r), "step": s["step"], "stopped": s["stopped"],
                                             "wall_s": s["wall_s"]} for r, s in zip(runs, summaries)],
            "step": min(s["step"] for s in summaries), "steps": cfg.steps, "stopped": "folds",
            "best_step": best_step, "before": {"step": 0, **by_step[0]}, "best": {"step": best_step, **by_step[best_step]},
            "pooled": choice["steps"], "export": str(out / "export"), "wall_s": time.perf_counter() - start,
            "significance": cfg.significance,
        }
        if cfg.report:
            summary["report"] = _forgetting_report(cfg, out / "export", _init_model(cfg.init)[0].context_features)
        write_json(summary_path, summary)
    barrier()
    summary = read_json(summary_path)
    result = FinetuneResult(out, summary["step"], "folds", summary["best_step"], summary["before"], summary["best"],
                            out / "export", summary["wall_s"], summary)
    if talk:
        print(result.table(), flush=True)
    return result


def _forgetting_report(cfg: FinetuneConfig, export: Path, context_features: str) -> dict[str, Any]:
    """`cfg.report`'s tables scored in context (their own held-out rows, as HoldoutEval scores the
    training tables) with the starting weights and with the export: what fine-tuning cost elsewhere."""
    from tabfm.weights import load_model

    tables = load_tables(cfg.report, cfg)
    scorer = HoldoutEval(tables, cfg, context_features)
    return {"source": cfg.report, "tables": [t.name for t in tables],
            "init": {k: _finite(v) for k, v in scorer(load_model(cfg.init)).items()},
            "export": {k: _finite(v) for k, v in scorer(load_model(export)).items()}}


# --------------------------------------------------------------------------- the summary table

def format_summary(summary: dict[str, Any]) -> str:
    """The before/after table: held-out metrics of the starting weights and of the best step."""
    before, best = summary["before"], summary["best"]
    keys = [k for k in before if k != "step"]
    unseen_keys = [k for k in (summary.get("holdout_tables") or {}).get("before", {}) if k != "step"]
    width = max([len(k) for k in keys + unseen_keys] + [24] + ([32] if unseen_keys else []))

    def cell(v: Any) -> str:
        return f"{v:>12.4f}" if isinstance(v, (int, float)) else f"{'-':>12}"

    lines = [
        "",
        f"  fine-tuned {summary['out']} from {summary['init']} on {summary['data']}",
        f"  steps {summary['step']}/{summary['steps']} (stopped: {summary['stopped']}), best step {summary['best_step']}, "
        f"wall {summary['wall_s'] / 60:.1f} min, export {summary['export']}",
        *([f"  {summary['folds']} folds: every row held out once, its losses pooled over the fold runs; the export "
           f"averages the {summary['folds']} runs' weights at the chosen step"] if summary.get("folds") else []),
        "",
        f"  {'held-out':<{width}}{'step 0':>12}{'best':>12}{'change':>12}",
    ]
    if summary["best_step"] == 0 and summary["step"] > 0:
        z = summary.get("significance")
        by = f" by more than {z:g} paired standard errors (--significance)" if z else ""
        lines[3:3] = [f"  no evaluation beat step 0{by}: the export is the starting weights"]
    for k in keys:
        a, b = before.get(k), best.get(k)
        change = b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
        lines.append(f"  {k:<{width}}{cell(a)}{cell(b)}{cell(change) if change is not None else cell(None)}")
    if summary.get("pooled"):
        lines += ["", f"  {'pooled over the folds, by step':<{width}}{'score':>12}{'z vs step 0':>12}{'rows':>12}"]
        for row in summary["pooled"]:
            lines.append(f"  {'step ' + str(row['step']):<{width}}{cell(row['score'])}{cell(row['z_vs_start'])}"
                         f"{row['rows']:>12}")
    unseen = summary.get("holdout_tables")
    if unseen:
        lines += ["", f"  {'held-out tables (never trained)':<{width}}{'step 0':>12}{'best':>12}{'change':>12}"]
        for k, a in unseen["before"].items():
            if k == "step":
                continue
            b = unseen["best"].get(k)
            change = b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
            lines.append(f"  {k:<{width}}{cell(a)}{cell(b)}{cell(change)}")
    report = summary.get("report")
    if report:
        lines += ["", f"  {'other tables (--report)':<{width}}{'init':>12}{'export':>12}{'change':>12}"]
        for k, a in report["init"].items():
            b = report["export"].get(k)
            change = b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
            lines.append(f"  {k:<{width}}{cell(a)}{cell(b)}{cell(change)}")
    return "\n".join(lines)
