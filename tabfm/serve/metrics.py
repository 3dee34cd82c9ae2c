"""Prometheus text exposition (format 0.0.4) without a client library: counters, gauges, histograms.

Thread-safe (worker threads observe batches while the event loop counts requests). With
--workers N every worker process keeps its own numbers; a scrape reads the worker that answers.
"""
from __future__ import annotations

import math
import threading
from typing import Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(k)} {_num(v)}" for k, v in (items or [((), 0.0)])]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[tuple(sorted(labels.items()))] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[Labels, list[float]] = {}  # bucket counts..., +Inf count, sum

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            s = self._series.setdefault(key, [0.0] * (len(self.buckets) + 2))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    s[i] += 1
            s[-2] += 1
            s[-1] += value

    def count(self, **labels: str) -> float:
        s = self._series.get(tuple(sorted(labels.items())))
        return s[-2] if s else 0.0

    def lines(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        for key, s in items:
            for bound, n in [*zip(self.buckets, s), (math.inf, s[-2])]:
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(key, le)} {_num(n)}")
            out.append(f"{self.name}_sum{_labels(key)} {_num(s[-1])}")
            out.append(f"{self.name}_count{_labels(key)} {_num(s[-2])}")
        return out


class Metrics:
    """Everything /metrics exposes (names prefixed tabfm_)."""

    def __init__(self) -> None:
        self.requests = Counter("tabfm_requests_total", "HTTP requests by endpoint (route template), method and status")
        self.latency = Histogram("tabfm_request_duration_seconds", "HTTP request latency by endpoint", LATENCY_BUCKETS)
        self.unauthorized = Counter("tabfm_unauthorized_total", "requests refused for a missing or wrong bearer token")
        self.in_flight = Gauge("tabfm_requests_in_flight", "HTTP requests being answered")
        self.queue_depth = Gauge("tabfm_queue_depth", "requests waiting for a model call, by lane")
        self.batch_requests = Histogram("tabfm_batch_requests", "requests answered by one model call", COUNT_BUCKETS)
        self.batch_rows = Histogram("tabfm_batch_rows", "query rows of one model call", ROW_BUCKETS)
        self.model_seconds = Histogram("tabfm_model_seconds", "time of one model call (fit or predict), by task",
                                       LATENCY_BUCKETS)
        self.queue_seconds = Histogram("tabfm_queue_seconds", "time a request waited in its lane", LATENCY_BUCKETS)
        self.cache_bytes = Gauge("tabfm_context_cache_bytes", "bytes held by registered contexts")
        self.cache_limit = Gauge("tabfm_context_cache_limit_bytes", "--context-cache-mib in bytes")
        self.cache_entries = Gauge("tabfm_context_cache_entries", "registered contexts held in memory")
        self.evictions = Counter("tabfm_context_evictions_total", "registered contexts evicted (least recently used)")
        self.rejected = Counter("tabfm_rejected_total", "requests refused before the model, by reason (error code)")

    def all(self) -> list[_Metric]:
        return [m for m in vars(self).values() if isinstance(m, _Metric)]

    def render(self) -> str:
        return "\n".join(line for m in self.all() for line in m.lines()) + "\n"
