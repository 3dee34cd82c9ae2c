"""The `tabfm` command line: one subcommand per module in tabfm/commands/.

Only the named subcommand's module is imported (to add its arguments and run it); the others are
listed by their one-line summary, so `tabfm --help` and `tabfm COMMAND --help` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from tabfm import __version__
from tabfm.errors import RunStopped

# subcommand -> its summary; tabfm.commands.<name> exposes add_parser(subparsers) and run(args) -> int
# and passes the same summary as its parser's help (tests/test_cli.py checks they agree)
COMMANDS = {
    "synth": "generate and summarise the synthetic-table stream, or write a synthetic corpus",
    "pretrain": "pretrain on the synthetic stream or a table store",
    "finetune": "fine-tune on your own tables (held-out rows judge it)",
    "export": "write model.safetensors + config.json from a checkpoint",
    "predict": "predict a target column of a test table from a training table (in context)",
    "eval": "score estimators on a task suite against baselines",
    "serve": "serve predictions over HTTP (FastAPI + uvicorn): classify, regress, impute, anomaly-score",
}


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (exit 2), as every other bad input; subcommand
    parsers are made of this class too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but a subcommand's unknown arguments are its error (`tabfm COMMAND: error: ...`)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
            owner = sub.choices.get(getattr(parsed, "command", None), self) if sub is not None else self
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s full arguments (its module imported) and the other commands listed."""
    parser = Parser(prog="tabfm", description="tabfm: a tabular foundation model and its training engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="`tabfm COMMAND --help` for its options")
    for name, summary in COMMANDS.items():
        if name == command:
            module = importlib.import_module(f"tabfm.commands.{name}")
            module.add_parser(sub).set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def one_line(err: BaseException) -> str:
    """An error's message as one line: an OSError as 'PATH: reason', the lines of a longer message joined."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        return f"{err.filename}: {err.strerror[:1].lower()}{err.strerror[1:]}"
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


def warning_format(command: str):
    """warnings.formatwarning for `tabfm COMMAND`: a warning as one line naming the command (not the
    source line that raised it)."""
    def format_line(message, category, filename, lineno, line=None) -> str:
        kind = "warning" if category is UserWarning else category.__name__
        return f"tabfm {command}: {kind}: {' '.join(str(message).split())}\n"

    return format_line


# what a user's input causes (exit 2, one line): a bad value, or a path that is missing or unusable
BAD_INPUT = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    """Run `tabfm ARGV`: 0 done, 1 a run stopped for a stated reason, 2 bad input (one line on stderr,
    no traceback; argparse's usage errors too)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no values
    args = build_parser(command).parse_args(argv)
    formatwarning, warnings.formatwarning = warnings.formatwarning, warning_format(args.command)
    try:
        return int(args._run(args) or 0)
    except BAD_INPUT as err:  # bad input: one clear line, no traceback
        print(f"tabfm {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a run that stopped for a stated reason (e.g. diverged)
        print(f"tabfm {args.command}: stopped: {one_line(err)}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning


if __name__ == "__main__":
    sys.exit(main())
