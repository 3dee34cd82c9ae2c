"""Export: the inference bundle the estimators load — exactly `model.safetensors` + `config.json`.

config.json records `weights_sha256`, the sha256 of model.safetensors; loading verifies it (a
damaged or replaced weights file fails with an error naming it) and refuses non-finite weights,
which an export never writes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .checkpoint import atomic_directory, unwrap_model
from .state_io import file_sha256, load_weights, read_json, save_weights

WEIGHTS, CONFIG = "model.safetensors", "config.json"
SHA256 = "weights_sha256"
StateTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def non_finite(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of `state` holding NaN or infinity."""
    return [k for k, v in state.items() if v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all())]


def export_model(model: nn.Module, out_dir: str | Path, config: dict[str, Any],
                 transform: StateTransform | None = None) -> Path:
    """Atomically write `out_dir/model.safetensors` (contiguous, tied weights once) and
    `out_dir/config.json`. An existing `out_dir` is replaced only if it holds nothing else.
    `transform` maps the full state dict to what is written (e.g. adapters merged into weights)."""
    out = Path(out_dir)
    if out.exists():
        others = sorted({p.name for p in out.iterdir()} - {WEIGHTS, CONFIG}) if out.is_dir() else [out.name]
        if others:
            raise ValueError(f"refusing to replace {out}: it holds other files {others[:5]}")
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config must be a JSON-serialisable dict: {e}") from None
    state = unwrap_model(model).state_dict()
    if transform is not None:
        state = transform(state)
    bad = non_finite(state)
    if bad:
        raise ValueError(f"refusing to export {out}: {len(bad)} weight tensors hold NaN or infinity ({bad[:5]}); "
                         "the model diverged, export an earlier checkpoint (tabfm export RUN/checkpoints/step_N OUT)")
    with atomic_directory(out) as tmp:
        save_weights(state, tmp / WEIGHTS, metadata={"tabfm_export": "1"})
        signed = {**config, SHA256: file_sha256(tmp / WEIGHTS)}
        (tmp / CONFIG).write_text(json.dumps(signed, indent=2, sort_keys=True, allow_nan=False))
    return out


def load_exported(out_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read an exported bundle: (state_dict of CPU tensors, config dict). Safetensors only; the
    weights' sha256 is checked against config.json (bundles written before it was recorded load
    unchecked) and non-finite weights are refused."""
    out = Path(out_dir)
    config_path = out / CONFIG
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    weights = out / WEIGHTS
    want = config.get(SHA256)
    if want is not None and weights.is_file():
        got = file_sha256(weights)
        if got != want:
            raise ValueError(f"{weights} is damaged or was replaced: its sha256 is {got}, {config_path} records "
                             f"{want}; export the model again (or restore the file)")
    state = load_weights(weights)
    bad = non_finite(state)
    if bad:
        raise ValueError(f"{weights}: {len(bad)} weight tensors hold NaN or infinity ({bad[:5]}); refusing to load them")
    return state, config
