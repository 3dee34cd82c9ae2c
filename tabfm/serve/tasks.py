"""One model call per batch: fit a context, or answer the merged query rows of its jobs.

Runs in a lane's worker thread (tabfm.serve.batching). The jobs of one batch share a context,
an operation and its options, so their query rows go through one estimator call and the answers
are split back by row counts; each row's answer is what the in-process estimator gives it alone.
If a merged call fails, every job runs alone, so an error is only its own request's.
"""
from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pandas as pd

from .config import ServeConfig
from .contexts import Context, ContextStore
from .errors import ApiError, invalid
from .estimators import ESTIMATORS
from .metrics import Metrics
from .wire import scalar

OPS = ("classify", "regress", "impute", "anomaly")


@dataclass
class Work:
    """A job's payload: what to do with which context."""

    ctx: Context
    op: str  # "fit" or one of OPS
    query: pd.DataFrame | None = None
    options: tuple = ()  # classify: (return_proba,), regress: (levels,)


# ----------------------------------------------------------------------------- warnings
_collector = threading.local()


@contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """The warnings this thread raises inside the block (see install_warning_hook)."""
    found: list[str] = []
    _collector.found = found
    try:
        yield found
    finally:
        _collector.found = None


def install_warning_hook() -> Any:
    """Route warnings raised in a collecting worker thread into its list (every time, not once per
    place); other warnings go where they went. Returns what to restore. `warnings.catch_warnings`
    is process-wide, so threads cannot each use it."""
    before = warnings.showwarning, list(warnings.filters)

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        found = getattr(_collector, "found", None)
        if found is not None:
            text = " ".join(str(message).split())
            if text not in found:
                found.append(text)
        else:
            before[0](message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.simplefilter("always", UserWarning)
    return before


def restore_warning_hook(before: Any) -> None:
    warnings.showwarning = before[0]
    warnings.filters[:] = before[1]


# ----------------------------------------------------------------------------- calls
def estimator_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """Request parameters as estimator keyword arguments."""
    out = dict(params)
    if isinstance(out.get("n_neighbors"), list):
        out["n_neighbors"] = tuple(out["n_neighbors"])
    return out


def fit(ctx: Context, config: ServeConfig) -> None:
    """Fit ctx's estimator on its rows (once); frees the raw rows."""
    if ctx.estimator is not None:
        return
    est = ESTIMATORS[ctx.task](model=config.model_for(ctx.task), device=config.device, precision=config.precision, progress=False,
                               **estimator_kwargs(ctx.params))
    with collected_warnings() as found:
        if ctx.y is not None:
            est.fit(ctx.x, ctx.y)
        else:
            est.fit(ctx.x)
    ctx.fit_warnings = found
    ctx.classes = [scalar(c) for c in est.classes_] if hasattr(est, "classes_") else None
    ctx.offset = float(est.offset_) if hasattr(est, "offset_") else None
    ctx.estimator, ctx.x, ctx.y = est, None, None


def answer(ctx: Context, op: str, query: pd.DataFrame, options: tuple) -> list[dict[str, Any]] | dict[str, Any]:
    """The estimator's answer for `query` rows (column arrays, split later by row)."""
    est = ctx.estimator
    if op == "classify":
        proba = est.predict_proba(query)
        labels = est.classes_[np.argmax(proba, axis=1)]  # = est.predict(query)
        return {"predictions": [scalar(v) for v in labels], "probabilities": proba if options[0] else None}
    if op == "regress":
        levels = list(options[0])
        mean, quantiles = est._distribution(query, levels)  # = predict(query), predict_quantiles(query, levels)
        return {"mean": mean, "quantiles": quantiles if levels else None}
    if op == "impute":
        filled = est.transform(query)
        n_filled = (query.isna().to_numpy() & filled.notna().to_numpy()).sum(1)
        return {"table": filled, "n_filled": n_filled}
    if op == "anomaly":
        scores = est.score_samples(query)
        decision = scores - est.offset_  # = decision_function
        return {"scores": scores, "decision": decision, "labels": np.where(decision < 0, -1, 1)}
    raise ValueError(f"unknown operation {op!r}")


def _take(result: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows start:stop of a column-array answer."""
    out = {}
    for k, v in result.items():
        if v is None:
            out[k] = None
        elif isinstance(v, pd.DataFrame):
            out[k] = v.iloc[start:stop].reset_index(drop=True)
        else:
            out[k] = v[start:stop]
    return out


def as_api_error(err: BaseException) -> BaseException:
    """An estimator's refusal of the input (ValueError, TypeError) as a 422; anything else unchanged."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, (ValueError, TypeError)):
        return invalid(" ".join(str(err).split()) or type(err).__name__, error="estimator_refused")
    return err


class Runner:
    """The batch runner the lanes call (config, store and metrics of one server process)."""

    def __init__(self, config: ServeConfig, store: ContextStore, metrics: Metrics) -> None:
        self.config, self.store, self.metrics = config, store, metrics

    def __call__(self, works: list[Work]) -> list[Any]:
        ctx = next((w.ctx for w in works if w.ctx.estimator is not None), works[0].ctx)
        op = works[0].op
        with ctx.lock:
            start = time.perf_counter()
            try:
                fit(ctx, self.config)
            except BaseException as err:  # noqa: BLE001 - the context's fault is every job's answer
                return [as_api_error(err)] * len(works)
            finally:
                if op == "fit":
                    self.metrics.model_seconds.observe(time.perf_counter() - start, task="fit")
            if op == "fit":
                results: list[Any] = [ctx] * len(works)
            else:  # each answer names the context that gave it (merged one-shot contexts: the batch's first)
                results = [r if isinstance(r, BaseException) else {**r, "context": ctx}
                           for r in self._answer_all(ctx, works)]
            ctx.requests += 0 if op == "fit" else len(works)
        self.store.account(ctx)
        return results

    def _answer_all(self, ctx: Context, works: list[Work]) -> list[Any]:
        op, options = works[0].op, works[0].options
        sizes = [len(w.query) for w in works]
        start = time.perf_counter()
        if len(works) > 1:
            try:
                query = pd.concat([w.query for w in works], ignore_index=True)
                with collected_warnings() as found:
                    merged = answer(ctx, op, query, options)
                bounds = np.cumsum([0, *sizes])
                results = [{**_take(merged, a, b), "warnings": found} for a, b in zip(bounds[:-1], bounds[1:])]
                self._observe(op, sum(sizes), start)
                return results
            except Exception:  # noqa: BLE001 - each job alone, so an error is only its own request's
                start = time.perf_counter()
        results = []
        for w in works:
            try:
                with collected_warnings() as found:
                    results.append({**answer(ctx, op, w.query, options), "warnings": found})
            except Exception as err:  # noqa: BLE001
                results.append(as_api_error(err))
        self._observe(op, sum(sizes), start)
        return results

    def _observe(self, op: str, rows: int, start: float) -> None:
        self.metrics.model_seconds.observe(time.perf_counter() - start, task=op)
        self.metrics.batch_rows.observe(rows)
