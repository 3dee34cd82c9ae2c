"""Build and load the CPU kernels of this folder (every `*.cpp`) as one shared library.

Compiled with the system C++ compiler on first use into the user cache
(``$TABFM_KERNEL_CACHE`` or ``~/.cache/tabfm/kernels``, keyed by a hash of the sources and
flags; a build takes a few seconds, needs no torch headers) and loaded with ctypes, which
releases the GIL during a call. `library()` is None where the kernels cannot run: not an
x86 CPU with AVX512-BF16, no compiler, a failed build, or ``TABFM_CPU_KERNELS=0``;
`reason()` says which. Callers then take torch's own ops and say so once (`usable`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).parent
FLAGS = ["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC", "-shared"]
ENV_SWITCH = "TABFM_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib", "reason", "pool", "pool_size", "warned"


def _sources() -> list[Path]:
    return sorted(HERE.glob("*.cpp"))


def _cache_dir() -> Path:
    return Path(os.environ.get("TABFM_KERNEL_CACHE", Path.home() / ".cache" / "tabfm" / "kernels"))


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512_bf16", "avx512bw", "avx512vl"))


def _signatures(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.tabfm_attn_bf16_fwd.argtypes = [ptr] * 6 + [i64] * 6 + [f32]
    lib.tabfm_attn_bf16_bwd.argtypes = [ptr] * 9 + [i64] * 6 + [f32]
    lib.tabfm_rms_norm_bf16_fwd.argtypes = [ptr] * 4 + [i64] * 3 + [f32]
    lib.tabfm_rms_norm_bf16_bwd.argtypes = [ptr] * 6 + [i64] * 3
    lib.tabfm_gelu_bf16_fwd.argtypes = [ptr] * 2 + [i64] * 2
    lib.tabfm_gelu_bf16_bwd.argtypes = [ptr] * 3 + [i64] * 2


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    if not _cpu_has_bf16():
        return None, "this CPU has no AVX512-BF16"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None, "no C++ compiler (g++ / c++ / $CXX) on PATH"
    sources = _sources()
    digest = hashlib.sha256(" ".join([cxx, *FLAGS]).encode())
    for path in [*sources, *sorted(HERE.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    lib_path = _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
            os.close(fd)
            res = subprocess.run([cxx, *FLAGS, *map(str, sources), "-o", tmp], capture_output=True, text=True)
            if res.returncode != 0:
                os.unlink(tmp)
                return None, f"{cxx} failed to build the CPU kernels ({HERE.name}/*.cpp): {res.stderr.strip()[-500:]}"
            os.replace(tmp, lib_path)  # atomic: concurrent processes never load a half-written file
        lib = ctypes.CDLL(str(lib_path))
    except OSError as err:  # an unwritable cache, a library the loader refuses
        return None, f"could not build or load {lib_path}: {err}"
    if not lib.tabfm_cpu_kernels_supported():
        return None, "this CPU has no AVX512-BF16 (cpuid)"
    _signatures(lib)
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (built on first call)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["reason"] = _build()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return library() is not None


def reason() -> str:
    """Why the kernels are unavailable ('' when they are)."""
    library()
    return str(_state.get("reason", ""))


def usable(supported: bool) -> bool:
    """Whether to run a kernel for a call its op `supports`: True if the kernels are available;
    False otherwise, and then the caller takes torch's op, said once in a warning."""
    if not supported:
        return False
    if available():
        return True
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(f"fused CPU bf16 kernels unavailable ({reason()}); bf16 attention, RMSNorm and GELU on CPU "
                      "use torch's ops (same maths, slower)", RuntimeWarning, stacklevel=3)
    return False


def chunks(n: int) -> int:
    """How many pieces `split` cuts n items into: torch's intra-op thread count, at most n."""
    return max(1, min(torch.get_num_threads(), n))


def split(n: int, fn) -> None:
    """Run fn(chunk, begin, end) over `chunks(n)` pieces of [0, n), one per thread (the
    kernels drop the GIL), so a kernel runs on as many cores as torch's own ops."""
    threads = chunks(n)
    bounds = [n * t // threads for t in range(threads + 1)]
    if threads == 1:
        fn(0, 0, n)
        return
    if _state.get("pool_size", 0) < threads:  # type: ignore[operator]
        _state["pool"], _state["pool_size"] = ThreadPoolExecutor(threads, thread_name_prefix="tabfm-kernels"), threads
    pool: ThreadPoolExecutor = _state["pool"]  # type: ignore[assignment]
    for f in [pool.submit(fn, t, bounds[t], bounds[t + 1]) for t in range(threads)]:
        f.result()


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
