"""Checkpoint IO: atomic, pickle-free training checkpoints.

A checkpoint is a directory `step_000123/` holding

    dcp/*.safetensors                 model weights and optimizer tensors, each rank's part
                                      (torch.distributed.checkpoint; `sharded_checkpoint.py`)
    optimizer.json                    optimizer hyperparameters and scalar state
    scheduler.json                    LR scheduler state
    extra.json/.safetensors           trainer state passed as `extra`, plus RNG states
    manifest.json                     written last: format, step, plugin, layout, versions, files

It is written into `.tmp-step_000123-<pid>/`, fsynced, and renamed into place, so a crash
leaves either the complete new checkpoint or none. The manifest lists every other file with its
size and sha256. `latest_checkpoint(root)` only counts directories with a manifest whose files
are all present with the recorded sizes; `resumable_checkpoint(root)` also verifies the hashes
(what a resume trusts) and says what was wrong with every newer checkpoint it passed over.

`CheckpointIO` is the seam plugins own; every plugin writes through the one
torch.distributed.checkpoint implementation (`ShardedCheckpointIO`, a single process
included), which keeps this directory contract (manifest, atomic rename, `extra`, `export`).
`GeneralCheckpointReader` still reads the full-tensor "general" checkpoints
(`model.safetensors`, `optimizer.json/.safetensors`) that single-process runs wrote before, so
their runs resume.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .state_io import file_sha256, load_state, load_weights, read_json, save_state, save_weights

FORMAT = "tabfm-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step_(\d+)-")
_LEFTOVER = re.compile(r"^\.(tmp|old)-step_\d+-\d+$")  # what atomic_directory leaves when killed


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """`root/step_000123`: the directory name `latest_checkpoint` recognises."""
    return Path(root) / f"step_{step:06d}"


def unwrap_model(model: nn.Module) -> nn.Module:
    return model.unwrap() if hasattr(model, "unwrap") else model


# --- atomic directories ------------------------------------------------------------------

def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling of `final`; on success fsync it and rename it to `final`.

    On any exception the temporary directory is removed and `final` is left untouched. An
    existing `final` is replaced only after the new content is complete on disk.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = parent / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- manifest ----------------------------------------------------------------------------

@dataclass
class CheckpointMeta:
    """What the booster knows about a checkpoint beyond its tensors (recorded in the manifest)."""

    step: int
    plugin: str = "unknown"
    precision: str = "fp32"
    layout: dict[str, int] = field(default_factory=lambda: {"world_size": 1, "dp": 1, "tp": 1, "sp": 1, "pp": 1})
    frozen: bool = True  # False: parameters with requires_grad=False left out (the run rebuilds them, e.g. LoRA's base)


def _versions() -> dict[str, str | None]:
    try:
        tabfm_version = importlib.metadata.version("tabfm")
    except importlib.metadata.PackageNotFoundError:
        tabfm_version = None
    return {"torch": torch.__version__, "tabfm": tabfm_version}


def write_manifest(ckpt: Path, meta: CheckpointMeta, checkpoint_io: str) -> Path:
    """Write manifest.json listing every other file in `ckpt` with its size and sha256 (call it last)."""
    files = {
        str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST
    }
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **asdict(meta),
        "checkpoint_io": checkpoint_io,
        "versions": _versions(),
        "created_unix": time.time(),
        "files": files,
    }
    path = ckpt / MANIFEST
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return path


def read_manifest(ckpt: str | Path) -> dict[str, Any]:
    """Parse and check a checkpoint's manifest: format, version, and every listed file's size."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST
    if not path.is_file():
        raise ValueError(f"{ckpt} is not a complete checkpoint: missing {MANIFEST}")
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format_version {doc.get('format_version')!r}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{path}: no 'files' table")
    for name, entry in files.items():
        size = entry.get("bytes") if isinstance(entry, dict) else entry  # format of older checkpoints: bytes only
        f = ckpt / name
        if not f.is_file():
            raise ValueError(f"{ckpt}: missing file {name} listed in {MANIFEST}")
        if f.stat().st_size != size:
            raise ValueError(f"{ckpt}: file {name} has {f.stat().st_size} bytes, manifest says {size}")
    return doc


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """`read_manifest` plus every file's sha256 (checkpoints written before hashes were recorded
    are checked by size only); ValueError naming the first damaged file."""
    ckpt = Path(ckpt)
    doc = read_manifest(ckpt)
    for name, entry in doc["files"].items():
        if isinstance(entry, dict) and "sha256" in entry and file_sha256(ckpt / name) != entry["sha256"]:
            raise ValueError(f"{ckpt}: file {name} does not match the sha256 in {MANIFEST} (its bytes changed)")
    return doc


