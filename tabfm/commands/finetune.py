"""`tabfm finetune`: fine-tune the model on your own tables, judged on rows it never trains on.

    tabfm finetune --data PATH --target COL --out DIR [--task classification|regression]
                   [--init tabfm-tiny-cf | EXPORT_DIR] [--steps N] [--max-minutes M] [--lr LR]
                   [--replay FRACTION [--replay-data PATH ...] [--replay-stream PRESET|none]]
                   [--holdout FRACTION | --folds K] [--holdout-tables K] [--plugin single|ddp|zero|fsdp|hybrid]
                   [--lora-rank R [--lora-alpha A] [--lora-targets PATTERNS]]

PATH is a CSV, a Parquet file, a directory of them, or a table store. A share of each table's
rows (--holdout, default 0.2, stratified for classification) is held out; the model trains on
episodes of the other rows and is scored in context on the held-out rows before training and
every --eval-every steps. The best weights go to DIR/export (load them with
TabFMClassifier(model="DIR/export")); a before/after table is printed and written to
DIR/finetune_summary.json. Rerunning the same command resumes from DIR/checkpoints.
--folds K cross-fits instead: K runs, each holding out another K-th of the rows; the held-out
losses of all rows together choose the step (and whether any beats the starting weights), and
DIR/export averages the K runs' weights at that step.
--holdout-tables K keeps K whole tables of a store / directory out of training and scores them
the same way (holdout_tables/... in the metrics and the summary). --replay F replays a share F
of the batches against forgetting: from the synthetic prior, or with --replay-data OLD (repeat
the flag for more) from episodes of earlier tables.
Many processes: torchrun --nproc_per_node N -m tabfm.cli finetune --plugin ddp ...
"""
from __future__ import annotations

import argparse
import gc
import traceback
from typing import TYPE_CHECKING

from tabfm.commands._common import (FINETUNE_PLUGINS, FINETUNE_PRESETS, OPTIMIZERS, PRECISIONS, PREDICTION_TASKS,
                                    STREAM_PRESETS, add_output_flags, add_preset, show_progress)

if TYPE_CHECKING:  # torch loads when the command runs, not for --help
    from tabfm.train.finetune import FinetuneConfig, FinetuneResult

# command-line flag -> FinetuneConfig field, for the plain overrides
_FIELDS = {
    "init": str, "steps": int, "max_minutes": float, "lr": float, "replay": float, "holdout": float, "threads": int,
    "seed": int, "optimizer": str, "precision": str, "warmup_steps": int, "weight_decay": float, "grad_accum": int,
    "eval_every": int, "patience": int, "ckpt_every": int, "keep_last": int, "log_every": int, "device": str,
    "min_rows": int, "max_rows": int, "cells_per_batch": int, "imputation": float, "categorical": str,
    "eval_estimators": int, "eval_rows": int, "replay_stream": str, "lora_rank": int, "lora_alpha": float,
    "report": str, "holdout_tables": int, "significance": float, "folds": int,
}
_CHOICES = {"optimizer": OPTIMIZERS, "precision": PRECISIONS, "categorical": ("ordinal", "identity"),
            "replay_stream": (*STREAM_PRESETS, "none")}
