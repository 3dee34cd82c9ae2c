"""Fused bf16 attention on CPUs with AVX512-BF16: `cpu_attention.cpp`, built on first use.

Why: on CPU, `F.scaled_dot_product_attention` has no fast bf16 path (its flash kernel runs
the maths in fp32 and its backward reaches a quarter of the bf16 matmul peak), and it was
the largest op of a bf16 train step. The kernel keeps one (sequence, head) slice in cache and
does both products in bf16 with fp32 accumulation and an fp32 softmax, as GPU flash
attention does.

The C++ source is compiled with the system C++ compiler into the user cache
(``$TABFM_KERNEL_CACHE`` or ``~/.cache/tabfm/kernels``, keyed by the source's hash) and
loaded with ctypes: no torch headers, a build of ~2 s. `available()` says whether it can run
here (x86 CPU with AVX512-BF16, a compiler, ``TABFM_CPU_ATTENTION`` not ``0``); `attend` in
`attention.py` uses it for bf16 CPU attention when it can, and says once in a warning when
it cannot, so a slower path is never silent.
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

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC", "-shared"]
ENV_SWITCH = "TABFM_CPU_ATTENTION"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL | None, "reason": str, "pool": ThreadPoolExecutor


def _cache_dir() -> Path:
    return Path(os.environ.get("TABFM_KERNEL_CACHE", Path.home() / ".cache" / "tabfm" / "kernels"))


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags and "avx512bw" in flags


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    if not _cpu_has_bf16():
        return None, "this CPU has no AVX512-BF16"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None, "no C++ compiler (g++ / c++ / $CXX) on PATH"
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cxx, *FLAGS]).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"cpu_attention-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        res = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            return None, f"{cxx} failed to build {SOURCE.name}: {res.stderr.strip()[-500:]}"
        os.replace(tmp, lib_path)  # atomic: concurrent processes never load a half-written file
    lib = ctypes.CDLL(str(lib_path))
    if not lib.tabfm_attn_bf16_supported():
        return None, "this CPU has no AVX512-BF16 (cpuid)"
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.tabfm_attn_bf16_fwd.argtypes = [ptr] * 6 + [i64] * 6 + [f32]
    lib.tabfm_attn_bf16_bwd.argtypes = [ptr] * 9 + [i64] * 6 + [f32]
    return lib, ""


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["reason"] = _build()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the fused kernel runs on this machine (built and loaded on first call)."""
    return _lib() is not None


def unavailable_reason() -> str:
    _lib()
    return str(_state.get("reason", ""))


def warn_unavailable_once() -> None:
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(f"fused CPU bf16 attention unavailable ({unavailable_reason()}); bf16 attention on CPU "
                      "falls back to torch SDPA in fp32 (same maths, slower)", RuntimeWarning, stacklevel=3)


def supports(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Shapes and settings the kernel handles: bf16 CPU tensors, even head dim, no dropout,
    a key mask broadcast over heads and queries (N, 1, 1, S) or none."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or dropout_p > 0 or q.dim() != 4 or q.shape[-1] % 2:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                             or mask.shape[0] not in (1, q.shape[0]) or mask.dtype != torch.bool):
        return False
    return True


def _split(n: int, fn) -> None:
    """Run fn(begin, end) over [0, n), on torch's intra-op thread count (ctypes drops the GIL)."""
    threads = min(torch.get_num_threads(), n)
    if threads <= 1:
        fn(0, n)
        return
    pool = _state.get("pool")
    if pool is None or pool._max_workers < threads:  # type: ignore[attr-defined]
        pool = _state["pool"] = ThreadPoolExecutor(threads, thread_name_prefix="tabfm-attn")
    bounds = [n * t // threads for t in range(threads + 1)]
    for f in [pool.submit(fn, bounds[t], bounds[t + 1]) for t in range(threads)]:
        f.result()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_u8):
        lib = _lib()
        n, h, l, d = q.shape
        s = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty(n, h, l, dtype=torch.float32)
        scale = d ** -0.5
        _split(n * h, lambda b, e: lib.tabfm_attn_bf16_fwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(mask_u8), _ptr(o), _ptr(lse), b, e, h, l, s, d, scale))
        ctx.save_for_backward(q, k, v, lse)
        ctx.mask_u8 = mask_u8
        return o

    @staticmethod
    def backward(ctx, do):
        lib = _lib()
        q, k, v, lse = ctx.saved_tensors
        mask_u8 = ctx.mask_u8
        do = do.to(torch.bfloat16).contiguous()
        n, h, l, d = q.shape
        s = k.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _split(n * h, lambda b, e: lib.tabfm_attn_bf16_bwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(mask_u8), _ptr(lse), _ptr(do), _ptr(dq), _ptr(dk), _ptr(dv),
            b, e, h, l, s, d, d ** -0.5))
        return dq, dk, dv, None


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v for bf16 CPU tensors (see `supports`); q (N, H, L, hd),
    k / v (N, H, S, hd), mask (N, 1, 1, S) bool (True = visible) or None. A query without any
    visible key gets zeros (SDPA gives NaN there)."""
    n, _, _, _ = q.shape
    s = k.shape[2]
    mask_u8 = None
    if mask is not None:
        mask_u8 = mask.reshape(mask.shape[0], s).expand(n, s).to(torch.uint8).contiguous()
    return _FusedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mask_u8)
