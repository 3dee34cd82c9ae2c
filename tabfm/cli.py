"""The `tabfm` command line: one subcommand per module in tabfm/commands/.

Only the named subcommand's module is imported (to add its arguments and run it); the others are
listed by their one-line summary, so `tabfm --help` and `tabfm COMMAND --help` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tabfm import __version__
from tabfm.errors import RunStopped

# subcommand -> its summary; tabfm.commands.<name> exposes add_parser(subparsers) and run(args) -> int
# and passes the same summary as its parser's help (tests/test_cli.py checks they agree)
COMMANDS = {
    "synth": "generate and summarise the synthetic-table stream, or write a synthetic corpus",
    "pretrain": "pretrain on the synthetic stream or a table store",
    "finetune": "fine-tune on your own tables (held-out rows judge it)",
    "export": "write model.safetensors + config.json from a checkpoint",
    "predict": "predict a target column of a test CSV from a training CSV (in context)",
    "eval": "score estimators on a task suite against baselines",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s full arguments (its module imported) and the other commands listed."""
    parser = argparse.ArgumentParser(prog="tabfm", description="tabfm: a tabular foundation model and its training engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in COMMANDS.items():
        if name == command:
            module = importlib.import_module(f"tabfm.commands.{name}")
            module.add_parser(sub).set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no values
    args = build_parser(command).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"tabfm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a run that stopped for a stated reason (e.g. diverged)
        print(f"tabfm {args.command}: stopped: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
