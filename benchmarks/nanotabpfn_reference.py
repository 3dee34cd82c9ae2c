"""nanoTabPFN-style reference model, trained on tabfm's prior, for the equal-budget comparison of issue #25.

What it is: our own small re-implementation of the recipe of nanoTabPFN (Pfefferle, Hog, Purucker,
Hutter 2025, "nanoTabPFN: a lightweight and educational reimplementation of TabPFN",
github.com/automl/nanoTabPFN): per-cell tokens (a shared Linear(1, d) on each standardised value, a
Linear(1, d) on the train-row label, the train-label mean in the test rows' label cells), 3 post-norm
blocks of width 96 with 4 heads and MLP width 192, each block attending across the features of a row,
then across the rows of a column where every row attends only to the train rows, then an MLP; a
96 -> 192 -> classes MLP on the label token of each test row. It learns from 150-row x 5-feature
classification tables, 32 tables a step, lr 4e-3, gradient clipping at 1, as the paper's run does.

What it is for: the simplest known tabular foundation model recipe, trained for the same CPU budget
as ours (30 min, one core), so our recipe is compared with it on (1) held-out synthetic
cross-entropy of its own 150 x 5 tables and (2) public-suite classification ROC-AUC of the model
alone (tabfm.eval.runner.evaluate, the project's protocol: 5-fold stratified CV per dataset).

Where it differs from nanoTabPFN, and why:
* data: tables come from THIS project's prior (tabfm.synth.sample_table, classification only, 2..10
  classes as it draws them), generated on the fly in the same process, so data generation is part of
  the CPU budget; the paper reads a pre-generated dump (its 150 x 5 prior tables, binary). Categorical
  codes are used as numbers; NaN -> 0 after standardising each column on the train rows.
* optimiser: plain AdamW (no schedule-free package in this project) with 25 warm-up steps and a
  cosine decay to 10% over the time budget, weight decay 0 as the paper's.
* outputs: 10 logits (the prior's max_classes); the classifier keeps the first K (K classes in y).
* the classifier ensembles `n_estimators` members that permute features and class labels.

Commands (run from the repository root; one thread; the budget is wall clock like `tabfm pretrain
--max-minutes`, or with `--clock cpu` this process's CPU time, the fair measure on a shared machine):

    nice -n 5 python benchmarks/nanotabpfn_reference.py --minutes 30 --out runs/nanotabpfn-30min \\
        --json benchmarks/results/nanotabpfn_reference.json          # train 30 min, held-out CE, public suite
    python benchmarks/nanotabpfn_reference.py --load runs/nanotabpfn-30min    # evaluate saved weights only
    python benchmarks/nanotabpfn_reference.py --quick --out /tmp/nano-quick --json /tmp/nano-quick.json
                                                                      # ~1 min smoke: wine, breast_cancer, penguins
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / torch load their thread pools

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator, ClassifierMixin
from torch import nn

from tabfm.synth import PriorConfig, sample_table

ROOT = Path(__file__).resolve().parents[1]
HELDOUT_SEED_OFFSET = 1_000_003  # held-out tables: seed + this, never a training seed of a short sweep
QUICK_DATASETS = ("wine", "breast_cancer", "penguins")


# ============================================================================ config
@dataclass(frozen=True)
class NanoConfig:
    """Architecture and training recipe; defaults are nanoTabPFN's (README / train.py)."""

    n_layers: int = 3
    d_model: int = 96
    n_heads: int = 4
    d_ff: int = 192  # the paper's mlp_hidden_size, used by the blocks and the decoder
    max_classes: int = 10  # decoder outputs; the prior draws 2..max_classes classes
    rows: int = 150  # rows per prior table (train + test)
    features: int = 5  # feature columns per prior table (the label is one more)
    train_fraction: tuple[float, float] = (0.1, 0.9)  # the batch's train/test split point, uniform
    lr: float = 4e-3
    batch_size: int = 32  # tables per step
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 25
    final_lr_fraction: float = 0.1  # cosine decay over the budget ends at lr * this
    clip_value: float = 100.0  # standardised values are clipped to +-clip_value, as nanoTabPFN does

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"NanoConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0.0 < self.train_fraction[0] <= self.train_fraction[1] < 1.0:
            raise ValueError(f"NanoConfig.train_fraction={self.train_fraction} must satisfy 0 < low <= high < 1")
        object.__setattr__(self, "train_fraction", tuple(float(v) for v in self.train_fraction))


