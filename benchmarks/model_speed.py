"""Model speed on CPU: train-step cells/s, inference latency and MFU of the tabfm presets,
side by side with TabPFN v2's architecture at equal size (random weights), in one run.

    python benchmarks/model_speed.py [--presets tiny,small,base] [--threads 1] [--reps 3]
                                     [--precisions fp32,bf16] [--no-tabpfn] [--quick]
                                     [--json benchmarks/results/model_speed.json]

What is measured (every case in the same process, interleaved):

- train step: `zero_grad -> forward -> loss -> backward -> AdamW.step` on B tables x R rows
  x C columns (main shape 8 x 256 x 16: the first 3/4 of each table's rows are context,
  the target column (the last, categorical, 5 classes) of the other rows is hidden).
  tabfm: `masked_cell_loss(model(batch), batch)`; TabPFN: cross-entropy of its 10-class
  output on the hidden targets. cells/s = B * R * C / step time (the same table for both,
  whatever each model's tokenisation).
- inference latency: one table of 1024 rows x 32 columns, the target of the last 256 rows
  hidden, the other 768 rows context; eval mode under `torch.inference_mode`.
- fp32, and bf16 as `torch.autocast("cpu", dtype=torch.bfloat16)` (weights stay fp32).
- the CPU's matmul peak: a 2048^3 `torch.matmul` in fp32 and in bf16, same thread count,
  timed in the same interleaved rounds as the models.

Timing: round 0 is warm-up (excluded); then `--reps` rounds, each running every case once
in a fixed order (so slow drifts of the machine load hit all cases alike). Per case the
minimum over rounds is kept, both of wall time (`time.perf_counter`) and of process CPU
time (`time.process_time`). At 1 thread the CPU time is the time the step needed on a core,
whatever else the machine ran; wall time also counts the time the scheduler gave to other
processes. Rates, ratios and MFU are reported from both; the printed table leads with the
CPU-time figures because this benchmark is meant to run next to other work (`nice`).

FLOPs (analytic, per step; the transformer blocks only - encoder, heads and norms, < 1 %
at these shapes, are left out, which understates MFU slightly):
    linear layer      2 * in * out per token it is applied to
    attention         4 * L_q * L_k * d per sequence (QK^T and AV; d = all heads together)
    train step        3 x forward (backward = 2 x forward; recomputation is not counted)
tabfm, per block, tokens = B * (R + T) * C (T thinking rows), keys = context rows + T:
    col attention     tokens * 2 * (3d^2 + d^2)  +  B*(R+T) rows * 4 * C^2 * d
    row attention     tokens * 2 * (3d^2 + d^2)  +  B*C columns * 4 * (R+T) * keys * d
                      (qkv is projected for every row, as the implementation does)
    MLP               tokens * 2 * 2 * d * mlp_hidden
TabPFN v2, per block, S = ceil((C-1)/2) + 1 tokens per row (2 features per token, plus
the target), tokens = B * R * S, N = context (train) rows:
    feature attention tokens * 2 * 4d^2  +  B*R rows * 4 * S^2 * d
    item attention    tokens * 2 * 2d^2 (q, out)  +  B*N*S * 2 * 2d^2 (k, v on train rows)
                      +  B*S columns * 4 * R * N * d (train->train and test->train)
    MLP               tokens * 2 * 2 * d * 4d
`torch.utils.flop_counter.FlopCounterMode` does not count SDPA on CPU (torch 2.13 registers
only the CUDA attention kernels), so it is used only as a cross-check: its matmul count of
one fp32 step (encoder, heads and explicit matmuls included, SDPA excluded) is reported
next to the analytic linear-layer count.

The TabPFN side: the `tabpfn` package (never a dependency of this project; install it in a
separate environment) provides `tabpfn.architectures.tabpfn_v2.TabPFNV2`, built here from
`TabPFNV2Config(emsize=d_model, nlayers=n_layers, nhead=n_heads, max_num_classes=10)` with
random weights (no checkpoint is loaded or downloaded; its zero-initialised output
projections are re-drawn so no matrix is all zeros). Its MLP is fixed at 4 x emsize and it
groups 2 features per token; those differences are part of the architecture compared.
Without the package, `V2LikeModel` below re-implements the v2 architecture and its rows are
labelled "tabpfn-v2-like (re-implemented)".

`--profile` (on by default in a full run) profiles one tiny bf16 train step with
torch.profiler and prints the top ops by self CPU time.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tabfm.data.batch import TableBatch  # noqa: E402
from tabfm.model import ModelConfig, TabFM, masked_cell_loss  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "model_speed.json"
N_CLASSES_TARGET = 5  # classes of the target column
TABPFN_N_OUT = 10  # TabPFN v2 classifier output width
GOAL_SPEEDUP = 1.5  # issue goal: >= 1.5x TabPFN v2's architecture in train cells/s
GOAL_MFU_BF16 = 0.50  # issue goal: >= 50 % of the bf16 matmul peak in a train step
ISSUE_REFERENCE = {"tabpfn_v2_train_cells_per_s_1thread": {"fp32": 1900, "bf16": 2700}, "tabpfn_v2_bf16_mfu": 0.37}
LABEL_PACKAGE = "tabpfn-v2 (tabpfn {version}, random weights)"
LABEL_REIMPL = "tabpfn-v2-like (re-implemented)"


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """B tables x R rows x C columns; the first `context` rows of each are context, the
    target (last column) of the other rows is hidden."""

    tables: int
    rows: int
    cols: int
    context: int

    @property
    def cells(self) -> int:
        return self.tables * self.rows * self.cols

    @property
    def queries(self) -> int:
        return self.rows - self.context

    def label(self) -> str:
        return f"{self.tables}x{self.rows}x{self.cols} ({self.context} context rows)"


TRAIN_SHAPE = Shape(tables=8, rows=256, cols=16, context=192)
INFER_SHAPE = Shape(tables=1, rows=1024, cols=32, context=768)
QUICK_TRAIN_SHAPE = Shape(tables=2, rows=32, cols=8, context=24)
QUICK_INFER_SHAPE = Shape(tables=1, rows=64, cols=8, context=48)
PEAK_N, QUICK_PEAK_N = 2048, 256


def make_batch(shape: Shape, seed: int = 0, cat_fraction: float = 0.3) -> TableBatch:
    """A synthetic prediction batch: Gaussian numeric columns, ~30 % categorical feature
    columns (5 codes), a categorical target in the last column, no missing cells."""
    b, r, c = shape.tables, shape.rows, shape.cols
    g = torch.Generator().manual_seed(seed)
    kind = torch.where(torch.rand(b, c, generator=g) < cat_fraction, 2, 1).to(torch.int8)
    kind[:, -1] = 2
    card = torch.where(kind == 2, N_CLASSES_TARGET, 0).long()
    x = torch.randn(b, r, c, generator=g)
    codes = torch.randint(0, N_CLASSES_TARGET, (b, r, c), generator=g).float()
    x = torch.where(kind[:, None, :] == 2, codes, x)
    context = torch.zeros(b, r, dtype=torch.bool)
    context[:, : shape.context] = True
    query = torch.zeros(b, r, c, dtype=torch.bool)
    query[:, shape.context :, -1] = True
    ones_r, ones_c = torch.ones(b, r, dtype=torch.bool), torch.ones(b, c, dtype=torch.bool)
    return TableBatch(x, kind, card, ones_r, ones_c, context, query).validate()


def tabpfn_inputs(batch: TableBatch, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same tables in TabPFN's format: X (R, B, C-1) features, y (N, B) train targets,
    and the hidden test targets (R-N, B) as class indices."""
    x = batch.x.transpose(0, 1).contiguous()  # (R, B, C)
    return x[:, :, :-1].contiguous(), x[:context, :, -1].contiguous(), x[context:, :, -1].long()