# the defaults named are those of the default preset (FinetuneConfig); --preset smoke / long change some
_HELP = {
    "init": "starting weights: a shipped model name or an export directory (default tabfm-tiny-cf)",
    "steps": "optimizer steps of the whole run, also the length of the cosine schedule (default 300)",
    "max_minutes": "wall-clock budget of this invocation in minutes; rerunning the command resumes (default: none)",
    "lr": "peak learning rate (default 1e-4; 1e-3 with --lora-rank)",
    "replay": "share of batches replayed against forgetting, drawn per batch from the seed: from the synthetic "
              "prior, or from --replay-data's tables (default 0)",
    "holdout": "share of each table's rows held out for evaluation, stratified for classification (default 0.2)",
    "holdout_tables": "K: hold K whole tables of the --data store or directory out of training (an integer count, "
                      "chosen from --seed; at least one table must remain). They are scored in context on their "
                      "own held-out rows before and during fine-tuning, reported as holdout_tables/..., and never "
                      "used for early stopping (default 0)",
    "folds": "K >= 2: K-fold cross-fitted fine-tuning: K runs (OUT/fold-k), each holding out one fold of every "
             "table's rows for max-minutes / K; the step is chosen on all rows pooled (a stronger --significance "
             "test than one held-out share) and the export averages the K runs' weights at it (default 1: one run, "
             "--holdout held out)",
    "threads": "torch intra-op threads (default: torch's; 1 is fastest on a busy 2-core machine)",
    "seed": "seed of the held-out split and tables, the episodes, the replay draw and the evaluation (default 0)",
    "optimizer": "adamw (default) or muon",
    "precision": "auto (default: bf16 on CUDA and on CPUs with tabfm's bf16 kernels, else fp32), fp32, bf16 or fp16",
    "warmup_steps": "steps of linear learning-rate warm-up (default 20)",
    "weight_decay": "weight decay of the optimizer (default 0.01)",
    "grad_accum": "batches accumulated into one optimizer step (default 1)",
    "eval_every": "steps between held-out evaluations (default 25)",
    "patience": "evaluations without improvement before stopping (0: never; default 4)",
    "significance": "an evaluation counts as an improvement (and is exported) only when the held-out rows' "
                    "losses are lower than the starting weights' by more than this many paired standard errors; 0: any "
                    "improvement (default 2)",
    "ckpt_every": "steps between checkpoints (default 25)",
    "keep_last": "checkpoints kept; older ones are removed (default 2)",
    "log_every": "steps between logged training metrics, and between plain progress lines without a progress "
                 "bar (default 5)",
    "device": "cpu, cuda or cuda:N (default: CUDA when available)",
    "min_rows": "rows per training episode, at least (default 32; capped by a table's training rows)",
    "max_rows": "rows per training episode, at most (default 512)",
    "cells_per_batch": "cells per training batch: it sets the episodes per batch (default 16384)",
    "imputation": "probability that a training episode is an imputation episode (default 0.2)",
    "categorical": "categorical features in prediction episodes: ordinal (relabelled codes read as numbers, as "
                   "the estimators show them; default) or identity (categorical cells)",
    "eval_estimators": "ensemble members of the held-out evaluation (default 4)",
    "eval_rows": "held-out rows scored per table; a fixed random subset beyond (default 2048)",
    "replay_stream": "synthetic prior preset of the --replay batches, or none (default: pretrain without "
                     "--replay-data, none with it; a preset together with --replay-data replays both, half the "
                     "replayed batches each)",
    "lora_rank": "train low-rank adapters of rank R on the blocks' attention and MLP projections instead of every "
                 "weight (the rest frozen; merged into the weights at export; default: full fine-tuning)",
    "lora_alpha": "--lora-rank: the adapters' update is scaled by ALPHA / R (default R: by 1)",
    "report": "other tables (a CSV, Parquet, directory or store with the same target column) scored in context "
              "on their own held-out rows with the starting and the fine-tuned weights: forgetting, measured",
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("finetune", help="fine-tune on your own tables (held-out rows judge it)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, metavar="PATH", help="CSV, Parquet, directory of tables, or table store")
    p.add_argument("--target", default=None, metavar="COL", help="target column (a store's header may supply it)")
    p.add_argument("--task", choices=PREDICTION_TASKS, default=None,
                   help="default: classification for text/boolean targets and integers with <= 20 values, else regression")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory; an existing run there resumes")
    add_preset(p, FINETUNE_PRESETS, "default", "recipe: default; long for more steps and sparser evaluation; "
                                                "smoke runs in seconds, for a first look")
    p.add_argument("--plugin", default="single", choices=FINETUNE_PLUGINS,
                   help="engine plugin: single (one process) or ddp | zero | fsdp | hybrid under torchrun")
    p.add_argument("--zero-stage", dest="zero_stage", type=int, choices=(1, 2, 3), default=None,
                   help="--plugin zero: 1 (default) or 2; --plugin hybrid: 2 or 3 (FSDP2 over the data-parallel x "
                        "row-sequence ranks; default replicated)")
    p.add_argument("--tp", type=int, default=None,
                   help="--plugin hybrid: tensor-parallel ranks per table (LoRA adapters are split beside their weights)")
    p.add_argument("--sp", type=int, default=None, help="--plugin hybrid: row-sequence-parallel ranks per table")
    p.add_argument("--replay-data", dest="replay_data", action="append", default=None, metavar="PATH",
                   help="--replay: replay episodes of these tables (CSV, Parquet, directory or table store; repeat "
                        "the flag for more). A store's headers supply each table's target, which may differ from "
                        "--target; other tables need the --target column. Only their training rows (split as "
                        "--holdout splits) are replayed, never a --data table; the prior is off unless "
                        "--replay-stream names a preset")
    p.add_argument("--lora-targets", dest="lora_targets", default=None, metavar="PATTERNS",
                   help="--lora-rank: comma-separated module-name patterns of the adapted linear layers (default "
                        "blocks.*.col_attn.qkv,blocks.*.col_attn.out,blocks.*.row_attn.qkv,blocks.*.row_attn.out,"
                        "blocks.*.mlp.fc1,blocks.*.mlp.fc2)")
    add_output_flags(p)
    p.add_argument("--restart", action="store_true",
                   help="start the run in --out over: remove its checkpoints and metrics first (a run resumes otherwise)")
    for name, typ in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=typ, default=None, choices=_CHOICES.get(name), help=_HELP[name])
    return p


def config_from_args(args: argparse.Namespace) -> "FinetuneConfig":
    """The FinetuneConfig the command line asks for (ValueError naming a bad field)."""
    from tabfm.train.finetune import FinetuneConfig

    overrides = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
    overrides.update(data=args.data, target=args.target, task=args.task, plugin=args.plugin)
    if args.replay_data:
        overrides["replay_data"] = tuple(args.replay_data)
    if args.lora_targets is not None:
        if args.lora_rank is None:
            raise ValueError("--lora-targets needs --lora-rank")
        overrides["lora_targets"] = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if args.zero_stage is not None:
        if args.plugin not in ("zero", "hybrid"):
            raise ValueError(f"--zero-stage applies to --plugin zero or hybrid, not --plugin {args.plugin}")
        overrides["zero_stage"] = args.zero_stage
    for name in ("tp", "sp"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return FinetuneConfig.preset(args.preset, **overrides)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    main, result = _train(cfg, args.out, progress=not args.quiet, restart=args.restart, bar=show_progress(args))
    if main and args.quiet:
        print(result.table())
    return 0


def _train(cfg: "FinetuneConfig", out: str, progress: bool, restart: bool = False,
           bar: bool | None = None) -> tuple[bool, "FinetuneResult"]:
    """Fine-tune in this process (one rank under torchrun); return (main process?, result).

    As `tabfm pretrain`: the process group is destroyed only after every object holding it is gone."""
    from tabfm.parallel.launch import barrier, destroy
    from tabfm.train.finetune import finetune
    from tabfm.train.pretrain import build_plugin

    plugin = build_plugin(cfg)  # type: ignore[arg-type]  # reads plugin, device, zero_stage
    main = plugin.is_main_process
    finished = False
    try:
        result = finetune(cfg, out, plugin=plugin, progress=progress, restart=restart, bar=bar)
        finished = True
        return main, result
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        del plugin
        gc.collect()
        if finished:
            barrier()
        destroy()
