"""`tabfm serve` under a mix of table sizes: does a small request wait behind a large one?

Starts the real server (`python -m tabfm serve`, one process on 127.0.0.1, --threads 1: the
`Server` of benchmarks/serve_latency.py) and drives it with concurrent clients (threads, one
kept-alive connection each, closed loop: a client sends its next request when the last one is
answered). Every client belongs to one size class (--sizes: context rows x feature columns, query
rows --query-fraction of the context rows) and sends classify requests, and a share
(--regress-share) of regress requests, on that class's contexts: per class one classification
and one regression context (binary / numeric target), registered once, so the requests of a class
carry only query rows and may share a model call (--mode one-shot sends the context rows in every
request instead). The same clients then run in phases, one server, one run:

    small               the smallest class alone (its clients only): the reference
    small+medium, ...   the reference with each other class
    all                 every class at once
    small               alone again (the machine's load drifts; both alone phases are pooled)

and, per phase and class, the table reports requests, errors, req/s, cells/s (cells the model
reads: (context + query rows) x (features + 1) x members, the cost the server queues by), p50 /
p90 / p99 latency, the lane (size class) the server puts that class in, and the ratio of the
reference class's latency to its latency alone (pooled over its alone phases). From /metrics,
per phase: model calls, requests per call, the mean wait in a lane, and the queue depth of each
lane (sampled every --scrape-interval s). A ratio near 1 in a phase means the small requests did
not wait for the larger ones; a class in the reference's lane is one they queue behind (FIFO); a
class in another lane has its own queue and thread, and competes with it only for the CPU (and
the GIL).

    python benchmarks/serve_load.py                        # 16 clients, 5 phases x 20 s, ~3 min
    python benchmarks/serve_load.py --quick                # smoke run (< 60 s)
    python benchmarks/serve_load.py --sizes small=50x5,large=2000x40 --clients small=8,large=4 \\
        --duration 30 --server-args "--max-wait-ms 0"
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common import machine_info
from serve_latency import ROOT, Server, rss_mib
from tabfm.client import TabFMClient
from tabfm.serve import wire
from tabfm.inference import DEFAULT_CHUNK_SIZE
from tabfm.serve.batching import lane_of, request_cost

QUICK = {"sizes": "small=30x4,large=300x12", "clients": "4", "duration": 6.0}
DEFAULTS = {"sizes": "small=50x5,medium=400x20,large=2000x40", "clients": "16", "duration": 20.0}
PATHS = {"classify": "/v1/classify", "regress": "/v1/regress"}


@dataclass
class SizeClass:
    name: str
    rows: int  # context rows
    cols: int  # feature columns (the target is one more)
    query_rows: int
    clients: int = 0
    members: int = 1

    @property
    def cells(self) -> int:
        """Cells the model reads for one request: the cost the server queues by (Service._submit)."""
        return request_cost(self.rows, self.query_rows, self.cols + 1, self.members, DEFAULT_CHUNK_SIZE)

    @property
    def lane(self) -> int:
        return lane_of(self.cells)


def parse_sizes(spec: str, query_fraction: float, members: int) -> list[SizeClass]:
    """'small=50x5,large=2000x40' (or NAME=ROWSxCOLS+QUERY) -> size classes, in that order."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*([A-Za-z][\w-]*)=(\d+)x(\d+)(?:\+(\d+))?\s*", item)
        if not m:
            raise SystemExit(f"--sizes: {item!r} is not NAME=ROWSxCOLS or NAME=ROWSxCOLS+QUERY_ROWS")
        rows, cols = int(m.group(2)), int(m.group(3))
        query = int(m.group(4)) if m.group(4) else max(1, round(rows * query_fraction))
        out.append(SizeClass(m.group(1), rows, cols, query, members=members))
    if len({c.name for c in out}) != len(out):
        raise SystemExit("--sizes: class names must differ")
    return out


