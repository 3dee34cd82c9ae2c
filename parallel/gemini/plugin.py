"""GeminiPlugin: chunk-based heterogeneous memory over device, host and disk (single process).

    booster = Booster(GeminiPlugin(device_budget_bytes=256 << 20, offload_param_frac=0.5,
                                   offload_optim_frac=0.25, disk_optim_frac=0.5))
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ... the usual loop: booster.backward, booster.clip_grad_norm_, optimizer.step/zero_grad ...
    booster.plugin.close()        # joins the disk thread, removes the disk tier's files

Parameters are packed into chunks (see `chunks.py`); module hooks fetch a chunk's parameters
into the device tier before a module runs forward or backward and release them afterwards
(forward pre/post hooks; a tensor hook on the module's output marks the start of its backward,
and each parameter's post-accumulate-grad hook moves its gradient into the chunk and releases
the chunk once all the module's gradients are in). The optimizer (torch Adam/AdamW, fp32)
steps chunk by chunk in the tier where the chunk's state lives, through torch's own
single-tensor Adam kernel on flat views, so the result equals `torch.optim.AdamW` on CPU;
disk state is prefetched one chunk ahead by a background thread through a bounded buffer.
Gradient clipping computes the global norm over the chunk gradients and folds the clip factor
into the step.

Checkpoints are the general (full-tensor) layout: model weights as a state dict and optimizer
state in torch.optim.AdamW's `state_dict` layout, so Gemini and SingleProcessPlugin resume each
other's checkpoints. Out of scope here: multi-rank sharding, auto placement, low-precision
compute copies (bf16 runs through autocast on the fp32 chunks; fp16 loss scaling is refused).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.adam import adam as _adam_functional
from torch.utils.data import DataLoader

from ..checkpoint import GeneralCheckpointIO
from ..plugin import Plugin
from ..precision import MixedPrecision
from ..wrappers import ModelWrapper, OptimizerWrapper
from .chunks import Chunk, ChunkManager, TensorState
from .tiers import DeviceBudget, DeviceBudgetError, DiskStore


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []


class _Hooks:
    """Module and parameter hooks that drive fetch/release and gradient collection."""

    def __init__(self, model: nn.Module, manager: ChunkManager) -> None:
        self.manager = manager
        self.handles: list[Any] = []
        self.owner: dict[nn.Parameter, nn.Module] = {}
        self.module_chunks: dict[nn.Module, list[Chunk]] = {}
        self.module_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.bwd_holds: dict[nn.Module, int] = {}
        self.pending: dict[nn.Module, set] = {}
        self._callback_queued = False
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if p in manager.tensors and p not in self.owner]
            if not params:
                continue
            for p in params:
                self.owner[p] = module
            chunks: list[Chunk] = []
            for p in params:
                c = manager.tensors[p].chunk
                if c not in chunks:
                    chunks.append(c)
            self.module_chunks[module] = chunks
            self.module_params[module] = params
            self.handles.append(module.register_forward_pre_hook(self._forward_pre))
            self.handles.append(module.register_forward_hook(self._forward_post))
        for p in manager.tensors:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        for c in self.module_chunks[module]:
            self.manager.acquire(c)

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            outs = [t for t in _tensors_in(output) if t.requires_grad]
            if outs:
                fired = [False]

                def on_output_grad(grad: torch.Tensor, module=module, fired=fired) -> None:
                    if not fired[0]:
                        fired[0] = True
                        self._backward_pre(module)

                for t in outs:
                    t.register_hook(on_output_grad)
        keep = torch.is_grad_enabled()  # a backward will want these chunks again soon
        for c in self.module_chunks[module]:
            self.manager.release(c, keep=keep)

    def _backward_pre(self, module: nn.Module) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._callback_queued = True
        for c in self.module_chunks[module]:
            self.manager.acquire(c)
        self.bwd_holds[module] = self.bwd_holds.get(module, 0) + 1
        self.pending[module] = {p for p in self.module_params[module] if p.requires_grad}

    def _grad_ready(self, p: nn.Parameter) -> None:
        self.manager.collect_grad(p)
        module = self.owner[p]
        pending = self.pending.get(module)
        if pending is not None:
            pending.discard(p)
            if not pending:
                self._release_module(module)

    def _release_module(self, module: nn.Module) -> None:
        for _ in range(self.bwd_holds.pop(module, 0)):
            for c in self.module_chunks[module]:
                self.manager.release(c)
        self.pending.pop(module, None)

    def _backward_done(self) -> None:
        """End of a backward pass: release what modules without gradients still hold."""
        self._callback_queued = False
        for module in list(self.bwd_holds):
            self._release_module(module)
        self.manager.flush()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class GeminiOptimizer(OptimizerWrapper):
    """Adam/AdamW stepped chunk by chunk where each chunk's state lives (fp32, exact)."""

    def __init__(self, optim: torch.optim.Optimizer, manager: ChunkManager, disk: DiskStore | None) -> None:
        super().__init__(optim, scaler=None)
        self.manager = manager
        self.disk = disk
        self._clip_coef: torch.Tensor | None = None
        self.max_disk_buffers = 0  # most disk-chunk state buffers alive at once during a step
        self._decoupled = isinstance(optim, torch.optim.AdamW)

    # --- gradients ---------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.flush()
        self.manager.zero_grad()
        for t in self.manager.order:
            t.param.grad = None
        self._clip_coef = None

    def _params_with_grad(self) -> list[torch.Tensor]:
        return self.manager.grad_views()

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm over the chunk gradients; the clip factor is applied inside `step` (one
        pass over each chunk, in its own tier) unless clipping is asked for again first."""
        if self._clip_coef is not None:  # clipped twice before a step: materialise the first factor
            with torch.no_grad():
                for c in self.manager.chunks:
                    c.grad[:c.used].mul_(self._clip_coef)
            self._clip_coef = None
        grads = self.manager.grad_views()
        norm = self.grad_norm_fn(grads, norm_type) if grads else torch.tensor(0.0)
        self._clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grads_with_norm_
        return norm

    # --- step --------------------------------------------------------------------------------
    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        if group.get("amsgrad", False):
            raise NotImplementedError("GeminiPlugin: amsgrad is not supported")
        beta1, beta2 = group["betas"]
        return dict(amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                    eps=group["eps"], maximize=group.get("maximize", False),
                    decoupled_weight_decay=group.get("decoupled_weight_decay", self._decoupled))

    def _step_chunk(self, c: Chunk, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        ready = [t for t in c.tensors if t.state is TensorState.READY]
        if not ready:
            return
        if self._clip_coef is not None:
            c.grad[:c.used].mul_(self._clip_coef)
        hyper = self._hyper(self.optim.param_groups[c.group])
        needs_copy = c.optim_tier == "device" and c.param_tier == "host"
        if needs_copy:  # master + grad visit the device for the step
            self.manager.reserve(2 * c.nbytes, f"stepping chunk {c.index} on device")
        try:
            if len(ready) == len(c.tensors) and len({t.step for t in ready}) == 1:
                step = torch.tensor(float(ready[0].step))  # one flat call over the whole chunk
                _adam_functional([c.master[:c.used]], [c.grad[:c.used]], [exp_avg[:c.used]],
                                 [exp_avg_sq[:c.used]], [], [step], foreach=False, **hyper)
            else:  # tensors at different step counts (some had no gradient): per-tensor views
                steps = [torch.tensor(float(t.step)) for t in ready]
                _adam_functional([c.view(c.master, t) for t in ready], [c.view(c.grad, t) for t in ready],
                                 [c.view(exp_avg, t) for t in ready], [c.view(exp_avg_sq, t) for t in ready],
                                 [], steps, foreach=False, **hyper)
            for t in ready:
                t.step += 1
        finally:
            if needs_copy:
                self.manager.budget.release(2 * c.nbytes)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError("GeminiOptimizer.step takes no closure")
        self.last_step_skipped = False
        self.manager.flush()
        with torch.no_grad():
            disk_chunks = [c for c in self.manager.chunks if c.optim_tier == "disk"
                           and any(t.state is TensorState.READY for t in c.tensors)]
            reads = {}
            if disk_chunks:
                reads[disk_chunks[0].index] = self.disk.read(ChunkManager.disk_key(disk_chunks[0]))
            pending_write = None
            di = 0
            for c in self.manager.chunks:
                if c.optim_tier != "disk":
                    self._step_chunk(c, c.exp_avg, c.exp_avg_sq)
                    continue
                if di >= len(disk_chunks) or disk_chunks[di] is not c:
                    continue
                buf = reads.pop(c.index).result()
                if di + 1 < len(disk_chunks):  # prefetch the next disk chunk while this one steps
                    nxt = disk_chunks[di + 1]
                    reads[nxt.index] = self.disk.read(ChunkManager.disk_key(nxt))
                self.max_disk_buffers = max(self.max_disk_buffers, 1 + len(reads) + (pending_write is not None))
                self._step_chunk(c, buf[:c.size], buf[c.size:])
                if pending_write is not None:
                    pending_write.result()  # bounded: at most one write in flight
                pending_write = self.disk.write(ChunkManager.disk_key(c), buf)
                di += 1
            if pending_write is not None:
                pending_write.result()
        self._clip_coef = None

    # --- state dicts (torch.optim.AdamW layout) ----------------------------------------------
    def _indexed_params(self) -> list[nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def _read_state(self, c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        if c.optim_tier == "disk":
            buf = self.disk.read(ChunkManager.disk_key(c)).result()
            return buf[:c.size], buf[c.size:]
        return c.exp_avg, c.exp_avg_sq

    def state_dict(self) -> dict[str, Any]:
        self.manager.flush()
        sd = self.optim.state_dict()  # param_groups (the inner optimizer never steps: no state)
        state: dict[int, dict[str, torch.Tensor]] = {}
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, p in enumerate(self._indexed_params()):
            t = self.manager.tensors[p]
            if t.step == 0:
                continue
            c = t.chunk
            if c.index not in cache:
                cache[c.index] = self._read_state(c)
            ea, eas = cache[c.index]
            state[i] = {"step": torch.tensor(float(t.step)), "exp_avg": c.view(ea, t).clone(),
                        "exp_avg_sq": c.view(eas, t).clone()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.flush()
        state = dict(state)
        state.pop("loss_scaler", None)
        saved = state.get("state", {})
        self.optim.load_state_dict({"state": {}, "param_groups": state["param_groups"]})  # checks group sizes
        params = self._indexed_params()
        by_chunk: dict[int, list] = {}
        for i, p in enumerate(params):
            by_chunk.setdefault(self.manager.tensors[p].chunk.index, []).append((i, self.manager.tensors[p]))
        with torch.no_grad():
            for c in self.manager.chunks:
                ea, eas = self._read_state(c)
                ea.zero_()
                eas.zero_()
                for i, t in by_chunk.get(c.index, []):
                    s = saved.get(i, saved.get(str(i)))
                    if s is None:
                        t.step = 0
                        continue
                    c.view(ea, t).copy_(s["exp_avg"])
                    c.view(eas, t).copy_(s["exp_avg_sq"])
                    t.step = int(round(float(s["step"])))
                if c.optim_tier == "disk":
                    self.disk.write(ChunkManager.disk_key(c), torch.cat([ea, eas])).result()


class GeminiCheckpointIO(GeneralCheckpointIO):
    """The general (full-tensor) checkpoint, after flushing cached device copies so the model's
    parameters are their chunk masters: SingleProcessPlugin reads it and vice versa."""

    def __init__(self, plugin: "GeminiPlugin") -> None:
        self._plugin = plugin

    def _flush(self) -> None:
        if self._plugin.manager is not None:
            self._plugin.manager.flush()

    def save_checkpoint(self, *args: Any, **kwargs: Any):
        self._flush()
        return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any):
        self._flush()
        return super().load_checkpoint(*args, **kwargs)

    def export(self, *args: Any, **kwargs: Any):
        self._flush()
        return super().export(*args, **kwargs)


class GeminiPlugin(Plugin):
    """Chunk-based heterogeneous memory over device, host and disk tiers, one process.

    placement            "static" (fractions below); "auto" is not in this slice.
    device_budget_bytes  bytes the device tier may hold (chunk buffers resident + fetched);
                         None: unbounded (still accounted).
    offload_param_frac   fraction of chunks (the last ones) whose params + grads live on host
                         and are fetched into the device tier only while their modules run.
    offload_optim_frac   fraction of chunks whose Adam state lives on host (stepped there).
    disk_optim_frac      fraction of chunks (the last ones) whose Adam state lives on disk.
    disk_dir             where the disk tier puts its files (a fresh subdirectory, removed at
                         close/exit); None: a temporary directory.
    chunk_size           elements per chunk; None: chosen to minimise padding.
    precision            "fp32" or "bf16" (autocast over the fp32 chunks).
    """

    name = "gemini"
    supports_no_sync = True
    supported_precisions = ("fp32", "bf16")

    def __init__(self, placement: str = "static", device_budget_bytes: int | None = None,
                 offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0, disk_optim_frac: float = 0.0,
                 disk_dir: "str | os.PathLike | None" = None, chunk_size: int | None = None,
                 precision: "str | MixedPrecision | None" = None) -> None:
        if placement != "static":
            raise NotImplementedError(f"placement={placement!r}: only 'static' is implemented")
        for name, frac in (("offload_param_frac", offload_param_frac), ("offload_optim_frac", offload_optim_frac),
                           ("disk_optim_frac", disk_optim_frac)):
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"{name}={frac} must lie in [0, 1]")
        if offload_optim_frac + disk_optim_frac > 1.0 + 1e-9:
            raise ValueError(f"offload_optim_frac + disk_optim_frac = {offload_optim_frac + disk_optim_frac} > 1")
        super().__init__(precision)
        self._checkpoint_io = GeminiCheckpointIO(self)
        self.placement = placement
        self.device_budget_bytes = device_budget_bytes
        self.offload_param_frac = offload_param_frac
        self.offload_optim_frac = offload_optim_frac
        self.disk_optim_frac = disk_optim_frac
        self.disk_dir = disk_dir
        self.chunk_size = chunk_size
        self.manager: ChunkManager | None = None
        self.disk: DiskStore | None = None
        self.optimizer: GeminiOptimizer | None = None
        self._hooks: _Hooks | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        if self.manager is not None:
            raise RuntimeError("a GeminiPlugin manages one model; make a new plugin for another")
        manager = self._plan(model, optimizer)
        hooks = _Hooks(model, manager)
        need = self.estimate(model, optimizer, manager=manager)
        if self.device_budget_bytes is not None and need["device_bytes"] > self.device_budget_bytes:
            hooks.remove()
            raise DeviceBudgetError(
                f"device budget {self.device_budget_bytes} bytes cannot hold what a step needs: "
                f"{need['device_bytes']} bytes = {need['device_resident_bytes']} resident (params+grads of "
                f"{need['device_param_chunks']} device chunks, optimizer state of {need['device_optim_chunks']} "
                f"device chunks) + {need['device_working_bytes']} working (largest module fetch "
                f"{need['largest_fetch_bytes']}, device step copy {need['step_copy_bytes']}); "
                f"{len(manager.chunks)} chunks of {manager.chunk_size} elements ({manager.chunk_size * 4} bytes). "
                "Raise device_budget_bytes or offload more")
        if any(c.optim_tier == "disk" for c in manager.chunks):
            self.disk = DiskStore(self.disk_dir)
            manager.disk = self.disk
        manager.materialize()
        self.manager, self._hooks = manager, hooks
        self.optimizer = GeminiOptimizer(optimizer, manager, self.disk)
        self.optimizer.grad_norm_fn = self.grad_norm
        return self.wrap_model(model), self.optimizer, criterion, dataloader, lr_scheduler

    def _plan(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> ChunkManager:
        if optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(f"GeminiPlugin steps torch.optim.Adam/AdamW on its chunks; got {type(optimizer).__name__}")
        group_of = {p: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = []
        for name, p in model.named_parameters():
            if p not in group_of:
                raise ValueError(f"parameter {name} is not in the optimizer; Gemini chunks only optimised parameters")
            named.append((name, p, group_of[p]))
        manager = ChunkManager(named, self.chunk_size, DeviceBudget(self.device_budget_bytes))
        manager.place(self.offload_param_frac, self.offload_optim_frac, self.disk_optim_frac)
        return manager

    def estimate(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 manager: ChunkManager | None = None) -> dict[str, int]:
        """Bytes this placement needs per tier, without allocating (the model may live on the
        meta device): device = resident + working set (largest module fetch or device step copy);
        host = host-tier params/grads/state + the disk stream's bounded buffers (3 chunks)."""
        manager = manager if manager is not None else self._plan(model, optimizer)
        resident = manager.resident_bytes_needed()
        fetch = 0
        for module in model.modules():
            chunks = {manager.tensors[p].chunk.index: manager.tensors[p].chunk
                      for p in module.parameters(recurse=False) if p in manager.tensors}
            fetch = max(fetch, sum(c.nbytes for c in chunks.values() if c.param_tier == "host"))
        step = max((2 * c.nbytes for c in manager.chunks if c.optim_tier == "device" and c.param_tier == "host"),
                   default=0)
        disk_chunks = [c for c in manager.chunks if c.optim_tier == "disk"]
        host = sum((2 * c.nbytes if c.param_tier == "host" else 0) + (2 * c.nbytes if c.optim_tier == "host" else 0)
                   for c in manager.chunks) + 3 * 2 * manager.chunk_size * 4 * min(1, len(disk_chunks))
        return {
            "device_bytes": resident + max(fetch, step),
            "device_resident_bytes": resident,
            "device_working_bytes": max(fetch, step),
            "largest_fetch_bytes": fetch,
            "step_copy_bytes": step,
            "device_param_chunks": sum(c.param_tier == "device" for c in manager.chunks),
            "device_optim_chunks": sum(c.optim_tier == "device" for c in manager.chunks),
            "host_bytes": host,
            "disk_bytes": sum(2 * c.nbytes for c in disk_chunks),
            "n_chunks": len(manager.chunks),
            "chunk_size": manager.chunk_size,
            "padding_bytes": manager.report()["padding_bytes"],
        }

    def memory_report(self) -> dict[str, Any]:
        """Chunk layout, padding waste, tiers, device bytes resident and peak, disk traffic."""
        if self.manager is None:
            raise RuntimeError("boost a model first")
        rep = self.manager.report()
        rep["disk_dir"] = str(self.disk.root) if self.disk is not None else None
        rep["disk_bytes_read"] = self.disk.bytes_read if self.disk is not None else 0
        rep["disk_bytes_written"] = self.disk.bytes_written if self.disk is not None else 0
        rep["cached_chunks"] = len(self.manager.cached)
        rep["max_disk_buffers"] = self.optimizer.max_disk_buffers if self.optimizer is not None else 0
        return rep

    def close(self) -> None:
        """Join the disk thread and remove the disk tier's files (also done at interpreter exit)."""
        if self.disk is not None:
            self.disk.close()

    def __repr__(self) -> str:
        return (f"GeminiPlugin(placement={self.placement!r}, device_budget_bytes={self.device_budget_bytes}, "
                f"offload_param_frac={self.offload_param_frac}, offload_optim_frac={self.offload_optim_frac}, "
                f"disk_optim_frac={self.disk_optim_frac}, precision={self.precision.dtype!r})")
