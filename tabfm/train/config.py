"""PretrainConfig: every knob of a pretraining run, as one dataclass with presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tabfm.model import ModelConfig
from tabfm.train.optim import OPTIMIZERS

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PLUGINS = ("single", "ddp", "zero", "fsdp")  # engine plugins a training run (pretrain, finetune) can use
PRETRAIN_PLUGINS = (*PLUGINS, "hybrid", "gemini")
FINETUNE_PLUGINS = (*PLUGINS, "hybrid")  # fine-tuning: + row-sequence parallel (long tables)  # pretraining also splits tables, or offloads (Gemini)
GEMINI_PLACEMENTS = ("static", "auto")


@dataclass
class PretrainConfig:
    """A pretraining run on the synthetic stream or a table store. The command line overrides any field.

    model          ModelConfig preset name (tiny | small | base)
    cells_per_token  ModelConfig.cells_per_token of the run's model (1: the preset's one token per
                   cell; 2-4 pack cells of a row into tokens, ~1/G of the compute per cell)
    n_layers       blocks of the run's model (None: the preset's). With `init` from a model with
                   fewer blocks, its blocks are repeated, the repeats starting as identity
                   (tabfm.model.growth): the deeper model starts as the trained function
    moe_experts, moe_top_k  ModelConfig.moe_experts / moe_top_k of the run's model: 0 (default) =
                   dense MLPs; E >= 1 = mixture-of-experts MLPs of E experts, k per token (the other
                   moe_* fields at the ModelConfig defaults)
    stream         StreamConfig preset name of the synthetic stream (with `data`: of the held-out
                   synthetic evaluation only)
    data           a table store directory (tabfm.data.store.write_table, `tabfm synth --out`): when set,
                   training batches are episodes posed on its tables (tabfm.data.store_episodes) instead
                   of the synthetic stream; held-out synthetic evaluation still measures the prior
    data_share     with `data`: share of the batches drawn from the store, the rest from the synthetic
                   stream (tabfm.train.mixed_data; Real-TabPFN's mixture of real and prior tables);
                   None: every batch from the store
    data_cells_per_batch, data_max_batch
                   with `data`: padded cells and tables per batch (per data-parallel rank and
                   micro-batch); None takes the stream preset's cells_per_batch / max_batch
    context_features  extra columns every prediction episode carries (tabfm.data.context_features:
                   "none", "knn-linear" = neighbour means at k = 5, 20 + a ridge score, "knn"); they
                   are recorded in the model's config, so the estimators show the model the same
    context_refs   ModelConfig.context_refs: the model also learns what each context-feature column
                   estimates (target column, class, estimator); from an init without them, they start at zero
    steps          optimizer steps of the whole run (also the length of the cosine schedule)
    max_minutes    wall-clock budget of this invocation; on expiry it checkpoints and exports
    threads        torch intra-op threads (None: torch's default); on a busy 2-core machine 1 is fastest
    grad_accum     micro-batches per optimizer step
    max_bad_steps  steps in a row with a non-finite loss or gradient norm (each skipped) that stop the
                   run, after a checkpoint of the weights from before them
    activation_checkpointing  recompute every block's activations in backward
                   (tabfm.parallel.checkpoint_blocks): activation memory of one block, ~1/3 more compute
    compile        torch.compile every block (tabfm.parallel.compile_blocks, dynamic shapes) before the
                   engine wraps the model; every plugin but Gemini (whose hooks move parameters inside the
                   blocks), not with tp or pp. Measured (BENCHMARKS.md); off by default
    microbatches   M: each batch holds a multiple of M tables and is cut into M equal micro-batches of
                   whole tables whose losses are averaged (gradient accumulation inside one batch);
                   with pp > 1 they stream through the pipeline stages (M >= pp), elsewhere they
                   run one after another (activation memory / M). The same M gives the same run on
                   every layout.
    eval_every     steps between evaluations (held-out synthetic tables + sklearn datasets)
    ckpt_every     steps between checkpoints; keep_last of them are kept
    init           warm start: model weights from an export directory or shipped name (same model
                   config); optimizer, schedule and stream start fresh. Ignored when the run resumes.
    plugin         engine plugin: single | ddp | zero | fsdp | hybrid | gemini (the distributed ones run under
                   torchrun; gemini runs in one process or under torchrun)
    zero_stage     ZeRO stage: --plugin zero 1 (sharded optimizer state, the default) or 2 (+ sharded
                   gradients); --plugin hybrid 2 or 3 (FSDP2 over the dp x sp ranks; default: replicated)
    tp, sp         plugin "hybrid": tensor-parallel ranks (attention heads and MLP width split) and
                   row-sequence-parallel ranks (each table's rows split); the remaining
                   world / (tp x sp) ranks are data parallel. Ranks of one tp x sp group train on
                   the same batches, so they add compute and memory per table, not batch size.
    ep             plugin "hybrid" with moe_experts E: expert-parallel ranks, a factor of the data-parallel
                   ones (world / (tp x sp x pp)); each holds E / ep experts of every MoE layer, tokens
                   cross ranks by all_to_all (tabfm.parallel.expert_parallel); not with pp
    pp             plugin "hybrid": pipeline stages (the model's blocks cut into pp stages of equal
                   depth; the world / (tp x pp) remaining ranks are data parallel); with tp and with
                   dp, not (yet) with sp or grad_accum > 1 (raise `microbatches` instead)
    gemini_budget_mib, gemini_placement, gemini_offload_optim, gemini_disk_dir, gemini_device
                   plugin "gemini" (one process, or data parallel under torchrun with each chunk
                   sharded over the ranks): the device budget in MiB (None: unbounded, still
                   accounted); placement "static" (default: parameters on device, the last
                   `gemini_offload_optim` fraction of the chunks' optimizer state off device) or
                   "auto" (parameters homed on host and cached in the budget, optimizer state
                   moved into what the budget has left after the warm-up step); with
                   `gemini_disk_dir` the off-device optimizer state goes to disk files under that
                   directory instead of host memory; `gemini_device` the device tier: "auto" (the
                   default: CUDA when torch sees a GPU, else CPU), "cpu" or "cuda" (refused where
                   there is none). Gemini steps AdamW only (not Muon).

    Batches are per data-parallel rank: every rank draws its own batch of about the stream's
    `cells_per_batch` cells per micro-batch (tables no other rank sees), so one optimizer step
    sees dp_ranks x grad_accum x cells_per_batch cells. Adding ranks grows the global batch;
    the logged cells/s and cell counts are global (summed over ranks), losses averaged over ranks.
    """

    model: str = "tiny"
    cells_per_token: int = 1
    n_layers: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 1
    context_features: str = "none"
    context_refs: bool = False
    stream: str = "pretrain"
    data: str | None = None
    data_share: float | None = None
    data_cells_per_batch: int | None = None
    data_max_batch: int | None = None
    steps: int = 2000
    max_minutes: float | None = None
    threads: int | None = None
    optimizer: str = "adamw"
    lr: float = 1e-3
    muon_lr: float = 0.02
    lr_scale: dict[str, float] = dataclasses.field(default_factory=dict)  # name fragment -> lr factor
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.01
    clip: float = 1.0
    precision: str = "auto"
    grad_accum: int = 1
    microbatches: int = 1
    max_bad_steps: int = 10
    seed: int = 0
    workers: int = 1
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int = 8
    eval_sklearn: bool = True
    ckpt_every: int = 100
    keep_last: int = 3
    device: str | None = None
    init: str | None = None
    plugin: str = "single"
    zero_stage: int | None = None
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1
    gemini_budget_mib: float | None = None
    gemini_placement: str | None = None
    gemini_offload_optim: float | None = None
    gemini_disk_dir: str | None = None
    gemini_device: str | None = None
    compile: bool = False
    activation_checkpointing: bool = False

    PRESETS = {
        # stage 1 of the shipped tabfm-tiny: 31 min on 2 vCPU with --threads 1; stage 2 warm-starts
        # from it with --init (the command is in docs/pretraining.md and BENCHMARKS.md)
        "tiny": dict(steps=1500, threads=1),
        "small": dict(model="small", stream="default", steps=20000, lr=5e-4, warmup_steps=500),
        "base": dict(model="base", stream="default", steps=50000, lr=3e-4, warmup_steps=1000),
        # seconds: CI and a first look
        "smoke": dict(stream="tiny", steps=20, warmup_steps=2, log_every=5, eval_every=10, eval_batches=2,
                      eval_sklearn=False, ckpt_every=10, workers=0, precision="fp32"),
    }

    GEMINI_FLAGS = {"gemini_budget_mib": "--gemini-budget-mib", "gemini_placement": "--gemini-placement",
                    "gemini_offload_optim": "--gemini-offload-optim", "gemini_disk_dir": "--gemini-disk-dir",
                    "gemini_device": "--gemini-device"}

    def _check_gemini(self, need: Any) -> None:
        """The gemini_* fields: each names its command-line flag when it is wrong."""
        flag = self.GEMINI_FLAGS
        for name in flag:
            need(getattr(self, name) is None or self.plugin == "gemini", name,
                 f"{flag[name]} configures --plugin gemini, not --plugin {self.plugin}")
        if self.plugin != "gemini":
            return
        budget, frac = self.gemini_budget_mib, self.gemini_offload_optim
        need(budget is None or (isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0),
             "gemini_budget_mib", f"{flag['gemini_budget_mib']} must be a number of MiB > 0")
        need(self.gemini_placement is None or self.gemini_placement in GEMINI_PLACEMENTS, "gemini_placement",
             f"{flag['gemini_placement']} must be one of {', '.join(GEMINI_PLACEMENTS)}")
        need(frac is None or (isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0.0 <= frac <= 1.0),
             "gemini_offload_optim", f"{flag['gemini_offload_optim']} must be a fraction in [0, 1]")
        need(frac is None or self.gemini_placement != "auto", "gemini_offload_optim",
             f"{flag['gemini_offload_optim']} is for --gemini-placement static; auto moves optimizer state into "
             "what the budget leaves after its warm-up step")
        need(self.gemini_disk_dir is None or (isinstance(self.gemini_disk_dir, str) and self.gemini_disk_dir.strip()),
             "gemini_disk_dir", f"{flag['gemini_disk_dir']} must name a directory")
        need(self.gemini_disk_dir is None or self.gemini_placement == "auto" or bool(frac), "gemini_disk_dir",
             f"{flag['gemini_disk_dir']} holds the optimizer state moved off device: give --gemini-offload-optim F > 0 "
             "(or --gemini-placement auto)")
        need(self.optimizer == "adamw", "optimizer", "--plugin gemini steps AdamW on its chunks; use --optimizer adamw")
        need(self.device in (None, "cpu"), "device", "--plugin gemini picks its device tier with --gemini-device "
             "(auto, cpu, cuda); leave --device unset or cpu")
        need(self.gemini_device in (None, "auto", "cpu", "cuda"), "gemini_device", "must be auto, cpu or cuda")
        if self.gemini_device == "cuda":
            import torch

            need(torch.cuda.is_available(), "gemini_device",
                 f"--gemini-device cuda, but this torch ({torch.__version__}, "
                 f"{'CPU-only build' if torch.version.cuda is None else 'no GPU visible'}) has no CUDA device; "
                 "use --gemini-device cpu or auto")

    def gemini_options(self) -> dict[str, Any]:
        """GeminiPlugin keyword arguments of these gemini_* fields."""
        placement = self.gemini_placement or "static"
        frac = self.gemini_offload_optim or 0.0
        out: dict[str, Any] = {"placement": placement, "disk_dir": self.gemini_disk_dir,
                               "device": self.gemini_device or "auto",
                               "device_budget_bytes": None if self.gemini_budget_mib is None
                               else int(self.gemini_budget_mib * (1 << 20))}
        if self.gemini_disk_dir is not None:
            out["disk_optim_frac"] = 1.0 if placement == "auto" else frac
        elif placement == "static":
            out["offload_optim_frac"] = frac
        return out

    @classmethod
    def preset(cls, name: str = "tiny", **overrides: Any) -> "PretrainConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown PretrainConfig preset {name!r}; choose from {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "PretrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"PretrainConfig.{name} = {getattr(self, name)!r}: {what}")

        for name in ("steps", "grad_accum", "microbatches", "max_bad_steps", "log_every", "eval_every", "ckpt_every", "keep_last", "cells_per_token"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        need(self.n_layers is None or (isinstance(self.n_layers, int) and self.n_layers >= 1), "n_layers",
             "must be None (the preset's) or an integer >= 1")
        need(isinstance(self.moe_experts, int) and not isinstance(self.moe_experts, bool) and self.moe_experts >= 0,
             "moe_experts", "must be an integer >= 0 (0: dense MLPs)")
        need(isinstance(self.moe_top_k, int) and not isinstance(self.moe_top_k, bool)
             and 1 <= self.moe_top_k <= max(self.moe_experts, 1), "moe_top_k",
             f"must be an integer in [1, moe_experts = {self.moe_experts}]" if self.moe_experts else
             "--moe-top-k needs --moe-experts E (a dense model routes nothing)")
        for name in ("warmup_steps", "eval_batches", "seed", "workers"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        need(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        need(self.precision in PRECISIONS, "precision", f"must be one of {', '.join(PRECISIONS)}")
        need(self.plugin in PRETRAIN_PLUGINS, "plugin", f"must be one of {', '.join(PRETRAIN_PLUGINS)}")
        stages = {"zero": (1, 2), "hybrid": (2, 3)}.get(self.plugin, ())
        need(self.zero_stage is None or self.zero_stage in stages, "zero_stage",
             f"--zero-stage {self.zero_stage} with --plugin {self.plugin}: --zero-stage applies to --plugin zero "
             "(1 or 2; ZeRO-3 is --plugin fsdp) and --plugin hybrid (2 or 3: FSDP2 over the data-parallel "
             "and row-sequence ranks)")
        for name in ("tp", "sp", "pp", "ep"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
            need(getattr(self, name) == 1 or self.plugin == "hybrid", name,
                 f"--{name} splits the model or its tables over ranks; it needs --plugin hybrid (not {self.plugin})")
        need(self.microbatches == 1 or self.data is None, "microbatches",
             "cuts the synthetic stream's batches (a multiple of M tables each); not with --data")
        if self.ep > 1:
            need(self.moe_experts > 0 and self.moe_experts % self.ep == 0, "ep",
                 f"--ep {self.ep} spreads the experts of mixture-of-experts layers over ranks: it needs "
                 f"--moe-experts E with E divisible by {self.ep} (got {self.moe_experts})")
            need(self.pp == 1, "ep", "--ep with --pp: a model with experts has no pipeline stages")
        if self.pp > 1:
            need(self.microbatches >= self.pp, "microbatches",
                 f"--pp {self.pp} streams micro-batches through {self.pp} stages: --microbatches must be >= {self.pp}")
            need(self.grad_accum == 1, "pp", "--pp runs one pipeline per step: raise --microbatches instead of "
                 "--grad-accum")
        self._check_gemini(need)
        need(isinstance(self.compile, bool), "compile", "must be True or False")
        need(isinstance(self.activation_checkpointing, bool), "activation_checkpointing", "must be True or False")
        need(not self.activation_checkpointing or self.plugin != "gemini", "activation_checkpointing",
             "--activation-checkpointing is not offered with --plugin gemini: Gemini's chunk hooks do not yet "
             "handle a block recomputed in backward (its losses left one process's after the first step); use "
             "--plugin fsdp or zero for activation memory")
        need(not self.compile or self.plugin != "gemini", "compile",
             "--compile is not offered with --plugin gemini: its chunk hooks move parameters in and out "
             "of every block during the step, which no test has run compiled; use --plugin fsdp or zero")
        need(not self.compile or self.ep == 1, "compile",
             f"--compile with --ep {self.ep}: the experts' all_to_all dispatch has not been run compiled; "
             "use --ep 1 or no --compile")
        need(not self.compile or self.pp == 1, "compile",
             "--compile with --pp: the pipeline's stages are built and traced by torch.distributed.pipelining")
        need(not self.compile or self.tp == 1, "compile",
             f"--compile with --tp {self.tp}: inductor fails on the tensor-parallel blocks' DTensor graphs "
             "(RecursionError while compiling, torch 2.13 on CPU); compile is offered with --sp, ZeRO and FSDP")
        need(self.lr > 0 and self.muon_lr > 0, "lr", "learning rates must be > 0")
        need(isinstance(self.lr_scale, dict) and all(
            isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in self.lr_scale.items()), "lr_scale",
             "must map parameter-name fragments to learning-rate factors > 0 (--lr-scale encoder.ref_=10)")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.clip > 0, "clip", "must be > 0")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes", "must be > 0")
        need(self.threads is None or (isinstance(self.threads, int) and self.threads >= 1), "threads", "must be None or an integer >= 1")
        need(self.data is None or (isinstance(self.data, str) and self.data.strip() != ""), "data",
             "must be None or the path of a table store directory")
        need(self.data_share is None or (self.data is not None and 0.0 < self.data_share <= 1.0), "data_share",
             "must be None, or in (0, 1] with data (a table store)")
        for name in ("data_cells_per_batch", "data_max_batch"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), name,
                 "must be None or an integer >= 1")


def resolve_precision(precision: str, device: "torch.device | str") -> str:
    """The precision a run trains in. "auto": bf16 on CUDA and on CPUs where tabfm's fused bf16
    kernels run (AVX512-BF16); fp32 on other CPUs, where torch's bf16 ops ran a tiny train step
    ~7x slower than fp32 (11 s vs 1.5 s on a 2-core AVX2 EPYC; BENCHMARKS.md)."""
    if precision != "auto":
        return precision
    import torch

    if torch.device(device).type != "cpu":
        return "bf16"
    from tabfm.model.cpu_kernels.build import available

    return "bf16" if available() else "fp32"


def run_model_config(train: "PretrainConfig | dict[str, Any]") -> ModelConfig:
    """The ModelConfig a run trains: its preset with the run's cells_per_token, n_layers and
    moe_experts / moe_top_k (`train` may be the dict a run saved in train_config.json, older ones
    lacking those keys)."""
    t = train.to_dict() if isinstance(train, PretrainConfig) else train
    extra = {"n_layers": t["n_layers"]} if t.get("n_layers") is not None else {}
    return ModelConfig.preset(t["model"], cells_per_token=t.get("cells_per_token", 1),
                              context_features=t.get("context_features", "none"),
                              context_refs=t.get("context_refs", False),
                              moe_experts=t.get("moe_experts", 0), moe_top_k=t.get("moe_top_k", 1), **extra)
