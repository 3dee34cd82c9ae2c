"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes its own
shards, nothing is pickled, and loading reshards to any world size and any layout.

A sharded checkpoint keeps the directory contract of `tabfm.parallel.checkpoint`:

    dcp/shard-0000R-model-00001-of-00001.safetensors   rank R-1's tensors: model weights
                                     ("model/<fqn>") and optimizer state ("optim/<fqn>/<key>"),
                                     each with its offsets in the safetensors header
    optimizer.json                   param_groups (by parameter FQN), non-tensor state, loss scaler
    scheduler.json                   LR scheduler state
    extra.json/.safetensors          trainer state and RNG state of every rank
    manifest.json                    written last, `checkpoint_io: "sharded"`

Tensors travel through DCP with torch's `HuggingFaceStorageWriter(save_distributed=True)` and
`HuggingFaceStorageReader`: safetensors files whose headers carry the DCP sharding offsets,
no `.metadata` pickle (the reader rebuilds DCP's Metadata from the headers). State comes from
`torch.distributed.checkpoint.state_dict` (plain, DDP and FSDP2 `fully_shard` modules; optimizer
state keyed by parameter FQN), so a checkpoint saved by FSDP2 at 2 ranks loads into 4 FSDP2
ranks, DDP, or one process. `ZeroRedundancyOptimizer` is handled here (DSD cannot read it):
each rank saves the full state of the parameters it owns, under the same keys.

All ranks write into one temporary sibling directory; rank 0 adds the JSON files and the
manifest, fsyncs and renames it into place. A failure on any rank raises on every rank and
leaves the previous checkpoint as it was.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from .checkpoint import (
    CheckpointIO,
    GeneralCheckpointReader,
    CheckpointMeta,
    atomic_directory,
    capture_rng_state,
    check_frozen_left_out,
    prune_checkpoints,
    read_manifest,
    restore_rng_state,
    unwrap_model,
    without_frozen,
    write_manifest,
)
from .state_io import load_state, load_weights, save_state

__all__ = ["ShardedCheckpointIO", "load_full_model_state", "read_dcp_metadata", "DCP_DIR", "SHARDED_IO_NAME"]

SHARDED_IO_NAME = "sharded"
DCP_DIR = "dcp"  # the safetensors shards live apart: the HF reader takes every .safetensors in its dir
_MODEL, _OPTIM = "model/", "optim/"
_SCALAR = (bool, int, float, str, type(None))


# --- DCP storage ---------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def read_dcp_metadata(dcp_dir: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global shape and dtype of every tensor stored in `dcp_dir` (from the safetensors headers)."""
    dcp_dir = Path(dcp_dir)
    if not dcp_dir.is_dir() or not any(dcp_dir.glob("*.safetensors")):
        raise ValueError(f"{dcp_dir}: no DCP safetensors shards")
    try:
        md = HuggingFaceStorageReader(str(dcp_dir)).read_metadata()
    except Exception as e:  # safetensors / JSON errors of a damaged header
        raise ValueError(f"{dcp_dir}: unreadable DCP shards ({type(e).__name__}: {e})") from None
    return {k: (v.size, v.properties.dtype) for k, v in md.state_dict_metadata.items()}


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP raises CheckpointException (a BaseException) on every rank when any rank fails;
    turn it into a RuntimeError naming the failed ranks and their first error."""
    try:
        yield
    except CheckpointException as e:
        first = ", ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
        raise RuntimeError(f"failed to {what} ({first})") from e


def _dcp_save(tensors: dict[str, torch.Tensor], dcp_dir: Path, group: Any) -> None:
    with _quiet(), _dcp_errors(f"write DCP shards to {dcp_dir}"):
        dcp_save(tensors, storage_writer=HuggingFaceStorageWriter(str(dcp_dir), save_distributed=True),
                 process_group=group)


def _dcp_load(tensors: dict[str, torch.Tensor], dcp_dir: Path, group: Any, no_dist: bool = False) -> None:
    with _quiet(), _dcp_errors(f"read DCP shards from {dcp_dir}"):
        dcp_load(tensors, storage_reader=HuggingFaceStorageReader(str(dcp_dir)), planner=DefaultLoadPlanner(),
                 process_group=group, no_dist=no_dist)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors whose bytes overlap an earlier entry's (tied weights): safetensors refuses
    to write two overlapping views of one storage."""
    seen: dict[int, list[tuple[int, int]]] = {}
    out = {}
    for k, t in tensors.items():
        loc = _local(t)
        if loc.numel():
            start = loc.storage_offset() * loc.element_size()
            span = (start, start + loc.numel() * loc.element_size())
            ranges = seen.setdefault(loc.untyped_storage().data_ptr(), [])
            if any(a < span[1] and span[0] < b for a, b in ranges):
                t = t.detach().clone()
            else:
                ranges.append(span)
        out[k] = t
    return out


# --- optimizer state by parameter FQN ------------------------------------------------------

def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.unwrap() if hasattr(optimizer, "unwrap") else optimizer


def _param_fqns(module: nn.Module) -> dict[int, str]:
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    return {id(p): n for n, p in inner.named_parameters()}


def _split_state(state: dict[str, dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """{fqn: {key: value}} -> (DCP tensors "optim/<fqn>/<key>", JSON {fqn: {key: scalar}})."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in state.items():
        scalars[fqn] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIM}{fqn}/{key}"] = value
            elif isinstance(value, _SCALAR):
                scalars[fqn][key] = value
            else:
                raise TypeError(f"optimizer state {fqn!r}/{key!r} is a {type(value).__name__}; sharded "
                                "checkpoints store tensors and python scalars only")
    return tensors, scalars


def _get_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]} of this rank.

    A never-stepped optimizer reads as no state: torch's reader would first create one with a
    zero-lr step, which counts as Adam's first step, so saving at step 0 would change the run."""
    if isinstance(optim, ZeroRedundancyOptimizer) or not optim.state:
        inner = optim.optim if isinstance(optim, ZeroRedundancyOptimizer) else optim  # ZeRO: this rank's partition
        fqn = _param_fqns(module)
        state = {fqn[id(p)]: dict(s) for p, s in inner.state.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[id(p)] for p in g["params"]]}
                  for g in optim.param_groups]
        return {"state": state, "param_groups": groups}
    return _initialised_optimizer_state(module, optim)


def _initialised_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's optimizer state dict by fqn; a fresh optimizer gets zero-initialised state first (the
    tensors a checkpoint's state loads into). ZeRO: this rank's partition, as it is."""
    if isinstance(optim, ZeroRedundancyOptimizer):
        return _get_optimizer_state(module, optim)
    try:
        return get_optimizer_state_dict(module, optim)
    except Exception as e:
        raise TypeError(f"{type(optim).__name__}: torch.distributed.checkpoint.state_dict cannot read its state "
                        f"({type(e).__name__}: {e}); sharded checkpoints support torch.optim optimizers "
                        "(also over FSDP2 shards) and ZeroRedundancyOptimizer") from e


def _check_groups(saved: list[dict[str, Any]], own: list[dict[str, Any]], where: Path) -> None:
    if len(saved) != len(own):
        raise ValueError(f"{where}: checkpoint has {len(saved)} optimizer param groups, the optimizer {len(own)}")
    for i, (s, o) in enumerate(zip(saved, own)):
        if sorted(s["params"]) != sorted(o["params"]):
            diff = sorted(set(s["params"]) ^ set(o["params"]))
            raise ValueError(f"{where}: optimizer param group {i} differs from the checkpoint's in {diff[:5]}")


# --- the checkpoint IO ---------------------------------------------------------------------

class ShardedCheckpointIO(CheckpointIO):
    """Checkpoint IO for sharded (FSDP2) and replicated (DDP, ZeRO-1) training via DCP.

    Every rank of `group` must call save/load/export (they are collective); in a single process
    without a process group they run locally. `load_checkpoint` reshards: any saved world size
    and layout into any other (plain module, DDP, FSDP2; torch optimizers or ZeRO-1).
    Per-rank trainer state (`extra`) and RNG are restored to the same rank when the world size
    is unchanged, else rank 0's are used everywhere.
    """

    name = SHARDED_IO_NAME

    def __init__(self, group: "dist.ProcessGroup | None" = None, fallback: GeneralCheckpointReader | None = None) -> None:
        self.group = group
        self.fallback = fallback  # reads checkpoints of another format (e.g. "general") into this layout

    # --- collectives -----------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return 0, 1

    def _global_src(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _everywhere(self, fn: Callable[[], Any], what: str) -> tuple[Any, list[Any]]:
        """Run `fn` on every rank; fn returns (local result, small payload). Returns (own
        result, every rank's payload). If any rank fails, every rank raises."""
        rank, world = self._rank_world()
        result, payload, error = None, None, None
        try:
            result, payload = fn()
        except Exception as e:
            error = e
        if world == 1:
            if error is not None:
                raise error
            return result, [payload]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (None if error is None else f"{type(error).__name__}: {error}",
                                          None if error is not None else payload), group=self.group)
        failed = {r: e for r, (e, _) in enumerate(gathered) if e is not None}
        if error is not None:
            raise error
        if failed:
            r, msg = next(iter(failed.items()))
            raise RuntimeError(f"rank(s) {sorted(failed)} failed to {what}; rank {r}: {msg}")
        return result, [p for _, p in gathered]

    def _on_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """Run `fn` on rank 0 and broadcast its (small) result, or its failure, to every rank."""
        rank, world = self._rank_world()
        box: list[Any] = [None, None]
        if rank == 0:
            try:
                box[0] = fn()
            except Exception as e:
                box[1] = f"{type(e).__name__}: {e}"
                if world > 1:
                    dist.broadcast_object_list(box, src=self._global_src(), group=self.group)
                raise
        if world > 1:
            dist.broadcast_object_list(box, src=self._global_src(), group=self.group)
        if box[1] is not None:
            raise RuntimeError(f"rank 0 failed to {what}: {box[1]}")
        return box[0]

    # --- what a rank saves and how loaded model state is applied (overridden by IOs whose
    # state does not live in a torch module/optimizer, e.g. the Gemini chunk manager) --------
    def _model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return get_model_state_dict(module)

    def _optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        return _get_optimizer_state(module, _inner_optimizer(optimizer))

    def _set_model_state(self, module: nn.Module, msd: dict[str, torch.Tensor], strict: bool) -> None:
        set_model_state_dict(module, msd, options=StateDictOptions(strict=strict))

    # --- save ------------------------------------------------------------------------------
    def save_checkpoint(self, path, meta: CheckpointMeta, model=None, optimizer=None, lr_scheduler=None, extra=None,
                        keep_last=None) -> Path:
        path = Path(path)
        if optimizer is not None and model is None:
            raise ValueError("saving optimizer state needs model= as well (its state is keyed by parameter name)")

        def collect() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            tensors: dict[str, torch.Tensor] = {}
            payload: dict[str, Any] = {"rng": capture_rng_state(), "trainer": dict(extra or {})}
            module = unwrap_model(model) if model is not None else None
            if module is not None:
                state = self._model_state(module)
                state = state if meta.frozen else without_frozen(module, state)
                tensors.update({_MODEL + k: v for k, v in state.items()})
            if optimizer is not None:
                osd = self._optimizer_state(module, optimizer)
                opt_tensors, scalars = _split_state(osd["state"])
                tensors.update(opt_tensors)
                payload["optimizer"] = {"param_groups": osd["param_groups"], "state": scalars}
                scaler = getattr(optimizer, "scaler", None)
                if scaler is not None:
                    payload["optimizer"]["loss_scaler"] = scaler.state_dict()
            return _unshare(tensors), payload

        tensors, payloads = self._everywhere(collect, f"collect the state for {path}")
        with contextlib.ExitStack() as stack:
            # rank 0 owns the temporary directory: an exception there (ours or a peer's, which
            # every rank raises) removes it; success renames it into place.
            tmp = Path(self._on_rank0(lambda: str(stack.enter_context(atomic_directory(path))),
                                      f"create a temporary directory for {path}"))
            if model is not None or optimizer is not None:  # DCP raises on every rank if one fails
                _dcp_save(tensors, tmp / DCP_DIR, self.group)

            def finish() -> str:
                if optimizer is not None:
                    merged = dict(payloads[0]["optimizer"])
                    merged["state"] = {k: v for p in payloads for k, v in p["optimizer"]["state"].items()}
                    save_state(merged, tmp / "optimizer")
                if lr_scheduler is not None:
                    save_state(lr_scheduler.state_dict(), tmp / "scheduler")
                save_state({"trainer": payloads[0]["trainer"], "trainer_ranks": [p["trainer"] for p in payloads],
                            "rng": payloads[0]["rng"], "rng_ranks": [p["rng"] for p in payloads]}, tmp / "extra")
                write_manifest(tmp, meta, self.name)
                stack.close()  # fsync, rename into place
                if keep_last is not None:
                    prune_checkpoints(path.parent, keep_last, keep=path)
                return str(path)

            return Path(self._on_rank0(finish, f"write checkpoint {path}"))

    # --- load ------------------------------------------------------------------------------
    def load_checkpoint(self, path, model=None, optimizer=None, lr_scheduler=None, strict=True,
                        restore_rng=True) -> dict[str, Any]:
        path = Path(path)
        written_by = read_manifest(path).get("checkpoint_io")
        if written_by != self.name and self.fallback is not None and written_by == self.fallback.name:
            return self.fallback.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                                 strict=strict, restore_rng=restore_rng)
        rank, world = self._rank_world()
        if optimizer is not None and model is None:
            raise ValueError("loading optimizer state needs model= as well (its state is keyed by parameter name)")
        module = unwrap_model(model) if model is not None else None
        optim = _inner_optimizer(optimizer) if optimizer is not None else None

        def plan() -> tuple[tuple[dict, dict | None, dict | None, bool], None]:
            manifest = read_manifest(path)
            if manifest.get("checkpoint_io") != self.name:
                raise ValueError(f"{path} was written by checkpoint IO {manifest.get('checkpoint_io')!r}; "
                                 f"{type(self).__name__} reads only {self.name!r} checkpoints")
            saved = read_dcp_metadata(path / DCP_DIR) if module is not None else {}
            targets: dict[str, torch.Tensor] = {}
            frozen = manifest.get("frozen", True)  # False: trainable parameters only
            if module is not None and not frozen:
                check_frozen_left_out(module, {k[len(_MODEL):] for k in saved if k.startswith(_MODEL)}, path)
            msd = self._model_targets(module, saved, strict and frozen, targets, path) if module is not None else None
            opt = self._optimizer_targets(module, optim, saved, targets, path) if optim is not None else None
            return (targets, msd, opt, frozen), None

        (targets, msd, opt, frozen), _ = self._everywhere(plan, f"prepare loading {path}")
        if module is not None:
            _dcp_load(targets, path / DCP_DIR, self.group)
        if msd is not None:
            self._set_model_state(module, msd, strict and frozen)
        if opt is not None:
            self._set_optimizer_state(module, optim, opt, targets)
            scaler = getattr(optimizer, "scaler", None)
            if scaler is not None and opt["saved"].get("loss_scaler") is not None:
                scaler.load_state_dict(opt["saved"]["loss_scaler"])
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(load_state(path / "scheduler"))
        state = load_state(path / "extra")
        if not isinstance(state, dict) or not {"trainer", "rng"} <= state.keys():
            raise ValueError(f"{path / 'extra.json'}: expected keys 'trainer' and 'rng'")
        same_world = lambda key: isinstance(state.get(key), list) and len(state[key]) == world  # noqa: E731
        if restore_rng:
            restore_rng_state(state["rng_ranks"][rank] if same_world("rng_ranks") else state["rng"])
        return state["trainer_ranks"][rank] if same_world("trainer_ranks") else state["trainer"]

    @staticmethod
    def _model_targets(module: nn.Module, saved: dict, strict: bool, targets: dict, path: Path) -> dict:
        """This rank's model state dict (DTensors for FSDP2) to load into, checked against the checkpoint."""
        msd = get_model_state_dict(module)
        stored = {k[len(_MODEL):] for k in saved if k.startswith(_MODEL)}
        missing, unexpected = sorted(msd.keys() - stored), sorted(stored - msd.keys())
        if strict and (missing or unexpected):
            raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        msd = {k: v for k, v in msd.items() if k in stored}
        for k, v in msd.items():
            shape, _ = saved[_MODEL + k]
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"{path}: key {k!r} has shape {list(shape)}, model expects {list(v.shape)}")
            targets[_MODEL + k] = v
        return msd

    @staticmethod
    def _optimizer_targets(module: nn.Module, optim: torch.optim.Optimizer, saved: dict, targets: dict,
                           path: Path) -> dict[str, Any]:
        """Tensors to load the optimizer state into, plus what to set afterwards."""
        doc = load_state(path / "optimizer")
        if not isinstance(doc, dict) or not {"param_groups", "state"} <= doc.keys():
            raise ValueError(f"{path / 'optimizer.json'}: expected keys 'param_groups' and 'state' "
                             "(was the checkpoint saved without an optimizer?)")
        if isinstance(optim, ZeroRedundancyOptimizer):
            fqn = _param_fqns(module)
            own_groups = [{"params": [fqn[id(p)] for p in g["params"]]} for g in optim.param_groups]
            _check_groups(doc["param_groups"], own_groups, path)
            state: dict[str, dict[str, Any]] = {}
            for p in (p for g in optim.optim.param_groups for p in g["params"]):
                name = fqn[id(p)]
                if name not in doc["state"]:
                    continue
                prefix = f"{_OPTIM}{name}/"
                state[name] = dict(doc["state"][name])
                for key, (shape, dtype) in saved.items():
                    if key.startswith(prefix):
                        t = torch.empty(shape, dtype=dtype, device=p.device)
                        state[name][key[len(prefix):]] = targets[key] = t
            return {"saved": doc, "state": state}
        if any(p.grad is not None for g in optim.param_groups for p in g["params"]) and not optim.state:
            raise ValueError(f"cannot load {path} into an optimizer whose parameters have gradients but no "
                             "state yet: load before the first backward (or zero_grad(set_to_none=True))")
        if not doc["state"]:  # saved before the first step: only the hyperparameters to set
            _check_groups(doc["param_groups"], _get_optimizer_state(module, optim)["param_groups"], path)
            return {"saved": doc, "state": None}
        template = _initialised_optimizer_state(module, optim)
        _check_groups(doc["param_groups"], template["param_groups"], path)
        state = {}
        for name, entry in template["state"].items():
            if name not in doc["state"]:
                continue  # no state when saved (never stepped): leave none
            state[name] = {}
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    if key not in doc["state"][name]:
                        raise ValueError(f"{path}: optimizer state {name!r}/{key!r} is missing")
                    state[name][key] = doc["state"][name][key]
                    continue
                flat = f"{_OPTIM}{name}/{key}"
                if flat not in saved:
                    raise ValueError(f"{path}: optimizer state {name!r}/{key!r} is missing from the checkpoint")
                if tuple(saved[flat][0]) != tuple(value.shape):
                    raise ValueError(f"{path}: optimizer state {name!r}/{key!r} has shape {list(saved[flat][0])}, "
                                     f"the optimizer expects {list(value.shape)}")
                state[name][key] = targets[flat] = value
        return {"saved": doc, "state": state}

    @staticmethod
    def _set_optimizer_state(module: nn.Module, optim: torch.optim.Optimizer, opt: dict[str, Any],
                             targets: dict) -> None:
        groups = opt["saved"]["param_groups"]
        if isinstance(optim, ZeroRedundancyOptimizer):
            fqn = _param_fqns(module)
            local = optim.optim.state_dict()
            names = [fqn[id(p)] for g in optim.optim.param_groups for p in g["params"]]
            own = opt["state"] or {}
            local["state"] = {i: own[n] for i, n in enumerate(names) if n in own}
            optim.optim.load_state_dict(local)
            for mine, theirs in zip(optim.param_groups, groups):  # ZeRO copies them to its local optimizer
                mine.update({k: v for k, v in theirs.items() if k != "params"})
            for mine, theirs in zip(optim.optim.param_groups, groups):
                mine.update({k: v for k, v in theirs.items() if k != "params"})
            return
        if opt["state"] is None:  # never stepped: leave it without state, as it was saved
            for mine, theirs in zip(optim.param_groups, groups):
                mine.update({k: v for k, v in theirs.items() if k != "params"})
            return
        set_optimizer_state_dict(module, optim, {"state": opt["state"], "param_groups": groups})

    # --- export ----------------------------------------------------------------------------
    def export(self, model: nn.Module, out_dir: str | Path, config: dict[str, Any], transform: Any = None) -> Path:
        """Gather the full model state (collective) and write model.safetensors + config.json on rank 0."""
        from .export import export_model

        module = unwrap_model(model)
        if dist.is_available() and dist.is_initialized():  # cpu_offload keeps the full copy on global rank 0 only
            options = StateDictOptions(full_state_dict=True, cpu_offload=self.group is None)
            state = get_model_state_dict(module, options=options)
        else:
            state = {k: _full(v) for k, v in get_model_state_dict(module).items()}
        return Path(self._on_rank0(lambda: str(export_model(_StateHolder(state), out_dir, config, transform)),
                                   f"export {out_dir}"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _StateHolder(nn.Module):
    """Presents an already-gathered state dict to `export_model`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        object.__setattr__(self, "_state", state)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._state


# --- offline reading -----------------------------------------------------------------------

def load_full_model_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU model weights of a checkpoint, read in this process alone (no process
    group needed; any open one is not used). Reads "sharded" and "general" checkpoints."""
    ckpt = Path(ckpt_dir)
    io_name = read_manifest(ckpt).get("checkpoint_io")
    if io_name == "general":
        return load_weights(ckpt / "model.safetensors")
    if io_name != SHARDED_IO_NAME:
        raise ValueError(f"{ckpt}: unknown checkpoint IO {io_name!r} (expected 'sharded' or 'general')")
    saved = read_dcp_metadata(ckpt / DCP_DIR)
    targets = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in saved.items() if k.startswith(_MODEL)}
    if not targets:
        raise ValueError(f"{ckpt}: the checkpoint holds no model weights")
    _dcp_load(targets, ckpt / DCP_DIR, group=None, no_dist=True)
    return {k[len(_MODEL):]: v for k, v in targets.items()}

