"""The server's settings and limits, as one frozen dataclass (standard library only).

`tabfm serve` builds it from its flags; with --workers N it travels to each worker process as
JSON in an environment variable (uvicorn starts workers by import string, not by object).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from tabfm.weights import DEFAULT_MODELS

MIB = 1 << 20
CONFIG_ENV = "TABFM_SERVE_CONFIG"  # the JSON of a ServeConfig, for worker processes
TOKEN_ENV = "TABFM_SERVE_TOKEN"  # default of --token (keeps the token out of `ps`)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
PRECISIONS = ("auto", "fp32", "bf16")  # tabfm.estimators.base.PRECISIONS (tests/test_serve.py checks)

# size classes of the batching lanes (tabfm.serve.batching): lane i takes requests whose cost
# (cells the model reads: (context rows + query rows padded to whole chunk_size passes) x columns
# x ensemble members) lies in [LANE_BASE * LANE_FACTOR**(i-1), LANE_BASE * LANE_FACTOR**i); the
# last lane takes the rest. 8k, 64k, 512k, 4M: a 50-row table, a 400-row one and a 2,000-row one
# of 5, 20 and 40 columns land in three lanes (benchmarks/serve_load.py, BENCHMARKS.md)
LANE_BASE = 1 << 13
LANE_FACTOR = 8
N_LANES = 5


@dataclass(frozen=True)
class ServeConfig:
    """What `tabfm serve` serves and the limits it enforces (each a --flag of the same name)."""

    model: str | None = None             # shipped model name or export directory; None: each task's default
    device: str = "auto"                 # estimators' device
    precision: str = "auto"              # estimators' precision
    token: str | None = None             # bearer token every endpoint but /healthz (and the page) requires
    max_rows: int = 10_000               # rows per table (context, query)
    max_columns: int = 500               # columns per table
    max_classes: int = 100               # distinct target values of a classification context
    max_categories: int = 10_000         # distinct values of one text / categorical column
    max_body_bytes: int = 64 * MIB       # request body
    max_estimators: int = 16             # n_estimators a request may ask for
    max_batch_cells: int = 1 << 18       # query cells merged into one model call (0: no batching)
    max_wait_ms: float = 5.0             # how long a lane waits for requests to merge with its oldest
    max_queue: int = 256                 # queued requests (all lanes) before 503
    context_cache_mib: float = 512.0     # registered contexts (fitted estimators + encoded contexts)
    context_dir: str | None = None       # spool of registered contexts shared by workers (--workers > 1)
    threads: int | None = None           # torch intra-op threads (None: torch's default)

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_columns", "max_classes", "max_categories", "max_body_bytes",
                     "max_estimators", "max_queue"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_cells < 0 or self.max_wait_ms < 0 or self.context_cache_mib <= 0:
            raise ValueError("--max-batch-cells and --max-wait-ms must be >= 0, --context-cache-mib > 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.token is not None and not self.token.strip():
            raise ValueError("--token is empty")

    @property
    def context_cache_bytes(self) -> int:
        return int(self.context_cache_mib * MIB)

    @property
    def batching(self) -> bool:
        return self.max_batch_cells > 0

    def model_for(self, task: str) -> str:
        """The weights that answer `task`: --model, else the task's default (tabfm.weights.DEFAULT_MODELS)."""
        return self.model if self.model is not None else DEFAULT_MODELS[task]

    def models(self) -> dict[str, str]:
        """Weights per task (GET /v1/info, /readyz)."""
        return {task: self.model_for(task) for task in DEFAULT_MODELS}

    def limits(self) -> dict[str, float | int]:
        """The limits a client may want to know (GET /v1/info)."""
        names = ("max_rows", "max_columns", "max_classes", "max_categories", "max_body_bytes", "max_estimators",
                 "max_batch_cells", "max_wait_ms", "max_queue", "context_cache_mib")
        return {n: getattr(self, n) for n in names}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ServeConfig":
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls) -> "ServeConfig":
        """The config a worker process was started with (CONFIG_ENV), else the defaults."""
        text = os.environ.get(CONFIG_ENV)
        return cls.from_json(text) if text else cls()
