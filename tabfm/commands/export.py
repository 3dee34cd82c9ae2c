"""`tabfm export CKPT OUT`: the inference bundle (model.safetensors + config.json) from a checkpoint.
`tabfm export --onnx OUT.onnx [--model NAME|DIR]`: the model's forward as an ONNX graph.

CKPT is a checkpoint directory (RUN/checkpoints/step_N) or a run directory, whose newest
complete checkpoint is used. Runs in one process whatever world size or plugin wrote the
checkpoint; the config.json header comes from the run's train_config.json, so the bundle
equals the run's own export at that step and loads in the estimators (`model=OUT`).

With --onnx the graph is the eval-mode forward (fp32) with the number of tables, rows, columns
and query cells all dynamic, of --model (a shipped name or an export directory; default
tabfm-tiny-cf, the classifier's default) or, given CKPT OUT, of the bundle just written. It is checked against torch in
onnxruntime on tables of several shapes, with and without missing cells, before it is
written, and runs in the estimators with backend="onnx", model=OUT.onnx (docs/serving.md).
Needs the onnx extra: pip install "tabfm[onnx]".

    tabfm export runs/pre/checkpoints/step_2000 runs/pre/export
    tabfm export --onnx tabfm-tiny-cf.onnx
    tabfm export runs/pre runs/pre/export --onnx runs/pre/model.onnx
"""
from __future__ import annotations

import argparse

from tabfm.weights import DEFAULT_MODEL

DEFAULT_MAX_CODES = 1024  # tabfm.model.onnx_export.DEFAULT_MAX_CODES (tests/test_onnx.py keeps them equal)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write model.safetensors + config.json from a checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", nargs="?", default=None,
                   help="checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("out", metavar="OUT", nargs="?", default=None,
                   help="export directory to write (replaced if it holds only an export)")
    p.add_argument("--train-config", metavar="JSON", default=None,
                   help="the run's train_config.json (default: found beside the checkpoints/ directory)")
    p.add_argument("--onnx", metavar="OUT.onnx", default=None,
                   help="also (or, without CKPT OUT, only) write the model's forward as an ONNX graph, checked "
                        "against torch in onnxruntime (the onnx extra)")
    p.add_argument("--model", default=None,
                   help=f"with --onnx and no CKPT: the shipped model name or export directory to export "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--max-codes", type=int, default=DEFAULT_MAX_CODES,
                   help=f"with --onnx: categories a categorical column may have in the graph (default {DEFAULT_MAX_CODES})")
    p.set_defaults(_export_parser=p)
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Usage errors (exit 2, one line) before anything heavy is imported."""
    parser = args._export_parser
    if args.checkpoint is not None and args.out is None:
        parser.error("CKPT needs OUT, the export directory to write")
    if args.checkpoint is None and args.onnx is None:
        parser.error("give CKPT OUT (the bundle), --onnx OUT.onnx (the ONNX graph), or both")
    if args.onnx is not None and args.checkpoint is not None and args.model is not None:
        parser.error("--model names what --onnx exports without CKPT; with CKPT OUT the graph is of OUT")
    if args.onnx is None and (args.model is not None or args.max_codes != DEFAULT_MAX_CODES):
        parser.error("--model and --max-codes go with --onnx")
    if args.max_codes < 1:
        parser.error(f"--max-codes must be >= 1, got {args.max_codes}")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    source = args.model or DEFAULT_MODEL
    if args.checkpoint is not None:
        from tabfm.train.pretrain import export_checkpoint  # heavy imports only when the command runs

        ckpt, out = export_checkpoint(args.checkpoint, args.out, train_config=args.train_config)
        print(f"exported {ckpt} -> {out} (model.safetensors, config.json)")
        source = out
    if args.onnx is not None:
        from tabfm.errors import RunStopped
        from tabfm.model.onnx_export import ATOL, RTOL, OnnxUnavailableError, export_onnx, require
        from tabfm.weights import load_model

        try:
            require("onnx", "onnxscript", "onnxruntime")  # before the model loads
        except OnnxUnavailableError as err:
            raise RunStopped(f"tabfm export --onnx: {err}") from None
        model = load_model(source, "cpu")
        _, check = export_onnx(model, args.onnx, max_codes=args.max_codes, check=True)
        worst = ", ".join(f"{k} {v:.1e}" for k, v in check.max_abs.items())
        print(f"exported {source} -> {args.onnx} (ONNX; onnxruntime vs torch on tables "
              f"{', '.join('x'.join(map(str, s)) for s in check.shapes)}: max |diff| {worst}; "
              f"tolerance atol {ATOL:g} + rtol {RTOL:g})")
    return 0