def assign_clients(classes: list[SizeClass], spec: str) -> None:
    """'16' (split evenly, in --sizes order, the remainder to the first) or 'small=8,large=4'."""
    if spec.strip().isdigit():
        n = int(spec)
        if n < len(classes):
            raise SystemExit(f"--clients {n}: fewer than the {len(classes)} size classes")
        for i, c in enumerate(classes):
            c.clients = n // len(classes) + (1 if i < n % len(classes) else 0)
        return
    counts = dict(kv.split("=") for kv in spec.split(","))
    for c in classes:
        c.clients = int(counts.pop(c.name, 0))
    if counts or not all(c.clients > 0 for c in classes):
        raise SystemExit(f"--clients {spec!r}: give every class of --sizes (and only those) a count > 0")


def default_phases(classes: list[SizeClass]) -> list[list[str]]:
    """The reference alone, the reference with each other class, all classes, the reference alone again."""
    ref, others = classes[0].name, [c.name for c in classes[1:]]
    phases = [[ref], *([ref, o] for o in others), [c.name for c in classes]]
    return [p for i, p in enumerate(phases) if p not in phases[:i]] + [[ref]]  # alone again: the load drifts


def parse_phases(spec: str | None, classes: list[SizeClass]) -> list[list[str]]:
    if not spec:
        return default_phases(classes)
    names = [c.name for c in classes]
    phases = [names if p.strip() == "all" else [n.strip() for n in p.split("+")] for p in spec.split(";")]
    for p in phases:
        if not set(p) <= set(names):
            raise SystemExit(f"--phases: {'+'.join(p)!r} names a class not in --sizes ({', '.join(names)})")
    return phases


# ----------------------------------------------------------------------------- tables and bodies
def make_table(rng: np.random.Generator, rows: int, cols: int, task: str) -> pd.DataFrame:
    """`rows` rows of `cols` numeric features and a target `y` (binary labels or a number)."""
    X = pd.DataFrame(rng.normal(size=(rows, cols)), columns=[f"f{i}" for i in range(cols)])
    signal = X.iloc[:, 0] + 0.5 * X.iloc[:, min(1, cols - 1)]
    if task == "classification":
        return X.assign(y=np.where(signal > 0, "yes", "no"))
    return X.assign(y=signal + 0.1 * rng.normal(size=rows))


def build_bodies(client: TabFMClient, c: SizeClass, mode: str, variants: int, params: dict,
                 rng: np.random.Generator) -> tuple[dict[str, list[bytes]], dict]:
    """Per operation, `variants` pre-encoded JSON bodies (different query rows) and the class's contexts."""
    bodies, info = {}, {}
    for op, task in (("classify", "classification"), ("regress", "regression")):
        table = make_table(rng, c.rows + variants * c.query_rows, c.cols, task)
        context = table.iloc[:c.rows]
        queries = [table.iloc[c.rows + i * c.query_rows:c.rows + (i + 1) * c.query_rows].drop(columns="y")
                   for i in range(variants)]
        extra = {"return_proba": True} if op == "classify" else {"quantiles": []}
        if mode == "registered":
            reg = client.register(task, context, target="y", params=params)
            head = {"context_id": reg["context_id"]}
            info[task] = {"context_id": reg["context_id"]}
        else:
            head = {"context": wire.frame_to_columns(context), "target": "y", "params": params}
        bodies[op] = [json.dumps({"query": wire.frame_to_columns(q), **head, **extra}).encode() for q in queries]
    return bodies, info


# ----------------------------------------------------------------------------- /metrics
SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$")


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, ((label, value), ...)): value}."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(sample: dict, name: str, **match: str) -> float:
    """Sum of a metric's series whose labels include `match`."""
    return sum(v for (n, labels), v in sample.items() if n == name and set(match.items()) <= set(labels))


