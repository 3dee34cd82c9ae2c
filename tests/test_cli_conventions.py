"""The command line reads like one tool (issue #19): every flag has help, --help answers without
torch, --quiet means one thing, --progress/--no-progress on every long command, --preset is checked
by argparse from the same constants, and bad input is exit 2 with one line on stderr, everywhere."""
import argparse
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pandas as pd
import pytest

from tabfm import cli
from tabfm.commands import _common

LONG_COMMANDS = ("synth", "pretrain", "finetune", "eval", "predict")  # the ones that draw progress bars
PRESET_COMMANDS = {"synth": _common.STREAM_PRESETS, "pretrain": _common.PRETRAIN_PRESETS,
                   "finetune": _common.FINETUNE_PRESETS}
HELP_ARGV = [[], *([c] for c in cli.COMMANDS), ["eval", "build-public"]]


def command_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def walk(parser: argparse.ArgumentParser):
    """(parser, action) for every action of `parser` and of its nested subcommands."""
    for action in parser._actions:
        yield parser, action
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from walk(child)


# ----------------------------------------------------------------------------- fast help
@pytest.mark.parametrize("argv", HELP_ARGV, ids=lambda a: " ".join(a) or "tabfm")
def test_help_imports_no_torch(argv):
    """`tabfm ... --help` as `python -m tabfm` runs it, in a fresh process: it prints help, exits 0 and
    never imports torch (nor numpy, pandas, the model, the engine or the synthetic prior)."""
    code = textwrap.dedent("""
        import json, runpy, sys
        sys.argv = ["tabfm", *json.loads(sys.argv[1]), "--help"]
        try:
            runpy.run_module("tabfm", run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print(json.dumps(sorted(sys.modules)), file=sys.stderr)
    """)
    run = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "usage: tabfm" in run.stdout
    modules = json.loads(run.stderr.strip().splitlines()[-1])
    heavy = ("torch", "numpy", "pandas", "sklearn", "tabfm.model", "tabfm.train", "tabfm.parallel", "tabfm.synth",
             "tabfm.data", "tabfm.estimators")
    assert not [m for m in modules if m.split(".")[0] in heavy or m.startswith(tuple(h + "." for h in heavy))]


def test_the_torch_free_names_are_the_registries():
    """The constants the parsers are built from equal what the code they mirror accepts."""
    from tabfm.data.context_features import ContextFeatureSpec
    from tabfm.data.store import PREDICTION_TASKS
    from tabfm.model.config import CONTEXT_FEATURES
    from tabfm.synth.stream import StreamConfig
    from tabfm.train import config as train_config
    from tabfm.train.finetune import FinetuneConfig
    from tabfm.train.optim import OPTIMIZERS

    assert _common.PRETRAIN_PRESETS == tuple(train_config.PretrainConfig.PRESETS)
    assert _common.FINETUNE_PRESETS == tuple(FinetuneConfig.PRESETS)
    assert _common.STREAM_PRESETS == tuple(StreamConfig.PRESETS)
    assert _common.OPTIMIZERS == OPTIMIZERS
    assert _common.PRECISIONS == train_config.PRECISIONS
    assert _common.PLUGINS == train_config.PLUGINS
    assert _common.PRETRAIN_PLUGINS == train_config.PRETRAIN_PLUGINS
    assert _common.GEMINI_PLACEMENTS == train_config.GEMINI_PLACEMENTS
    assert _common.CONTEXT_FEATURES == CONTEXT_FEATURES == ContextFeatureSpec.NAMES
    assert _common.PREDICTION_TASKS == PREDICTION_TASKS


