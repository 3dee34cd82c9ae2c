"""The command line's shape: lazy subcommands (help without the model's imports), --version."""
import argparse
import json
import subprocess
import sys
from importlib.metadata import version

import pytest

from tabfm import cli

# what answering --help may not import: the model stack (torch first of all)
HEAVY = ("torch", "sklearn", "pandas", "tabfm.model", "tabfm.estimators", "tabfm.train", "tabfm.synth",
         "tabfm.data", "tabfm.parallel")


def loaded_after(argv: list[str]) -> list[str]:
    """Modules loaded in a fresh process by `tabfm ARGV` (which prints help or a version and exits 0)."""
    code = ("import json, sys\nfrom tabfm.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(json.dumps(sorted(sys.modules)), file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stderr.strip().splitlines()[-1])


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_top_level_help_imports_no_command():
    modules = loaded_after(["--help"])
    assert not [m for m in modules if m.startswith("tabfm.commands.")] and not heavy(modules)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_command_help_imports_only_its_command(command):
    """Only the command's own module (and the torch-free tabfm.commands._common) answers its --help."""
    modules = loaded_after([command, "--help"])
    commands = [m for m in modules if m.startswith("tabfm.commands.") and not m.startswith("tabfm.commands._")]
    assert commands == [f"tabfm.commands.{command}"]
    assert not heavy(modules)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_listed_summary_is_the_commands_own(command):
    """cli.COMMANDS lists each command by the help its module gives its parser."""
    sub = next(a for a in cli.build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    own = {a.dest: a.help for a in sub._choices_actions}[command]
    assert cli.COMMANDS[command] == own


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tabfm {version('tabfm')}"
