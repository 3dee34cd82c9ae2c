"""Process-group launch: torchrun environment -> initialised `torch.distributed`, or one process.

    info = launch()                 # RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from torchrun
    torch.manual_seed(seed_for_rank(base_seed, info.rank))
    ...
    destroy()

Without a torchrun environment (no WORLD_SIZE, or WORLD_SIZE=1) nothing is initialised and
`launch` returns a single-process `DistInfo`. The collective timeout (`timeout_s`) turns a
dead or stuck peer into an exception instead of a hang: gloo enforces it on every
collective, NCCL through async error handling (enabled here unless the user set it).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands. `initialized` is False for a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    initialized: bool = False

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def seed_for_rank(seed: int, rank: int) -> int:
    """A per-rank seed derived from `seed` (stable across runs and platforms, distinct per rank,
    fits in 63 bits). Rank 0 does *not* get `seed` itself, so no two ranks alias by accident."""
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed={seed}, rank={rank}")
    state = np.random.SeedSequence([int(seed), int(rank)]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(backend: str | None, local_rank: int) -> torch.device:
    if torch.cuda.is_available() and backend in (None, "nccl"):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def current() -> DistInfo:
    """DistInfo of an already-initialised process group (or the single-process one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo(device=_device_for(None, 0) if torch.cuda.is_available() else torch.device("cpu"))
    backend = dist.get_backend()
    local_rank = _env_int("LOCAL_RANK", dist.get_rank())
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    local_world_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()), backend=backend,
                    device=_device_for(backend, local_rank), initialized=True)


def launch(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Initialise `torch.distributed` from the torchrun environment, or run as one process.

    backend     None -> "nccl" when CUDA is available, else "gloo".
    timeout_s   collective timeout; a peer that dies or stalls longer raises on the others.

    Idempotent: if a process group already exists it is described, not re-created. On CUDA
    the current device is set to `cuda:LOCAL_RANK`.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_available() and dist.is_initialized():
        return current()
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad torchrun environment: RANK={rank}, WORLD_SIZE={world_size}")
    backend = backend or _default_backend()
    device = _device_for(backend, local_rank)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistInfo(device=device, backend=None)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={world_size} but {missing} not set; launch with torchrun "
                         "(or set the variables yourself)")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(device)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init: bind the communicator to this GPU
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank,
                    local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size), backend=backend,
                    device=device, initialized=True)


def destroy() -> None:
    """Tear down the default process group if there is one (safe to call always)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """A barrier when distributed, else nothing."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
