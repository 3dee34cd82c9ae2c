"""Memory tiers of the Gemini chunk manager: an accounted "device" budget, where the device tier
lives and how bytes cross into it (`DeviceTier`), and a disk store.

  device   CUDA memory (device="cuda"), or CPU memory on CPU-only machines (device="cpu"), in
           both cases accounted against `device_budget_bytes` (`DeviceBudget`): every buffer the
           manager places "on device" is reserved here first; a reservation that would exceed
           the budget is refused with an error naming the numbers. The peak is recorded.
  host     CPU memory outside the budget; pinned (page-locked) when the device is CUDA, so
           host <-> device copies run asynchronously on side streams.
  disk     raw little-endian fp32 files under a directory (`DiskStore`), one per chunk, with a
           JSON sidecar, in a fresh `gemini-<host>-<pid>-*` subdirectory per process (removed at
           close/exit; one left by a killed process is removed by the next DiskStore there); read and written by one background thread so the optimizer can prefetch
           the next chunk while it steps the current one. Nothing is pickled.
"""
from __future__ import annotations

import contextlib
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


def resolve_device(device: "str | torch.device") -> torch.device:
    """The device tier's torch device for GeminiPlugin(device=...): "cpu", "cuda" / "cuda:N", or
    "auto" (CUDA when this torch build sees a GPU, else CPU). Asking for CUDA where there is none
    is an error, never a silent CPU run (the budget would then mean something else)."""
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: the Gemini device tier is 'cuda' or 'cpu' (or 'auto'), not {dev.type!r}")
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no GPU visible"
        raise RuntimeError(f"GeminiPlugin(device={device!r}) asks for a CUDA device tier, but torch.cuda.is_available() "
                           f"is False (torch {torch.__version__}, {build}); use device='cpu' (the budget is then "
                           "accounted CPU memory) or 'auto'")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


class DeviceTier:
    """Where the device tier lives and how chunk bytes cross between it and the host.

    CPU (`device.type == "cpu"`): every method is a plain allocation or copy; host tensors are
    not pinned (pinning needs an accelerator); nothing is asynchronous.

    CUDA: host-tier buffers are pinned; host -> device fetches run on `h2d` and device -> host
    gradient writes on `d2h`, two side streams (PCIe is full duplex), each fenced by an event:

      fetch     the destination is allocated on the compute (current) stream, so it is that
                stream's memory; the side stream first waits for the compute stream (the block
                may have been freed there with kernels still reading it), copies, and records an
                event that the compute stream waits for before the first kernel reads the copy
                (`wait`). A copy evicted before use is waited for too, so the allocator cannot
                hand its block out while the copy still writes it.
      write     the side stream waits for the compute stream (the gradient is complete), copies
                into a pinned staging buffer and records an event; the device source is marked
                `record_stream(d2h)` so the allocator keeps it until the copy is done. The host
                add happens when the event has completed (`ChunkManager.drain`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self.timeline: list | None = None  # CUDA, for tests: (start, end) events of every fetch

    def empty(self, n: int, dtype: torch.dtype = torch.float32, host: bool = False) -> torch.Tensor:
        """A flat buffer in the device tier, or (`host`) in the host tier (pinned on CUDA)."""
        if host or not self.cuda:
            return torch.empty(n, dtype=dtype, pin_memory=self.cuda)
        return torch.empty(n, dtype=dtype, device=self.device)

    def zeros(self, n: int, dtype: torch.dtype = torch.float32, host: bool = False) -> torch.Tensor:
        return self.empty(n, dtype, host).zero_()

    def to_tier(self, t: torch.Tensor, host: bool) -> torch.Tensor:
        """A copy of `t` in the device tier or the host tier (synchronous)."""
        out = self.empty(t.numel(), t.dtype, host)
        out.copy_(t.reshape(-1))
        return out

    @contextlib.contextmanager
    def fetch_stream(self):
        """Context for a fetch: the h2d side stream after it waited for the compute stream (CUDA),
        or nothing (CPU). With `timeline` set to a list, each fetch appends a (start, end) pair of
        timing events on the h2d stream (tests measure how much copying overlaps compute)."""
        if not self.cuda:
            yield
            return
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            start = torch.cuda.Event(enable_timing=True) if self.timeline is not None else None
            if start is not None:
                start.record(self.h2d)
            yield
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.h2d)
                self.timeline.append((start, end))

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (a device-tier buffer) := src cast to dst's dtype. On CUDA from a pinned host
        tensor without blocking the CPU; a cast happens first on the CPU into pinned staging (no
        full-size fp32 temporary in device memory; the host allocator keeps the staging block
        until the copy is done)."""
        if not self.cuda or src.device == dst.device:
            dst.copy_(src)
            return
        if src.dtype != dst.dtype:
            staging = torch.empty(src.shape, dtype=dst.dtype, pin_memory=True)
            staging.copy_(src)
            src = staging
        dst.copy_(src, non_blocking=True)

    def record(self, stream) -> "torch.cuda.Event | None":
        """An event recorded on `stream` (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, event: "torch.cuda.Event | None") -> None:
        """The compute stream waits (on the GPU, the CPU does not block) for `event`."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def write_back(self, src: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """Start copying device tensor `src` into a new host buffer; (buffer, event). On CPU the
        buffer is `src` itself and the event None."""
        if not self.cuda:
            return src, None
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            staging.copy_(src, non_blocking=True)
            src.record_stream(self.d2h)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        return staging, ev

    def synchronize(self) -> None:
        """Wait (CPU) until both side streams are idle: before the host tier's masters are changed
        in place (CPU Adam, checkpoint loads) no copy may still read them."""
        if self.cuda:
            self.h2d.synchronize()
            self.d2h.synchronize()

    def memory(self) -> dict[str, int]:
        """torch's own count of CUDA bytes allocated now and at peak (the report's cross-check)."""
        if not self.cuda:
            return {}
        return {"cuda_allocated_bytes": torch.cuda.memory_allocated(self.device),
                "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(self.device)}


class DeviceBudgetError(RuntimeError):
    """The device budget cannot hold what a step needs."""


class DeviceBudget:
    """Bytes resident in the device tier (CUDA memory, or accounted CPU memory), checked against
    a budget."""

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
