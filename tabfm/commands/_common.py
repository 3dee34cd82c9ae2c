"""What the subcommands share, without torch: the names their flags choose from and the flags every
long command takes (--preset, --quiet, --progress/--no-progress).

The parsers are built from these constants so that `tabfm COMMAND --help` answers without importing
torch; tests/test_cli_conventions.py checks each tuple equals the registry it mirrors (the presets
dicts of PretrainConfig, FinetuneConfig and StreamConfig, tabfm.train.config, tabfm.train.optim,
tabfm.model.config), so they cannot drift apart.
"""
from __future__ import annotations

import argparse
import sys

# tabfm.train.config.PretrainConfig.PRESETS (keys, in order)
PRETRAIN_PRESETS = ("tiny", "small", "base", "smoke")
# tabfm.train.finetune.FinetuneConfig.PRESETS
FINETUNE_PRESETS = ("default", "long", "smoke")
# tabfm.synth.stream.StreamConfig.PRESETS
STREAM_PRESETS = ("default", "small", "tiny", "pretrain", "pretrain-wide", "pretrain-mixed", "pretrain-classes", "pretrain-nominal", "nano", "pretrain-small", "pretrain-impute", "pretrain-missing", "pretrain-residual", "pretrain-residual-impute", "pretrain-regions", "pretrain-many-classes", "large")
# tabfm.train.optim.OPTIMIZERS
OPTIMIZERS = ("adamw", "muon")
# tabfm.train.config.PRECISIONS, PLUGINS, PRETRAIN_PLUGINS, FINETUNE_PLUGINS, GEMINI_PLACEMENTS
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PLUGINS = ("single", "ddp", "zero", "fsdp")
PRETRAIN_PLUGINS = (*PLUGINS, "hybrid", "gemini")
FINETUNE_PLUGINS = (*PLUGINS, "hybrid")
GEMINI_PLACEMENTS = ("static", "auto")
# tabfm.model.config.CONTEXT_FEATURES (= tabfm.data.context_features.ContextFeatureSpec.NAMES)
CONTEXT_FEATURES = ("none", "knn-linear", "knn")
# the tasks of a target column (tabfm.data.store.PREDICTION_TASKS): finetune --task, predict --task
PREDICTION_TASKS = ("classification", "regression")

QUIET_HELP = "print only warnings, errors and the final summary (no progress or status messages)"
PROGRESS_HELP = "draw progress bars on stderr (default: when stderr is a terminal and not --quiet)"


def add_preset(parser: argparse.ArgumentParser, names: tuple[str, ...], default: str, what: str) -> None:
    """--preset, one of `names`: argparse refuses any other in one line naming the valid ones (exit 2)."""
    parser.add_argument("--preset", default=default, choices=names, help=f"{what} (default: {default})")


def add_output_flags(parser: argparse.ArgumentParser, progress: bool = True) -> None:
    """--quiet (one meaning everywhere) and, on commands that draw progress bars, --progress/--no-progress."""
    parser.add_argument("--quiet", action="store_true",
                        help=QUIET_HELP[:-1] + ", and no progress bar unless --progress)" if progress else QUIET_HELP)
    if progress:
        parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help=PROGRESS_HELP)


def show_progress(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: --progress / --no-progress when given, else when stderr is a
    terminal and the command is not --quiet."""
    chosen = getattr(args, "progress", None)
    if chosen is not None:
        return bool(chosen)
    return not getattr(args, "quiet", False) and _isatty(sys.stderr)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False