# ============================================================================ model
def standardise(x_train: torch.Tensor, x_test: torch.Tensor, clip: float = 100.0) -> torch.Tensor:
    """Rows of both parts scaled by the mean / std of each column over its observed train rows,
    clipped to +-clip, NaN -> 0 (the mean). (B, N, F), (B, M, F) -> (B, N + M, F) float32."""
    xt = x_train.double()
    seen = ~torch.isnan(xt)
    count = seen.sum(1, keepdim=True).clamp_min(1)
    mean = torch.where(seen, xt, 0.0).sum(1, keepdim=True) / count
    var = torch.where(seen, xt - mean, 0.0).square().sum(1, keepdim=True) / count
    std = var.sqrt()
    std = torch.where(std > 1e-8, std, 1.0)  # constant (or all-missing) columns: centre only
    z = (torch.cat([xt, x_test.double()], 1) - mean) / std
    return torch.nan_to_num(z.clamp(-clip, clip), nan=0.0).float()


class Attention(nn.Module):
    """Multi-head attention of `x` (S, L, D) over `context` (S, N, D): queries from x, keys/values from context."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        S, L, D = x.shape
        N, h = context.shape[1], self.n_heads
        q = self.q(x).view(S, L, h, D // h).transpose(1, 2)
        k, v = self.kv(context).view(S, N, 2, h, D // h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(S, L, D))


class Block(nn.Module):
    """Post-norm block: attention across the cells of a row, then across the rows of a column
    (keys/values = the train rows only, so test rows never see each other), then an MLP."""

    def __init__(self, cfg: NanoConfig):
        super().__init__()
        self.feature_attn = Attention(cfg.d_model, cfg.n_heads)
        self.row_attn = Attention(cfg.d_model, cfg.n_heads)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))

    def forward(self, h: torch.Tensor, n_train: int) -> torch.Tensor:
        B, R, C, D = h.shape
        x = h.reshape(B * R, C, D)
        x = self.norm1(x + self.feature_attn(x, x))
        x = x.reshape(B, R, C, D).transpose(1, 2).reshape(B * C, R, D)
        x = self.norm2(x + self.row_attn(x, x[:, :n_train]))
        x = self.norm3(x + self.mlp(x))
        return x.reshape(B, C, R, D).transpose(1, 2)


class NanoTabPFN(nn.Module):
    """Per-cell table transformer: (x_train, y_train, x_test) -> class logits of the test rows."""

    def __init__(self, cfg: NanoConfig | None = None):
        super().__init__()
        self.cfg = cfg or NanoConfig()
        d = self.cfg.d_model
        self.feature_encoder = nn.Linear(1, d)  # one standardised value -> one token
        self.target_encoder = nn.Linear(1, d)  # one label (as a number) -> one token
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.n_layers))
        self.decoder = nn.Sequential(nn.Linear(d, self.cfg.d_ff), nn.GELU(), nn.Linear(self.cfg.d_ff, self.cfg.max_classes))

    def forward(self, x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor) -> torch.Tensor:
        """x_train (B, N, F) with NaN = missing, y_train (B, N) labels 0..max_classes-1, x_test (B, M, F)
        -> logits (B, M, max_classes)."""
        B, N, _ = x_train.shape
        M = x_test.shape[1]
        cells = self.feature_encoder(standardise(x_train, x_test, self.cfg.clip_value).unsqueeze(-1))  # (B, R, F, D)
        y = y_train.float()
        y = torch.cat([y, y.mean(1, keepdim=True).expand(B, M)], 1)  # test rows: the train-label mean
        h = torch.cat([cells, self.target_encoder(y[..., None, None])], 2)  # (B, R, F + 1, D)
        for block in self.blocks:
            h = block(h, N)
        return self.decoder(h[:, N:, -1])


# ============================================================================ prior tables
@dataclass
class PriorBatch:
    """Tables of one step: x (B, R, F) float32 with NaN, y (B, R) int64, rows [:n_train] are train rows."""

    x: torch.Tensor
    y: torch.Tensor
    n_train: int
    n_classes: torch.Tensor  # (B,) classes each table's prior drew (all present in the table)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_train, y_train, x_test, y_test)."""
        n = self.n_train
        return self.x[:, :n], self.y[:, :n], self.x[:, n:], self.y[:, n:]


