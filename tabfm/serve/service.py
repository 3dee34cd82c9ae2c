"""The server's state and its one job: turn a checked request into a queued model call.

Service owns the config, the metrics, the registered contexts and the lanes of one process;
the FastAPI routes (tabfm.serve.app) parse and validate, then call `context_for` / `register` /
`run` here and shape the answer. Nothing here knows HTTP beyond ApiError.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import pandas as pd

from . import tables, wire
from .batching import Batcher, request_cost
from .config import ServeConfig
from .contexts import Context, ContextStore, digest
from .errors import ApiError, invalid
from .metrics import Metrics
from .schemas import DEFAULT_CHUNK_SIZE, DEFAULT_N_ESTIMATORS, PARAMS
from .tasks import Runner, Work, install_warning_hook, restore_warning_hook

log = logging.getLogger("tabfm.serve")
TASK_OF = {"classify": "classification", "regress": "regression", "impute": "imputation", "anomaly": "anomaly"}
SUPERVISED = ("classification", "regression")


class Service:
    """One server process: model, lanes, registered contexts, metrics."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.store = ContextStore(config.context_cache_bytes, self.metrics, config.context_dir)
        self.batcher = Batcher(Runner(config, self.store, self.metrics), self.metrics, config.max_wait_ms,
                               config.max_batch_cells, config.max_queue)
        self.ready = False
        self.device = "?"
        self._warnings: Any = None

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        """Load the weights (safetensors, tabfm.weights), start the lanes."""
        import torch

        from tabfm.weights import load_model

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.config.device == "auto" else self.config.device
        for name in sorted(set(self.config.models().values())):
            load_model(name, device)  # cached per process: the estimators reuse it
        self.device = device
        self._warnings = install_warning_hook()
        self.batcher.start()
        self.ready = True
        log.info("tabfm serve: models %s on %s, %d lanes, batching %s", self.config.models(), device,
                 len(self.batcher.lanes), "on" if self.config.batching else "off")

    def stop(self) -> None:
        """Finish queued calls, stop the lanes."""
        self.ready = False
        self.batcher.close(timeout=120)  # the calls running now finish; their threads are daemons past that
        if self._warnings is not None:
            restore_warning_hook(self._warnings)
            self._warnings = None

    # ---------------------------------------------------------------- contexts
    def check_params(self, params: Any) -> dict[str, Any]:
        """Explicit estimator parameters of a request (defaults left to the estimator), within limits."""
        if params.n_estimators > self.config.max_estimators:
            raise ApiError(422, "too_many_estimators", f"params.n_estimators = {params.n_estimators}, over this "
                           f"server's limit of {self.config.max_estimators} (tabfm serve --max-estimators)",
                           field="params.n_estimators", limit=self.config.max_estimators)
        return params.model_dump(exclude_unset=True)

    def new_context(self, task: str, frame: pd.DataFrame, target: str | None, params: Any, identity: bytes) -> Context:
        """A Context of `frame` (checked; target split off), its key a digest of what decides its answers."""
        explicit = self.check_params(params)
        if task in SUPERVISED:
            if not target:
                raise invalid(f"a {task} context needs `target`, its target column", field="target",
                              error="missing_target")
            x, y = tables.split_target(frame, target, task, self.config)
        else:
            if target:
                raise invalid(f"an {task} context has no target; leave `target` out", field="target")
            x, y = frame, None
        key = digest(task, target, explicit, identity)
        return Context(key=key, task=task, params=explicit, columns=list(x.columns),
                       numeric=tables.numeric_columns(x), target=target, x=x, y=y, n_rows=len(x))

    def registered(self, context_id: str, op: str) -> Context:
        ctx = self.store.get(context_id, self._reload)
        if ctx.task != TASK_OF[op]:
            raise invalid(f"context {context_id!r} was registered for {ctx.task}, not {TASK_OF[op]}",
                          field="context_id", error="wrong_task")
        return ctx

    def _reload(self, meta: dict[str, Any], body: bytes) -> Context:
        """A context from the workers' spool (the table as it arrived, never a pickle)."""
        if meta["media"] == wire.JSON:
            import json

            frame = tables.json_table(json.loads(body), "context", self.config)
        else:
            frame = tables.body_table(body, meta["media"], "context", self.config)
        params = PARAMS[meta["task"]].model_validate(meta["params"])
        ctx = self.new_context(meta["task"], frame, meta["target"], params, b"")
        ctx.key = meta["key"]
        return ctx

    async def register(self, task: str, frame: pd.DataFrame, target: str | None, params: Any,
                       media: str, body: bytes) -> tuple[Context, bool]:
        """Register (fit, in a lane) a context; (context, it existed already)."""
        if params.random_state is None:  # a drawn seed, so every later request (and worker) repeats it
            params = params.model_copy(update={"random_state": secrets.randbelow(2**31)})
        ctx = self.new_context(task, frame, target, params, body)
        existing = self.store.peek(ctx.id)
        if existing is not None:
            return self.store.put(existing, None, None)
        if ctx.measure() > self.config.context_cache_bytes:
            raise ApiError(413, "context_too_large", f"the context holds {ctx.nbytes} bytes, over this server's "
                           f"context cache of {self.config.context_cache_bytes} (tabfm serve --context-cache-mib)",
                           field="context", limit=self.config.context_cache_bytes)
        ctx = await self._submit(Work(ctx, "fit"), ("fit", id(ctx)), cells=0)
        return self.store.put(ctx, media, body)

    # ---------------------------------------------------------------- calls
    async def run(self, op: str, ctx: Context, query: pd.DataFrame, options: tuple = ()) -> dict[str, Any]:
        """The answer for `query` rows in context `ctx` (columns checked against the context)."""
        query = tables.match_columns(query, ctx.columns, drop=ctx.target)
        tables.check_numbers(ctx.numeric, query)
        work = Work(ctx, op, query, options)
        return await self._submit(work, (ctx.key, op, options), cells=len(query) * (len(ctx.columns) + 1))

    async def _submit(self, work: Work, group: Any, cells: int) -> Any:
        ctx = work.ctx
        members = int(ctx.params.get("n_estimators", DEFAULT_N_ESTIMATORS))
        cost = request_cost(ctx.n_rows, len(work.query) if work.query is not None else 0, len(ctx.columns) + 1,
                            members, int(ctx.params.get("chunk_size", DEFAULT_CHUNK_SIZE)))
        future = self.batcher.submit(group, cost, cells, work)
        return await asyncio.wrap_future(future)
