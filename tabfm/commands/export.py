"""`tabfm export CKPT OUT`: the inference bundle (model.safetensors + config.json) from a checkpoint.

CKPT is a checkpoint directory (RUN/checkpoints/step_N) or a run directory, whose newest
complete checkpoint is used. Runs in one process whatever world size or plugin wrote the
checkpoint; the config.json header comes from the run's train_config.json, so the bundle
equals the run's own export at that step and loads in the estimators (`model=OUT`).
"""
from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write model.safetensors + config.json from a checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("out", metavar="OUT", help="export directory to write (replaced if it holds only an export)")
    p.add_argument("--train-config", metavar="JSON", default=None,
                   help="the run's train_config.json (default: found beside the checkpoints/ directory)")
    return p


def run(args: argparse.Namespace) -> int:
    from tabfm.train.pretrain import export_checkpoint  # heavy imports only when the command runs

    ckpt, out = export_checkpoint(args.checkpoint, args.out, train_config=args.train_config)
    print(f"exported {ckpt} -> {out} (model.safetensors, config.json)")
    return 0
