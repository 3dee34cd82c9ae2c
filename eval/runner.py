"""Run methods over a suite under the task's protocol, with caching, progress bars and reports.

    from .runner import evaluate, baseline_methods
    report = evaluate("classification", "suites/public", {**baseline_methods("classification"),
                      "mine": Method(MyClassifier, version="v3")}, out_dir="results/cls")

``methods`` maps a name to a zero-argument factory returning a fresh estimator (see the contract
in tabfm.eval.protocols), or to a :class:`Method` carrying the factory plus a version (part of the cache
key: give a checkpoint hash or release number so a new model is not served stale results) and
whether it counts as a baseline in the wins/ties/losses table.

With ``out_dir`` a run writes ``results.json`` (per-fold / per-condition details and the
failures), ``report.{md,json,csv}``, ``run.json`` (versions, protocol seeds, suite, methods,
start time, wall time per dataset x method, cached or not, and in total) and, unless
``plots=False``, PNG plots under ``plots/`` (see tabfm.eval.plots).

A method that raises on a dataset does not stop the run: the exception (type, message,
traceback) is recorded in the results, run.json and the report (``failed`` cells, worst rank on
that dataset, see tabfm.eval.report), a warning names the dataset and method, and nothing is cached
for it, so a rerun retries it. KeyboardInterrupt (and other BaseExceptions) still stop the run.
"""
from __future__ import annotations

import json
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from .baselines import baseline_version, baselines
from .cache import ResultCache, _clean, cache_key
from .protocols import get_protocol
from .report import Report
from .suites import load_suite

Factory = Callable[[], Any]
_DEFAULT = object()


@dataclass
class Method:
    factory: Factory
    version: str | Mapping[str, str] | None = None
    baseline: bool = False


def baseline_methods(task: str, names=None, n_jobs: int = 1, warn: bool = True) -> dict[str, Method]:
    """The task's baseline registry as :class:`Method` objects (versions = library versions)."""
    return {name: Method(f, version=baseline_version(task, name), baseline=True)
            for name, f in baselines(task, n_jobs=n_jobs, names=names, warn=warn).items()}


def _as_method(m) -> Method:
    if isinstance(m, Method):
        return m
    if callable(m):
        return Method(m, version=getattr(m, "version", None))
    raise TypeError(f"a method must be a factory (callable) or tabfm.eval.runner.Method, got {type(m).__name__}")


def _versions(method: Method) -> dict[str, str]:
    import numpy
    import pandas
    import sklearn

    v = {"numpy": numpy.__version__, "pandas": pandas.__version__, "sklearn": sklearn.__version__}
    if isinstance(method.version, Mapping):
        v.update({str(k): str(x) for k, x in method.version.items()})
    elif method.version is not None:
        v["method"] = str(method.version)
    return v


def _package_version(name: str) -> str | None:
    """Installed version of a distribution without importing it (None = not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment_versions() -> dict[str, str | None]:
    """python, numpy, pandas, sklearn, torch (None when not installed) and matplotlib versions."""
    import numpy
    import pandas
    import sklearn

    return {"python": platform.python_version(), "numpy": numpy.__version__, "pandas": pandas.__version__,
            "sklearn": sklearn.__version__, "torch": _package_version("torch"),
            "matplotlib": _package_version("matplotlib")}


def protocol_seeds(task: str) -> dict[str, Any]:
    """The splits / seeds the task's protocol uses (constants of tabfm.eval.protocols)."""
    from . import protocols as P

    if task == "classification":
        return {"cv": "StratifiedKFold", "n_splits": P.N_FOLDS, "shuffle": True, "random_state": P.CV_SEED}
    if task == "regression":
        return {"cv": "KFold", "n_splits": P.N_FOLDS, "shuffle": True, "random_state": P.CV_SEED}
    if task == "imputation":
        return {"mechanisms": dict(P.MECHANISMS), "rates": list(P.RATES), "seeds": list(P.IMPUTATION_SEEDS),
                "mask_rng": "numpy.random.default_rng([seed, mechanism_id, round(100 * rate)])"}
    if task == "anomaly":
        return {"split": "train_test_split(stratify=y)", "test_size": P.ANOMALY_TEST_SIZE,
                "random_state": list(P.ANOMALY_SEEDS)}
    return {}


