"""`tabfm serve`: the prediction server (FastAPI + uvicorn; the `serve` extra).

    tabfm serve [--model NAME | EXPORT_DIR] [--host 127.0.0.1] [--port 8000] [--workers N]
                [--token T] [--max-rows N] [--max-columns N] [--max-classes N] [--max-categories N]
                [--max-body-bytes N] [--max-estimators N] [--max-batch-cells N] [--max-wait-ms MS]
                [--max-queue N] [--context-cache-mib MIB]

Binds loopback unless --host says otherwise; with --token (or $TABFM_SERVE_TOKEN) every endpoint
but /healthz and the page needs `Authorization: Bearer T`. SIGINT / SIGTERM stop accepting and
finish the requests in flight (up to --graceful-timeout seconds). docs/serving.md has the API.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from tabfm.commands._common import add_output_flags
from tabfm.serve.config import CONFIG_ENV, LOOPBACK, PRECISIONS, TOKEN_ENV, ServeConfig

SUMMARY = "serve predictions over HTTP (FastAPI + uvicorn): classify, regress, impute, anomaly-score"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = ServeConfig()
    p = subparsers.add_parser("serve", help=SUMMARY, description="An HTTP server for in-context predictions: "
                              "classify, regress, impute, anomaly-score, registered contexts, /metrics, a page at /. "
                              "Needs the serve extra: pip install 'tabfm[serve]'.")
    p.add_argument("--model", default=d.model, help="shipped model name or export directory for every task (default: "
                   "each task's own, " + ", ".join(f"{t} {m}" for t, m in d.models().items()) + ")")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for every interface, with --token)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="server processes (default 1); each loads the weights, "
                   "registered contexts are shared through --context-dir")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"require `Authorization: Bearer TOKEN` on every "
                   f"endpoint but /healthz and the page (default: ${TOKEN_ENV}, else none)")
    p.add_argument("--device", default=d.device, help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--precision", default=d.precision, choices=PRECISIONS, help="the estimators' precision (default auto)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    limits = p.add_argument_group("limits (a request over one is refused with 413 / 422 naming it)")
    limits.add_argument("--max-rows", type=int, default=d.max_rows, help=f"rows per table (default {d.max_rows})")
    limits.add_argument("--max-columns", type=int, default=d.max_columns, help=f"columns per table (default {d.max_columns})")
    limits.add_argument("--max-classes", type=int, default=d.max_classes,
                        help=f"distinct target values of a classification context (default {d.max_classes})")
    limits.add_argument("--max-categories", type=int, default=d.max_categories,
                        help=f"distinct values of one text column (default {d.max_categories})")
    limits.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help=f"request body size (default {d.max_body_bytes}, 64 MiB)")
    limits.add_argument("--max-estimators", type=int, default=d.max_estimators,
                        help=f"n_estimators a request may ask for (default {d.max_estimators})")
    limits.add_argument("--max-queue", type=int, default=d.max_queue,
                        help=f"requests waiting for the model before 503 (default {d.max_queue})")
    batching = p.add_argument_group("batching and memory")
    batching.add_argument("--max-batch-cells", type=int, default=d.max_batch_cells,
                          help=f"query cells merged into one model call (default {d.max_batch_cells}; 0: no batching)")
    batching.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                          help=f"how long a request waits for others to merge with (default {d.max_wait_ms:g})")
    batching.add_argument("--context-cache-mib", type=float, default=d.context_cache_mib,
                          help=f"memory for registered contexts, least recently used evicted (default "
                               f"{d.context_cache_mib:g})")
    batching.add_argument("--context-dir", default=None, help="spool of registered contexts shared by --workers "
                          "(default with --workers > 1: a temporary directory)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM / SIGINT, seconds to let requests in flight finish (default 30)")
    add_output_flags(p, progress=False)
    return p


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from tabfm.errors import RunStopped
    from tabfm.weights import resolve_model_path

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.model is not None:
        resolve_model_path(args.model)  # a wrong name or directory is one line now, not a worker's traceback
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu or auto")
    context_dir = args.context_dir or (tempfile.mkdtemp(prefix="tabfm-serve-") if args.workers > 1 else None)
    config = ServeConfig(model=args.model, device=args.device, precision=args.precision, token=args.token,
                         max_rows=args.max_rows, max_columns=args.max_columns, max_classes=args.max_classes,
                         max_categories=args.max_categories, max_body_bytes=args.max_body_bytes,
                         max_estimators=args.max_estimators, max_batch_cells=args.max_batch_cells,
                         max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                         context_cache_mib=args.context_cache_mib, context_dir=context_dir, threads=args.threads)
    try:
        import uvicorn

        from tabfm.serve.app import create_app
    except ImportError as err:
        raise RunStopped(f"tabfm serve needs the serve extra ({err.name} is not installed): "
                         "pip install 'tabfm[serve]'") from None
    if args.host not in LOOPBACK and not args.token:
        print(f"tabfm serve: warning: listening on {args.host} without --token: anyone who reaches this port can use "
              "the server", file=sys.stderr)
    level = "warning" if args.quiet else "info"
    common = dict(host=args.host, port=args.port, log_level=level, access_log=not args.quiet,
                  timeout_graceful_shutdown=args.graceful_timeout)
    # uvicorn stops on SIGINT / SIGTERM after the requests in flight, then raises the signal again:
    # these handlers turn that into exit 0 (a server stopped as asked), with the spool cleaned up
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.workers == 1:
            uvicorn.run(create_app(config), **common)
        else:  # worker processes import the app by name and read the config from the environment
            os.environ[CONFIG_ENV] = config.to_json()
            uvicorn.run("tabfm.serve.app:app_from_env", factory=True, workers=args.workers, **common)
    except SystemExit as stop:
        if stop.code != 0:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if context_dir is not None and not args.context_dir:
            shutil.rmtree(context_dir, ignore_errors=True)
    return 0


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)
