"""`tabfm pretrain`: pretrain the table transformer on the synthetic stream or a table store (resumes from --out).

One process:           tabfm pretrain --preset tiny --out runs/tiny
From a table store:    tabfm pretrain --preset tiny --data corpus/ --out runs/tiny-corpus
N processes (torchrun): torchrun --nproc_per_node N -m tabfm.cli pretrain --plugin ddp --out runs/tiny
Long tables (tp x sp): torchrun --nproc_per_node 4 -m tabfm.cli pretrain --plugin hybrid --tp 2 --sp 2 --out runs/t
Experts over ranks:    torchrun --nproc_per_node 2 -m tabfm.cli pretrain --plugin hybrid --moe-experts 4 --ep 2 --out runs/e
Under a device budget: tabfm pretrain --plugin gemini --gemini-budget-mib 64 --gemini-placement auto --out runs/g

Each data-parallel rank trains on its own batches of the stream's cells_per_batch cells, so the
global batch is N times the single-process one; logged cells/s are global, losses rank averages.
With --plugin hybrid the tp x sp ranks of a group split each table (heads and MLP width over tp,
rows over sp) and see the same batches: only world / (tp x sp) ranks are data parallel. --ep N
spreads every mixture-of-experts layer's experts over N of those data-parallel ranks.
With --data STORE (a directory written by `tabfm synth --out` or tabfm.data.store.write_table) batches
are episodes posed on the store's tables, bucketed by size, each rank its own tables, epoch after
epoch; the held-out synthetic evaluation still measures the prior.
"""
from __future__ import annotations

import argparse
import gc
import traceback
from typing import TYPE_CHECKING

from tabfm.commands._common import (CONTEXT_FEATURES, GEMINI_PLACEMENTS, OPTIMIZERS, PRECISIONS, PRETRAIN_PLUGINS,
                                    PRETRAIN_PRESETS, STREAM_PRESETS, add_output_flags, add_preset, show_progress)

if TYPE_CHECKING:  # torch loads when the command runs, not for --help
    from tabfm.train.config import PretrainConfig
    from tabfm.train.trainer import TrainResult

# command-line flag -> PretrainConfig field, for the plain overrides
_FIELDS = {
    "steps": int, "max_minutes": float, "threads": int, "optimizer": str, "lr": float, "muon_lr": float, "warmup_steps": int, "precision": str,
    "grad_accum": int, "seed": int, "workers": int, "eval_every": int, "ckpt_every": int, "keep_last": int,
    "log_every": int, "device": str, "stream": str, "clip": float, "weight_decay": float, "init": str,
    "eval_batches": int, "data": str, "data_share": float, "data_cells_per_batch": int, "data_max_batch": int, "cells_per_token": int,
    "n_layers": int, "context_features": str, "microbatches": int, "max_bad_steps": int,
    "moe_experts": int, "moe_top_k": int,
}
_CHOICES = {"optimizer": OPTIMIZERS, "precision": PRECISIONS, "context_features": CONTEXT_FEATURES,
            "stream": STREAM_PRESETS}