# ----------------------------------------------------------------------------- help text
def test_every_action_of_every_parser_has_help():
    missing = [f"{p.prog}: {a.option_strings or a.dest}" for p, a in walk(cli.build_parser())
               if not (a.help or "").strip()]
    for command in cli.COMMANDS:
        missing += [f"{p.prog}: {a.option_strings or a.dest}" for p, a in walk(command_parser(command))
                    if a.help is argparse.SUPPRESS or not (a.help or "").strip()]
    assert not missing


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_renders(command, capsys):
    """--help formats (a help string with a stray % would fail only here)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0 and f"usage: tabfm {command}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- shared flags
def test_quiet_means_one_thing_and_long_commands_take_progress():
    helps = {}
    for command in cli.COMMANDS:
        actions = {a.dest: a for a in command_parser(command)._actions}
        if "quiet" in actions:
            helps[command] = actions["quiet"].help
            assert actions["quiet"].help.startswith(_common.QUIET_HELP[:-1])
        progress = actions.get("progress")
        if command in LONG_COMMANDS:
            assert "quiet" in actions
            assert isinstance(progress, argparse.BooleanOptionalAction) and progress.default is None
            assert progress.option_strings == ["--progress", "--no-progress"]
        else:
            assert progress is None
    assert set(helps) >= set(LONG_COMMANDS)


@pytest.mark.parametrize("argv, isatty, want", [
    ([], True, True), ([], False, False), (["--quiet"], True, False), (["--no-progress"], True, False),
    (["--progress"], False, True), (["--quiet", "--progress"], False, True),
])
def test_progress_defaults_to_a_terminal_and_not_quiet(argv, isatty, want, monkeypatch):
    parser = argparse.ArgumentParser()
    _common.add_output_flags(parser)
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(isatty=lambda: isatty))
    assert _common.show_progress(parser.parse_args(argv)) is want


@pytest.mark.parametrize("command", sorted(PRESET_COMMANDS))
def test_preset_choices_come_from_the_constants(command):
    action = next(a for a in command_parser(command)._actions if a.dest == "preset")
    assert tuple(action.choices) == PRESET_COMMANDS[command] and action.default in action.choices


@pytest.mark.parametrize("bar, progress, isatty, show_bar, plain_log", [
    (None, True, True, True, False), (None, True, False, False, True), (None, False, True, False, False),
    (False, True, True, False, True), (True, False, False, True, False), (True, True, False, True, False),
])
def test_trainer_bar_and_plain_log(bar, progress, isatty, show_bar, plain_log, tmp_path, monkeypatch):
    """Trainer(bar=None) keeps its old rule (a bar in a terminal, else plain lines); --progress /
    --no-progress choose the bar, --quiet (progress=False) silences the lines."""
    import torch

    from tabfm.train.trainer import Trainer

    monkeypatch.setattr(sys, "stderr", SimpleNamespace(isatty=lambda: isatty, write=lambda s: None, flush=lambda: None))
    plugin = SimpleNamespace(dp_world_size=1, is_main_process=True, layout=lambda: {"pp": 1})
    booster = SimpleNamespace(plugin=plugin, device=torch.device("cpu"))
    model = torch.nn.Linear(2, 1)
    t = Trainer(booster, model, None, None, None, [], tmp_path, steps=1, progress=progress, bar=bar)
    assert (t.show_bar, t.plain_log) == (show_bar, plain_log)
    if t.log is not None:
        t.log.close()


def test_pretrain_progress_flags_reach_the_trainer(tmp_path, capsys):
    """--no-progress: plain log lines, no bar; --quiet --progress: the bar, no lines; the summary either way."""
    flags = ["pretrain", "--preset", "smoke", "--steps", "2", "--log-every", "1", "--eval-batches", "0",
             "--no-sklearn-eval", "--threads", "1"]
    assert cli.main([*flags, "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "step 2/2" in out.out and "train:" not in out.err and "checkpoint" in out.out
    assert cli.main([*flags, "--out", str(tmp_path / "b"), "--quiet", "--progress"]) == 0
    out = capsys.readouterr()
    assert "step 2/2" not in out.out and "fresh run" not in out.out and "train:" in out.err
    assert "checkpoint" in out.out  # the final summary


# ----------------------------------------------------------------------------- bad input
def one_error_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    return lines[0]


def tabfm(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tabfm", *argv], capture_output=True, text=True, timeout=300, cwd=cwd)


USAGE_ERRORS = {  # refused by argparse: no torch, one line
    "synth": [["--preset", "nope"], ["--batches", "x"], ["--bogus"]],
    "pretrain": [["--preset", "nope"], ["--stream", "nope"], ["--steps", "1.5"], ["--lr", "fast"]],
    "finetune": [["--data", "t.csv", "--out", "r", "--preset", "nope"], ["--data", "t.csv", "--out", "r", "--holdout",
                                                                          "x"], ["--out", "r"]],
    "export": [[], ["a", "b", "c"]],
    "predict": [["--train", "t.csv", "--test", "t.csv", "--target", "y", "--n-estimators", "x"],
                ["--train", "t.csv", "--target", "y"], ["--train", "t.csv", "--test", "t.csv", "--target", "y",
                                                        "--task", "nope"]],
    "eval": [["--task", "nope"], ["--threads", "x"], ["--tie-tol", "?"]],
    "": [["nope"], [], ["--bogus"]],
}


@pytest.mark.parametrize("command, argv", [(c, a) for c, argvs in USAGE_ERRORS.items() for a in argvs],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_usage_error_is_one_line_and_exit_2(command, argv, tmp_path):
    run = tabfm(*([command] if command else []), *argv, cwd=tmp_path)
    line = one_error_line(run.returncode, run.stderr)
    assert line.startswith(f"tabfm{' ' + command if command else ''}: error: ") and "--help" in line
    if "--preset" in argv:  # names the valid presets
        assert all(repr(name) in line for name in PRESET_COMMANDS[command])


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    frame = pd.DataFrame({"a": [0.1 * i for i in range(40)], "b": [i % 3 for i in range(40)], "y": [i % 2 for i in range(40)]})
    frame.to_csv(d / "t.csv", index=False)
    frame.to_parquet(d / "t.parquet")
    frame.drop(columns="b").to_csv(d / "nob.csv", index=False)
    (d / "ragged.csv").write_text("a,b,y\n1,2,3\n1,2,3,4\n")
    return d


# run-time refusals: each command's run meets the bad value (a missing file, an unknown column, a value out
# of range, a wrong file type); every argv runs through tabfm.cli.main in one fresh process per command
# (torch loads once), stderr captured per call, and an exception escaping main is a traceback
RUN_ERRORS = {
    "synth": [(["--batches", "0"], "--batches"), (["--rows", "5"], "--rows"), (["--world-size", "0"], "world_size"),
              (["--out", "{d}/t.csv", "--tables", "2"], "not a directory"), (["--tables", "2"], "--out")],
    "pretrain": [(["--preset", "smoke", "--steps", "0", "--out", "{d}/r1"], "steps"),
                 (["--preset", "smoke", "--data", "{d}/nowhere", "--out", "{d}/r2"], "nowhere"),
                 (["--preset", "smoke", "--init", "{d}/nowhere", "--out", "{d}/r3"], "nowhere"),
                 (["--zero-stage", "2", "--out", "{d}/r4"], "--zero-stage")],
    "finetune": [(["--data", "{d}/nowhere.csv", "--target", "y", "--out", "{d}/f1"], "nowhere.csv"),
                 (["--data", "{d}/t.csv", "--target", "nope", "--out", "{d}/f2"], "'nope'"),
                 (["--data", "{d}/t.csv", "--target", "y", "--out", "{d}/f3", "--steps", "-1"], "steps"),
                 (["--data", "{d}/ragged.csv", "--target", "y", "--out", "{d}/f4"], "line 3")],
    "export": [(["{d}/nowhere", "{d}/e1"], "no such directory"), (["{d}/t.csv", "{d}/e2"], "not a directory")],
    "predict": [(["--train", "{d}/nowhere.csv", "--test", "{d}/t.csv", "--target", "y"], "cannot read"),
                (["--train", "{d}/t.csv", "--test", "{d}/t.csv", "--target", "nope"], "'nope' is not in"),
                (["--train", "{d}/t.csv", "--test", "{d}/nob.csv", "--target", "y"], "missing ['b']"),
                (["--train", "{d}/ragged.csv", "--test", "{d}/t.csv", "--target", "y"], "line 3"),
                (["--train", "{d}/t.parquet", "--test", "{d}/t.csv", "--target", "y", "--n-estimators", "0"],
                 "n_estimators"),
                (["--train", "{d}/t.csv", "--test", "{d}/t.csv", "--target", "y", "--model", "{d}/nowhere"], "nowhere"),
                (["--train", "{d}/t.csv", "--test", "{d}/t.csv", "--target", "y", "--task", "regression", "--proba"],
                 "--proba")],
    "eval": [(["--task", "classification", "--suite", "{d}/nowhere"], "nowhere"), ([], "--task"),
             (["--task", "classification", "--suite", "{d}", "--methods", "nope"], "'nope'"),
             (["--task", "regression", "--suite", "public"], "public")],
}

DRIVER = textwrap.dedent("""
    import io, json, sys, traceback
    from tabfm.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        err, real = io.StringIO(), sys.stderr
        sys.stderr = err
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = "raised"
        finally:
            sys.stderr = real
        results.append([rc, err.getvalue()])
    print(json.dumps(results))