def resumable_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `root` that passes `verify_checkpoint`, or None; one line per
    newer `step_*` directory passed over, naming what is wrong with it)."""
    root = Path(root)
    steps = sorted(((int(m.group(1)), d) for d in (root.iterdir() if root.is_dir() else ())
                    if (m := _STEP_DIR.match(d.name)) and d.is_dir()), reverse=True)
    problems = []
    for _, d in steps:
        try:
            verify_checkpoint(d)
        except (ValueError, OSError) as err:
            problems.append(f"{d.name}: {err}")
            continue
        return d, problems
    return None, problems


def remove_leftovers(root: str | Path) -> list[Path]:
    """Remove the temporary directories a killed save left under `root` (`.tmp-step_*`,
    `.old-step_*`); call it only while no process is writing there. Returns what went."""
    root = Path(root)
    doomed = [d for d in (root.iterdir() if root.is_dir() else ()) if _LEFTOVER.match(d.name) and d.is_dir()]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete `step_*` checkpoints under `root`, oldest first (temporary dirs are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir():
            try:
                read_manifest(d)
            except ValueError:
                continue
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (never `keep`), and stale
    temporary dirs of older steps; return what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ckpts = list_checkpoints(root)
    kept = set(ckpts[-keep_last:]) | ({Path(keep)} if keep is not None else set())
    doomed = [d for d in ckpts if d not in kept]
    newest = int(_STEP_DIR.match(ckpts[-1].name).group(1)) if ckpts else -1
    for d in Path(root).iterdir():
        m = _TMP_DIR.match(d.name)
        if m and int(m.group(1)) < newest:
            doomed.append(d)
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


# --- RNG ---------------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """torch CPU (uint8 tensor), CUDA (when initialised), numpy and python RNG states."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_extra(ckpt: Path) -> dict[str, Any]:
    """The trainer state and RNG record a 'general' checkpoint keeps in extra.json, checked."""
    state = load_state(ckpt / "extra")
    if not isinstance(state, dict) or not {"trainer", "rng"} <= state.keys():
        raise ValueError(f"{ckpt / 'extra.json'}: expected keys 'trainer' and 'rng'")
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- model weights -----------------------------------------------------------------------

def frozen_names(model: nn.Module) -> set[str]:
    """State-dict names of the parameters that do not train (requires_grad=False)."""
    return {n for n, p in unwrap_model(model).named_parameters() if not p.requires_grad}