_HELP = {
    "steps": "optimizer steps of the whole run, also the length of the cosine schedule (default: the preset's)",
    "max_minutes": "wall-clock budget of this invocation in minutes; on expiry it checkpoints and exports, and "
                   "rerunning the command resumes (default: none)",
    "threads": "torch intra-op threads (default: the preset's, else torch's; 1 is fastest on a busy 2-core machine)",
    "optimizer": "adamw (default) or muon (Muon on the blocks' hidden matrices, AdamW on the rest)",
    "lr": "peak learning rate of the warm-up + cosine schedule (default: the preset's)",
    "warmup_steps": "steps of linear learning-rate warm-up (default: the preset's)",
    "precision": "auto (default: bf16 on CUDA and on CPUs with tabfm's bf16 kernels, else fp32), fp32, bf16 or fp16",
    "grad_accum": "batches accumulated into one optimizer step (default 1)",
    "seed": "seed of the model's initialisation and of the synthetic stream (default 0)",
    "workers": "DataLoader worker processes generating batches (default: the preset's; 0: the main process)",
    "eval_every": "steps between evaluations: held-out synthetic tables and scikit-learn datasets (default 250)",
    "ckpt_every": "steps between checkpoints (default: the preset's)",
    "keep_last": "checkpoints kept; older ones are removed (default 3)",
    "log_every": "steps between logged training metrics, and between plain progress lines without a progress "
                 "bar (default: the preset's)",
    "device": "cpu, cuda or cuda:N (default: CUDA when available; --plugin gemini picks its device with "
              "--gemini-device)",
    "stream": "StreamConfig preset of the synthetic stream (with --data: of the held-out synthetic evaluation "
              "only; default: the preset's)",
    "clip": "gradient-norm clipping threshold (default 1.0)",
    "weight_decay": "weight decay of the optimizer (default 0.01)",
    "init": "warm start: model weights from an export directory or a shipped model name (same model config, "
            "or fewer blocks with --n-layers); ignored when the run resumes",
    "eval_batches": "held-out synthetic batches per evaluation (default: the preset's; 0: none)",
    "max_bad_steps": "steps in a row with a non-finite loss or gradient norm (each skipped) that stop the run "
                     "(default 10)",
    "microbatches": "cut each batch into M micro-batches of whole tables, losses averaged (default 1): with --pp "
                    "they stream through the stages (M >= PP), elsewhere they run in turn (activation memory / M)",
    "data": "train on a table store directory (tabfm synth --out, tabfm.data.store.write_table) instead of the "
            "synthetic stream",
    "data_share": "with --data: share of the batches drawn from the store, the rest from the synthetic stream "
                  "(e.g. 0.3: real tables mixed into the prior, as Real-TabPFN did; default: all from the store)",
    "data_cells_per_batch": "with --data: padded cells per batch and rank (default: the stream preset's)",
    "data_max_batch": "with --data: tables per batch at most (default: the stream preset's max_batch)",
    "cells_per_token": "cells of a row packed into one token (ModelConfig.cells_per_token; default 1): "
                       "~1/G of the compute per cell",
    "muon_lr": "--optimizer muon: learning rate of the blocks' hidden matrices (Muon, RMS-matched to AdamW)",
    "context_features": "extra columns every prediction episode carries, recorded in the model's config so the "
                        "estimators show the same: none (default; with --init: the init's), knn-linear (neighbour target means at "
                        "k = 5, 20 + an out-of-fold ridge score; tabfm.data.context_features), knn",
    "n_layers": "blocks of the model (default: the preset's); with --init from a model with fewer blocks, "
                "its blocks are repeated, the repeats starting as identity (a deeper model that starts "
                "as the trained one)",
    "moe_experts": "mixture of experts: every block's MLP becomes E expert MLPs of the dense one's size, a "
                   "learned router sending each token to --moe-top-k of them (default 0: dense); logs moe_aux, "
                   "moe_z and moe_dropped. Split over ranks with --plugin hybrid --ep N; not with --pp",
    "moe_top_k": "with --moe-experts: experts per token, 1..E (default 1)",
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("pretrain", help="pretrain on the synthetic stream or a table store", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(p, PRETRAIN_PRESETS, "tiny", "training recipe, by model size; smoke runs in seconds, for a first look")
    p.add_argument("--out", default=None, help="run directory (default runs/pretrain-PRESET); an existing run resumes")
    p.add_argument("--plugin", default="single", choices=PRETRAIN_PLUGINS,
                   help="engine plugin: single (one process), ddp | zero | fsdp | hybrid under torchrun, or gemini "
                        "(device budget + host/disk offload; one process or under torchrun)")
    p.add_argument("--zero-stage", dest="zero_stage", type=int, choices=(1, 2, 3), default=None,
                   help="--plugin zero: 1 (sharded optimizer state, default) or 2 (+ gradients); --plugin hybrid: "
                        "2 or 3 (FSDP2 over the data-parallel x row-sequence ranks; default replicated)")
    p.add_argument("--tp", type=int, default=None, help="--plugin hybrid: tensor-parallel ranks per table")
    p.add_argument("--sp", type=int, default=None, help="--plugin hybrid: row-sequence-parallel ranks per table")
    p.add_argument("--ep", type=int, default=None,
                   help="--plugin hybrid with --moe-experts E: expert-parallel ranks (each holds E/EP experts; "
                        "tokens cross ranks by all_to_all); EP divides the data-parallel ranks")
    p.add_argument("--pp", type=int, default=None,
                   help="--plugin hybrid: pipeline stages (the blocks cut into PP stages; use --microbatches >= PP)")
    p.add_argument("--gemini-budget-mib", dest="gemini_budget_mib", type=float, default=None,
                   help="--plugin gemini: device budget in MiB (default: unbounded, still accounted)")
    p.add_argument("--gemini-placement", dest="gemini_placement", choices=GEMINI_PLACEMENTS, default=None,
                   help="--plugin gemini: static (default; fractions) or auto (params cached in the budget, "
                        "optimizer state moved into what it has left after the warm-up step)")
    p.add_argument("--gemini-offload-optim", dest="gemini_offload_optim", type=float, default=None,
                   help="--plugin gemini, static: fraction of chunks whose optimizer state lives off device "
                        "(host, or disk with --gemini-disk-dir)")
    p.add_argument("--gemini-disk-dir", dest="gemini_disk_dir", default=None,
                   help="--plugin gemini: put the off-device optimizer state in files under DIR (removed at exit)")
    p.add_argument("--gemini-device", dest="gemini_device", choices=("auto", "cpu", "cuda"), default=None,
                   help="--plugin gemini: the device tier (default auto: CUDA when a GPU is visible, else CPU; "
                        "cuda is refused where there is none)")
    p.add_argument("--no-sklearn-eval", action="store_true", help="skip the scikit-learn dataset evaluation")
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                   help="recompute every block's activations in backward instead of keeping them: activation "
                        "memory of one block for ~1/3 more compute; every plugin but gemini")
    p.add_argument("--context-refs", dest="context_refs", action="store_true",
                   help="the model also learns what each context-feature column estimates (the target column, "
                        "the class whose share it is, the estimator): ModelConfig.context_refs; needs context "
                        "features; from an --init without them they start at zero (default: the init's, else off)")
    p.add_argument("--lr-scale", dest="lr_scale", action="append", default=None, metavar="FRAGMENT=FACTOR",
                   help="parameters whose name contains FRAGMENT learn at FACTOR x the learning rate (repeatable; "
                        "the first match counts), e.g. encoder.ref_=10 for projections a warm start added at zero")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block (dynamic shapes) before the engine wraps the model; every "
                        "plugin but gemini, not with --tp or --pp. Off by default: pays only on long runs, "
                        "slower on CPUs under FSDP (BENCHMARKS.md)")
    add_output_flags(p)
    p.add_argument("--restart", action="store_true",
                   help="start the run in --out over: remove its checkpoints and metrics first (a run resumes otherwise)")
    for name, typ in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kwargs = {"choices": _CHOICES[name]} if name in _CHOICES else {}
        p.add_argument(flag, dest=name, type=typ, default=None, help=_HELP[name], **kwargs)
    return p


