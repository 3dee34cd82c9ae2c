"""Module-level hooks that drive chunk fetch/release and gradient collection, and the model
wrapper that routes autograd's saved tensors through the chunk manager.

Forward: a module's pre-hook acquires the chunks of its own parameters, its post-hook releases
them. Backward: a tensor hook on the module's output marks the start of its backward (acquire
again); each parameter's post-accumulate-grad hook moves its gradient into the chunk and
releases the chunk once all the module's gradients are in; an autograd end-of-backward callback
releases what is left and lets the manager reduce-scatter incomplete chunks. From a module's
backward start to its release, the bytes of its parameters' gradients as autograd produces them
(in the compute dtype, before they are added into the chunk) are reserved in the device budget:
they really exist there for that moment (the process-memory cross-check in
tests/test_gemini_memory.py sees them). Hooks are per
module, not per op, so any model built of modules works and `torch.compile` is not blocked.

Low precision (bf16/fp16 compute copies): a module that owns chunked parameters also gets its
fp32 tensor inputs cast to the compute dtype, so its parameters and inputs agree (ops outside
autocast's lists, e.g. CPU layer_norm, refuse an fp32 input with a bf16 weight). Colossal-AI's
Gemini casts the model's inputs once; casting per module also covers fp32 tensors made inside
the model. Autocast (the ModelWrapper's) still runs its fp32 ops (softmax, losses) in fp32.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..torch_internals import queue_backward_callback
from .chunks import Chunk, ChunkManager


def _cast_fp32(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every fp32 tensor (in nested tuples/lists/dicts) cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype == torch.float32 else obj
    if isinstance(obj, dict):
        return type(obj)((k, _cast_fp32(v, dtype)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_fp32(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_fp32(v, dtype) for v in obj)
    return obj


def grad_landing_bytes(params: list[nn.Parameter], dtype: torch.dtype) -> int:
    """Bytes of the gradients autograd produces for `params` (in the compute dtype)."""
    return sum(p.numel() for p in params if p.requires_grad) * dtype.itemsize


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of a module output: nested in tuples, lists, dicts and dataclasses (a model's
    output record), so a backward through any of them marks the module's backward start."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors_in(getattr(obj, f.name))]
    return []


def hook_units(model: nn.Module, tensors: Any, blocks: list[str] | None = None) -> dict[nn.Module, list[nn.Parameter]]:
    """Which module's hooks fetch which parameters (those in `tensors`), in model order.

    Each module fetches its own parameters, except that when the model names its blocks (its
    `parallel_plan().blocks`, as FSDP's units), every parameter outside the blocks is fetched by
    the root module for its whole forward and backward, as FSDP2's root unit holds them. A model
    may call such modules through methods other than `forward` (an encoder's `embed`), which
    module hooks do not see; the root's forward covers them."""
    under_blocks: set = set()
    for name in blocks or []:
        under_blocks |= set(model.get_submodule(name).parameters())
    units: dict[nn.Module, list[nn.Parameter]] = {}
    seen: set = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p not in tensors or p in seen:
                continue
            seen.add(p)
            owner = module if not blocks or p in under_blocks else model
            units.setdefault(owner, []).append(p)
    return {m: units[m] for m in model.modules() if m in units}


class ChunkHooks:
    """Module and parameter hooks of one model over one ChunkManager (fetch units: `hook_units`)."""

    def __init__(self, model: nn.Module, manager: ChunkManager, blocks: list[str] | None = None) -> None:
        self.manager = manager
        self.handles: list[Any] = []
        self.owner: dict[nn.Parameter, nn.Module] = {}
        self.module_chunks: dict[nn.Module, list[Chunk]] = {}
        self.module_params: dict[nn.Module, list[nn.Parameter]] = {}
        self.bwd_holds: dict[nn.Module, int] = {}
        self.pending: dict[nn.Module, set] = {}
        self.landing_bytes: dict[nn.Module, int] = {}  # a module's gradients as autograd hands them over
        self._callback_queued = False
        for module, params in hook_units(model, manager.tensors, blocks).items():
            for p in params:
                self.owner[p] = module
            chunks: list[Chunk] = []
            for p in params:
                c = manager.tensors[p].chunk
                if c not in chunks:
                    chunks.append(c)
            self.module_chunks[module] = chunks
            self.module_params[module] = params
            self.landing_bytes[module] = grad_landing_bytes(params, manager.compute_dtype)
            self.handles.append(module.register_forward_pre_hook(self._forward_pre))
            self.handles.append(module.register_forward_hook(self._forward_post))
            if manager.compute_dtype != torch.float32:
                self.handles.append(module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        for p in manager.tensors:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        for c in self.module_chunks[module]:
            self.manager.acquire(c)

    def _cast_inputs(self, module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict]:
        dtype = self.manager.compute_dtype
        return _cast_fp32(args, dtype), _cast_fp32(kwargs, dtype)

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
            queue_backward_callback(self._backward_done)
            self._callback_queued = True
        for c in self.module_chunks[module]:
            self.manager.acquire(c)
        self.manager.reserve(self.landing_bytes[module], f"gradients of {type(module).__name__} as autograd hands "
                                                         "them over (before they are added into the chunks)")
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
            self.manager.budget.release(self.landing_bytes[module])
            for c in self.module_chunks[module]:
                self.manager.release(c)
        self.pending.pop(module, None)

    def _backward_done(self) -> None:
        """End of a backward pass: release what modules without gradients still hold, reduce
        what is left, flush cached copies."""
        self._callback_queued = False
        for module in list(self.bwd_holds):
            self._release_module(module)
        self.manager.finish_backward()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class GeminiModule(nn.Module):
    """Runs the user's module with saved-tensor hooks: tensors that live in chunk compute copies
    are saved as references (so released copies are really freed), and during the auto warm-up
    the bytes of the other saved tensors (activations: the step's non-model memory) are summed."""

    def __init__(self, module: nn.Module, manager: ChunkManager) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_manager", manager)
        self.measure = False
        self.peak_saved_bytes = 0
        self._seen: set[int] = set()
        self._saved = 0

    def _pack(self, t: torch.Tensor):
        packed = self._manager.pack(t)
        if self.measure and packed is t:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return packed
            ptr = storage.data_ptr()
            if ptr not in self._seen and ptr not in self._manager.master_ptrs:
                self._seen.add(ptr)
                self._saved += storage.nbytes()
        return packed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._seen, self._saved = set(), 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._manager.unpack):
            out = self.module(*args, **kwargs)
        if self.measure:
            self.peak_saved_bytes = max(self.peak_saved_bytes, self._saved)
        self._seen = set()
        return out
