"""The `tabfm` command line: one subcommand per module in tabfm/commands/."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module in tabfm.commands exposing add_parser(subparsers) and run(args) -> int
COMMANDS = ["synth", "pretrain", "finetune", "export", "predict", "eval"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tabfm", description="tabfm: a tabular foundation model and its training engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"tabfm.commands.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"tabfm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
