"""`tabfm eval`: score estimators on a task suite against the library baselines.

    tabfm eval --task classification --suite public            # all baselines + TabFM methods
    tabfm eval --task anomaly --suite public --methods iforest,ecod --out runs/eval/anomaly
    tabfm eval --task regression --suite path/to/my_suite       # your own NAME.parquet + NAME.json
    tabfm eval build-public DIR                                  # materialise the public suites

The measuring instrument lives in ``eval/`` (which never imports ``tabfm``); this command hands it
the methods: the task's baselines (``tabfm.eval.baselines``) plus the project's own estimators from
:func:`tabfm_methods` (the weights named by ``--model``).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

from tabfm.commands._common import add_output_flags, show_progress

TASKS = ("classification", "regression", "imputation", "anomaly")


def _top_level_items(text: str) -> list[str]:
    """`text` split at the commas outside brackets: "a=1,b=(5,20)" -> ["a=1", "b=(5,20)"]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def parse_params(text: str | None) -> dict[str, Any]:
    """`--tabfm-params "n_estimators=1,n_neighbors=(5,20)"` -> {"n_estimators": 1, "n_neighbors": (5, 20)}
    (values read as Python literals, else kept as strings; commas inside brackets stay in the value)."""
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in _top_level_items(text or ""))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--tabfm-params: expected KEY=VALUE pairs separated by commas, got {item!r}")
        try:
            params[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            params[key.strip()] = value.strip()
    return params


def inference_code_hash(root: Path | None = None) -> str:
    """Hash of the source the estimators' answers depend on (tabfm/estimators, tabfm/model,
    tabfm/inference.py, data/): part of the TabFM methods' cache version, so a change in how the
    estimators predict is never served stale scores (any edit there recomputes them). `root` is a
    folder laid out as the repository; by default the files are those imported (checkout or wheel),
    named as in the repository so both give one hash."""
    if root is None:
        package = Path(__file__).resolve().parents[1]
        data = Path(importlib.util.find_spec("tabfm.data").origin).parent  # found, not imported
    else:
        package, data = Path(root) / "tabfm", Path(root) / "data"
    named = [(f"tabfm/{sub}/{f.name}", f) for sub in ("estimators", "model") for f in (package / sub).glob("*.py")]
    named += [("tabfm/inference.py", package / "inference.py")] + [(f"data/{f.name}", f) for f in data.glob("*.py")]
    digest = hashlib.sha256()
    for name, f in sorted(named):
        digest.update(name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def tabfm_methods(model: str | None = None, params: dict[str, Any] | None = None,
                  tasks: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """The project's own methods per task, {task: {"tabfm": tabfm.eval.runner.Method}}, for weights `model`
    (default: each task's own, tabfm.weights.DEFAULT_MODELS) and the given `tasks` (default all);
    `params` are passed to each task's estimator (a name it does not take is an error naming it;
    e.g. `numeric` exists for classification and regression only).

    The estimators follow the contract in eval/protocols.py; the anomaly detector scores
    higher = more normal (sklearn), so it is flipped. The weights' hash is the method's version,
    so new weights are never served stale cached scores. No weights: a warning, no methods.
    """
    from tabfm.estimators import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
    from tabfm.eval.detectors import Negated
    from tabfm.eval.runner import Method
    from tabfm.weights import DEFAULT_MODELS, resolve_model_path

    code = inference_code_hash()
    extra = dict(params or {})

    def method(task: str, cls: Any, wrap: Any = None) -> Any:
        """The estimator's parameters (not the weights' path) are part of its version, so
        changing a default (e.g. how categorical features are shown) recomputes its scores."""
        path = resolve_model_path(model or DEFAULT_MODELS[task])
        weights = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:16]
        where = str(path)

        def make() -> Any:
            est = cls(model=where, random_state=0)
            unknown = sorted(set(extra) - set(est.get_params()))
            if unknown:
                raise ValueError(f"--tabfm-params: {cls.__name__} has no parameter(s) {unknown}; "
                                 f"it takes {sorted(est.get_params())}")
            return est.set_params(**extra)

        chosen = {k: v for k, v in sorted(make().get_params().items()) if k != "model"}
        version = {"tabfm": weights, "params": hashlib.sha256(repr(chosen).encode()).hexdigest()[:12],
                   "code": code}
        return Method((lambda: wrap(make())) if wrap else make, version)

    estimators = {"classification": (TabFMClassifier,), "regression": (TabFMRegressor,),
                  "imputation": (TabFMImputer,), "anomaly": (TabFMAnomalyDetector, Negated)}
    try:
        return {task: {"tabfm": method(task, *how)} for task, how in estimators.items()
                if tasks is None or task in tasks}
    except FileNotFoundError as err:
        warnings.warn(f"TabFM methods skipped: {err}")
        return {}


# ---------------------------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="score estimators on a task suite against baselines",
        description="Evaluate methods on a suite (a directory of NAME.parquet + NAME.json) under the "
                    "task's public protocol; print and write per-dataset and aggregate tables.",
        epilog="Also: `tabfm eval build-public DIR` writes the public suites to DIR/<task>/.",
    )
    p.add_argument("--task", choices=TASKS, help="which protocol to run")
    p.add_argument("--suite", default="public",
                   help="'public' (built on first use under $TABFM_PUBLIC_SUITES or ~/.cache/tabfm/public_suites) "
                        "or a suite directory (DIR/<task>/ is used when it exists)")
    p.add_argument("--methods", default="all",
                   help="comma-separated method names, or 'all' (default), 'baselines', 'extra'")
    p.add_argument("--model", default=None, help="TabFM weights: a shipped name or an export directory (default: "
                   "the task's estimator's own, tabfm.weights.DEFAULT_MODELS)")
    p.add_argument("--tabfm-params", metavar="K=V,...",
                   help="estimator parameters for the TabFM method, e.g. 'n_estimators=1' (part of its cache key)")
    p.add_argument("--datasets", help="comma-separated dataset names (default: every dataset of the suite)")
    p.add_argument("--out", help="output directory (default runs/eval/<task>)")
    p.add_argument("--cache", help="result cache directory (default OUT/cache)")
    p.add_argument("--no-cache", action="store_true", help="recompute everything, cache nothing")
    p.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads and baseline n_jobs (default 1)")
    p.add_argument("--tie-tol", type=float, default=0.0, help="|difference| counted as a tie in wins/ties/losses")
    add_output_flags(p)
    p.add_argument("--no-plots", action="store_true", help="do not write the PNG plots (OUT/plots/*.png)")
    sub = p.add_subparsers(dest="eval_action", metavar="{build-public DIR}",
                           help="instead of evaluating: build-public DIR writes the public suites")
    b = sub.add_parser("build-public", help="materialise the public suites (docs/evaluation-protocol.md) into DIR/<task>/",
                       description="Write the public classification / imputation / anomaly suites of "
                                   "docs/evaluation-protocol.md into DIR/<task>/NAME.parquet + NAME.json.")
    b.add_argument("dir", help="output directory")
    b.add_argument("--tasks", default="classification,imputation,anomaly",
                   help="comma-separated subset of classification,imputation,anomaly")
    return p


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def select_methods(task: str, spec: str, threads: int = 1, extras: dict[str, Any] | None = None) -> dict[str, Any]:
    """Resolve ``--methods`` into {name: Method}: 'all', 'baselines', 'extra' or explicit names.

    `extras` are the project's own methods for `task` ({name: factory or Method})."""
    from tabfm.eval.baselines import BASELINE_NAMES
    from tabfm.eval.runner import Method, baseline_methods

    extras = {n: (m if isinstance(m, Method) else Method(m)) for n, m in (extras or {}).items()}
    names = _split(spec) or ["all"]
    out: dict[str, Any] = {}
    for name in names:
        if name in ("all", "baselines"):
            out.update(baseline_methods(task, n_jobs=threads))
        if name in ("all", "extra"):
            out.update(extras)
        if name in ("all", "baselines", "extra"):
            continue
        if name in extras:
            out[name] = extras[name]
        elif name in BASELINE_NAMES[task]:
            out.update(baseline_methods(task, names=[name], n_jobs=threads))
        else:
            known = BASELINE_NAMES[task] + sorted(extras)
            raise ValueError(f"unknown {task} method {name!r} (known: {', '.join(known)}; or all, baselines, extra)")
    if not out:
        raise ValueError(f"no {task} methods available for --methods {spec!r} (optional packages missing?)")
    return out


def _suite_dir(task: str, suite: str, quiet: bool = False) -> Path:
    from tabfm.eval.suites import PUBLIC_TASKS, build_public, default_public_dir

    if suite == "public":
        if task not in PUBLIC_TASKS:
            raise ValueError(f"there is no public {task} suite (public: {', '.join(PUBLIC_TASKS)}); pass --suite DIR")
        root = default_public_dir()
        if not (root / task).is_dir():
            if not quiet:
                print(f"building the public {task} suite into {root} ...")
            build_public(root, tasks=[task])
        return root
    path = Path(suite)
    if not path.is_dir():
        raise ValueError(f"suite directory not found: {path}")
    return path


def run(args: argparse.Namespace) -> int:
    if getattr(args, "eval_action", None) == "build-public":
        from tabfm.eval.suites import build_public

        tasks = _split(args.tasks)
        written = build_public(args.dir, tasks=tasks)
        for task, names in written.items():
            print(f"{task}: {len(names)} datasets in {Path(args.dir) / task}")
        return 0
    if not args.task:
        raise ValueError("--task is required (classification, regression, imputation or anomaly)")
    from tabfm.eval.runner import evaluate

    extras = tabfm_methods(args.model, parse_params(args.tabfm_params), (args.task,)).get(args.task, {}) \
        if args.methods != "baselines" else {}
    methods = select_methods(args.task, args.methods, threads=args.threads, extras=extras)
    suite = _suite_dir(args.task, args.suite, quiet=args.quiet)
    out = Path(args.out) if args.out else Path("runs") / "eval" / args.task
    cache = None if args.no_cache else (Path(args.cache) if args.cache else out / "cache")
    report = evaluate(args.task, suite, methods, out, cache_dir=cache, datasets=_split(args.datasets) or None,
                      progress=show_progress(args), n_threads=args.threads, tie_tol=args.tie_tol,
                      verbose=True, plots=not args.no_plots,  # the report is the final summary, --quiet or not
                      command={"argv": list(sys.argv), "methods_spec": args.methods, "model": args.model,
                               "tabfm_params": args.tabfm_params,
                               "suite_arg": args.suite, "datasets": _split(args.datasets) or None})
    return 1 if report.errors else 0
