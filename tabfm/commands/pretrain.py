"""`tabfm pretrain`: pretrain the table transformer on the synthetic stream (resumes from --out)."""
from __future__ import annotations

import argparse

from tabfm.train.config import PRECISIONS, PretrainConfig
from tabfm.train.optim import OPTIMIZERS

PLUGINS = ("single",)

# command-line flag -> PretrainConfig field, for the plain overrides
_FIELDS = {
    "steps": int, "max_minutes": float, "threads": int, "optimizer": str, "lr": float, "warmup_steps": int, "precision": str,
    "grad_accum": int, "seed": int, "workers": int, "eval_every": int, "ckpt_every": int, "keep_last": int,
    "log_every": int, "device": str, "stream": str, "clip": float, "weight_decay": float, "init": str,
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("pretrain", help="pretrain on the synthetic stream", description=__doc__)
    p.add_argument("--preset", default="tiny", choices=sorted(PretrainConfig.PRESETS), help="training recipe (model size)")
    p.add_argument("--out", default=None, help="run directory (default runs/pretrain-PRESET); an existing run resumes")
    p.add_argument("--plugin", default="single", choices=PLUGINS, help="engine plugin")
    p.add_argument("--no-sklearn-eval", action="store_true", help="skip the scikit-learn dataset evaluation")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for name, typ in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kwargs = {"choices": OPTIMIZERS} if name == "optimizer" else {"choices": PRECISIONS} if name == "precision" else {}
        p.add_argument(flag, dest=name, type=typ, default=None, **kwargs)
    return p


def run(args: argparse.Namespace) -> int:
    from tabfm.train.pretrain import pretrain  # heavy imports only when the command runs

    overrides = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
    if args.no_sklearn_eval:
        overrides["eval_sklearn"] = False
    cfg = PretrainConfig.preset(args.preset, **overrides)
    out = args.out or f"runs/pretrain-{args.preset}"
    result = pretrain(cfg, out, progress=not args.quiet)
    print(f"\n{'':2}{'run':<16}{out}")
    for key, value in [("stopped", result.stopped), ("step", result.step), ("cells", f"{result.cells:,}"),
                       ("wall", f"{result.wall_s / 60:.1f} min"), ("checkpoint", result.checkpoint), ("export", result.export)]:
        print(f"{'':2}{key:<16}{value}")
    for key, value in {**{f"train/{k}": v for k, v in result.last.items() if k in ("loss", "cells_per_s")}, **result.evals}.items():
        print(f"{'':2}{key:<28}{value:.4f}" if isinstance(value, float) else f"{'':2}{key:<28}{value}")
    return 0