# ------------------------------------------------------------------------------ FLOPs
def tabfm_flops(cfg: ModelConfig, shape: Shape, train: bool = True) -> dict[str, float]:
    """Analytic FLOPs of the tabfm blocks for one step on `shape` (see module docstring)."""
    d, h, t, g = cfg.d_model, cfg.mlp_hidden, cfg.n_thinking_rows, cfg.cells_per_token
    b, r, c = shape.tables, shape.rows + t, math.ceil(shape.cols / g)  # c: tokens per row
    keys = shape.context + t
    tokens = b * r * c
    linear = tokens * (2 * 4 * d * d) * 2 + tokens * 2 * 2 * d * h
    attention = b * r * 4 * c * c * d + b * c * 4 * r * keys * d
    k = (3 if train else 1) * cfg.n_layers
    pack = (3 if train else 1) * tokens * 2 * g * d * d if g > 1 else 0  # cells -> tokens (not a block)
    return {"linear": float(k * linear + pack), "attention": float(k * attention),
            "total": float(k * (linear + attention) + pack)}


def tabpfn_v2_flops(d: int, n_layers: int, shape: Shape, train: bool = True, features_per_group: int = 2) -> dict[str, float]:
    """Analytic FLOPs of the TabPFN v2 blocks for one step on `shape` (see module docstring)."""
    b, r, n = shape.tables, shape.rows, shape.context
    s = math.ceil((shape.cols - 1) / features_per_group) + 1
    tokens = b * r * s
    linear = tokens * 2 * 4 * d * d + tokens * 2 * 2 * d * d + b * n * s * 2 * 2 * d * d + tokens * 2 * 2 * d * 4 * d
    attention = b * r * 4 * s * s * d + b * s * 4 * r * n * d
    k = (3 if train else 1) * n_layers
    return {"linear": float(k * linear), "attention": float(k * attention), "total": float(k * (linear + attention))}