def metric_delta(before: dict, after: dict) -> dict:
    """What the server's counters and histograms say about one phase."""
    d = {k: total(after, k) - total(before, k) for k in (
        "tabfm_batch_requests_count", "tabfm_batch_requests_sum", "tabfm_queue_seconds_count",
        "tabfm_queue_seconds_sum", "tabfm_batch_rows_sum", "tabfm_context_evictions_total")}
    calls = d["tabfm_batch_requests_count"]
    out = {"model_calls": int(calls),
           "requests_per_call": round(d["tabfm_batch_requests_sum"] / calls, 2) if calls else None,
           "query_rows_per_call": round(d["tabfm_batch_rows_sum"] / calls, 1) if calls else None,
           "mean_lane_wait_ms": round(1000 * d["tabfm_queue_seconds_sum"] / d["tabfm_queue_seconds_count"], 1)
           if d["tabfm_queue_seconds_count"] else None,
           "evictions": int(d["tabfm_context_evictions_total"]), "model_seconds": {}}
    for task in ("classify", "regress", "fit"):
        n = total(after, "tabfm_model_seconds_count", task=task) - total(before, "tabfm_model_seconds_count", task=task)
        s = total(after, "tabfm_model_seconds_sum", task=task) - total(before, "tabfm_model_seconds_sum", task=task)
        if n:
            out["model_seconds"][task] = {"calls": int(n), "mean_s": round(s / n, 3)}
    return out


class Sampler(threading.Thread):
    """Polls /metrics: the queue depth of every lane and the requests in flight."""

    def __init__(self, url: str, interval: float, n_lanes: int) -> None:
        super().__init__(daemon=True)
        self.client, self.interval, self.n_lanes = TabFMClient(url, timeout=30), interval, n_lanes
        self.depths: list[list[float]] = [[] for _ in range(n_lanes)]
        self.in_flight: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            try:
                s = scrape(self.client.metrics())
            except Exception:  # noqa: BLE001 - a missed sample is only a missed sample
                continue
            for lane in range(self.n_lanes):
                self.depths[lane].append(total(s, "tabfm_queue_depth", lane=str(lane)))
            self.in_flight.append(total(s, "tabfm_requests_in_flight"))

    def summary(self) -> dict:
        return {"samples": len(self.in_flight),
                "queue_depth_mean": [round(float(np.mean(d)), 2) if d else None for d in self.depths],
                "queue_depth_max": [int(max(d)) if d else None for d in self.depths],
                "in_flight_max": int(max(self.in_flight)) if self.in_flight else None}