def run(args: argparse.Namespace) -> int:
    from tabfm.train.config import PretrainConfig

    overrides = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
    overrides["plugin"] = args.plugin
    if args.zero_stage is not None:
        overrides["zero_stage"] = args.zero_stage
    for name in ("tp", "sp", "pp", "ep", *PretrainConfig.GEMINI_FLAGS):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.no_sklearn_eval:
        overrides["eval_sklearn"] = False
    if args.compile:
        overrides["compile"] = True
    if args.lr_scale:
        overrides["lr_scale"] = _lr_scale(args.lr_scale)
    if args.activation_checkpointing:
        overrides["activation_checkpointing"] = True
    init = _init_model(args.init) if args.init is not None else {}
    if args.init is not None and args.context_features is None:
        overrides["context_features"] = _init_context_features(args.init, init, quiet=args.quiet)
    if args.context_refs or (init.get("context_refs", False) and overrides.get("context_features") != "none"):
        overrides["context_refs"] = True
    elif init.get("context_refs", False) and not args.quiet:
        print(f"pretrain: --context-features none drops --init {args.init}'s context references too", flush=True)
    cfg = PretrainConfig.preset(args.preset, **overrides)
    out = args.out or f"runs/pretrain-{args.preset}"
    main, result = _train(cfg, out, progress=not args.quiet, restart=args.restart, bar=show_progress(args))
    if main:
        _summary(out, result)
    return 0