def prior_config(cfg: NanoConfig) -> PriorConfig:
    """tabfm's default prior, classification only, up to cfg.max_classes classes."""
    return dataclasses.replace(PriorConfig(), p_classification=1.0, max_classes=cfg.max_classes)


def prior_batch(cfg: NanoConfig, seed: int, step: int, n_tables: int | None = None) -> PriorBatch:
    """Batch `step` of stream `seed`: a pure function of (cfg, seed, step). Each table is drawn by
    tabfm.synth.sample_table (cfg.rows x (cfg.features + 1), label last), rows shuffled; one split
    point per batch, the train fraction uniform in cfg.train_fraction (nanoTabPFN's dumps also carry
    one split point per batch)."""
    prior, B = prior_config(cfg), n_tables or cfg.batch_size
    xs, ys, ks = [], [], []
    for j in range(B):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0, step, j)))
        t = sample_table(prior, rng, cfg.rows, cfg.features + 1)
        X = t.X[rng.permutation(cfg.rows)]
        xs.append(X[:, :cfg.features])
        ys.append(X[:, cfg.features].astype(np.int64))
        ks.append(int(t.cardinality[t.target]))
    split_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1, step)))
    lo, hi = (round(f * cfg.rows) for f in cfg.train_fraction)
    x = torch.from_numpy(np.stack(xs))
    x = torch.where(torch.isinf(x), float("nan"), x)  # overflowing prior values count as missing
    return PriorBatch(x=x, y=torch.from_numpy(np.stack(ys)), n_train=int(split_rng.integers(max(lo, 1), hi + 1)),
                      n_classes=torch.tensor(ks))


def heldout_batches(cfg: NanoConfig, seed: int, n_tables: int) -> list[PriorBatch]:
    """`n_tables` held-out tables (whole batches of cfg.batch_size) from seed + HELDOUT_SEED_OFFSET."""
    n_batches = max(1, math.ceil(n_tables / cfg.batch_size))
    return [prior_batch(cfg, seed + HELDOUT_SEED_OFFSET, i) for i in range(n_batches)]


@torch.no_grad()
def heldout_metrics(model: NanoTabPFN, batches: list[PriorBatch]) -> dict[str, float]:
    """Mean over test cells: `ce` over all max_classes logits (the training loss), `ce_present` and
    `accuracy` with the logits cut to each table's own classes (what the classifier does)."""
    model.eval()
    ce = ce_k = correct = cells = 0.0
    for b in batches:
        x_tr, y_tr, x_te, y_te = b.split()
        logits = model(x_tr, y_tr, x_te)
        absent = torch.arange(logits.shape[-1]) >= b.n_classes[:, None, None]
        cut = logits.masked_fill(absent, float("-inf"))
        ce += float(F.cross_entropy(logits.flatten(0, 1), y_te.flatten(), reduction="sum"))
        ce_k += float(F.cross_entropy(cut.flatten(0, 1), y_te.flatten(), reduction="sum"))
        correct += float((cut.argmax(-1) == y_te).sum())
        cells += y_te.numel()
    return {"ce": ce / cells, "ce_present": ce_k / cells, "accuracy": correct / cells, "tables": sum(len(b.y) for b in batches)}