def without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` less the model's frozen parameters (a checkpoint of what trains: CheckpointMeta.frozen=False)."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def check_frozen_left_out(model: nn.Module, stored: set[str], path: Path) -> None:
    """A checkpoint saved without frozen parameters may lack exactly those: ValueError naming any other
    missing key (and any the model lacks), so leaving frozen weights out never hides a real mismatch."""
    own = set(unwrap_model(model).state_dict())
    missing, unexpected = sorted(own - stored - frozen_names(model)), sorted(stored - own)
    if missing or unexpected:
        raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]} (a checkpoint "
                         "without frozen parameters holds every trainable one)")


def load_model_weights(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load `path` into `model` after checking names and shapes (ValueError naming key and file)."""
    module = unwrap_model(model)
    loaded = load_weights(path)
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - loaded.keys()), sorted(loaded.keys() - own.keys())
    if strict and (missing or unexpected):
        raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    for key in own:
        if key in loaded and own[key].shape != loaded[key].shape:
            raise ValueError(f"{path}: key {key!r} has shape {list(loaded[key].shape)}, "
                             f"model expects {list(own[key].shape)}")
    module.load_state_dict(loaded, strict=strict)


# --- checkpoint IO -----------------------------------------------------------------------

class CheckpointIO(ABC):
    """How a plugin saves and loads training state. One instance per plugin."""

    name: str = "abstract"

    @abstractmethod
    def save_checkpoint(
        self,
        path: str | Path,
        meta: CheckpointMeta,
        model: nn.Module | None = None,
        optimizer: Any | None = None,
        lr_scheduler: Any | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path:
        """Write a complete checkpoint directory at `path` atomically; prune to `keep_last`."""

    @abstractmethod
    def load_checkpoint(
        self,
        path: str | Path,
        model: nn.Module | None = None,
        optimizer: Any | None = None,
        lr_scheduler: Any | None = None,
        strict: bool = True,
        restore_rng: bool = True,
    ) -> dict[str, Any]:
        """Load what was asked for from `path` (resharding if needed); return the `extra` dict."""

    def export(self, model: nn.Module, out_dir: str | Path, config: dict[str, Any], transform: Any = None) -> Path:
        """Write the inference bundle (model.safetensors + config.json); sharded IOs gather first;
        `transform` maps the full state dict before it is written (export.export_model)."""
        from .export import export_model

        return export_model(model, out_dir, config, transform)


def sharded_reader(group: Any = None) -> CheckpointIO:
    """The IO that reads "sharded" (DCP) checkpoints into any layout, this process included."""
    from .sharded_checkpoint import ShardedCheckpointIO  # imports torch.distributed.checkpoint

    return ShardedCheckpointIO(group)


class GeneralCheckpointReader:
    """Reads "general" checkpoints (full tensors, written by one process) into this process's objects.

    A distributed plugin's checkpoint IO writes "sharded" checkpoints and reads general ones
    through a reader of this kind (its `fallback`): subclasses say how full state reaches their
    (possibly sharded) objects (`load_full_model_state`, `load_full_optimizer_state`) and which
    process group they read in (`group`, for each rank's own saved RNG state)."""

    name = "general"
    group: Any = None

    def _rank_world(self) -> tuple[int, int]:
        import torch.distributed as dist

        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    # --- hooks: how full state reaches the (possibly sharded) objects of a reader's plugin --------
    def load_full_model_state(self, model: nn.Module, path: Path, strict: bool) -> None:
        load_model_weights(model, path, strict=strict)

    def load_full_optimizer_state(self, model: nn.Module | None, optimizer: Any, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def load_checkpoint(self, path, model=None, optimizer=None, lr_scheduler=None, strict=True, restore_rng=True):
        path = Path(path)
        rank, world = self._rank_world()
        manifest = read_manifest(path)
        if manifest.get("checkpoint_io") == "sharded":  # written by a distributed run: DCP reshards it here
            return sharded_reader(self.group).load_checkpoint(path, model=model, optimizer=optimizer,
                                                              lr_scheduler=lr_scheduler, strict=strict,
                                                              restore_rng=restore_rng)
        if manifest.get("checkpoint_io") != self.name:
            raise ValueError(f"{path} was written by checkpoint IO {manifest.get('checkpoint_io')!r}; "
                             f"{type(self).__name__} reads only {self.name!r} checkpoints")
        if model is not None:
            if manifest.get("frozen", True):
                self.load_full_model_state(model, path / "model.safetensors", strict)
            else:  # what trains only: the frozen weights are the model's own (its init)
                check_frozen_left_out(model, set(load_weights(path / "model.safetensors")), path)
                self.load_full_model_state(model, path / "model.safetensors", False)
        if optimizer is not None:
            self.load_full_optimizer_state(model, optimizer, load_state(path / "optimizer"))
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(load_state(path / "scheduler"))
        state = load_extra(path)
        if restore_rng:
            ranks = state.get("rng_ranks")
            restore_rng_state(ranks[rank] if isinstance(ranks, list) and len(ranks) == world else state["rng"])
        return state["trainer"]