def _lr_scale(items: list[str]) -> dict[str, float]:
    """--lr-scale FRAGMENT=FACTOR flags as a mapping; a malformed one names itself."""
    out: dict[str, float] = {}
    for item in items:
        fragment, eq, factor = item.partition("=")
        try:
            value = float(factor)
        except ValueError:
            value = float("nan")
        if not eq or not fragment or not value > 0:
            raise ValueError(f"--lr-scale {item!r}: expected FRAGMENT=FACTOR with a factor > 0, e.g. encoder.ref_=10")
        out[fragment] = value
    return out


def _init_context_features(init: str, model: dict, quiet: bool = False) -> str:
    """The context features `--init`'s model (its saved ModelConfig fields `model`) was trained with: a
    warm start keeps the init's input contract unless --context-features names another (a run may
    teach the init new columns)."""
    name = model.get("context_features", "none")
    if name != "none" and not quiet:
        print(f"pretrain: --init {init} was trained with context features {name!r}; this run keeps them "
              f"(--context-features none to drop them)", flush=True)
    return name


def _init_model(init: str) -> dict:
    """The ModelConfig fields (as saved) of `--init`'s model."""
    import json

    from tabfm.weights import CONFIG_FILE, resolve_model_path

    return json.loads((resolve_model_path(init) / CONFIG_FILE).read_text()).get("model", {})


def _train(cfg: "PretrainConfig", out: str, progress: bool, restart: bool = False,
           bar: bool | None = None) -> tuple[bool, "TrainResult"]:
    """Run pretraining in this process (one rank under torchrun); return (main process?, result).

    The process group is torn down only after every object holding it (DDP's reducer, ...) is
    gone: gloo joins its worker threads in the group's destructor while holding the GIL, and a
    reducer that outlives destroy() can deadlock the process at exit."""
    from tabfm.parallel.gemini import DeviceBudgetError
    from tabfm.parallel.launch import barrier, destroy
    from tabfm.train.pretrain import build_plugin, pretrain  # heavy imports only when the command runs

    plugin = build_plugin(cfg)
    main = plugin.is_main_process  # asks the process group, so before destroy()
    finished = False
    try:
        result = pretrain(cfg, out, plugin=plugin, progress=progress, restart=restart, bar=bar)
        finished = True
        return main, result
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)  # the traceback would keep the training objects alive
        if isinstance(err, DeviceBudgetError):  # Gemini: the budget flag's value is what to change
            raise ValueError(f"--gemini-budget-mib {cfg.gemini_budget_mib}: {err}") from None
        raise
    finally:
        close = getattr(plugin, "close", None)  # plugins with resources of their own (Gemini's disk tier files)
        if close is not None:
            close()
        del plugin, close
        gc.collect()
        if finished:
            barrier()  # every collective done everywhere (after a failure a peer may be gone: skip)
        destroy()


def _summary(out: str, result: "TrainResult") -> None:
    """The end-of-run table (main process only)."""
    print(f"\n{'':2}{'run':<16}{out}")
    for key, value in [("stopped", result.stopped), ("step", result.step), ("cells", f"{result.cells:,}"),
                       ("wall", f"{result.wall_s / 60:.1f} min"), ("checkpoint", result.checkpoint), ("export", result.export)]:
        print(f"{'':2}{key:<16}{value}")
    for key, value in {**{f"train/{k}": v for k, v in result.last.items() if k in ("loss", "cells_per_s")}, **result.evals}.items():
        print(f"{'':2}{key:<28}{value:.4f}" if isinstance(value, float) else f"{'':2}{key:<28}{value}")
