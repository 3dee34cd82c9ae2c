"""Contexts: the labelled rows a request is answered in, fitted once into an estimator.

A Context is either one-shot (the rows came with the request; it lives for that request's batch)
or registered (POST /v1/contexts): then it has an id and stays in the ContextStore, an LRU whose
entries' bytes (fitted table + the members' encoded contexts, see tabfm.serve.estimators) stay
under --context-cache-mib. The id is a digest of the task, target, parameters and table, so
registering the same table twice gives the same id. An evicted or deleted id answers 404 saying so.

With --workers N > 1 each worker process has its own store, so registrations are also written to a
spool directory the workers share (the table as it arrived, never a pickle): a worker that does not
hold an id reads it from there and fits it again (same table, same parameters, same answers). The
spool keeps under the same byte cap, least recently used first.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import ApiError
from .metrics import Metrics

EVICTED_MEMORY = 4096  # recently evicted ids remembered, to say "evicted" rather than "unknown"
ID = re.compile(r"ctx_[0-9a-f]{32}")


def digest(*parts: Any) -> str:
    """Hex digest of JSON-able parts and bytes: the identity of a context."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()


@dataclass
class Context:
    """Context rows of one task, fitted (in a worker thread) on first use."""

    key: str  # identity: equal keys = same table, target and parameters
    task: str
    params: dict[str, Any]  # explicit estimator parameters
    columns: list[str]  # feature columns, in order
    numeric: dict[str, bool]  # feature column -> the context holds numbers (query cells must too)
    target: str | None = None
    x: pd.DataFrame | None = None  # until fitted
    y: pd.Series | None = None
    estimator: Any = None
    registered: bool = False
    fit_warnings: list[str] = field(default_factory=list)
    classes: list[Any] | None = None
    offset: float | None = None
    n_rows: int = 0
    nbytes: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def id(self) -> str:
        return "ctx_" + self.key[:32]

    def measure(self) -> int:
        """Bytes it holds now (fitted table + encodings, or the raw rows until fitted)."""
        if self.estimator is not None:
            self.nbytes = int(self.estimator.table_bytes() + self.estimator.encoded_bytes())
        elif self.x is not None:
            self.nbytes = int(self.x.memory_usage(deep=True).sum() + (0 if self.y is None else self.y.memory_usage(deep=True)))
        return self.nbytes