def _error_record(err: BaseException) -> dict[str, str]:
    return {"type": type(err).__name__, "message": str(err),
            "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-8))}


def evaluate(task: str, suite_dir, methods: Mapping[str, Factory | Method], out_dir=None, *,
             cache_dir=_DEFAULT, datasets=None, progress: bool = True, n_threads: int | None = 1,
             tie_tol: float = 0.0, verbose: bool = True, raise_errors: bool = False, plots: bool = True,
             command: Mapping[str, Any] | None = None) -> Report:
    """Evaluate every method on every dataset of ``suite_dir`` (``DIR/<task>`` if that exists).

    * results are cached (``cache_dir``; default ``out_dir/cache``, None = no cache) by
      (dataset + fingerprint, protocol, method, versions): a rerun computes only new pairs;
    * one tqdm bar per dataset (units = folds / conditions / seeds of every method);
    * a method that raises (an ``Exception``) on a dataset is recorded as a failure, warned about
      and skipped (``raise_errors`` re-raises instead); nothing is cached for it, so a rerun
      retries it; KeyboardInterrupt stops the run;
    * with ``out_dir``: writes ``results.json`` (per-fold details + failures), ``report.md``,
      ``report.json``, ``report.csv``, ``run.json`` (the run record, also ``report.run``) and,
      with ``plots``, PNGs under ``out_dir/plots`` (no matplotlib: a warning, no plots);
      with ``verbose`` prints the Markdown report and the files written at the end;
    * ``n_threads`` caps BLAS/OpenMP threads while running (None = leave as is);
    * ``command``: what the caller wants recorded in run.json about how it was invoked (argv,
      the ``--methods`` spec, ...); the task and method names are always recorded.
    """
    started = datetime.now(timezone.utc)
    t_start = time.perf_counter()
    protocol = get_protocol(task)
    if not methods:
        raise ValueError("no methods to evaluate")
    suite = load_suite(suite_dir, task, datasets=datasets)
    meths = {name: _as_method(m) for name, m in methods.items()}
    if cache_dir is _DEFAULT:
        cache_dir = Path(out_dir) / "cache" if out_dir is not None else None
    cache = ResultCache(cache_dir)

    import sklearn.ensemble  # noqa: F401  (loads sklearn's OpenMP runtime so the limit below reaches it)
    from threadpoolctl import threadpool_limits
    from tqdm.auto import tqdm

    scores: dict[str, dict[str, dict[str, float]]] = {}
    details: dict[str, dict[str, Any]] = {}
    errors: dict[str, dict[str, str]] = {}
    failures: dict[str, dict[str, dict[str, str]]] = {}
    timings: dict[str, dict[str, dict[str, Any]]] = {}
    limiter = threadpool_limits(limits=n_threads) if n_threads else None
    try:
        for ds in suite:
            scores[ds.name], details[ds.name], timings[ds.name] = {}, {}, {}
            bar = tqdm(total=len(meths) * protocol.n_units, desc=f"{task}:{ds.name}", unit="fit",
                       disable=not progress, leave=True, file=sys.stderr, dynamic_ncols=True)
            for name, method in meths.items():
                key = cache_key(ds.name, ds.fingerprint, protocol.name, name, _versions(method))
                result = cache.get(key)
                if result is not None:
                    bar.update(protocol.n_units)
                    result["cached"] = True
                    timings[ds.name][name] = {"status": "cached", "cached": True, "seconds": 0.0,
                                              "computed_seconds": result.get("seconds")}
                else:
                    bar.set_postfix_str(name)
                    done = bar.n
                    t0 = time.perf_counter()
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            result = protocol.run(ds, method.factory, progress=lambda: bar.update(1))
                    except Exception as err:  # noqa: BLE001 - one failing method must not end the run
                        if raise_errors:
                            raise
                        seconds = time.perf_counter() - t0
                        rec = _error_record(err)
                        msg = f"{rec['type']}: {rec['message']}"
                        errors.setdefault(ds.name, {})[name] = msg
                        failures.setdefault(ds.name, {})[name] = rec
                        timings[ds.name][name] = {"status": "failed", "cached": False, "seconds": seconds,
                                                  "error": {"type": rec["type"], "message": rec["message"]}}
                        warnings.warn(f"{task}/{ds.name}: method {name!r} failed (not cached, a rerun retries it): "
                                      f"{msg}", RuntimeWarning, stacklevel=2)
                        if verbose:
                            traceback.print_exc(limit=3, file=sys.stderr)
                        bar.update(protocol.n_units - (bar.n - done))
                        continue
                    seconds = time.perf_counter() - t0
                    cache.put(key, result)
                    result["cached"] = False
                    timings[ds.name][name] = {"status": "ok", "cached": False, "seconds": seconds}
                scores[ds.name][name] = dict(result["metrics"])
                details[ds.name][name] = result
            bar.close()
    finally:
        if limiter is not None:
            limiter.restore_original_limits()

    rank_scores = None
    if protocol.rank_unit_keys:
        rank_scores = {}
        for d, per in details.items():
            for name, res in per.items():
                for u in res["units"]:
                    unit = d + "|" + "|".join(str(u[k]) for k in protocol.rank_unit_keys)
                    rank_scores.setdefault(unit, {})[name] = {k: v for k, v in u.items() if k not in protocol.rank_unit_keys}
    report = Report(task=task, scores=scores, methods=list(meths), rank_scores=rank_scores,
                    baselines=[n for n, m in meths.items() if m.baseline] or list(meths),
                    tie_tol=tie_tol, errors=errors, results=details,
                    meta={"protocol": protocol.name, "suite": str(suite_dir),
                          "cache": {"dir": str(cache_dir) if cache_dir else None, "hits": cache.hits, "misses": cache.misses}})
    report.run = {
        "task": task,
        "protocol": protocol.name,
        "seeds": protocol_seeds(task),
        "suite": {"dir": str(Path(suite_dir).resolve()), "datasets": [ds.name for ds in suite],
                  "fingerprints": {ds.name: ds.fingerprint for ds in suite}},
        "command": {"task": task, "methods": list(meths), **dict(command or {})},
        "versions": environment_versions(),
        "methods": {n: {"versions": _versions(m), "baseline": m.baseline} for n, m in meths.items()},
        "platform": platform.platform(),
        "n_threads": n_threads,
        "started": started.isoformat(timespec="seconds"),
        "cache": report.meta["cache"],
        "timings": timings,
        "failures": {d: {m: {"type": r["type"], "message": r["message"]} for m, r in per.items()}
                     for d, per in failures.items()},
    }
    written: list[Path] = []
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(_clean({"task": task, "protocol": protocol.name, "results": details,
                                                             "failures": failures}), indent=1) + "\n")
        paths = report.write(out)
        files = {k: str(v) for k, v in paths.items()}
        files["results"] = str(out / "results.json")
        files["run"] = str(out / "run.json")
        if plots:
            from .plots import write_plots

            try:
                written = write_plots(report, out / "plots")
            except Exception as err:  # noqa: BLE001 - a plotting problem must not lose the results
                warnings.warn(f"plots not written: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)
            files["plots"] = [str(p) for p in written]
        report.meta["files"] = files
        report.run["files"] = files
    report.run["total_seconds"] = time.perf_counter() - t_start
    report.run["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if out_dir is not None:
        (Path(out_dir) / "run.json").write_text(json.dumps(_clean(report.run), indent=1) + "\n")
    if verbose:
        print(report.to_markdown())
        n_failed = sum(len(per) for per in errors.values())
        if n_failed:
            print(f"{n_failed} failed run(s), not cached (a rerun retries them): "
                  + "; ".join(f"{d}/{m}" for d, per in errors.items() for m in per))
        if out_dir is not None:
            print(f"reports written to {Path(out_dir)}/report.{{md,json,csv}}; run record {Path(out_dir) / 'run.json'}")
            for p in written:
                print(f"plot: {p}")
        print(f"total wall time {report.run['total_seconds']:.1f} s")
    return report