# ============================================================================ training
def lr_at(cfg: NanoConfig, step: int, progress: float) -> float:
    """Linear warm-up over cfg.warmup_steps, then cosine from lr to lr * final_lr_fraction as `progress`
    (the spent share of the budget, wall clock or steps) goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.final_lr_fraction + (1.0 - cfg.final_lr_fraction) * cosine)


def train(model: NanoTabPFN, minutes: float = math.inf, max_steps: int | None = None, seed: int = 0,
          clock: str = "wall", log_every_s: float = 30.0,
          batch_fn: Callable[[NanoConfig, int, int], PriorBatch] = prior_batch,
          log: Callable[[str], None] | None = print) -> dict:
    """Train on prior batches until `minutes` of `clock` ("wall", or "cpu": this process's CPU time, the
    fair budget on a shared machine) or `max_steps` steps, whichever comes first. Returns steps, tables,
    cells (tables x rows x (features + 1)), wall / CPU minutes (and the CPU share spent generating
    tables) and a short loss history (EMA of the training loss)."""
    if max_steps is None and not math.isfinite(minutes):
        raise ValueError("train needs a budget: minutes or max_steps")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    spent = (lambda: time.perf_counter() - t0) if clock == "wall" else (lambda: time.process_time() - c0)
    cfg = model.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    budget_s = minutes * 60.0
    t0, c0 = time.perf_counter(), time.process_time()
    data_cpu, step, ema, history, last_log = 0.0, 0, None, [], t0
    model.train()
    while True:
        progress = max(spent() / budget_s if math.isfinite(budget_s) else 0.0, step / max_steps if max_steps else 0.0)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, progress)
        c = time.process_time()
        batch = batch_fn(cfg, seed, step)
        data_cpu += time.process_time() - c
        x_tr, y_tr, x_te, y_te = batch.split()
        loss = F.cross_entropy(model(x_tr, y_tr, x_te).flatten(0, 1), y_te.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        value = loss.item()
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        now = time.perf_counter()
        if now - last_log >= log_every_s or step == 1:
            last_log = now
            history.append({"step": step, "wall_s": round(now - t0, 1), "loss_ema": round(ema, 4)})
            if log is not None:
                rate = step * cfg.batch_size / (now - t0)
                log(f"step {step:6d} | {(now - t0) / 60:5.1f} min | loss {ema:.4f} | lr {lr_at(cfg, step, progress):.2e} "
                    f"| {rate:5.1f} tables/s")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tables = step * cfg.batch_size
    history.append({"step": step, "wall_s": round(wall, 1), "loss_ema": None if ema is None else round(ema, 4)})
    model.eval()
    return {"steps": step, "tables": tables, "cells": tables * cfg.rows * (cfg.features + 1),
            "wall_minutes": wall / 60, "cpu_minutes": cpu / 60, "data_cpu_fraction": data_cpu / max(cpu, 1e-9),
            "tables_per_s": tables / max(wall, 1e-9), "tables_per_cpu_s": tables / max(cpu, 1e-9), "clock": clock,
            "final_loss_ema": ema, "loss_history": history}


# ============================================================================ weights
def save_weights(model: NanoTabPFN, out: str | Path, record: dict | None = None) -> str:
    """Write out/model.safetensors and out/config.json (NanoConfig + `record`); returns the weights' sha256[:12]."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    sha = weights_sha(out)
    (out / "config.json").write_text(json.dumps({"config": asdict(model.cfg), "sha256_12": sha, **(record or {})}, indent=1))
    return sha


def weights_sha(directory: str | Path) -> str:
    """sha256 of model.safetensors, first 12 hex digits (the eval cache's method version)."""
    return hashlib.sha256((Path(directory) / "model.safetensors").read_bytes()).hexdigest()[:12]