class ContextStore:
    """Registered contexts of this process: LRU under a byte cap (+ the workers' spool)."""

    def __init__(self, cap_bytes: int, metrics: Metrics, spool: str | None = None) -> None:
        self.cap, self.metrics = cap_bytes, metrics
        self.spool = Path(spool) if spool else None
        if self.spool is not None:
            self.spool.mkdir(parents=True, exist_ok=True)
        self._items: OrderedDict[str, Context] = OrderedDict()
        self._gone: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (when, "evicted" | "deleted")
        self._lock = threading.RLock()
        metrics.cache_limit.set(cap_bytes)

    # ---------------------------------------------------------------- lookup
    def get(self, context_id: str, reload: Any = None) -> Context:
        """The context `context_id`; reload(meta, body) rebuilds one from the spool; 404 if gone."""
        if not ID.fullmatch(context_id):
            raise self.gone(context_id)
        with self._lock:
            ctx = self._items.get(context_id)
            if ctx is not None and self.spool is not None and not self._spooled(context_id).exists():
                self._drop(context_id)  # deleted or evicted from the spool by another worker
                ctx = None
            if ctx is not None:
                self._items.move_to_end(context_id)
                ctx.last_used = time.time()
                return ctx
        if self.spool is not None and reload is not None:
            found = self._read_spool(context_id)
            if found is not None:
                ctx = reload(*found)
                return self.put(ctx, None, None)[0]
        raise self.gone(context_id)

    def gone(self, context_id: str) -> ApiError:
        cap = f"--context-cache-mib {self.cap / (1 << 20):g}"
        when, how = self._gone.get(context_id, (None, ""))
        if how == "evicted":
            why = f"it was evicted {time.time() - when:.0f} s ago (least recently used) to stay under {cap}"
        elif how == "deleted":
            why = f"it was deleted {time.time() - when:.0f} s ago"
        else:
            why = f"it was never registered here, was deleted, or was evicted (least recently used) to stay under {cap}"
        return ApiError(404, "context_not_found", f"context {context_id!r} is not registered: {why}; register it "
                        "again (POST /v1/contexts)", field="context_id")

    def peek(self, context_id: str) -> Context | None:
        """The registered context `context_id` if this process holds it (no LRU touch, no spool)."""
        with self._lock:
            return self._items.get(context_id)

    def list(self) -> list[Context]:
        with self._lock:
            return list(self._items.values())

    def total(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._items.values())

    # ---------------------------------------------------------------- changes
    def put(self, ctx: Context, media: str | None, body: bytes | None) -> tuple[Context, bool]:
        """Register `ctx` (or return the one with its id); spool the table as it arrived."""
        with self._lock:
            old = self._items.get(ctx.id)
            if old is not None:
                self._items.move_to_end(ctx.id)
                return old, True
            ctx.registered = True
            self._items[ctx.id] = ctx
            self._gone.pop(ctx.id, None)
        if self.spool is not None and body is not None:
            self._write_spool(ctx, media or "", body)
        self.account(ctx)
        return ctx, False

    def delete(self, context_id: str) -> None:
        if not ID.fullmatch(context_id):
            raise self.gone(context_id)
        with self._lock:
            known = context_id in self._items
            self._drop(context_id)
            if known:
                self._forget(context_id, "deleted")
        spooled = self.spool is not None and self._spooled(context_id).exists()
        if spooled:
            for path in (self._spooled(context_id), self._spooled(context_id, ".json")):
                path.unlink(missing_ok=True)
        if not known and not spooled:
            raise self.gone(context_id)

    def account(self, ctx: Context) -> None:
        """After a call on `ctx`: its bytes now; evict least recently used contexts above the cap,
        then, if `ctx` alone is over it, its encodings; a table alone over the cap is evicted."""
        with self._lock:
            ctx.measure()
            if not ctx.registered or ctx.id not in self._items:
                return
            for other in list(self._items.values()):
                if self.total() <= self.cap:
                    break
                if other is not ctx:
                    self._evict(other.id)
            if self.total() > self.cap and ctx.estimator is not None:
                ctx.estimator.drop_encoded()
                ctx.measure()
            if self.total() > self.cap:
                self._evict(ctx.id)
            self._gauges()

    def _evict(self, context_id: str) -> None:
        self._drop(context_id)
        self._forget(context_id, "evicted")
        self.metrics.evictions.inc()

    def _forget(self, context_id: str, how: str) -> None:
        self._gone[context_id] = (time.time(), how)
        while len(self._gone) > EVICTED_MEMORY:
            self._gone.popitem(last=False)

    def _drop(self, context_id: str) -> None:
        ctx = self._items.pop(context_id, None)
        if ctx is not None:
            ctx.registered = False
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.cache_bytes.set(sum(c.nbytes for c in self._items.values()))
        self.metrics.cache_entries.set(len(self._items))

    # ---------------------------------------------------------------- spool (workers > 1)
    def _spooled(self, context_id: str, suffix: str = ".table") -> Path:
        assert self.spool is not None
        return self.spool / f"{context_id}{suffix}"

    def _write_spool(self, ctx: Context, media: str, body: bytes) -> None:
        meta = {"task": ctx.task, "target": ctx.target, "params": ctx.params, "media": media, "key": ctx.key}
        for suffix, data in ((".table", body), (".json", json.dumps(meta).encode())):
            tmp = self._spooled(ctx.id, suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self._spooled(ctx.id, suffix))
        files = sorted((p for p in self.spool.glob("*.table")), key=lambda p: p.stat().st_mtime)
        size = sum(p.stat().st_size for p in files)
        for path in files:
            if size <= self.cap:
                break
            size -= path.stat().st_size
            path.unlink(missing_ok=True)
            path.with_suffix(".json").unlink(missing_ok=True)

    def _read_spool(self, context_id: str) -> tuple[dict, bytes] | None:
        table, meta = self._spooled(context_id), self._spooled(context_id, ".json")
        try:
            body, info = table.read_bytes(), json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        os.utime(table)  # least recently used = oldest mtime
        return info, body
