"""Spawn N gloo processes running one function and collect what each returns.

    results = run_distributed(worker, world_size=2, args=(...,), timeout_s=60)

`worker(rank, world_size, *args)` must be a module-level (picklable) function. Each process
gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one
intra-op thread, and an initialised gloo process group (`tabfm.parallel.launch.launch`). Tensors in
the return value come back as CPU tensors (copied through numpy, no shared memory).

A rank that raises makes `run_distributed` raise `DistributedError` with its traceback
(the other ranks are given a moment, then killed); no answer within `timeout_s` raises
`TimeoutError`. Nothing is left running either way.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class DistributedError(RuntimeError):
    """A rank raised; `errors` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed: {sorted(errors)}\n{text}")


def free_port() -> int:
    """A port free on every address: the rendezvous store listens on the wildcard, and a port free on
    127.0.0.1 alone can be held by another test's store on [::] (the kernel then hands the same
    port out again and again, and every rendezvous fails with EADDRINUSE)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if not socket.has_ipv6:
            return port
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
                s6.bind(("::", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both IPv4 and IPv6 after 100 tries")


def _portable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("__tensor__", obj.detach().cpu().numpy().copy())
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _restore(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore(v) for v in obj)
    return obj


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, pg_timeout_s: float) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from tabfm.parallel.launch import destroy, launch

    try:
        launch(backend="gloo", timeout_s=pg_timeout_s)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _portable(out)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            destroy()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: float = 60.0,
                    pg_timeout_s: float = 30.0, grace_s: float = 3.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, pg_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outs) + len(errors) < world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + grace_s)  # the others are likely stuck on the dead peer
            if now >= deadline:
                break
            try:
                rank, status, value = results.get(timeout=min(0.5, max(deadline - now, 0.01)))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outs and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if status == "ok":
                outs[rank] = _restore(value)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    if errors:
        raise DistributedError(errors)
    if len(outs) < world_size:
        missing = sorted(set(range(world_size)) - outs.keys())
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
    return [outs[r] for r in range(world_size)]