def counted_matmul_flops(step: Callable[[], object]) -> float | None:
    """FLOPs FlopCounterMode sees in one call of `step` (no SDPA on CPU); None if it fails."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            step()
        return float(counter.get_total_flops())
    except Exception:  # a cross-check only; never fail the benchmark over it
        return None


# ------------------------------------------------------------- TabPFN v2 reference side
def load_tabpfn_v2():
    """(module, version) of the installed tabpfn's v2 architecture, or (None, reason)."""
    try:
        from importlib.metadata import version

        from tabpfn.architectures import tabpfn_v2

        return tabpfn_v2, version("tabpfn")
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def build_tabpfn_v2(module, d: int, n_layers: int, n_heads: int, seed: int = 0) -> nn.Module:
    """TabPFN v2 from its config, random weights; zero-initialised matrices re-drawn."""
    torch.manual_seed(seed)
    cfg = module.TabPFNV2Config(emsize=d, nlayers=n_layers, nhead=n_heads, max_num_classes=TABPFN_N_OUT)
    model = module.TabPFNV2(config=cfg, n_out=TABPFN_N_OUT)
    _redraw_zero_matrices(model)
    return model


def _redraw_zero_matrices(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and not bool(p.any()):
                nn.init.normal_(p, std=0.02)


class _V2Attention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.h, self.hd = n_heads, d // n_heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def heads(self, t: torch.Tensor) -> torch.Tensor:  # (N, L, d) -> (N, H, L, hd)
        return t.view(t.shape[0], t.shape[1], self.h, self.hd).transpose(1, 2)

    def merge(self, o: torch.Tensor) -> torch.Tensor:  # (N, H, L, hd) -> (N, L, d)
        return self.out(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], self.h * self.hd))


