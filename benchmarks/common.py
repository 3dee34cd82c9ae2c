"""What the multi-process benchmarks share: a record of the machine they ran on."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch


def machine_info() -> dict:
    """CPU model, core count and versions, for the JSON record of a gloo benchmark (1 thread per rank)."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(), "torch_threads_per_rank": 1, "backend": "gloo",
            "torch_version": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "executable": sys.executable}
