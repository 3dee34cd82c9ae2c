"""GeminiOptimizer: Adam/AdamW stepped chunk by chunk, on this rank's shard, in the tier where
each chunk's state lives (fp32, exact).

Each chunk is one call of torch's single-tensor Adam kernel on flat views of the local shard
(per-tensor slices when tensors are at different step counts), so the result equals
`torch.optim.AdamW`: AdamW is elementwise, so stepping shards is stepping the whole. On CUDA
the step runs where the chunk's Adam state lives: device-tier state with torch's fused CUDA
Adam kernel (equal to torch.optim.AdamW(fused=True); within float rounding of the CPU kernel),
host and disk state with the CPU kernel as above; a master and gradient shard in the other
tier are copied there for the step and the updated master copied back (a device step copy is
reserved in the budget, as on CPU). Disk state
is prefetched one chunk ahead by a background thread through a bounded buffer (at most three
chunk-state buffers alive). Gradient clipping computes the global norm (over all ranks' shards)
and folds the clip factor into the step.

The update always runs in fp32 on the fp32 master shards, whatever the compute dtype; the chunk
gradients are fp32 too (bf16/fp16 gradients are added into them). fp16 dynamic loss scaling
(`precision.DynamicLossScaler`, the algorithm every other plugin uses) is folded in: `backward`
scales the loss; before clipping or stepping, each chunk's fp32 gradient shard is unscaled in
place by the fused non-finite-check-and-unscale kernel, in the tier where it lives, and the
found-inf flag is agreed across ranks (one all-reduce MAX); clipping computes the norm of the
unscaled gradients, a non-finite norm also counts as an overflow; on overflow the step is
skipped on every rank (no Adam state or step count changes) and the scale backs off, otherwise
it grows after `growth_interval` clean steps.

`state_dict`/`load_state_dict` use torch.optim.AdamW's layout (full tensors by parameter index,
gathered from the shards when W > 1, a collective then).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam as _adam_functional

from ..precision import DynamicLossScaler
from ..wrappers import OptimizerWrapper
from .chunks import GRAD_STATES, Chunk, ChunkManager, TensorState
from ..torch_internals import mark_optimizer_stepped
from .tiers import DiskStore


class GeminiOptimizer(OptimizerWrapper):
    """Adam/AdamW over the chunks of a ChunkManager."""

    def __init__(self, optim: torch.optim.Optimizer, manager: ChunkManager, disk: DiskStore | None,
                 on_step: Any = None, scaler: DynamicLossScaler | None = None) -> None:
        super().__init__(optim, scaler=scaler)
        self.manager = manager
        self.disk = disk
        self.on_step = on_step  # called before every step (the auto placement ends its warm-up there)
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
        self._unscaled, self._found_inf = False, None

    def _unscale_once(self, params: Any = None) -> None:
        """fp16: unscale every chunk's fp32 gradient shard in place (once per step) and agree
        across ranks whether some gradient overflowed."""
        if self.scaler is None or self._unscaled:
            return
        found = self.scaler.unscale_([c.grad for c in self.manager.chunks])
        self._found_inf = bool(self.manager.comm.all_reduce(found, "max").item() > 0)
        self._unscaled = True

    def _params_with_grad(self) -> list[torch.Tensor]:
        return self.manager.grad_views()

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm over the chunk gradients (all ranks); the clip factor is applied inside
        `step` (one pass over each chunk, in its own tier) unless clipping is asked for again."""
        self._unscale_once()  # fp16: the norm is that of the unscaled gradients
        if self._clip_coef is not None:  # clipped twice before a step: materialise the first factor
            with torch.no_grad():
                for c in self.manager.chunks:
                    c.grad.mul_(self._clip_coef.to(c.grad.device))
            self._clip_coef = None
        if self.manager.comm.sharded:
            norm = self.manager.grad_norm(norm_type)
        else:
            grads = self.manager.grad_views()
            norm = self.grad_norm_fn(grads, norm_type) if grads else torch.tensor(0.0)
        if self.scaler is not None:  # the norm is global: the same verdict on every rank
            self._found_inf = bool(self._found_inf) or not bool(torch.isfinite(norm))
            if self._found_inf:  # the step will be skipped; leave the gradients alone
                return norm
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
        ready = [t for t in c.tensors if t.state in GRAD_STATES]
        if not ready:
            return
        if self.manager.comm.sharded and any(t.state is TensorState.READY for t in ready):
            raise RuntimeError(f"chunk {c.index}: gradients were not reduced over the ranks before the step")
        if self._clip_coef is not None:
            c.grad.mul_(self._clip_coef.to(c.grad.device))
        hyper = self._hyper(self.optim.param_groups[c.group])
        needs_copy = c.optim_tier == "device" and c.param_tier == "host"
        if needs_copy:  # master + grad shards visit the device for the step
            self.manager.reserve(2 * c.shard_nbytes, f"stepping chunk {c.index} on device")
        try:
            where = exp_avg.device  # the step runs where the Adam state lives
            master, grad = c.master, c.grad
            if master.device != where:  # CUDA only: the other tier's shards visit for the step
                master, grad = master.to(where), grad.to(where)
            kernel = dict(foreach=False, fused=True) if where.type == "cuda" else dict(foreach=False)

            def steps(counts: list[int]) -> list[torch.Tensor]:
                return [torch.tensor(float(n), device=where if where.type == "cuda" else None) for n in counts]

            if len(ready) == len(c.tensors) and len({t.step for t in ready}) == 1:
                n = c.local_used  # one flat call over the parameters of the shard
                if n:
                    _adam_functional([master[:n]], [grad[:n]], [exp_avg[:n]], [exp_avg_sq[:n]], [],
                                     steps([ready[0].step]), **kernel, **hyper)
            else:  # tensors at different step counts (some had no gradient): per-tensor slices
                parts = [(t, r) for t in ready if (r := c.local_range(t)) is not None]
                if parts:
                    sl = [slice(r[0], r[0] + r[2]) for _, r in parts]
                    _adam_functional([master[s] for s in sl], [grad[s] for s in sl], [exp_avg[s] for s in sl],
                                     [exp_avg_sq[s] for s in sl], [], steps([t.step for t, _ in parts]),
                                     **kernel, **hyper)
            if master is not c.master:
                c.master.copy_(master)
            for t in ready:
                t.step += 1
        finally:
            if needs_copy:
                self.manager.budget.release(2 * c.shard_nbytes)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError("GeminiOptimizer.step takes no closure")
        self.last_step_skipped = False
        mark_optimizer_stepped(self.optim)  # the chunks step instead of the inner optimizer
        if self.on_step is not None:
            self.on_step()
        self.manager.flush()
        self.manager.policy.on_step()
        if self.scaler is not None:
            self._unscale_once()
            skip = bool(self._found_inf)
            self.scaler.update(skip)
            self._unscaled, self._found_inf = False, None
            if skip:  # an inf/nan gradient on some rank: no rank steps; zero_grad discards them
                self.last_step_skipped = True
                self._clip_coef = None
                return
        with torch.no_grad():
            disk_chunks = [c for c in self.manager.chunks if c.optim_tier == "disk"
                           and any(t.state in GRAD_STATES for t in c.tensors)]
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
                self._step_chunk(c, buf[:c.shard_size], buf[c.shard_size:])
                if pending_write is not None:
                    pending_write.result()  # bounded: at most one write in flight
                pending_write = self.disk.write(ChunkManager.disk_key(c), buf)
                di += 1
            if pending_write is not None:
                pending_write.result()
        self._clip_coef = None

    # --- state --------------------------------------------------------------------------------
    def read_state(self, c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (exp_avg, exp_avg_sq) shards of a chunk (read from disk if they live there)."""
        if c.optim_tier == "disk":
            buf = self.disk.read(ChunkManager.disk_key(c)).result()
            return buf[:c.shard_size], buf[c.shard_size:]
        return c.exp_avg, c.exp_avg_sq

    def write_state(self, c: Chunk, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if c.optim_tier == "disk":
            self.disk.write(ChunkManager.disk_key(c), torch.cat([exp_avg, exp_avg_sq])).result()

    def _indexed_params(self) -> list[nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout, full tensors (gathered from the shards: collective)."""
        self.manager.flush()
        sd = self.optim.state_dict()  # param_groups (the inner optimizer never steps: no state)
        extra = {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}
        state: dict[int, dict[str, torch.Tensor]] = {}
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, p in enumerate(self._indexed_params()):
            t = self.manager.tensors[p]
            if t.step == 0:
                continue
            c = t.chunk
            if c.index not in cache:
                ea, eas = self.read_state(c)
                cache = {c.index: (self.manager.gather(c, ea), self.manager.gather(c, eas))}
            ea, eas = cache[c.index]
            state[i] = {"step": torch.tensor(float(t.step)), "exp_avg": c.view(ea, t).clone(),
                        "exp_avg_sq": c.view(eas, t).clone()}
        return {"state": state, "param_groups": sd["param_groups"], **extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """torch.optim.AdamW's layout (full tensors by index): each rank keeps its slices."""
        self.manager.flush()
        state = dict(state)
        scaler_state = state.pop("loss_scaler", None)
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        saved = state.get("state", {})
        self.optim.load_state_dict({"state": {}, "param_groups": state["param_groups"]})  # checks group sizes
        by_param = {p: saved.get(i, saved.get(str(i))) for i, p in enumerate(self._indexed_params())}
        self.load_tensor_states({self.manager.tensors[p]: s for p, s in by_param.items()})

    def load_tensor_states(self, states: dict[Any, dict[str, Any] | None]) -> None:
        """Set Adam state per tensor ({TensorInfo: {"step", "exp_avg", "exp_avg_sq"} or None})."""
        with torch.no_grad():
            for c in self.manager.chunks:
                ea, eas = self.read_state(c)
                ea.zero_()
                eas.zero_()
                for t in c.tensors:
                    s = states.get(t)
                    if s is None:
                        t.step = 0
                        continue
                    if "exp_avg" in s:
                        self.manager.copy_in(c, t, ea, s["exp_avg"])
                        self.manager.copy_in(c, t, eas, s["exp_avg_sq"])
                    t.step = int(round(float(s["step"])))
                self.write_state(c, ea, eas)