# ----------------------------------------------------------------------------- load
def run_phase(url: str, classes: list[SizeClass], bodies: dict, duration: float, max_requests: int | None,
              regress_share: float, seed: int) -> tuple[list[dict], float]:
    """The clients of `classes` for `duration` s (or until `max_requests` are sent): one record per request."""
    records: list[dict] = []
    lock, sent = threading.Lock(), [0]
    deadline = time.monotonic() + duration

    def take() -> bool:
        with lock:
            if time.monotonic() >= deadline or (max_requests is not None and sent[0] >= max_requests):
                return False
            sent[0] += 1
            return True

    def worker(c: SizeClass, k: int) -> None:
        rng = np.random.default_rng([seed, k])
        client = TabFMClient(url)
        while take():
            op = "regress" if rng.random() < regress_share else "classify"
            body = bodies[c.name][op][int(rng.integers(len(bodies[c.name][op])))]
            start = time.perf_counter()
            try:
                client.call("POST", PATHS[op], body=body)
                error = None
            except Exception as err:  # noqa: BLE001 - counted, should be 0
                error = f"{type(err).__name__}: {err}"[:200]
            records.append({"size": c.name, "op": op, "start": start, "seconds": time.perf_counter() - start,
                            "error": error})

    threads = [threading.Thread(target=worker, args=(c, 1000 * j + i)) for j, c in enumerate(classes)
               for i in range(c.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


def class_stats(c: SizeClass, records: list[dict], wall: float) -> dict:
    ok = [r["seconds"] for r in records if r["size"] == c.name and r["error"] is None]
    errors = [r["error"] for r in records if r["size"] == c.name and r["error"] is not None]
    ms = np.array(ok) * 1000
    pct = {f"p{q}_ms": round(float(np.percentile(ms, q)), 1) if len(ms) else None for q in (50, 90, 99)}
    return {"size": c.name, "context_rows": c.rows, "features": c.cols, "query_rows": c.query_rows,
            "lane": c.lane, "cells_per_request": c.cells, "clients": c.clients, "requests": len(ok),
            "regress": sum(r["op"] == "regress" for r in records if r["size"] == c.name and r["error"] is None),
            "errors": len(errors), "first_errors": errors[:3], "requests_per_s": round(len(ok) / wall, 3),
            "cells_per_s": round(len(ok) * c.cells / wall, 1), **pct}


def fmt(v, digits: int = 0) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a smoke run (< 60 s): --sizes {QUICK['sizes']} "
                    f"--clients {QUICK['clients']} --duration {QUICK['duration']:g} unless given")
    ap.add_argument("--sizes", help=f"size classes NAME=ROWSxCOLS[+QUERY_ROWS], smallest first: the first is the "
                    f"reference (default {DEFAULTS['sizes']})")
    ap.add_argument("--query-fraction", type=float, default=0.1,
                    help="query rows per request as a fraction of the context rows, where --sizes gives none (0.1)")
    ap.add_argument("--clients", help=f"concurrent clients: a total split evenly over the classes, or NAME=N,... "
                    f"(default {DEFAULTS['clients']})")
    ap.add_argument("--duration", type=float, help=f"seconds per phase (default {DEFAULTS['duration']:g})")
    ap.add_argument("--requests", type=int, help="end a phase after this many requests (all classes) if sooner")
    ap.add_argument("--phases", help="';'-separated phases, each 'all' or classes joined by '+' (default: the "
                    "first class alone, with each other class, all, alone again)")
    ap.add_argument("--regress-share", type=float, default=0.25, help="share of regress requests (default 0.25)")
    ap.add_argument("--mode", choices=("registered", "one-shot"), default="registered",
                    help="registered: contexts posted once, requests carry query rows; one-shot: every request "
                    "carries its context rows (default registered)")
    ap.add_argument("--n-estimators", type=int, default=1, help="ensemble members per request (default 1)")
    ap.add_argument("--variants", type=int, default=4, help="distinct query tables per class and operation (4)")
    ap.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics samples (0.5)")
    ap.add_argument("--server-args", default="", help="more `tabfm serve` flags, e.g. \"--max-wait-ms 0\"")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/serve_load.json"), help="JSON record")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key in preset:
        if getattr(args, key) is None:
            setattr(args, key, preset[key])

    classes = parse_sizes(args.sizes, args.query_fraction, args.n_estimators)
    assign_clients(classes, args.clients)
    phases = parse_phases(args.phases, classes)
    by_name = {c.name: c for c in classes}
    ref = classes[0]
    params = {"n_estimators": args.n_estimators}
    rng = np.random.default_rng(args.seed)
    machine = {k: v for k, v in machine_info().items() if k not in ("torch_threads_per_rank", "backend")}
    machine["load_average_start"] = list(os.getloadavg())

    server = Server(*shlex.split(args.server_args))
    results, contexts, alone_ms = [], {}, []
    try:
        client = TabFMClient(server.url)
        n_lanes = int(client.ready()["lanes"])
        bodies = {}
        start = time.perf_counter()
        for c in classes:  # register, then one request of each operation: every context encoded before timing
            bodies[c.name], contexts[c.name] = build_bodies(client, c, args.mode, args.variants, params, rng)
            for op in PATHS:
                client.call("POST", PATHS[op], body=bodies[c.name][op][0])
            for task, entry in contexts[c.name].items():
                entry["bytes"] = client.context(entry["context_id"])["bytes"]
        warm_s = time.perf_counter() - start
        print(f"server {server.url} ({n_lanes} lanes), warm-up {warm_s:.1f} s; classes: " + ", ".join(
            f"{c.name} {c.rows}x{c.cols}+{c.query_rows} (lane {c.lane}, {c.clients} clients)" for c in classes),
            flush=True)

        for i, names in enumerate(phases):
            members = [by_name[n] for n in names]
            label = "+".join(names) if len(names) < len(classes) or len(classes) == 1 else "all"
            sampler = Sampler(server.url, args.scrape_interval, n_lanes)
            before, load0 = scrape(client.metrics()), os.getloadavg()[0]
            sampler.start()
            records, wall = run_phase(server.url, members, bodies, args.duration, args.requests, args.regress_share,
                                      args.seed + i)
            sampler.halt.set()
            sampler.join()
            after = scrape(client.metrics())
            ok = [r for r in records if r["error"] is None]
            phase = {"phase": label, "classes": names, "seconds": round(wall, 2), "requests": len(ok),
                     "errors": len(records) - len(ok), "requests_per_s": round(len(ok) / wall, 3),
                     "cells_per_s": round(sum(by_name[r["size"]].cells for r in ok) / wall, 1),
                     "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
                     "rss_mib": round(rss_mib(server.proc.pid), 1),
                     "server": {**metric_delta(before, after), **sampler.summary()},
                     "by_size": [class_stats(c, records, wall) for c in members]}
            if names == [ref.name]:
                alone_ms += [1000 * r["seconds"] for r in ok]
            results.append(phase)
            print(f"phase {label:24s} {wall:6.1f} s  {phase['requests']:4d} requests  {phase['errors']} errors  "
                  + "  ".join(f"{s['size']} p50 {s['p50_ms']} ms" for s in phase["by_size"]), flush=True)
    finally:
        server.stop()

    # the reference alone: its requests of every phase it ran alone in, pooled (before and after the mixes)
    ref_alone = {q: float(np.percentile(alone_ms, q)) for q in (50, 90, 99)} if alone_ms else {}
    for p in results:
        for s in p["by_size"]:
            for q in (50, 90):
                a, b = ref_alone.get(q), s[f"p{q}_ms"]
                s[f"p{q}_vs_alone"] = round(b / a, 2) if s["size"] == ref.name and a and b else None

    print(f"\n| phase | class | context × features, query rows | lane | clients | requests | errors | req/s | "
          f"cells/s | p50 ms | p90 ms | p99 ms | p50 / p90 vs {ref.name} alone |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for p in results:
        for s in p["by_size"]:
            ratio = f"**{s['p50_vs_alone']:.2f}×** / {s['p90_vs_alone']:.2f}×" if s["p50_vs_alone"] else ""
            print(f"| {p['phase']} | {s['size']} | {s['context_rows']} × {s['features']}, {s['query_rows']} | "
                  f"{s['lane']} | {s['clients']} | {s['requests']} | {s['errors']} | {s['requests_per_s']:.2f} | "
                  f"{fmt(s['cells_per_s'])} | {fmt(s['p50_ms'])} | {fmt(s['p90_ms'])} | {fmt(s['p99_ms'])} | {ratio} |")
    print("\n| phase | req/s | cells/s | model calls | requests / call | mean lane wait ms | queue depth mean (max) "
          "by lane | load avg start → end |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for p in results:
        sv = p["server"]
        depth = " · ".join(f"{m if m is not None else '–'} ({x if x is not None else '–'})"
                           for m, x in zip(sv["queue_depth_mean"], sv["queue_depth_max"]))
        print(f"| {p['phase']} | {p['requests_per_s']:.2f} | {fmt(p['cells_per_s'])} | {sv['model_calls']} | "
              f"{fmt(sv['requests_per_call'], 2)} | {fmt(sv['mean_lane_wait_ms'])} | {depth} | "
              f"{p['load_average'][0]} → {p['load_average'][1]} |")
    shared = [c.name for c in classes[1:] if c.lane == ref.lane]
    if ref_alone:
        print(f"\n{ref.name} alone, pooled over {len(alone_ms)} requests: p50 {ref_alone[50]:,.0f} ms, "
              f"p90 {ref_alone[90]:,.0f} ms (the ratios are to these)")
    print(f"{ref.name} (lane {ref.lane}) shares its lane with: {', '.join(shared) or 'no other class'}")

    machine["load_average_end"] = list(os.getloadavg())
    record = {"benchmark": "serve_load", "command": " ".join(["python", *sys.argv]) if argv is None else
              " ".join(["python", "benchmarks/serve_load.py", *argv]),
              "settings": {"mode": args.mode, "params": params, "duration_s": args.duration,
                           "max_requests_per_phase": args.requests, "regress_share": args.regress_share,
                           "variants": args.variants, "server_args": args.server_args, "seed": args.seed,
                           "quick": args.quick},
              "sizes": [{**asdict(c), "cells_per_request": c.cells, "lane": c.lane} for c in classes],
              "reference": ref.name, "reference_alone_ms": {f"p{q}": round(v, 1) for q, v in ref_alone.items()},
              "contexts": contexts, "warm_up_s": round(warm_s, 2), "phases": results,
              "machine": machine}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return record


if __name__ == "__main__":
    main()
