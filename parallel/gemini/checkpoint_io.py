"""Gemini checkpoints through the layout-free (DCP, safetensors, pickle-free) checkpoint IO.

`GeminiCheckpointIO` is `ShardedCheckpointIO` with Gemini's state in place of a torch module's
and optimizer's: on save, every chunk is all-gathered once (master, then Adam state) and each
rank contributes the *full* tensors of the parameters it owns (round-robin over parameters,
as ZeRO-1 does), keyed by parameter FQN exactly as FSDP/DDP/single-process checkpoints are:
"model/<fqn>", "optim/<fqn>/{step,exp_avg,exp_avg_sq}" (+ optimizer.json, scheduler, RNG). So
a Gemini checkpoint at any world size loads into FSDP, DDP, ZeRO or one process, and theirs
load into Gemini: on load each rank reads, through DCP, the full tensors of the parameters that
intersect its shards and keeps its slices. "general" (full-tensor, single-process) checkpoints
are read by `GeminiGeneralReader`. Memory: saving holds about 1/W of the model's training state
plus one gathered chunk per rank; loading the full tensors that touch the local shards.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint import unwrap_model
from ..plugins.ddp import ReplicatedCheckpointReader
from ..sharded_checkpoint import ShardedCheckpointIO, _check_groups, _StateHolder
from ..state_io import load_state, load_weights

if TYPE_CHECKING:
    from .plugin import GeminiPlugin

_MODEL, _OPTIM = "model/", "optim/"


class GeminiCheckpointIO(ShardedCheckpointIO):
    """DCP checkpoints of a Gemini run (1 or more ranks), readable by every other plugin."""

    def __init__(self, plugin: "GeminiPlugin") -> None:
        super().__init__(group=None, fallback=GeminiGeneralReader(plugin))
        self._plugin = plugin

    @property
    def _manager(self):
        if self._plugin.manager is None:
            raise RuntimeError("boost a model with the GeminiPlugin before saving or loading")
        return self._plugin.manager

    def _owned(self) -> set:
        """TensorInfos whose full tensors this rank writes (round-robin over the parameters)."""
        comm = self._manager.comm
        return {t for i, t in enumerate(self._manager.order) if i % comm.world == comm.rank}

    # --- save ---------------------------------------------------------------------------------
    def save_checkpoint(self, *args: Any, **kwargs: Any):
        if self._plugin.manager is not None:
            self._plugin.manager.flush()
        return super().save_checkpoint(*args, **kwargs)

    def _model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        m = self._manager
        owned = self._owned()
        full: dict[nn.Parameter, torch.Tensor] = {}
        for c in m.chunks:  # one all-gather per chunk, the same order on every rank
            buf = m.gather(c, c.master)
            for t in c.tensors:
                if t in owned:
                    full[t.param] = c.view(buf, t).clone()
        out: dict[str, torch.Tensor] = {}
        for key, v in module.state_dict(keep_vars=True).items():
            if isinstance(v, nn.Parameter) and v in m.tensors:
                if v in full:
                    out[key] = full[v]
            else:
                out[key] = v.detach()  # buffers: replicated (DCP writes them once)
        return out

    def _optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        m, opt = self._manager, self._plugin.optimizer
        owned = self._owned()
        state: dict[str, dict[str, torch.Tensor]] = {}
        for c in m.chunks:
            if not any(t.step for t in c.tensors):
                continue  # same decision on every rank: step counts are replicated
            ea, eas = opt.read_state(c)
            ea, eas = m.gather(c, ea), m.gather(c, eas)
            for t in c.tensors:
                if t in owned and t.step:
                    state[t.name] = {"step": torch.tensor(float(t.step)), "exp_avg": c.view(ea, t).clone(),
                                     "exp_avg_sq": c.view(eas, t).clone()}
        return {"state": state, "param_groups": self._groups()}

    def _groups(self) -> list[dict[str, Any]]:
        m = self._manager
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [m.tensors[p].name for p in g["params"]]}
                for g in self._plugin.optimizer.optim.param_groups]

    # --- load ---------------------------------------------------------------------------------
    def load_checkpoint(self, *args: Any, **kwargs: Any):
        if self._plugin.manager is not None:
            self._plugin.manager.flush()
        return super().load_checkpoint(*args, **kwargs)

    def _model_targets(self, module: nn.Module, saved: dict, strict: bool, targets: dict, path: Path) -> dict:
        m = self._manager
        own = module.state_dict(keep_vars=True)
        stored = {k[len(_MODEL):] for k in saved if k.startswith(_MODEL)}
        missing, unexpected = sorted(own.keys() - stored), sorted(stored - own.keys())
        if strict and (missing or unexpected):
            raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        plan: dict[str, torch.Tensor] = {}
        done: set = set()
        for key, v in own.items():
            if key not in stored:
                continue
            shape, _ = saved[_MODEL + key]
            t = m.tensors.get(v) if isinstance(v, nn.Parameter) else None
            expect = tuple(t.shape) if t is not None else tuple(v.shape)
            if tuple(shape) != expect:
                raise ValueError(f"{path}: key {key!r} has shape {list(shape)}, model expects {list(expect)}")
            if t is None:
                plan[key] = targets[_MODEL + key] = v.detach()  # buffers load in place
            elif t not in done:  # tied parameters: read once
                done.add(t)
                if t.chunk.local_range(t) is not None:
                    plan[key] = targets[_MODEL + key] = torch.empty(t.shape, dtype=torch.float32)
        return plan

    def _set_model_state(self, module: nn.Module, msd: dict[str, torch.Tensor], strict: bool) -> None:
        params = dict(module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for key, value in msd.items():
                p = params.get(key)
                t = self._manager.tensors.get(p) if p is not None else None
                if t is not None:
                    self._manager.copy_in(t.chunk, t, t.chunk.master, value)

    def _optimizer_targets(self, module: nn.Module, optim: torch.optim.Optimizer, saved: dict, targets: dict,
                           path: Path) -> dict[str, Any]:
        doc = load_state(path / "optimizer")
        if not isinstance(doc, dict) or not {"param_groups", "state"} <= doc.keys():
            raise ValueError(f"{path / 'optimizer.json'}: expected keys 'param_groups' and 'state' "
                             "(was the checkpoint saved without an optimizer?)")
        _check_groups(doc["param_groups"], self._groups(), path)
        state: dict[str, dict[str, Any]] = {}
        for t in self._manager.order:
            if t.name not in doc["state"]:
                continue
            entry: dict[str, Any] = {}
            keys = ["step"] + (["exp_avg", "exp_avg_sq"] if t.chunk.local_range(t) is not None else [])
            for key in keys:
                flat = f"{_OPTIM}{t.name}/{key}"
                if flat in saved:
                    shape, dtype = saved[flat]
                    if key != "step" and tuple(shape) != tuple(t.shape):
                        raise ValueError(f"{path}: optimizer state {t.name!r}/{key!r} has shape {list(shape)}, "
                                         f"the parameter is {list(t.shape)}")
                    entry[key] = targets[flat] = torch.empty(shape, dtype=dtype)
                elif key in doc["state"][t.name]:
                    entry[key] = doc["state"][t.name][key]
                else:
                    raise ValueError(f"{path}: optimizer state {t.name!r}/{key!r} is missing from the checkpoint")
            state[t.name] = entry
        return {"saved": doc, "state": state}

    def _set_optimizer_state(self, module: nn.Module, optim: torch.optim.Optimizer, opt: dict[str, Any],
                             targets: dict) -> None:
        for mine, theirs in zip(optim.param_groups, opt["saved"]["param_groups"]):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self._plugin.optimizer.load_tensor_states({t: opt["state"].get(t.name) for t in self._manager.order})

    # --- export -------------------------------------------------------------------------------
    def export(self, model: nn.Module, out_dir, config: dict[str, Any], transform: Any = None) -> Path:
        """Gather the full weights (collective) and write model.safetensors + config.json on rank 0."""
        from ..export import export_model

        state = self._plugin.full_state_dict(unwrap_model(model))
        return Path(self._on_rank0(lambda: str(export_model(_StateHolder(state), out_dir, config, transform)),
                                   f"export {out_dir}"))


class GeminiGeneralReader(ReplicatedCheckpointReader):
    """Reads "general" (full-tensor, single-process) checkpoints into a Gemini run at any world
    size: every rank reads the full tensors and keeps its slices. Writing is GeminiCheckpointIO's."""

    def __init__(self, plugin: "GeminiPlugin") -> None:
        super().__init__(group=None)
        self._plugin = plugin

    def load_full_model_state(self, model: nn.Module, path: Path, strict: bool) -> None:
        self._plugin.load_full_model_state(unwrap_model(model), load_weights(path), strict=strict, where=path)