def load_weights(directory: str | Path) -> tuple[NanoTabPFN, dict]:
    """The model saved by save_weights (safetensors only) and its config.json record."""
    from safetensors.torch import load_file

    directory = Path(directory)
    record = json.loads((directory / "config.json").read_text())
    model = NanoTabPFN(NanoConfig(**record["config"]))
    model.load_state_dict(load_file(str(directory / "model.safetensors")))
    return model.eval(), record


# ============================================================================ scikit-learn classifier
class _NumericEncoder:
    """Columns -> float64 matrix: numbers as they are, categorical / text columns as codes of the
    categories seen at fit (unseen or missing -> NaN), +-inf -> NaN. nanoTabPFN treats all as numbers."""

    def fit(self, X) -> "_NumericEncoder":
        self.categories: dict[int, pd.Index] = {}
        if isinstance(X, pd.DataFrame):
            for j, c in enumerate(X.columns):
                s = X[c]
                if isinstance(s.dtype, pd.CategoricalDtype):
                    self.categories[j] = s.cat.categories
                elif not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)):
                    self.categories[j] = pd.Index(sorted(s.dropna().astype(str).unique()))
        self.n_features = X.shape[1]
        return self

    def transform(self, X) -> np.ndarray:
        if X.shape[1] != self.n_features:
            raise ValueError(f"X has {X.shape[1]} features, the classifier was fitted on {self.n_features}")
        if isinstance(X, pd.DataFrame):
            cols = []
            for j, c in enumerate(X.columns):
                s = X[c]
                if j in self.categories:
                    values = s.astype(str).where(s.notna(), None) if not isinstance(s.dtype, pd.CategoricalDtype) else s
                    codes = pd.Categorical(values, categories=self.categories[j]).codes.astype(np.float64)
                    cols.append(np.where(codes < 0, np.nan, codes))
                else:
                    cols.append(pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan))
            out = np.stack(cols, 1) if cols else np.empty((len(X), 0))
        else:
            out = np.array(X, dtype=np.float64)
            if out.ndim != 2:
                raise ValueError(f"X must be 2-D, got shape {out.shape}")
        out[np.isinf(out)] = np.nan
        return out


class NanoTabPFNClassifier(ClassifierMixin, BaseEstimator):
    """scikit-learn classifier around a trained NanoTabPFN: fit stores the rows, predict_proba runs the
    model in context. An ensemble of `n_estimators` members, each with its own feature order and class
    relabelling (member 0: the identity), averages probabilities; train rows above `max_context_rows`
    are subsampled (stratified, seeded); test rows go through in chunks of `chunk_rows`."""

    def __init__(self, model: NanoTabPFN | str | None = None, n_estimators: int = 4, max_context_rows: int = 2048,
                 chunk_rows: int = 1024, random_state: int = 0):
        self.model = model
        self.n_estimators = n_estimators
        self.max_context_rows = max_context_rows
        self.chunk_rows = chunk_rows
        self.random_state = random_state

    def _net(self) -> NanoTabPFN:
        if self.model is None:
            raise ValueError("NanoTabPFNClassifier needs a model: a NanoTabPFN or a directory written by save_weights")
        if not isinstance(self.model, nn.Module):
            self.model = load_weights(self.model)[0]
        return self.model.eval()

    def fit(self, X, y) -> "NanoTabPFNClassifier":
        limit = self._net().cfg.max_classes
        self.classes_, codes = np.unique(np.asarray(y), return_inverse=True)
        if len(self.classes_) > limit:
            raise ValueError(f"NanoTabPFNClassifier: y has {len(self.classes_)} classes, more than the model's "
                             f"max_classes={limit}")
        self._encoder = _NumericEncoder().fit(X)
        Xn = self._encoder.transform(X)
        keep = self._context_rows(codes)
        self._X, self._y = Xn[keep], codes[keep]
        self.n_features_in_ = Xn.shape[1]
        return self

    def _context_rows(self, codes: np.ndarray) -> np.ndarray:
        """All rows, or max_context_rows of them: stratified when every class can keep a row, else random."""
        n = len(codes)
        if n <= self.max_context_rows:
            return np.arange(n)
        from sklearn.model_selection import train_test_split

        try:
            keep, _ = train_test_split(np.arange(n), train_size=self.max_context_rows, stratify=codes,
                                       random_state=self.random_state)
        except ValueError:  # a class with a single row: stratification impossible
            keep = np.random.default_rng(self.random_state).choice(n, self.max_context_rows, replace=False)
        return np.sort(keep)

    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        if not hasattr(self, "_X"):
            raise ValueError("NanoTabPFNClassifier is not fitted: call fit(X, y) first")
        net, K = self._net(), len(self.classes_)
        X_test = self._encoder.transform(X)
        P = np.zeros((len(X_test), K))
        for e in range(self.n_estimators):
            rng = np.random.default_rng([self.random_state, e])
            features = np.arange(self._X.shape[1]) if e == 0 else rng.permutation(self._X.shape[1])
            relabel = np.arange(K) if e == 0 else rng.permutation(K)  # class c is shown to the model as relabel[c]
            x_tr = torch.from_numpy(self._X[:, features]).float()[None]
            y_tr = torch.from_numpy(relabel[self._y])[None]
            for lo in range(0, len(X_test), self.chunk_rows):
                x_te = torch.from_numpy(X_test[lo:lo + self.chunk_rows, features]).float()[None]
                probs = torch.softmax(net(x_tr, y_tr, x_te)[0, :, :K].double(), -1).numpy()
                P[lo:lo + len(probs)] += probs[:, relabel]
        return P / self.n_estimators

    def predict(self, X) -> np.ndarray:
        return self.classes_[self.predict_proba(X).argmax(1)]