class V2LikeBlock(nn.Module):
    """TabPFN v2 block: attention between the feature tokens of a row, attention of every
    row to the train rows of its column (train rows: all heads; test rows: the first
    key/value head only, as v2 does), MLP 4 x d with GELU; post-LayerNorm without affine;
    no biases."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.feat = _V2Attention(d, n_heads)
        self.item = _V2Attention(d, n_heads)
        self.norms = nn.ModuleList(nn.LayerNorm(d, elementwise_affine=False) for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x: torch.Tensor, n_train: int) -> torch.Tensor:  # x (B, R, S, d)
        b, r, s, d = x.shape
        a = self.feat
        y = x.reshape(b * r, s, d)
        o = F.scaled_dot_product_attention(a.heads(a.q(y)), a.heads(a.k(y)), a.heads(a.v(y)))
        x = self.norms[0](x + a.merge(o).view(b, r, s, d))
        t = x.transpose(1, 2).contiguous().view(b * s, r, d)
        a = self.item
        q, k, v = a.heads(a.q(t)), a.heads(a.k(t[:, :n_train])), a.heads(a.v(t[:, :n_train]))
        o_train = F.scaled_dot_product_attention(q[:, :, :n_train], k, v)
        k1, v1 = (z[:, :1].expand(-1, a.h, -1, -1) for z in (k, v))
        o_test = F.scaled_dot_product_attention(q[:, :, n_train:], k1, v1)
        t = t + a.merge(torch.cat([o_train, o_test], dim=2))
        x = self.norms[1](t.view(b, s, r, d)).transpose(1, 2).contiguous()
        return self.norms[2](x + self.mlp(x))


class V2LikeModel(nn.Module):
    """Re-implementation of TabPFN v2 (`forward(X (R, B, F), y (N, B)) -> (R-N, B, n_out)`):
    NaN/Inf indicators, mean imputation and standard scaling fitted on train rows, 2
    features per token (Linear(4, d)), a target token (Linear(2, d)), random column
    embeddings (Linear(d/4, d)), blocks as above, decoder d -> 4d -> n_out on the test
    rows' target tokens. Same parameter count as the package's TabPFNV2."""

    def __init__(self, d: int, n_layers: int, n_heads: int, n_out: int = TABPFN_N_OUT, features_per_group: int = 2) -> None:
        super().__init__()
        self.d, self.fpg = d, features_per_group
        self.feature_group_embedder = nn.Linear(2 * features_per_group, d, bias=False)
        self.target_embedder = nn.Linear(2, d)
        self.column_embedder = nn.Linear(d // 4, d)
        self.blocks = nn.ModuleList(V2LikeBlock(d, n_heads) for _ in range(n_layers))
        self.decoder = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, n_out))

    @staticmethod
    def _prep(x: torch.Tensor, n_train: int) -> torch.Tensor:  # (R, ..., F) -> scaled values ++ NaN indicator
        nan = torch.isnan(x)
        mean = torch.nanmean(x[:n_train], dim=0, keepdim=True)
        x = torch.where(nan, mean.expand_as(x), x)
        mu, sd = x[:n_train].mean(0, keepdim=True), x[:n_train].std(0, keepdim=True).clamp(min=1e-6)
        return torch.cat([(x - mu) / sd, nan.to(x.dtype) * -2.0], dim=-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r, b, f = x.shape
        n = y.shape[0]
        x = F.pad(x, (0, -f % self.fpg))
        g = x.shape[-1] // self.fpg
        groups = x.reshape(r, b * g, self.fpg)
        tok = self.feature_group_embedder(self._prep(groups, n)).view(r, b, g, self.d).transpose(0, 1)
        gen = torch.Generator().manual_seed(0)
        tok = tok + self.column_embedder(torch.randn(g, self.d // 4, generator=gen))
        yy = F.pad(y.reshape(n, b, 1), (0, 0, 0, 0, 0, r - n), value=float("nan"))
        ytok = self.target_embedder(self._prep(yy, n)).transpose(0, 1)  # (B, R, d)
        h = torch.cat([tok, ytok[:, :, None]], dim=2)
        for block in self.blocks:
            h = block(h, n)
        return self.decoder(h[:, n:, -1].transpose(0, 1))


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One timed callable. kind: 'train', 'infer' or 'peak'."""

    name: str
    fn: Callable[[], object]
    kind: str
    model: str = ""  # 'tabfm' / 'tabpfn' / ''
    preset: str = ""
    precision: str = ""
    cells: int = 0
    flops: dict[str, float] = field(default_factory=dict)
    inner: int = 1  # calls per timing (peak GEMMs: several short calls, min kept)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def tabfm_train_step(model: TabFM, opt: torch.optim.Optimizer, batch: TableBatch, precision: str) -> Callable[[], float]:
    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with _autocast(precision):
            loss, _ = masked_cell_loss(model(batch), batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def tabfm_infer(model: TabFM, batch: TableBatch, precision: str) -> Callable[[], object]:
    def run():
        with torch.inference_mode(), _autocast(precision):
            return model(batch).num_logits

    return run


def tabpfn_train_step(model: nn.Module, opt: torch.optim.Optimizer, inputs, precision: str) -> Callable[[], float]:
    x, y, target = inputs

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with _autocast(precision):
            out = model(x, y)  # (M, B, n_out)
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def tabpfn_infer(model: nn.Module, inputs, precision: str) -> Callable[[], object]:
    x, y, _ = inputs

    def run():
        with torch.inference_mode(), _autocast(precision):
            return model(x, y)

    return run


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def build_cases(
    presets: list[str],
    precisions: list[str],
    train_shape: Shape,
    infer_shape: Shape,
    reference: str,
    peak_n: int,
    seed: int = 0,
    cells_per_token: tuple[int, ...] = (1,),
) -> tuple[list[Case], dict]:
    """All timed cases plus a description of the models (params, reference kind)."""
    train_batch, infer_batch = make_batch(train_shape, seed), make_batch(infer_shape, seed + 1)
    pfn_train, pfn_infer = tabpfn_inputs(train_batch, train_shape.context), tabpfn_inputs(infer_batch, infer_shape.context)
    module, version = (None, "disabled (--no-tabpfn)") if reference == "none" else (None, "forced (--reference reimpl)")
    if reference in ("auto", "package"):
        module, version = load_tabpfn_v2()
        if module is None and reference == "package":
            raise SystemExit(f"--reference package: tabpfn v2 architecture not importable ({version})")
    ref_label = None
    if reference != "none":
        ref_label = LABEL_PACKAGE.format(version=version) if module is not None else LABEL_REIMPL
    info: dict = {"reference": ref_label, "reference_note": None if module is not None else version, "models": {}}

    cases: list[Case] = []
    for preset in presets:
        cfgs, pair = {}, {}
        for g in cells_per_token:  # "tabfm" = one token per cell, "tabfm-g4" = 4 cells per token
            name = "tabfm" if g == 1 else f"tabfm-g{g}"
            cfgs[name] = ModelConfig.preset(preset, cells_per_token=g)
            torch.manual_seed(seed)
            pair[name] = TabFM(cfgs[name])
        cfg = ModelConfig.preset(preset)
        if reference != "none":
            if module is not None:
                try:
                    pair["tabpfn"] = build_tabpfn_v2(module, cfg.d_model, cfg.n_layers, cfg.n_heads, seed)
                except Exception as exc:  # noqa: BLE001 - fall back, and say so
                    info["reference"], info["reference_note"] = LABEL_REIMPL, f"constructing TabPFNV2 failed: {exc!r}"
                    module = None
            if module is None:
                torch.manual_seed(seed)
                pair["tabpfn"] = V2LikeModel(cfg.d_model, cfg.n_layers, cfg.n_heads)
        for name, model in pair.items():
            info["models"][f"{name}/{preset}"] = {
                "params": sum(p.numel() for p in model.parameters()),
                "d_model": cfg.d_model,
                "n_layers": cfg.n_layers,
                "n_heads": cfg.n_heads,
                "mlp_hidden": cfg.mlp_hidden if name in cfgs else 4 * cfg.d_model,
                "tokens_per_row": (math.ceil(train_shape.cols / cfgs[name].cells_per_token) if name in cfgs
                                   else math.ceil((train_shape.cols - 1) / 2) + 1),
                "thinking_rows": cfg.n_thinking_rows if name in cfgs else 0,
            }
        for prec in precisions:
            for name, model in pair.items():
                model.train()
                opt = _adamw(model)
                if name in cfgs:
                    step = tabfm_train_step(model, opt, train_batch, prec)
                    fl = tabfm_flops(cfgs[name], train_shape, train=True)
                    infer, fl_inf = tabfm_infer(model, infer_batch, prec), tabfm_flops(cfgs[name], infer_shape, train=False)
                else:
                    step = tabpfn_train_step(model, opt, pfn_train, prec)
                    fl = tabpfn_v2_flops(cfg.d_model, cfg.n_layers, train_shape, train=True)
                    infer, fl_inf = tabpfn_infer(model, pfn_infer, prec), tabpfn_v2_flops(cfg.d_model, cfg.n_layers, infer_shape, train=False)
                common = {"model": name, "preset": preset, "precision": prec}
                cases.append(Case(f"{name} {preset} {prec} train", step, "train", cells=train_shape.cells, flops=fl, **common))
                cases.append(Case(f"{name} {preset} {prec} infer", _eval_mode(model, infer), "infer", cells=infer_shape.cells, flops=fl_inf, **common))
    a32, b32 = torch.randn(peak_n, peak_n), torch.randn(peak_n, peak_n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    peak_flops = {"total": 2.0 * peak_n**3}
    cases.append(Case("peak fp32 matmul", lambda: torch.matmul(a32, b32), "peak", precision="fp32", flops=peak_flops, inner=3))
    cases.append(Case("peak bf16 matmul", lambda: torch.matmul(a16, b16), "peak", precision="bf16", flops=peak_flops, inner=3))
    return cases, info


def _eval_mode(model: nn.Module, fn: Callable[[], object]) -> Callable[[], object]:
    """Run fn with the model in eval mode, restoring train mode after (train steps share it)."""

    def run():
        model.eval()
        try:
            return fn()
        finally:
            model.train()

    return run


# ---------------------------------------------------------------------------- timing
def time_call(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call, with Python's GC paused."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w0, time.process_time() - c0
    finally:
        if was_enabled:
            gc.enable()


def run_interleaved(cases: list[Case], reps: int, log: Callable[[str], None] = lambda s: None) -> None:
    """Round 0 warms up (not recorded); rounds 1..reps time every case once, in order."""
    for rnd in range(reps + 1):
        gc.collect()  # GC is paused inside timed calls; collect between rounds
        t0 = time.perf_counter()
        for case in cases:
            best_w, best_c = math.inf, math.inf
            for _ in range(case.inner):
                w, c = time_call(case.fn)
                best_w, best_c = min(best_w, w), min(best_c, c)
            if rnd > 0:
                case.wall.append(best_w)
                case.cpu.append(best_c)
        log(f"round {rnd}/{reps} {'(warm-up) ' if rnd == 0 else ''}done in {time.perf_counter() - t0:.1f} s, load {os.getloadavg()[0]:.2f}")


# --------------------------------------------------------------------------- results
def summarise(cases: list[Case], info: dict) -> dict:
    peaks = {}
    for c in cases:
        if c.kind == "peak":
            peaks[c.precision] = {
                clock: c.flops["total"] / min(getattr(c, clock)) / 1e9 for clock in ("cpu", "wall")
            }
    rows = []
    by_key = {(c.model, c.preset, c.precision, c.kind): c for c in cases if c.kind != "peak"}
    for c in cases:
        if c.kind != "train":
            continue
        inf = by_key[(c.model, c.preset, c.precision, "infer")]
        row = {
            "model": c.model,
            "label": c.model if c.model.startswith("tabfm") else info["reference"],
            "preset": c.preset,
            "precision": c.precision,
            "params": info["models"][f"{c.model}/{c.preset}"]["params"],
        }
        for clock in ("cpu", "wall"):
            t = min(getattr(c, clock))
            ti = min(getattr(inf, clock))
            row[f"train_step_s_{clock}"] = t
            row[f"train_step_s_{clock}_median"] = sorted(getattr(c, clock))[len(getattr(c, clock)) // 2]
            row[f"cells_per_s_{clock}"] = c.cells / t
            row[f"gflops_{clock}"] = c.flops["total"] / t / 1e9
            row[f"mfu_{clock}"] = c.flops["total"] / t / 1e9 / peaks[c.precision][clock]
            row[f"infer_ms_{clock}"] = ti * 1e3
            row[f"infer_mfu_{clock}"] = inf.flops["total"] / ti / 1e9 / peaks[c.precision][clock]
        row["train_flops"] = c.flops
        row["infer_flops"] = inf.flops
        rows.append(row)
    for row in rows:  # ratios vs the reference at the same preset and precision, same run
        ref = next((r for r in rows if r["model"] == "tabpfn" and r["preset"] == row["preset"] and r["precision"] == row["precision"]), None)
        for clock in ("cpu", "wall"):
            key = f"cells_per_s_{clock}"
            ours = row["model"].startswith("tabfm")
            row[f"speedup_vs_tabpfn_{clock}"] = row[key] / ref[key] if (ref and ours) else None
            row[f"infer_speedup_vs_tabpfn_{clock}"] = ref[f"infer_ms_{clock}"] / row[f"infer_ms_{clock}"] if (ref and ours) else None
    goals = []
    for row in rows:
        if not row["model"].startswith("tabfm"):
            continue
        sp = row["speedup_vs_tabpfn_cpu"]
        goals.append({
            "model": row["model"],
            "preset": row["preset"],
            "precision": row["precision"],
            "speedup_vs_tabpfn_cpu": sp,
            "speedup_goal_met": None if sp is None else sp >= GOAL_SPEEDUP,
            "mfu_cpu": row["mfu_cpu"],
            "mfu_goal_met": (row["mfu_cpu"] >= GOAL_MFU_BF16) if row["precision"] == "bf16" else None,
        })
    peak_n = next((int(round((c.flops["total"] / 2) ** (1 / 3))) for c in cases if c.kind == "peak"), 0)
    return {"peak_gflops": peaks, "peak_matmul_n": peak_n, "rows": rows, "goals": goals}


def print_table(summary: dict, info: dict, train_shape: Shape, infer_shape: Shape) -> None:
    p = summary["peak_gflops"]
    print(f"\nmatmul peak ({summary['peak_matmul_n']}^3 torch.matmul, min over rounds): "
          + ", ".join(f"{k} {v['cpu']:.0f} GFLOP/s (cpu-time) / {v['wall']:.0f} (wall)" for k, v in p.items()))
    print(f"train step on {train_shape.label()}; inference on {infer_shape.label()}")
    print(f"reference: {info['reference']}" + (f"  [{info['reference_note']}]" if info.get("reference_note") else ""))
    head = (f"{'preset':6} {'prec':4} {'model':8} {'params':>8} {'cells/s':>8} {'(wall)':>8} {'x tabpfn':>8} "
            f"{'(wall)':>6} {'MFU %':>6} {'(wall)':>6} {'infer ms':>9} {'(wall)':>8} {'x tabpfn':>8}")
    print(head)
    print("-" * len(head))
    for r in summary["rows"]:
        sp = r["speedup_vs_tabpfn_cpu"]
        spw = r["speedup_vs_tabpfn_wall"]
        isp = r["infer_speedup_vs_tabpfn_cpu"]
        print(
            f"{r['preset']:6} {r['precision']:4} {r['model']:8} {r['params'] / 1e6:7.2f}M "
            f"{r['cells_per_s_cpu']:8,.0f} {r['cells_per_s_wall']:8,.0f} "
            f"{(f'{sp:.2f}x' if sp else '-'):>8} {(f'{spw:.2f}x' if spw else '-'):>6} "
            f"{100 * r['mfu_cpu']:6.1f} {100 * r['mfu_wall']:6.1f} "
            f"{r['infer_ms_cpu']:9.1f} {r['infer_ms_wall']:8.1f} {(f'{isp:.2f}x' if isp else '-'):>8}"
        )
    print("cells/s, MFU and latency from process CPU time (min over rounds); '(wall)' from wall-clock time.")
    for g in summary["goals"]:
        sp = g["speedup_vs_tabpfn_cpu"]
        msg = f"goal check {g['model']:8} {g['preset']:5} {g['precision']}: speed {('%.2fx' % sp) if sp else 'n/a'} vs >= {GOAL_SPEEDUP}x " \
              f"[{'met' if g['speedup_goal_met'] else ('n/a' if sp is None else 'MISSED')}]"
        if g["precision"] == "bf16":
            msg += f"; bf16 MFU {100 * g['mfu_cpu']:.1f} % vs >= {100 * GOAL_MFU_BF16:.0f} % [{'met' if g['mfu_goal_met'] else 'MISSED'}]"
        print(msg)


# --------------------------------------------------------------------------- profile
PROFILE_CATEGORIES = {  # op-name substrings -> category (first match wins)
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "mkldnn", "aten::linear", "aten::matmul"),
    "sdpa": ("scaled_dot_product", "flash_attention"),
    "softmax": ("softmax",),
    "copy/cast/layout": ("copy_", "_to_copy", "contiguous", "clone", "aten::cat", "empty", "stack", "index", "gather", "scatter"),
    "optimizer": ("Optimizer", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt"),
}


def profile_train_step(preset: str, precision: str, shape: Shape, top: int = 15, seed: int = 0) -> dict:
    """torch.profiler of one tabfm train step (after two warm-up steps): top ops by self CPU
    time, and the share of matmul / attention / other ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(seed)
    model = TabFM(ModelConfig.preset(preset)).train()
    batch = make_batch(shape, seed)
    step = tabfm_train_step(model, _adamw(model), batch, precision)
    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    share = {name: 0.0 for name in (*PROFILE_CATEGORIES, "other")}
    for e in events:
        cat = next((name for name, keys in PROFILE_CATEGORIES.items() if any(k in e.key for k in keys)), "other")
        share[cat] += e.self_cpu_time_total / total
    return {
        "preset": preset,
        "precision": precision,
        "shape": asdict(shape),
        "total_self_cpu_ms": total / 1e3,
        "share": share,
        "top_ops": [
            {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total, "calls": e.count}
            for e in events[:top]
        ],
    }


def print_profile(prof: dict) -> None:
    s = prof["share"]
    print(f"\nprofile: one {prof['preset']} {prof['precision']} train step on {Shape(**prof['shape']).label()}, "
          f"{prof['total_self_cpu_ms']:.0f} ms self CPU; " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in s.items()))
    for op in prof["top_ops"]:
        print(f"  {op['op'][:60]:60} {op['self_cpu_ms']:9.1f} ms {100 * op['share']:5.1f} % {op['calls']:6d} calls")


# --------------------------------------------------------------------------- machine
def machine_info(threads: int) -> dict:
    model, flags = platform.processor() or "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_flags": flags,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0) if hasattr(os, "nice") else None,
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=None, help="comma-separated presets (default tiny,small,base; tiny with --quick)")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds after one warm-up round (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="toy sizes (smoke test)")
    ap.add_argument("--no-tabpfn", action="store_true", help="skip the TabPFN v2 reference")
    ap.add_argument("--reference", choices=("auto", "package", "reimpl"), default="auto",
                    help="TabPFN v2 side: the installed package if importable (auto), only the package, or the re-implementation")
    ap.add_argument("--flop-check", action=argparse.BooleanOptionalAction, default=None,
                    help="cross-check FLOPs with FlopCounterMode (one extra fp32 step per model; default on unless --quick)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.profiler of one tiny bf16 train step (default on unless --quick)")
    ap.add_argument("--json", default=None, help=f"output JSON (default {DEFAULT_JSON.relative_to(ROOT)}; not written with --quick unless given)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cells-per-token", default="1",
                    help="comma-separated ModelConfig.cells_per_token values to time side by side (e.g. 1,2,4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    presets = (args.presets or ("tiny" if args.quick else "tiny,small,base")).split(",")
    precisions = args.precisions.split(",")
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    train_shape, infer_shape = (QUICK_TRAIN_SHAPE, QUICK_INFER_SHAPE) if args.quick else (TRAIN_SHAPE, INFER_SHAPE)
    peak_n = QUICK_PEAK_N if args.quick else PEAK_N
    flop_check = (not args.quick) if args.flop_check is None else args.flop_check
    do_profile = (not args.quick) if args.profile is None else args.profile
    reference = "none" if args.no_tabpfn else args.reference

    def log(msg: str) -> None:
        print(f"[model_speed] {msg}", file=sys.stderr, flush=True)

    load_start = os.getloadavg()
    started = time.time()
    machine = machine_info(args.threads)
    log(f"{machine['cpu_model']}, {args.threads} thread(s), torch {torch.__version__}, load {load_start[0]:.2f}")
    cells_per_token = tuple(int(g) for g in args.cells_per_token.split(","))
    cases, info = build_cases(presets, precisions, train_shape, infer_shape, reference, peak_n, args.seed,
                              cells_per_token)
    log(f"{len(cases)} cases, reference: {info['reference']}")

    flop_checks = {}
    if flop_check:
        for c in cases:
            if c.kind == "train" and c.precision == "fp32":
                counted = counted_matmul_flops(c.fn)
                flop_checks[c.name] = {"flop_counter_matmul": counted, "analytic_linear": c.flops["linear"],
                                       "analytic_attention": c.flops["attention"]}
        log("FlopCounterMode cross-check done")

    run_interleaved(cases, reps, log)
    summary = summarise(cases, info)
    prof = None
    if do_profile:
        prof = profile_train_step("tiny", "bf16", train_shape, seed=args.seed)
    load_end = os.getloadavg()
    machine["load_average_start"] = list(load_start)
    machine["load_average_end"] = list(load_end)
    cpu_share = [sum(c.cpu) / max(sum(c.wall), 1e-9) for c in cases]
    machine["cpu_time_over_wall_time_mean"] = sum(cpu_share) / len(cpu_share)

    print_table(summary, info, train_shape, infer_shape)
    if flop_checks:
        print("\nFLOP cross-check (one fp32 train step; FlopCounterMode sees matmuls, not CPU SDPA):")
        for name, fc in flop_checks.items():
            cnt = fc["flop_counter_matmul"]
            print(f"  {name:28} counter {cnt / 1e9 if cnt else float('nan'):9.2f} GFLOP  analytic linear "
                  f"{fc['analytic_linear'] / 1e9:9.2f}  + attention {fc['analytic_attention'] / 1e9:8.2f}")
    if prof:
        print_profile(prof)
    print(f"\nmachine: {machine['cpu_model']} ({machine['logical_cpus']} logical CPUs, flags {','.join(machine['cpu_flags'])}), "
          f"{args.threads} thread(s), nice {machine['nice']}, torch {machine['torch_version']}; load average "
          f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end; CPU time / wall time {machine['cpu_time_over_wall_time_mean']:.2f}")

    result = {
        "benchmark": "model_speed",
        "command": " ".join([Path(sys.executable).name, "benchmarks/model_speed.py", *(argv if argv is not None else sys.argv[1:])]),
        "created_unix": started,
        "duration_s": time.time() - started,
        "machine": machine,
        "settings": {
            "presets": presets,
            "precisions": precisions,
            "reps": reps,
            "warmup_rounds": 1,
            "train_shape": asdict(train_shape),
            "infer_shape": asdict(infer_shape),
            "peak_matmul_n": peak_n,
            "optimizer": "torch.optim.AdamW(lr=1e-4, weight_decay=0.01), defaults otherwise",
            "bf16": "torch.autocast('cpu', dtype=torch.bfloat16), fp32 weights",
            "timing": "interleaved rounds, min over rounds of wall (perf_counter) and process CPU time; round 0 warm-up",
            "flops": "analytic, transformer blocks only: linear 2*in*out per token, attention 4*Lq*Lk*d per sequence, "
                     "train = 3x forward; see benchmarks/model_speed.py docstring",
        },
        "reference": {"label": info["reference"], "note": info["reference_note"], "issue_reference": ISSUE_REFERENCE},
        "models": info["models"],
        "goals": {"speedup_vs_tabpfn": GOAL_SPEEDUP, "bf16_mfu": GOAL_MFU_BF16},
        **summary,
        "flop_check": flop_checks,
        "profile": prof,
        "raw_times": {c.name: {"wall": c.wall, "cpu": c.cpu} for c in cases},
    }
    out = args.json if args.json is not None else (None if args.quick else str(DEFAULT_JSON))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2, default=float) + "\n")
        log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