""")


@pytest.mark.parametrize("command", sorted(RUN_ERRORS))
def test_bad_input_is_one_line_and_exit_2(command, tables):
    cases = RUN_ERRORS[command]
    argvs = [[command, *(a.format(d=tables) for a in argv)] for argv, _ in cases]
    run = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=600, cwd=tables, check=True)
    for (argv, needle), (rc, err) in zip(cases, json.loads(run.stdout.strip().splitlines()[-1])):
        line = one_error_line(rc, err)
        assert line.startswith(f"tabfm {command}: error: ") and needle in line, (argv, line)
    assert not (tables / "r1").exists() and not (tables / "f2").exists()  # refused before writing anything


def test_os_errors_from_user_paths_are_one_line():
    assert cli.one_line(FileNotFoundError(2, "No such file or directory", "/x/y.csv")) == \
        "/x/y.csv: no such file or directory"
    assert cli.one_line(ValueError("first\n  second\n")) == "first; second"
    assert issubclass(PermissionError, cli.BAD_INPUT) and not issubclass(RuntimeError, cli.BAD_INPUT)


def test_a_warning_is_one_line_naming_the_command():
    code = textwrap.dedent("""
        import sys, warnings
        from tabfm import cli
        from tabfm.commands import export

        def run(args):
            warnings.warn("something to know\\nacross lines")
            warnings.warn("and how", RuntimeWarning)
            return 0

        export.run = run
        before = warnings.formatwarning
        assert cli.main(["export", "a", "b"]) == 0
        assert warnings.formatwarning is before  # restored
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert run.stderr == ("tabfm export: warning: something to know across lines\n"
                          "tabfm export: RuntimeWarning: and how\n")
