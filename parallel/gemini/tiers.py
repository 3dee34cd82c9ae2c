"""Memory tiers of the Gemini chunk manager: an accounted "device" budget and a disk store.

On this CPU-only machine the three tiers are simulated honestly where it matters:

  device   CPU memory accounted against `device_budget_bytes` (`DeviceBudget`): every buffer the
           manager places "on device" is reserved here first; a reservation that would exceed
           the budget is refused with an error naming the numbers. The peak is recorded.
  host     CPU memory outside the budget.
  disk     raw little-endian fp32 files under a directory (`DiskStore`), one per chunk, with a
           JSON sidecar, in a fresh `gemini-<host>-<pid>-*` subdirectory per process (removed at
           close/exit; one left by a killed process is removed by the next DiskStore there); read and written by one background thread so the optimizer can prefetch
           the next chunk while it steps the current one. Nothing is pickled.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


class DeviceBudgetError(RuntimeError):
    """The device budget cannot hold what a step needs."""


class DeviceBudget:
    """Bytes resident in the (simulated) device tier, checked against a budget."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.resident_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> None:
        with self._lock:
            after = self.resident_bytes + int(nbytes)
            if self.budget_bytes is not None and after > self.budget_bytes:
                raise DeviceBudgetError(
                    f"device budget exceeded: {what} needs {nbytes} bytes, {self.resident_bytes} bytes are resident, "
                    f"budget is {self.budget_bytes} bytes ({after - self.budget_bytes} bytes short); raise "
                    "device_budget_bytes or offload more (offload_param_frac / offload_optim_frac / disk_optim_frac)")
            self.resident_bytes = after
            self.peak_bytes = max(self.peak_bytes, after)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.resident_bytes -= int(nbytes)
            assert self.resident_bytes >= 0, "device budget released more than it reserved"

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.resident_bytes


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_dirs(disk_dir: str | os.PathLike) -> list[Path]:
    """Remove disk-tier directories left under `disk_dir` by killed processes of this host (a
    SIGKILL skips the exit-time cleanup). Only `gemini-<this host>-<pid>-*` directories whose
    process is gone are touched, so runs on other hosts sharing the directory are safe."""
    pattern = re.compile(rf"^gemini-{re.escape(_host())}-(\d+)-")
    removed = []
    for d in Path(disk_dir).iterdir():
        m = pattern.match(d.name)
        if m and d.is_dir() and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class DiskStore:
    """Flat fp32 buffers in raw files under `root` (a fresh subdirectory, removed by `close`).

    `write(key, tensor)` / `read(key)` run on one background thread and return futures;
    `read` gives a new CPU fp32 tensor. Each file `KEY.bin` has a sidecar `KEY.json`
    ({"dtype": "float32", "numel": N, "byteorder": "little"}).
    """

    def __init__(self, disk_dir: str | os.PathLike | None = None) -> None:
        if disk_dir is None:
            self.root = Path(tempfile.mkdtemp(prefix="tabfm-gemini-"))
        else:
            Path(disk_dir).mkdir(parents=True, exist_ok=True)
            self.stale_removed = remove_stale_dirs(disk_dir)
            self.root = Path(tempfile.mkdtemp(prefix=f"gemini-{_host()}-{os.getpid()}-", dir=disk_dir))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-disk")
        self._finalizer = weakref.finalize(self, _remove_tree, str(self.root))  # also runs at exit
        self.bytes_written = 0
        self.bytes_read = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.bin"

    def _write(self, key: str, t: torch.Tensor) -> None:
        arr = t.detach().to("cpu", torch.float32).contiguous().numpy()
        tmp = self.root / f"{key}.bin.tmp"
        with open(tmp, "wb") as f:
            f.write(arr.astype("<f4", copy=False).tobytes())
        os.replace(tmp, self.path(key))
        (self.root / f"{key}.json").write_text(json.dumps({"dtype": "float32", "numel": int(arr.size),
                                                           "byteorder": "little"}))
        self.bytes_written += arr.nbytes

    def _read(self, key: str) -> torch.Tensor:
        meta = json.loads((self.root / f"{key}.json").read_text())
        arr = np.fromfile(self.path(key), dtype="<f4")
        if arr.size != meta["numel"]:
            raise ValueError(f"{self.path(key)}: {arr.size} values, sidecar says {meta['numel']}")
        self.bytes_read += arr.nbytes
        return torch.from_numpy(arr.astype(np.float32, copy=False))

    def write(self, key: str, t: torch.Tensor) -> Future:
        return self._pool.submit(self._write, key, t)

    def read(self, key: str) -> Future:
        return self._pool.submit(self._read, key)

    def remove(self, key: str) -> Future:
        """Delete a key's files (after its state moved to another tier); queued behind pending IO."""
        def _remove() -> None:
            for path in (self.path(key), self.root / f"{key}.json"):
                path.unlink(missing_ok=True)
        return self._pool.submit(_remove)

    def files(self) -> list[Path]:
        return sorted(self.root.glob("*.bin")) if self.root.exists() else []

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._finalizer()
