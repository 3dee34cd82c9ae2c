"""Pipeline parallelism: a model's layers cut into stages over the ranks of a "pp" group,
micro-batches streamed through them by `torch.distributed.pipelining`: `Schedule1F1B` with one
stage per rank, `ScheduleInterleaved1F1B` with v stages per rank (rank r holds stages r, r + pp,
..., r + (v-1) pp: smaller bubbles, more point-to-point traffic).

    stages = split_stages(model, plan.pipeline, pp * v)  # all stage modules; checks the cut
    mine = local_stages(stages, pp_rank, pp)               # this rank's v of them
    runner = PipelineRunner(mine, plan.pipeline, pp_rank, pp, pp_group, device, num_microbatches, precision)
    result = runner.run(batch, criterion)                 # forward + backward of every micro-batch

torch has the mechanism (`PipelineStage`, `Schedule1F1B`: point-to-point activations and
gradients, one forward and one backward in flight per stage); what is ours is the seam to a
model whose input is not a tensor. The model's `PipelinePlan` says how to cut it:

    batch_tensors   the batch as named tensors with its items (tables) on dim 0: every stage gets
                    them as keyword arguments, cut into micro-batches by the schedule, so stages
                    rebuild masks and indices locally and only activations travel;
    build_stage     stage k of n, a module holding the model's own submodules under the model's
                    names, so a stage's state dict is the model's restricted to the stage and
                    checkpoints of any pp layout (or none) name every tensor alike;
    output          the last stage's tensors -> the object the user's criterion takes.

The criterion runs on the last stage, once per micro-batch, on `batch[start:stop]` (the schedule's
"target" is the items' index, so any batch that slices along dim 0 works). Semantics equal
gradient accumulation over `num_microbatches` equal micro-batches: the loss is the mean of the
micro-batch losses (each backward is scaled by 1 / num_microbatches inside the loss, which keeps
gradients accumulated before the call intact, unlike the schedule's own `scale_grads`).

Stage outputs are point-to-point buffers whose shapes `PipelineStage` infers from the first
micro-batch (one extra forward and backward of it, under a forked RNG). Batches of another shape
need other buffers: the runner keeps one stage and schedule per batch signature and builds a
new one (new inference) when the signature changes; ranks must agree on it, which is checked.

Other parallelisms compose on the stage modules, in the torchtitan order, before the first run:
tensor parallel on the stage's layers (plain tensors in and out, so only local activations
travel), then FSDP2 `fully_shard` of each module in `runner.modules` (the modules the
`PipelineStage`s run): torch's stage then holds gradients unreduced over the micro-batches
(`set_requires_gradient_sync(False)`) and reduce-scatters them once after the last backward.
Row-sequence parallelism cuts each table's rows before the batch tensors reach the stages
(`shard_batch`); its collectives are hooks on modules that live on stages.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .checkpoint import unwrap_model
from .plan import PipelinePlan
from .precision import MixedPrecision
from .sharded_checkpoint import (
    ShardedCheckpointIO,
    _check_groups,
    _get_optimizer_state,
    _initialised_optimizer_state,
    _StateHolder,
)
from .state_io import load_state
from .wrappers import _to_fp32

__all__ = ["check_pp_layout", "split_stages", "local_stages", "merge_modules", "PipelineRunner",
           "PipelineCheckpointIO", "pipeline_grad_norm", "PipelineOnlyModule", "PipelineEvalModule"]


# --- the cut --------------------------------------------------------------------------------

def check_pp_layout(n_layers: int, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    """Pipeline sizes that can work (no communication); errors give the numbers."""
    v = stages_per_rank
    if pp < 1 or v < 1:
        raise ValueError(f"pp and stages_per_rank must be >= 1, got {pp} and {v}")
    n = pp * v
    if n_layers % n:
        what = f"pp={pp} stages" if v == 1 else f"pp × stages_per_rank = {pp} × {v} = {n} stages"
        raise ValueError(f"pipeline parallelism splits the model's {n_layers} layers into {what} of equal depth, "
                         f"but {n_layers} % {n} = {n_layers % n}; choose sizes whose product divides {n_layers}")
    if num_microbatches < pp:
        raise ValueError(f"the 1F1B schedule needs at least one micro-batch per stage: num_microbatches="
                         f"{num_microbatches} < pp={pp}")
    if v > 1 and num_microbatches % pp:
        raise ValueError(f"the interleaved 1F1B schedule runs micro-batches in rounds of pp={pp}: num_microbatches="
                         f"{num_microbatches} is not a multiple of {pp}")


def local_stages(stages: list[nn.Module], pp_rank: int, pp: int) -> list[nn.Module]:
    """The stages rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (the interleaved layout)."""
    return stages[pp_rank::pp]


def merge_modules(modules: list[nn.Module]) -> nn.Module:
    """One module whose submodules are all of `modules`' under the same names (its state dict is
    the union of theirs): where two name different modules at one path, a container holds the
    union of their children (e.g. two stages' `blocks`), which is allowed only for modules
    without tensors of their own."""
    if len(modules) == 1:
        return modules[0]
    union = nn.Module()
    for module in modules:
        _merge_into(union, module, "")
    return union


def _merge_into(union: nn.Module, module: nn.Module, path: str) -> None:
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        raise ValueError(f"cannot merge pipeline stages: {path or 'the root'} ({type(module).__name__}) holds tensors "
                         f"{own[:3]} itself and appears in two stages")
    for name, child in module.named_children():
        mine = dict(union.named_children()).get(name)
        if mine is None:
            union.add_module(name, child)
        elif mine is not child:
            if not type(mine) is nn.Module:  # a stage's own container: replace it by a merged copy
                merged = nn.Module()
                _merge_into(merged, mine, f"{path}{name}")
                union.add_module(name, merged)  # replaces the child of that name
                mine = merged
            _merge_into(mine, child, f"{path}{name}.")


def split_stages(model: nn.Module, plan: PipelinePlan, pp: int) -> list[nn.Module]:
    """All `pp` stage modules of `model` (they share its parameters; nothing is copied).

    Checks that the cut is a partition: every parameter of the model belongs to exactly one
    stage, under the model's own name there (checkpoints depend on it)."""
    stages = [plan.build_stage(k, pp) for k in range(pp)]
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[str, int] = {}
    for k, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise TypeError(f"PipelinePlan.build_stage({k}, {pp}) returned {type(stage).__name__}, not an nn.Module")
        for name, p in stage.named_parameters():
            if id(p) not in names:
                raise ValueError(f"pipeline stage {k} holds a parameter {name!r} that is not the model's")
            if names[id(p)] != name:
                raise ValueError(f"pipeline stage {k} names the model's parameter {names[id(p)]!r} {name!r}; a stage "
                                 "must keep the model's names (checkpoints are keyed by them)")
            if name in owner:
                raise ValueError(f"parameter {name!r} is in pipeline stages {owner[name]} and {k}")
            owner[name] = k
    missing = [n for n in names.values() if n not in owner]
    if missing:
        raise ValueError(f"no pipeline stage holds the parameters {missing[:5]} ({len(missing)} in all)")
    return stages


class PipelineOnlyModule(nn.Module):
    """What a pipeline-parallel boosted model calls: this rank holds one stage, so a plain
    forward cannot run; `booster.execute_pipeline` is the way in. Holds the stage (for
    train()/eval() and parameters)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this model is pipeline parallel (pp > 1): each rank holds one stage, so it cannot be "
                           "called on a batch; run training steps with booster.execute_pipeline(data_iter, model, "
                           "criterion, optimizer)")


class PipelineEvalModule(nn.Module):
    """What evaluation calls under pp > 1: `module(batch)` runs the whole batch through the stages
    (`PipelineRunner.forward`, collective over the pp group) and returns the model's output on
    every rank. Holds the stage modules, so train()/eval() and parameters() reach them."""

    def __init__(self, runner: "PipelineRunner") -> None:
        super().__init__()
        self.runner = runner
        self.stages = nn.ModuleList(runner.modules)

    def forward(self, batch: Any, id_seed: int = 0) -> Any:
        if id_seed:
            raise NotImplementedError("pipeline evaluation runs the model's default column identities (id_seed=0)")
        return self.runner.forward(batch)


class _AutocastStage(nn.Module):
    """Runs a stage under the plugin's autocast; the last stage's outputs come back in fp32
    (as `ModelWrapper` does for a whole model), the others contiguous (point-to-point
    transfers need contiguous buffers, and the receive buffers copy the outputs' strides).
    This is the module a `PipelineStage` runs, so it is also the one to make an FSDP root
    (torch's stage special-cases FSDP only on the module it was given)."""

    def __init__(self, stage: nn.Module, precision: MixedPrecision, device: torch.device, last: bool) -> None:
        super().__init__()
        self.stage = stage
        self.precision, self.device, self.last = precision, device, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast(self.device):
            out = self.stage(*args, **kwargs)
        if not self.last:
            return tuple(t.contiguous() for t in out) if isinstance(out, (tuple, list)) else out.contiguous()
        if self.precision.torch_dtype is not None and self.precision.output_fp32:
            out = _to_fp32(out)
        return out


# --- running it -----------------------------------------------------------------------------

class PipelineRunner:
    """This rank's stages of a pipeline and the schedule that drives them, per batch signature.

    stages            this rank's stage modules (`local_stages`): one (1F1B) or v (interleaved).
    pp_rank, pp       this rank's place in the pp group and its size.
    group             the pp process group.
    num_microbatches  equal micro-batches per batch (the batch size must be a multiple).
    shard_batch       batch -> the part of it this rank's stages compute on (row-sequence
                      parallel: this rank's rows of every table); None: the whole batch. The
                      criterion still gets the whole batch's items (it cuts rows itself).
    loss_scale        factor on every micro-batch loss before its backward (besides
                      1 / num_microbatches), e.g. sp under FSDP, which averages gradients that
                      the sp ranks' shares must sum.

    `modules` are what the `PipelineStage`s run (the stages under the plugin's autocast); a data
    parallel wrapper (FSDP2 `fully_shard`) goes on them before the first `run`.
    """

    def __init__(self, stages: list[nn.Module], plan: PipelinePlan, pp_rank: int, pp: int, group: Any,
                 device: torch.device, num_microbatches: int, precision: MixedPrecision,
                 shard_batch: Callable[[Any], Any] | None = None, loss_scale: float = 1.0) -> None:
        self.plan = plan
        self.shard_batch = shard_batch
        self.loss_scale = float(loss_scale)
        self.pp_rank, self.pp, self.group = pp_rank, pp, group
        self.num_stages = pp * len(stages)
        self.indices = [pp_rank + i * pp for i in range(len(stages))]
        self.device = torch.device(device)
        self.num_microbatches = num_microbatches
        self.is_last = self.indices[-1] == self.num_stages - 1  # this rank computes the loss
        self.modules = [_AutocastStage(stage, precision, self.device, k == self.num_stages - 1)
                        for stage, k in zip(stages, self.indices)]
        self._signature: tuple | None = None
        self._schedule: Any = None
        self._batch: Any = None
        self._criterion: Callable | None = None
        self._records: list[tuple[torch.Tensor, Any, Any]] = []
        self._keep_outputs = False
        self._eval_schedules: dict[tuple, Any] = {}
        self._eval_output: Any = None

    def _tensors(self, batch: Any) -> dict[str, torch.Tensor]:
        tensors = self.plan.batch_tensors(self.shard_batch(batch) if self.shard_batch is not None else batch)
        sizes = {name: int(t.shape[0]) for name, t in tensors.items()}
        if not sizes or len(set(sizes.values())) != 1:
            raise ValueError(f"PipelinePlan.batch_tensors must give tensors with the batch's items on dim 0 "
                             f"(one size), got sizes {sizes}")
        items = next(iter(sizes.values()))
        m = self.num_microbatches
        if items % m:
            raise ValueError(f"pipeline parallelism cuts each batch into num_microbatches={m} equal micro-batches, "
                             f"but this batch has {items} items ({items} % {m} = {items % m}); use batches of a "
                             f"multiple of {m} items")
        return {name: t.to(self.device) for name, t in tensors.items()}

    def _agree(self, signature: tuple) -> None:
        """Every stage must see a batch of the same signature (the same batch, in fact): a
        mismatch would hang or garble the point-to-point transfers, so fail instead."""
        mine = torch.tensor([zlib.crc32(repr(signature).encode())], dtype=torch.int64, device=self.device)
        seen = [torch.zeros_like(mine) for _ in range(self.pp)]
        dist.all_gather(seen, mine, group=self.group)
        if len({int(s) for s in seen}) != 1:
            raise RuntimeError(f"pipeline ranks were given batches of different shapes (pp rank {self.pp_rank}: "
                               f"{signature}); every rank of a pp group must get the same batch")

    def _schedule_for(self, signature: tuple) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        if signature != self._signature:
            stages = [PipelineStage(module, k, self.num_stages, self.device, group=self.group)
                      for module, k in zip(self.modules, self.indices)]
            if len(stages) == 1:
                self._schedule = Schedule1F1B(stages[0], self.num_microbatches, loss_fn=self._loss, scale_grads=False)
            else:
                self._schedule = ScheduleInterleaved1F1B(stages, self.num_microbatches, loss_fn=self._loss,
                                                         scale_grads=False)
            self._signature = signature
        return self._schedule

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the user's criterion on the micro-batch's items, scaled by
        1 / num_microbatches for the backward; the unscaled loss and metrics are recorded."""
        start, stop = int(target[0]), int(target[-1]) + 1
        made = self.plan.output(tuple(output) if isinstance(output, (tuple, list)) else (output,)) \
            if self.plan.output is not None else output
        result = self._criterion(made, self._batch[start:stop])
        loss, metrics = result if isinstance(result, tuple) else (result, None)
        self._records.append((loss.detach(), metrics, made if self._keep_outputs else None))
        return loss * (self.loss_scale / self.num_microbatches)

    def run(self, batch: Any, criterion: Callable, return_outputs: bool = False) -> dict[str, Any]:
        """Forward and backward of every micro-batch of `batch` through the pipeline (collective
        over the pp group; gradients accumulate into the stage's parameters). Returns, on every
        stage, "loss" (mean over micro-batches, a 0-d tensor) and "metrics" (means over
        micro-batches of the criterion's finite float metrics); "outputs" (the last stage's
        per-micro-batch outputs, else None) when asked."""
        tensors = self._tensors(batch)
        signature = tuple((name, tuple(t.shape), str(t.dtype)) for name, t in tensors.items())
        self._agree(signature)
        inferring = signature != self._signature
        schedule = self._schedule_for(signature)
        items = next(iter(tensors.values())).shape[0]
        self._batch, self._criterion, self._records, self._keep_outputs = batch, criterion, [], return_outputs
        held = self._set_aside_grads() if inferring else []
        try:
            if self.is_last:
                schedule.step(target=torch.arange(items, device=self.device), return_outputs=False, **tensors)
            else:
                schedule.step(return_outputs=False, **tensors)
            records = self._records[-self.num_microbatches:] if self.is_last else []  # earlier: shape inference
        finally:
            self._batch = self._criterion = None
            self._records = []
            self._add_back_grads(held)
        summary = _summarise(records) if self.is_last else None
        box = [summary]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, self.pp - 1), group=self.group)
        loss, metrics = box[0]
        return {"loss": torch.tensor(loss, device=self.device), "metrics": metrics,
                "outputs": [r[2] for r in records] if return_outputs and self.is_last else None}


    def forward(self, batch: Any) -> Any:
        """The model's output on a whole batch, on every rank of the pp group, without gradients
        (evaluation): one micro-batch of any number of items through the stages (a forward-only
        schedule per batch signature), the last stage's output broadcast to the others."""
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        if len(self.modules) > 1:
            raise NotImplementedError("evaluating through an interleaved pipeline (stages_per_rank > 1) is not "
                                      "implemented; use stages_per_rank=1")
        tensors = {name: t.to(self.device) for name, t in self.plan.batch_tensors(batch).items()}
        signature = ("eval",) + tuple((name, tuple(t.shape), str(t.dtype)) for name, t in tensors.items())
        self._agree(signature)
        schedule = self._eval_schedules.get(signature)
        if schedule is None:
            stage = PipelineStage(self.modules[0], self.indices[0], self.num_stages, self.device, group=self.group)
            schedule = self._eval_schedules[signature] = ScheduleGPipe(stage, 1, loss_fn=self._record_output)
        items = next(iter(tensors.values())).shape[0]
        try:
            if self.is_last:
                schedule.eval(target=torch.arange(items, device=self.device), **tensors)
            else:
                schedule.eval(**tensors)
            box = [self._eval_output if self.is_last else None]
        finally:
            self._eval_output = None
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, self.pp - 1), group=self.group)
        return box[0]

    def _record_output(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The forward-only schedule's "loss": keeps the last stage's output as the model's."""
        out = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        self._eval_output = self.plan.output(out) if self.plan.output is not None else output
        return torch.zeros((), device=self.device)

    def _set_aside_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Gradients accumulated before a run that infers shapes (a new batch signature): torch
        clears the gradients of FSDP modules after its inference forward and backward, which
        would drop them. They are held here and added back after the run."""
        held = []
        for module in self.modules:
            for p in module.parameters():
                if p.grad is not None:
                    held.append((p, p.grad))
                    p.grad = None
        return held

    @staticmethod
    def _add_back_grads(held: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        with torch.no_grad():
            for p, grad in held:
                p.grad = grad if p.grad is None else p.grad.add_(grad)


def _summarise(records: list[tuple[torch.Tensor, Any, Any]]) -> tuple[float, dict[str, float]]:
    """(mean loss, {metric: mean over micro-batches of its finite values}) of the records."""
    loss = sum(float(r[0]) for r in records) / len(records)
    values: dict[str, list[float]] = {}
    for _, metrics, _ in records:
        for k, v in (metrics or {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                values.setdefault(k, []).append(float(v))
    metrics = {k: sum(v) / len(v) for k, v in values.items()}
    if any(r[1] is not None for r in records):
        metrics["loss"] = loss
    return loss, metrics


def pipeline_grad_norm(local: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The global gradient norm from each stage's norm of its own parameters' gradients."""
    local = local.detach().to(torch.float64)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local.float()
    power = local ** norm_type
    dist.all_reduce(power, op=dist.ReduceOp.SUM, group=group)
    return (power ** (1.0 / norm_type)).float()


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (FSDP or tensor-parallel shards: a collective over their
    mesh, so every rank of the stage calls it in the same order); a plain tensor as it is."""
    return t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t


# --- checkpoints ----------------------------------------------------------------------------

class PipelineCheckpointIO(ShardedCheckpointIO):
    """Sharded (DCP) checkpoints of a pipeline: each stage writes its own parameters and their
    optimizer state under the model's names, so the checkpoint reads like any other (one
    process, another pp or none; `load_full_model_state` gives the whole model).

    Three things differ from `ShardedCheckpointIO`: a stage loads its own keys and accepts the
    other stages' (strict about its own); the optimizer's param groups are written as the
    union of all stages' (so a layout without stages can resume them) and each stage loads its
    own part; and `export` gathers every stage's weights to rank 0.

    stage_keys   the model state-dict keys each pp rank holds (all its stages'), in model order.
    key_meta     {key: (shape, dtype)} of the whole model (receive buffers for `export`).
    """

    def __init__(self, stage_keys: list[list[str]], key_meta: dict[str, tuple[torch.Size, torch.dtype]],
                 pp_rank: int, pp_group: Any, device: torch.device, fallback: Any = None) -> None:
        super().__init__(None, fallback=fallback)
        self.device = torch.device(device)
        self.stage_keys = stage_keys
        self.key_meta = key_meta
        self.order = {k: i for i, k in enumerate(key_meta)}
        self.pp_rank, self.pp_group = pp_rank, pp_group

    def _everywhere(self, fn: Callable[[], Any], what: str) -> tuple[Any, list[Any]]:
        result, payloads = super()._everywhere(fn, what)
        groups = [p["optimizer"]["param_groups"] for p in payloads if isinstance(p, dict) and "optimizer" in p]
        if groups:  # save: the groups written are rank 0's; make them every stage's
            merged = []
            for i, group in enumerate(groups[0]):
                names = {n for g in groups for n in g[i]["params"]}
                merged.append({**group, "params": sorted(names, key=lambda n: self.order.get(n, len(self.order)))})
            payloads[0]["optimizer"]["param_groups"] = merged
        return result, payloads

    def _model_targets(self, module: nn.Module, saved: dict, strict: bool, targets: dict, path: Any) -> dict:
        own = set(get_model_state_dict(module))
        stored = {k[len("model/"):] for k in saved if k.startswith("model/")}
        missing = sorted(own - stored)
        foreign = sorted(stored - own - set(self.key_meta))
        if strict and (missing or foreign):
            raise ValueError(f"{path}: missing keys {missing[:10]}, unexpected keys {foreign[:10]}")
        return ShardedCheckpointIO._model_targets(module, saved, False, targets, path)

    def _optimizer_targets(self, module: nn.Module, optim: torch.optim.Optimizer, saved: dict, targets: dict,
                           path: Any) -> dict[str, Any]:
        """This stage's part of the optimizer state (param groups restricted to its parameters)."""
        doc = load_state(path / "optimizer")
        if not isinstance(doc, dict) or not {"param_groups", "state"} <= doc.keys():
            raise ValueError(f"{path / 'optimizer.json'}: expected keys 'param_groups' and 'state'")
        stepped = bool(doc["state"])  # False: saved before the first step, only hyperparameters to set
        template = (_initialised_optimizer_state if stepped else _get_optimizer_state)(module, optim)
        own = {n for g in template["param_groups"] for n in g["params"]}
        groups = [{**g, "params": [n for n in g["params"] if n in own]} for g in doc["param_groups"]]
        _check_groups(groups, template["param_groups"], path)
        state: dict[str, dict[str, Any]] = {}
        for name, entry in template["state"].items():
            if name not in doc["state"]:
                continue  # never stepped when saved
            state[name] = {}
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    state[name][key] = doc["state"][name][key]
                    continue
                flat = f"optim/{name}/{key}"
                if flat not in saved or tuple(saved[flat][0]) != tuple(value.shape):
                    raise ValueError(f"{path}: optimizer state {name!r}/{key!r} is missing or has another shape")
                state[name][key] = targets[flat] = value
        return {"saved": {**doc, "param_groups": groups}, "state": state if stepped else None}

    def export(self, model: nn.Module, out_dir: Any, config: dict[str, Any], transform: Any = None) -> Any:
        """Every stage's weights, broadcast over the pp group in model order; rank 0 writes them."""
        from pathlib import Path

        from .export import export_model

        own = {k: _full_tensor(v) for k, v in get_model_state_dict(unwrap_model(model)).items()}  # stage peers
        state: dict[str, torch.Tensor] = {}
        for k, keys in enumerate(self.stage_keys):
            src = dist.get_global_rank(self.pp_group, k)
            for key in keys:
                shape, dtype = self.key_meta[key]
                if k == self.pp_rank:
                    t = own[key].detach().to(self.device).contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(t, src=src, group=self.pp_group)
                state[key] = t.cpu()
        state = {k: state[k] for k in self.key_meta}
        return Path(self._on_rank0(lambda: str(export_model(_StateHolder(state), out_dir, config, transform)),
                                   f"export {out_dir}"))