# ============================================================================ public suite
def evaluate_public(model: NanoTabPFN, version: str, datasets: list[str] | None = None, out_dir: str | Path | None = None,
                    n_estimators: int = 4, suite_dir: str | Path | None = None) -> dict:
    """The public classification suite under the project's protocol (tabfm.eval.runner.evaluate);
    returns {"datasets": {name: {roc_auc, accuracy, log_loss}}, "mean": {...}, "failures": {...}}."""
    from tabfm.eval.runner import Method, evaluate
    from tabfm.eval.suites import default_public_dir

    suite_dir = Path(suite_dir) if suite_dir else default_public_dir()
    if not (suite_dir / "classification").is_dir():
        raise SystemExit(f"no public classification suite under {suite_dir}: run `tabfm eval build-public {suite_dir}`")
    factory = lambda: NanoTabPFNClassifier(model, n_estimators=n_estimators)  # noqa: E731
    report = evaluate("classification", suite_dir,
                      {"nanotabpfn": Method(factory, version={"weights": version, "n_estimators": str(n_estimators)})},
                      out_dir=out_dir, datasets=datasets, n_threads=1, plots=False, verbose=False,
                      command={"argv": sys.argv[1:]})
    per = {d: dict(m["nanotabpfn"]) for d, m in report.scores.items() if "nanotabpfn" in m}
    metrics = ("roc_auc", "accuracy", "log_loss")
    mean = {k: float(np.mean([v[k] for v in per.values()])) for k in metrics} if per else {}
    return {"datasets": per, "mean": mean, "failures": {d: e.get("nanotabpfn") for d, e in report.errors.items()},
            "n_datasets": len(per), "suite_dir": str(suite_dir)}


def print_summary(heldout: dict, suite: dict | None) -> None:
    print(f"\nheld-out synthetic ({heldout['tables']} tables of 150 x 5): CE {heldout['ce']:.4f} (all logits), "
          f"CE {heldout['ce_present']:.4f} (own classes), accuracy {heldout['accuracy']:.4f}")
    if not suite:
        return
    print(f"\npublic classification suite, model alone ({suite['n_datasets']} datasets, 5-fold CV)\n")
    print("| dataset | ROC-AUC | accuracy | log-loss |\n|---|---:|---:|---:|")
    for name, m in suite["datasets"].items():
        print(f"| {name} | {m['roc_auc']:.4f} | {m['accuracy']:.4f} | {m['log_loss']:.4f} |")
    if suite["mean"]:
        m = suite["mean"]
        print(f"| **mean** | **{m['roc_auc']:.4f}** | **{m['accuracy']:.4f}** | **{m['log_loss']:.4f}** |")
    for name, err in suite["failures"].items():
        print(f"FAILED {name}: {err}")


