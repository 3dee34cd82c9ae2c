"""Export: the inference bundle the estimators load — exactly `model.safetensors` + `config.json`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import atomic_directory, unwrap_model
from .state_io import load_weights, read_json, save_weights

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def export_model(model: nn.Module, out_dir: str | Path, config: dict[str, Any]) -> Path:
    """Atomically write `out_dir/model.safetensors` (contiguous, tied weights once) and
    `out_dir/config.json`. An existing `out_dir` is replaced only if it holds nothing else."""
    out = Path(out_dir)
    if out.exists():
        others = sorted({p.name for p in out.iterdir()} - {WEIGHTS, CONFIG}) if out.is_dir() else [out.name]
        if others:
            raise ValueError(f"refusing to replace {out}: it holds other files {others[:5]}")
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config must be a JSON-serialisable dict: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    with atomic_directory(out) as tmp:
        save_weights(unwrap_model(model).state_dict(), tmp / WEIGHTS, metadata={"tabfm_export": "1"})
        (tmp / CONFIG).write_text(config_text)
    return out


def load_exported(out_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read an exported bundle: (state_dict of CPU tensors, config dict). Safetensors only."""
    out = Path(out_dir)
    config_path = out / CONFIG
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    return load_weights(out / WEIGHTS), config
