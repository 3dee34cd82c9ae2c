"""Nested state <-> safetensors + JSON, with no pickle anywhere.

`save_state(obj, stem)` stores any nest of dict / list / tuple / int / float / bool / str /
None / torch.Tensor as `<stem>.json` (the structure, python numbers, tensor dtypes and
shapes) plus `<stem>.safetensors` (the tensors, written only when there are any).
`load_state(stem)` rebuilds the nest and validates it against the files: a missing file,
a shape or dtype mismatch, or an unexpected tensor raises ValueError naming key and file.
Optimizer, scheduler and trainer state all go through this one mechanism.

`save_weights` / `load_weights` are the flat-state-dict counterpart for model weights
(tied weights stored once, restored under every name).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

STATE_FORMAT = "tabfm-state"
STATE_VERSION = 1
# Single-key JSON objects with these keys encode non-JSON values.
_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"
_MARKERS = {_TENSOR, _TUPLE, _DICT, _FLOAT}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _state_paths(stem: str | Path) -> tuple[Path, Path]:
    stem = Path(stem)
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".safetensors")


class _Encoder:
    """Turns a nest into JSON-able data, pulling tensors out into a flat name -> tensor dict."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {_TENSOR: self._add_tensor(obj, path)}
        if isinstance(obj, tuple):
            return {_TUPLE: [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not _MARKERS.intersection(obj):
                return {k: self.encode(v, f"{path}/{k}") for k, v in obj.items()}
            return {_DICT: [[self.encode(k, f"{path}/<key>"), self.encode(v, f"{path}/{k}")] for k, v in obj.items()]}
        raise TypeError(f"cannot store {type(obj).__name__} at {path or '/'}: only dict/list/tuple/"
                        "int/float/bool/str/None/torch.Tensor are allowed")

    def _add_tensor(self, t: torch.Tensor, path: str) -> str:
        name = path.lstrip("/") or "tensor"
        base, n = name, 1
        while name in self.tensors:
            name, n = f"{base}#{n}", n + 1
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in self._storages:
            t = t.clone()  # safetensors refuses tensors that share storage
        if t.numel():
            self._storages.add(t.untyped_storage().data_ptr())
        self.tensors[name] = t
        return name


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, val), = obj.items()
        if key == _TENSOR:
            return tensors[val]
        if key == _TUPLE:
            return tuple(_decode(v, tensors) for v in val)
        if key == _FLOAT:
            return float(val)
        if key == _DICT:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in val}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(obj: Any, stem: str | Path) -> list[Path]:
    """Write `obj` to `<stem>.json` (+ `<stem>.safetensors` if it holds tensors); return the files."""
    json_path, tensor_path = _state_paths(stem)
    enc = _Encoder()
    tree = enc.encode(obj, "")
    doc = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "tensor_file": tensor_path.name if enc.tensors else None,
        "tensors": {k: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for k, t in enc.tensors.items()},
        "state": tree,
    }
    written = []
    if enc.tensors:
        save_file(enc.tensors, str(tensor_path), metadata={"format": "pt", "tabfm": STATE_FORMAT})
        written.append(tensor_path)
    json_path.write_text(json.dumps(doc, allow_nan=False, indent=1))
    written.append(json_path)
    return written


def load_state(stem: str | Path) -> Any:
    """Read what `save_state` wrote, validating every tensor against the JSON record."""
    json_path, _ = _state_paths(stem)
    doc = read_json(json_path)
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise ValueError(f"{json_path}: not a {STATE_FORMAT} file")
    if doc.get("version") != STATE_VERSION:
        raise ValueError(f"{json_path}: unsupported version {doc.get('version')!r} (expected {STATE_VERSION})")
    expected: dict[str, dict] = doc.get("tensors", {})
    tensors: dict[str, torch.Tensor] = {}
    if doc.get("tensor_file"):
        tensor_path = json_path.with_name(doc["tensor_file"])
        tensors = read_safetensors(tensor_path)
        for key in tensors.keys() - expected.keys():
            raise ValueError(f"{tensor_path}: unknown tensor key {key!r} (not in {json_path.name})")
        for key, spec in expected.items():
            if key not in tensors:
                raise ValueError(f"{tensor_path}: missing tensor key {key!r}")
            _check_tensor(tensors[key], spec, key, tensor_path)
    elif expected:
        raise ValueError(f"{json_path}: lists tensors but names no tensor file")
    try:
        return _decode(doc["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{json_path}: malformed state ({e!r})") from None


def _check_tensor(t: torch.Tensor, spec: dict, key: str, path: Path) -> None:
    if _dtype_name(t.dtype) != spec.get("dtype"):
        raise ValueError(f"{path}: tensor {key!r} has dtype {_dtype_name(t.dtype)}, expected {spec.get('dtype')}")
    if list(t.shape) != spec.get("shape"):
        raise ValueError(f"{path}: tensor {key!r} has shape {list(t.shape)}, expected {spec.get('shape')}")


def read_json(path: Path) -> Any:
    """A JSON file's content; ValueError naming the file when it is missing or not JSON."""
    if not path.is_file():
        raise ValueError(f"missing file {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically (a temporary file beside it, then a rename): a process
    killed mid-write leaves the previous file or none, never a truncated one that a resume refuses."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file` with a ValueError (naming the file) for missing/corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"missing file {path}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def read_safetensors_metadata(path: str | Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


# --- model weights -------------------------------------------------------------------------

def save_weights(state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Save a flat state dict as one safetensors file: contiguous CPU tensors, tied weights once.

    Two names for the very same tensor (tied embeddings) are stored once and recorded as
    aliases in the file's metadata; other overlapping views are copied.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}   # exact view -> first name
    storages: set[int] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is {type(t).__name__}, not a tensor")
        t = t.detach()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() and view in seen:
            aliases[name] = seen[view]
            continue
        cpu = t.to("cpu").contiguous()
        if cpu.numel() and cpu.untyped_storage().data_ptr() in storages:
            cpu = cpu.clone()  # overlaps a tensor already stored: safetensors needs disjoint storage
        if t.numel():
            seen[view] = name
            storages.add(cpu.untyped_storage().data_ptr())
        tensors[name] = cpu
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta["tabfm_aliases"] = json.dumps(aliases)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a weights file written by `save_weights`, restoring tied names (CPU tensors)."""
    tensors = read_safetensors(path)
    aliases = json.loads(read_safetensors_metadata(path).get("tabfm_aliases", "{}"))
    for name, target in aliases.items():
        if target not in tensors:
            raise ValueError(f"{path}: alias {name!r} points to missing tensor {target!r}")
        tensors[name] = tensors[target]
    return tensors


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
