"""Writes a checkpoint in the "general" format: full tensors from one process
(`model.safetensors`, `optimizer.json/.safetensors`), what single-process runs wrote before every
plugin went through the one DCP checkpoint IO. Kept so tests can check such runs still resume."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tabfm.parallel.checkpoint import (
    CheckpointMeta,
    atomic_directory,
    capture_rng_state,
    unwrap_model,
    write_manifest,
)
from tabfm.parallel.state_io import save_state, save_weights


def save_general_checkpoint(path: str | Path, step: int, model: Any = None, optimizer: Any = None,
                            lr_scheduler: Any = None, extra: dict[str, Any] | None = None,
                            plugin: str = "single", precision: str = "fp32") -> Path:
    path = Path(path)
    meta = CheckpointMeta(step=step, plugin=plugin, precision=precision,
                          layout={"world_size": 1, "dp": 1, "tp": 1, "sp": 1, "pp": 1})
    with atomic_directory(path) as tmp:
        if model is not None:
            save_weights(unwrap_model(model).state_dict(), tmp / "model.safetensors")
        if optimizer is not None:
            save_state(optimizer.state_dict(), tmp / "optimizer")
        if lr_scheduler is not None:
            save_state(lr_scheduler.state_dict(), tmp / "scheduler")
        save_state({"trainer": dict(extra or {}), "rng": capture_rng_state()}, tmp / "extra")
        write_manifest(tmp, meta, "general")
    return path
