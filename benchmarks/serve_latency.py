"""Latency and throughput of `tabfm serve` with batching on and off, on 127.0.0.1.

Starts the real server (`python -m tabfm serve`, one process, --threads 1) twice: batching on
(the defaults: --max-batch-cells 262144, --max-wait-ms 5) and off (--max-batch-cells 0). Each
run registers one context (200 rows x 8 numeric features, a binary target, n_estimators=1, the
estimators' other defaults) and then sends a fixed number of small requests (4 query rows each)
from 1, 8 and 32 concurrent clients (threads, one kept-alive connection each), in two modes:
"registered" (context_id + query rows) and "one-shot" (the 200 context rows in every request).
Prints a table and writes JSON: requests/s, p50 / p95 / p99 latency, errors (must be 0), model
calls (from /metrics), server RSS before and after.

    python benchmarks/serve_latency.py                    # ~3 min on a 2-core machine
    python benchmarks/serve_latency.py --quick            # smoke run (seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tabfm.client import TabFMClient, TabFMServerError

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def model_calls(client: TabFMClient) -> int:
    m = re.search(r"^tabfm_batch_requests_count (\d+)", client.metrics(), re.M)
    return int(m.group(1)) if m else 0


class Server:
    """`tabfm serve` in a subprocess on a free port."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tabfm", "serve", "--port", str(self.port), "--threads",
                                      "1", "--quiet", *flags], cwd=ROOT)
        client, deadline = TabFMClient(self.url, timeout=5), time.monotonic() + 120
        while True:
            try:
                client.ready()
                return
            except (OSError, TabFMServerError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"tabfm serve did not start (exit {self.proc.returncode})") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def load(url: str, clients: int, n_requests: int, send) -> dict:
    """n_requests calls of send(client, i) from `clients` threads: latencies and errors."""
    latencies, errors, lock = [], [0], threading.Lock()
    todo = iter(range(n_requests))

    def worker() -> None:
        client = TabFMClient(url)
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            start = time.perf_counter()
            try:
                send(client, i)
            except Exception:  # noqa: BLE001 - counted, must be 0
                with lock:
                    errors[0] += 1
                continue
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    return {"clients": clients, "requests": n_requests, "errors": errors[0], "seconds": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 2),
            **{f"p{q}_ms": round(float(np.percentile(ms, q)), 1) if len(ms) else None for q in (50, 95, 99)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 requests, 1 and 4 clients")
    ap.add_argument("--requests", type=int, default=64, help="requests per (mode, clients) cell (default 64)")
    ap.add_argument("--clients", default="1,8,32", help="concurrent clients, comma-separated (default 1,8,32)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/serve_latency.json"), help="JSON record")
    args = ap.parse_args()
    n_requests = 8 if args.quick else args.requests
    levels = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]

    rng = np.random.default_rng(0)
    X = pd.DataFrame(rng.normal(size=(200 + 4 * n_requests, 8)), columns=[f"f{i}" for i in range(8)])
    y = np.where(X.f0 + 0.5 * X.f1 > 0, "yes", "no")
    context = X.iloc[:200].assign(y=y[:200])
    queries = [X.iloc[200 + 4 * i:204 + 4 * i] for i in range(n_requests)]
    params = {"n_estimators": 1}
    runs = []
    for batching, flags in (("on", ()), ("off", ("--max-batch-cells", "0"))):
        server = Server(*flags)
        try:
            client = TabFMClient(server.url)
            cid = client.register("classification", context, target="y", params=params)["context_id"]
            client.classify(queries[0], context_id=cid)  # warm: the context's encodings
            for mode, send in (("registered", lambda c, i: c.classify(queries[i], context_id=cid)),
                               ("one-shot", lambda c, i: c.classify(queries[i], context=context, target="y",
                                                                    params=params))):
                for clients in levels:
                    rss0, calls0 = rss_mib(server.proc.pid), model_calls(client)
                    row = load(server.url, clients, n_requests, send)
                    row.update(batching=batching, mode=mode, model_calls=model_calls(client) - calls0,
                               rss_mib_before=round(rss0, 1), rss_mib_after=round(rss_mib(server.proc.pid), 1))
                    runs.append(row)
                    print(f"batching {batching:3s} {mode:10s} clients {clients:3d}: {row['requests_per_s']:7.2f} req/s "
                          f"p50 {row['p50_ms']} ms p95 {row['p95_ms']} ms errors {row['errors']}", flush=True)
        finally:
            server.stop()

    print("\n| batching | mode | clients | requests | errors | req/s | p50 ms | p95 ms | p99 ms | model calls | RSS MiB before → after |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        print(f"| {r['batching']} | {r['mode']} | {r['clients']} | {r['requests']} | {r['errors']} | {r['requests_per_s']} | "
              f"{r['p50_ms']} | {r['p95_ms']} | {r['p99_ms']} | {r['model_calls']} | {r['rss_mib_before']} → "
              f"{r['rss_mib_after']} |")
    record = {"benchmark": "serve_latency", "command": " ".join(["python", *sys.argv]), "context_rows": 200,
              "features": 8, "query_rows_per_request": 4, "params": params, "runs": runs,
              "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
