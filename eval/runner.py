"""Run methods over a suite under the task's protocol, with caching, progress bars and reports.

    from eval.runner import evaluate, baseline_methods
    report = evaluate("classification", "suites/public", {**baseline_methods("classification"),
                      "mine": Method(MyClassifier, version="v3")}, out_dir="results/cls")

``methods`` maps a name to a zero-argument factory returning a fresh estimator (see the contract
in eval.protocols), or to a :class:`Method` carrying the factory plus a version (part of the cache
key: give a checkpoint hash or release number so a new model is not served stale results) and
whether it counts as a baseline in the wins/ties/losses table.
"""
from __future__ import annotations

import json
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from eval.baselines import baseline_version, baselines
from eval.cache import ResultCache, _clean, cache_key
from eval.protocols import get_protocol
from eval.report import Report
from eval.suites import load_suite

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
    raise TypeError(f"a method must be a factory (callable) or eval.runner.Method, got {type(m).__name__}")


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


def evaluate(task: str, suite_dir, methods: Mapping[str, Factory | Method], out_dir=None, *,
             cache_dir=_DEFAULT, datasets=None, progress: bool = True, n_threads: int | None = 1,
             tie_tol: float = 0.0, verbose: bool = True, raise_errors: bool = False) -> Report:
    """Evaluate every method on every dataset of ``suite_dir`` (``DIR/<task>`` if that exists).

    * results are cached (``cache_dir``; default ``out_dir/cache``, None = no cache) by
      (dataset + fingerprint, protocol, method, versions): a rerun computes only new pairs;
    * one tqdm bar per dataset (units = folds / conditions / seeds of every method);
    * a method that raises on a dataset is recorded as an error and skipped (``raise_errors``
      re-raises instead); nothing is cached for it;
    * with ``out_dir``: writes ``results.json`` (per-fold details), ``report.md``, ``report.json``
      and ``report.csv``; with ``verbose`` prints the Markdown report at the end.
    * ``n_threads`` caps BLAS/OpenMP threads while running (None = leave as is).
    """
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
    limiter = threadpool_limits(limits=n_threads) if n_threads else None
    try:
        for ds in suite:
            scores[ds.name], details[ds.name] = {}, {}
            bar = tqdm(total=len(meths) * protocol.n_units, desc=f"{task}:{ds.name}", unit="fit",
                       disable=not progress, leave=True, file=sys.stderr, dynamic_ncols=True)
            for name, method in meths.items():
                key = cache_key(ds.name, ds.fingerprint, protocol.name, name, _versions(method))
                result = cache.get(key)
                if result is not None:
                    bar.update(protocol.n_units)
                    result["cached"] = True
                else:
                    bar.set_postfix_str(name)
                    done = bar.n
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            result = protocol.run(ds, method.factory, progress=lambda: bar.update(1))
                    except Exception as err:  # noqa: BLE001 - one failing method must not end the run
                        if raise_errors:
                            raise
                        msg = f"{type(err).__name__}: {err}"
                        errors.setdefault(ds.name, {})[name] = msg
                        warnings.warn(f"{task}/{ds.name}: method {name!r} failed: {msg}", stacklevel=2)
                        if verbose:
                            traceback.print_exc(limit=3, file=sys.stderr)
                        bar.update(protocol.n_units - (bar.n - done))
                        continue
                    cache.put(key, result)
                    result["cached"] = False
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
                    tie_tol=tie_tol, errors=errors,
                    meta={"protocol": protocol.name, "suite": str(suite_dir),
                          "cache": {"dir": str(cache_dir) if cache_dir else None, "hits": cache.hits, "misses": cache.misses}})
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(_clean({"task": task, "protocol": protocol.name, "results": details}), indent=1) + "\n")
        paths = report.write(out)
        report.meta["files"] = {k: str(v) for k, v in paths.items()}
    if verbose:
        print(report.to_markdown())
        if out_dir is not None:
            print(f"reports written to {Path(out_dir)}/report.{{md,json,csv}}")
    return report