# ============================================================================ command line
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="training budget in minutes of --clock (default 30)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="budget clock: wall (like tabfm pretrain --max-minutes) or this process's CPU time")
    p.add_argument("--seed", type=int, default=0, help="training stream seed (held-out: seed + %d)" % HELDOUT_SEED_OFFSET)
    p.add_argument("--out", default=None, help="directory for model.safetensors + config.json (default runs/nanotabpfn-<minutes>min)")
    p.add_argument("--load", default=None, help="evaluate the weights in this directory; no training")
    p.add_argument("--heldout-tables", type=int, default=256)
    p.add_argument("--datasets", default=None, help="comma-separated public classification datasets (default: all)")
    p.add_argument("--skip-suite", action="store_true", help="no public-suite evaluation")
    p.add_argument("--n-estimators", type=int, default=4)
    p.add_argument("--eval-out", default=None, help="evaluate()'s reports and cache (default <out>/eval)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=float, default=30.0, help="seconds between training log lines")
    p.add_argument("--quick", action="store_true", help="1 minute of training, 64 held-out tables, wine/breast_cancer/penguins")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "nanotabpfn_reference.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.heldout_tables, args.log_every = 1.0, 64, 10.0
        args.datasets = args.datasets or ",".join(QUICK_DATASETS)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.load:
        model, record = load_weights(args.load)
        out, training = Path(args.load), record.get("training", {})
        print(f"loaded {out} ({training.get('steps', '?')} steps, {training.get('tables', '?')} tables)")
    else:
        out = Path(args.out or ROOT / "runs" / f"nanotabpfn-{args.minutes:g}min")
        model = NanoTabPFN(NanoConfig())
        n_params = sum(q.numel() for q in model.parameters())
        print(f"training nanoTabPFN reference ({n_params:,} parameters) for {args.minutes:g} {args.clock} min on "
              f"{args.threads} thread(s), seed {args.seed}")
        training = train(model, minutes=args.minutes, seed=args.seed, clock=args.clock, log_every_s=args.log_every)
        save_weights(model, out, {"training": training, "seed": args.seed})
        print(f"{training['steps']} steps, {training['tables']} tables in {training['wall_minutes']:.1f} min wall / "
              f"{training['cpu_minutes']:.1f} min CPU, {training['tables_per_s']:.1f} tables/s (wall), "
              f"data generation {100 * training['data_cpu_fraction']:.0f}% of CPU; weights in {out}")
    sha = weights_sha(out)
    cfg = model.cfg
    t0 = time.perf_counter()
    heldout = heldout_metrics(model, heldout_batches(cfg, args.seed, args.heldout_tables))
    heldout["seconds"] = time.perf_counter() - t0
    suite = None
    if not args.skip_suite:
        datasets = args.datasets.split(",") if args.datasets else None
        t0 = time.perf_counter()
        suite = evaluate_public(model, sha, datasets, args.eval_out or out / "eval", args.n_estimators)
        suite["seconds"] = time.perf_counter() - t0
    print_summary(heldout, suite)
    result = {
        "model": "nanotabpfn-reference", "weights": str(out), "sha256_12": sha, "config": asdict(cfg),
        "parameters": sum(q.numel() for q in model.parameters()), "seed": args.seed, "threads": args.threads,
        "argv": sys.argv[1:] if argv is None else argv,
        "training": {k: v for k, v in training.items()},
        "heldout": heldout, "public_classification": suite,
        "torch": torch.__version__,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
