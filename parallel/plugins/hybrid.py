"""HybridParallelPlugin: data × pipeline × expert × row-sequence × tensor parallelism on one DeviceMesh.

    plugin = HybridParallelPlugin(tp_size=2, sp_size=2, zero_stage=0, precision="bf16")
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4)     # dp × pp
    plugin = HybridParallelPlugin(ep_size=2)                         # experts over 2 of the dp ranks
    # world size = dp × pp × sp × tp; ep divides dp

Composition, in the torchtitan order, of what the model's `ParallelPlan` declares:

    tensor parallel   DTensor `parallelize_module` over mesh["tp"] (`tabfm.parallel.tensor_parallel`):
                      attention heads of both attentions and the MLP width are split.
    expert parallel   (ep_size > 1) the plan's grouped experts are sharded on their expert dim
                      over mesh["ep"], and their dispatch buffers cross ranks by all_to_all
                      (`tabfm.parallel.expert_parallel`). ep ranks are data-parallel ranks (each
                      sees its own batches): expert gradients are reduced over the dp ranks that
                      hold the same experts, everything else over all of dp × sp. Under ZeRO the
                      experts stay out of FSDP (ignored parameters, sharded by ep alone). Under tp
                      each expert's width is split over tp as well (the plan's `expert_tp`).
    row-sequence      each sp rank gets a contiguous slice of every table's rows; row attention
                      all-gathers K/V over mesh["sp"], row statistics are all-reduced
                      (`tabfm.parallel.sequence_parallel`); the loss is the sp group's global mean.
    pipeline          (pp_size > 1) the model's layers are cut into pp stages, one per rank of
                      mesh["pp"], from the plan's `pipeline` (`tabfm.parallel.pipeline`); training steps
                      run through `booster.execute_pipeline` (torch `Schedule1F1B` over
                      `num_microbatches` micro-batches). The other dimensions compose on each
                      rank's stage modules as torchtitan does: tensor parallel on the stage's
                      planned layers, row seams on the model's modules (rows are cut before the
                      batch reaches the stages), then FSDP2 over dp × sp on each stage (ZeRO 2/3),
                      whose gradients torch's PipelineStage reduces once per batch, after the
                      last micro-batch. fp16 is refused under pp.
    data parallel     the remaining dp ranks see different batches. Gradients of every
                      parameter are summed over sp and averaged over dp: zero_stage=0 by a
                      bucketed all-reduce over the flattened dp×sp group after backward;
                      zero_stage=2/3 by FSDP2 `fully_shard` over that group (parameters,
                      gradients and optimizer state sharded over dp×sp; 2 keeps parameters
                      gathered between forward and backward, 3 frees them).

The boosted model takes the full batch on every rank of a dp group (tensor and sequence
peers must be handed the same batch; `prepare_dataloader` shards over dp only) and cuts its
rows itself; the boosted criterion does the same, so the training loop is unchanged. Model
outputs refer to this rank's rows (`shard_batch` gives them). Gradients are reduced in
`booster.backward` (call it rather than `loss.backward()`). Layouts are checked before any collective,
with errors that give the numbers. Checkpoints are sharded (DCP); a tp × sp checkpoint loads
in one process, into any other layout, or into another plugin.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..mesh import build_mesh, mesh_rank, sub_mesh
from ..pipeline import (
    PipelineCheckpointIO,
    PipelineEvalModule,
    PipelineOnlyModule,
    PipelineRunner,
    check_pp_layout,
    local_stages,
    merge_modules,
    pipeline_grad_norm,
    split_stages,
)
from ..activation_checkpointing import checkpoint_blocks
from ..parallelize import parallelize
from ..plan import ParallelPlan, plan_of
from ..plugin import Plugin
from ..precision import MixedPrecision, local_shard
from ..sequence_parallel import (
    RowShardedCriterion,
    RowShardedModule,
    parallelize_rows,
    shard_rows,
    sync_rng_state,
)
from ..sharded_checkpoint import ShardedCheckpointIO
from ..expert_parallel import check_expert_layout, resolve_experts
from ..tensor_parallel import check_tp_layout
from ..wrappers import ModelWrapper, OptimizerWrapper, plain_grad_norm
from .ddp import _require_process_group
from .zero import (
    FullStateFSDPReader,
    _param_names_by_group,
    rebuild_optimizer,
)

__all__ = ["HybridParallelPlugin", "hybrid_grad_norm", "parallelize_stage_tensor"]


def hybrid_grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Global gradient norm over plain (replicated) gradients and DTensor shards that may live
    on different meshes (TP-only, FSDP-only, FSDP × TP): each mesh's part is reduced over its
    mesh, plain gradients count once, and the parts are combined."""
    by_mesh = _by_mesh(grads, lambda g: g)
    plain = [g for g in by_mesh.pop(None, []) if g.numel()]
    norms = [plain_grad_norm(group, norm_type).full_tensor() for group in by_mesh.values()]
    if plain:
        norms.append(plain_grad_norm(plain, norm_type))
    if not norms:
        return torch.zeros(())
    device = norms[0].device
    return norms[0] if len(norms) == 1 else plain_grad_norm([n.to(device) for n in norms], norm_type)


def _by_mesh(items: list[Any], grad_of: Callable[[Any], torch.Tensor]) -> dict[int | None, list[Any]]:
    """Items grouped by the mesh of their gradient (None: plain tensors). Foreach kernels
    refuse DTensors of different meshes in one call (FSDP × TP has 1-D and 2-D ones)."""
    groups: dict[int | None, list[Any]] = defaultdict(list)
    for item in items:
        mesh = getattr(grad_of(item), "device_mesh", None)
        groups[None if mesh is None else id(mesh)].append(item)
    return groups


class HybridParallelPlugin(Plugin):
    """dp × pp × sp × tp on the default process group (dp = world / (pp × tp × sp)).

    tp_size      tensor-parallel ranks: attention heads and MLP width are split.
    sp_size      row-sequence-parallel ranks: every table's rows are split.
    ep_size      expert-parallel ranks (a factor of dp): each holds 1/ep of every mixture-of-experts
                 layer's experts (the model's plan names them); not with pp_size > 1.
    pp_size      pipeline stages: the model's layers are split into pp_size stages (with dp, tp, sp
                 and zero_stage 0/2/3; precision fp32 or bf16); train with `booster.execute_pipeline`.
    num_microbatches  micro-batches per batch under pp (default pp_size; at least pp_size; a
                 batch's size must be a multiple). Equivalent to gradient accumulation over them.
    stages_per_rank  pipeline stages each pp rank holds: 1 runs `Schedule1F1B`; v > 1 cuts the
                 layers into pp × v stages and runs `ScheduleInterleaved1F1B` (rank r holds stages
                 r, r + pp, ...; num_microbatches must be a multiple of pp).
    zero_stage   0: replicated parameters, gradients all-reduced over dp × sp;
                 2 / 3: FSDP2 over dp × sp (3 reshards parameters after forward).
                 1 (optimizer state sharded alone) is not offered: use 2, which shards gradients too.
    precision    "fp32" | "bf16" | "fp16" | MixedPrecision.
    loss_count   how the boosted criterion weighs ranks' losses under sp > 1: a metrics key
                 giving the items the loss averaged (default "cells"), a function
                 `(output, *inputs) -> count`, or None (equal weights). See RowShardedCriterion.
    bucket_cap_mb  size of the gradient all-reduce buckets (zero_stage 0).
    device       None -> cuda:LOCAL_RANK when the backend is NCCL, else cpu.
    """

    name = "hybrid"

    def __init__(self, tp_size: int = 1, sp_size: int = 1, zero_stage: int = 0,
                 precision: "str | MixedPrecision | None" = None, *, pp_size: int = 1, ep_size: int = 1,
                 num_microbatches: int | None = None, stages_per_rank: int = 1,
                 loss_count: "str | Callable[..., float] | None" = "cells", bucket_cap_mb: float = 25.0,
                 device: "str | torch.device | None" = None) -> None:
        _require_process_group()
        super().__init__(precision)
        world = dist.get_world_size()
        self.tp_size, self.sp_size, self.pp_size, self.zero_stage = _check_layout(
            world, tp_size, sp_size, pp_size, zero_stage)
        self.ep_size = _check_ep(world // (self.tp_size * self.sp_size * self.pp_size), ep_size, self.pp_size)
        self.num_microbatches = _check_microbatches(self.pp_size, num_microbatches)
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1 or (stages_per_rank > 1 and self.pp_size == 1):
            raise ValueError(f"stages_per_rank must be an int >= 1 (> 1 only with pp_size > 1), got {stages_per_rank!r} "
                             f"with pp_size={self.pp_size}")
        self.stages_per_rank = stages_per_rank
        self.dp_size = world // (self.tp_size * self.sp_size * self.pp_size)
        if self.zero_stage and self.dp_size * self.sp_size == 1:
            raise ValueError(f"zero_stage={zero_stage} shards over dp × sp = {self.dp_size} × {self.sp_size} "
                             "= 1 rank: nothing to shard; use zero_stage=0")
        self.loss_count = loss_count
        self.bucket_cap_mb = bucket_cap_mb
        if device is None:
            from ..launch import current
            device = current().device
        self._device = torch.device(device)
        self.mesh = build_mesh(world, dp_shard=self.dp_size // self.ep_size, ep=self.ep_size, tp=self.tp_size,
                               sp=self.sp_size, pp=self.pp_size, device_type=self._device.type)
        self.pp_mesh = sub_mesh(self.mesh, "pp")
        self.tp_mesh = sub_mesh(self.mesh, "tp")
        self.sp_mesh = sub_mesh(self.mesh, "sp")
        self.grad_mesh = sub_mesh(self.mesh, "dp_shard", "ep", "sp")  # ranks holding the same parameters
        self.expert_grad_mesh = sub_mesh(self.mesh, "dp_shard", "sp")  # ... and the same experts (under ep)
        self.rng_mesh = sub_mesh(self.mesh, "sp", "tp")  # ranks computing on the same tables
        self.process_group = None  # checkpoints and fallbacks run over the whole world
        self._param_names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._expert_params: set[int] = set()  # ids of the ep-sharded experts' parameters
        self._fsdp_module: nn.Module | None = None
        self._syncing = True
        self.tp_styles: dict[str, str] = {}
        self._runner: PipelineRunner | None = None
        self._row_seams: tuple[nn.Module, ParallelPlan, list[Any]] | None = None
        self._checkpoint_io = ShardedCheckpointIO(None, fallback=FullStateFSDPReader(self))

    def set_block_options(self, *, activation_checkpointing: bool = False, compile: bool = False) -> None:
        if compile and self.pp_size > 1:
            raise ValueError("compiling the blocks is not offered with pp_size > 1 (the pipeline's stages are "
                             "built and traced by torch.distributed.pipelining); use pp_size=1 or compile=False")
        if compile and self.tp_size > 1:
            raise ValueError("compiling the blocks is not offered with tp_size > 1: inductor fails on the "
                             "tensor-parallel blocks' DTensor graphs (RecursionError, torch 2.13 on CPU); use "
                             "sp_size or data parallelism, or compile=False")
        super().set_block_options(activation_checkpointing=activation_checkpointing, compile=compile)

    # --- topology --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dp_rank(self) -> int:
        return mesh_rank(self.mesh, "dp_shard") * self.ep_size + mesh_rank(self.mesh, "ep")

    @property
    def dp_world_size(self) -> int:
        return self.dp_size

    @property
    def sp_rank(self) -> int:
        return mesh_rank(self.mesh, "sp")

    @property
    def tp_rank(self) -> int:
        return mesh_rank(self.mesh, "tp")

    @property
    def pp_rank(self) -> int:
        return mesh_rank(self.mesh, "pp")

    @property
    def is_main_process(self) -> bool:
        return dist.get_rank() == 0

    def layout(self) -> dict[str, int]:
        return {"world_size": dist.get_world_size(), "dp": self.dp_size, "tp": self.tp_size, "sp": self.sp_size,
                "pp": self.pp_size, "ep": self.ep_size}

    def shard_batch(self, batch: Any) -> Any:
        """This rank's rows of `batch` (the slice the boosted model computes on and its outputs
        refer to: local row r is row r + sp_rank * rows / sp of the batch); `batch` when sp = 1."""
        return shard_rows(batch, self.sp_rank, self.sp_size) if self.sp_size > 1 else batch

    @staticmethod
    def _group(mesh: Any) -> Any:
        return mesh.get_group() if mesh is not None else None

    # --- wrapping --------------------------------------------------------------------------
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any | None]:
        if self.pp_size > 1:
            return self._configure_pipeline(model, optimizer, criterion, dataloader, lr_scheduler)
        plan = plan_of(model, "tensor, expert and row-sequence parallelism"
                       if self.tp_size * self.sp_size * self.ep_size > 1 else None)
        if self.tp_size > 1:  # every check before the first collective
            check_tp_layout(model, plan, self.tp_size)
        experts = resolve_experts(model, plan)
        if experts or self.ep_size > 1:
            check_expert_layout(model, plan, self.ep_size, self.tp_size if plan.expert_tp else 1)
        group_names = _param_names_by_group(model, optimizer) if optimizer is not None else []
        model.to(self.device)
        with torch.no_grad():  # like DDP: rank 0's parameters and buffers are the model
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        done = parallelize(model, plan, tp_mesh=self.tp_mesh if self.tp_size > 1 else None,
                           expert_mesh=self._expert_mesh(plan) if experts else None, sp_group=self._group(self.sp_mesh) if self.sp_size > 1 else None,
                           activation_checkpointing=self.activation_checkpointing, compile=self.compile,
                           fully_shard_kwargs=self._fully_shard_kwargs(model) if self.zero_stage else None)
        self.tp_styles = done.tp_styles
        if self.sp_size > 1:
            self._row_seams = (model, plan, done.row_hooks)
        if self.zero_stage:  # FSDP averages gradients over dp x sp; `backward` scales the loss by sp, so
            self._fsdp_module = model  # they are summed over sp (parts of one batch) and averaged over dp
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._expert_params = {id(p) for name in done.experts for p in model.get_submodule(name).parameters()}
        wrapped_optimizer = None
        if optimizer is not None:
            self._param_names = [n for names in group_names for n in names]
            wrapped_optimizer = self.wrap_optimizer(rebuild_optimizer(model, optimizer, group_names, lr_scheduler))
        sharded = RowShardedModule(model, sp_group=self._group(self.sp_mesh), rng_group=self._group(self.rng_mesh),
                                   device=self.device)
        self._row_module = sharded
        if criterion is not None and self.sp_size > 1:
            criterion = RowShardedCriterion(criterion, sharded, count=self.loss_count)
        return self.wrap_model(model, sharded), wrapped_optimizer, criterion, dataloader, lr_scheduler

    def _expert_mesh(self, plan: ParallelPlan) -> Any:
        """The mesh the experts are split over: "ep" when ep > 1, and "tp" when tp > 1 and the plan
        says how to split an expert's width (None: neither; the experts are ordinary parameters)."""
        dims = tuple(d for d, size in (("ep", self.ep_size), ("tp", self.tp_size if plan.expert_tp else 1)) if size > 1)
        return None if not dims else self.mesh[dims if len(dims) > 1 else dims[0]]

    @contextlib.contextmanager
    def evaluation(self, model: ModelWrapper) -> Iterator[nn.Module]:
        """The model computing whole batches on every rank (for evaluators that call it on their
        own batches): the unwrapped model, or under pp the pipeline run forward-only on whole
        batches. Under sp its row seams (K/V all-gathers, statistics all-reduces) are suspended
        meanwhile, so a full table is not counted sp times; tensor-parallel and FSDP layers stay,
        so every rank must evaluate together."""
        with self._row_seams_suspended():
            yield PipelineEvalModule(self._runner) if self._runner is not None else model.unwrap()

    @contextlib.contextmanager
    def _row_seams_suspended(self) -> Iterator[None]:
        if self._row_seams is None:
            yield
            return
        root, plan, handles = self._row_seams
        for handle in handles:
            handle.remove()
        try:
            yield
        finally:
            self._row_seams = (root, plan, parallelize_rows(root, plan, self._group(self.sp_mesh)))

    def _configure_pipeline(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, criterion: Any,
                            dataloader: Any, lr_scheduler: Any) -> tuple:
        """pp > 1: cut the model into stages (the plan's `pipeline`), keep this rank's, and drive
        them with a `PipelineRunner`. Every check runs before the first collective. The whole
        model is broadcast from rank 0 (every rank builds it); then, in the torchtitan order,
        this rank's stages get tensor parallelism over tp, the model's row seams go over sp, and
        the modules the PipelineStages run are sharded with FSDP2 over dp × sp (ZeRO 2/3). The
        optimizer is rebuilt over the stage's parameters; checkpoints hold each stage's tensors
        under the model's names."""
        plan = plan_of(model, "pipeline stages")
        if plan.pipeline is None:
            raise ValueError(f"pp_size={self.pp_size}: {type(model).__name__}.parallel_plan() declares no pipeline "
                             "(ParallelPlan.pipeline: a tabfm.parallel.plan.PipelinePlan)")
        if self.precision.dtype == "fp16":
            raise ValueError("pp_size > 1 supports precision fp32 and bf16; fp16 loss scaling inside the pipeline "
                             "schedule is not implemented")
        check_pp_layout(plan.pipeline.n_layers, self.pp_size, self.num_microbatches, self.stages_per_rank)
        tp_styles = check_tp_layout(model, plan, self.tp_size) if self.tp_size > 1 else {}
        stages = split_stages(model, plan.pipeline, self.pp_size * self.stages_per_rank)
        group_names = _param_names_by_group(model, optimizer) if optimizer is not None else []
        full_state = model.state_dict()
        key_meta = {k: (v.shape, v.dtype) for k, v in full_state.items()}
        rank_sets = [set().union(*(s.state_dict() for s in local_stages(stages, r, self.pp_size)))
                     for r in range(self.pp_size)]
        stage_keys = [[k for k in full_state if k in keys] for keys in rank_sets]
        model.to(self.device)
        with torch.no_grad():  # like DDP: rank 0's parameters and buffers are the model
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        mine = local_stages(stages, self.pp_rank, self.pp_size)
        for part in mine if tp_styles else ():
            self.tp_styles.update(parallelize_stage_tensor(part, self.tp_mesh, tp_styles))
        if self.sp_size > 1:  # the stages hold the model's own modules: its seams are theirs
            self._row_seams = (model, plan, parallelize_rows(model, plan, self._group(self.sp_mesh)))
        if self.activation_checkpointing:  # after tp and sp, before FSDP (parallelize's order)
            checkpoint_blocks(model, plan)
        stage = merge_modules(mine)  # this rank's part of the model, under the model's names
        rows = RowShardedModule(stage, sp_group=self._group(self.sp_mesh), device=self.device)  # cuts rows
        self._runner = PipelineRunner(mine, plan.pipeline, self.pp_rank, self.pp_size, self._group(self.pp_mesh),
                                      self.device, self.num_microbatches, self.precision, shard_batch=rows.shard,
                                      loss_scale=self.sp_size if self.zero_stage else 1)
        if self.zero_stage:
            for module in self._runner.modules:
                self._fully_shard_stage(module, plan)
        self._params = [p for p in stage.parameters() if p.requires_grad]
        wrapped_optimizer = None
        if optimizer is not None:
            own = {n for n, _ in stage.named_parameters()}
            group_names = [[n for n in names if n in own] for names in group_names]
            self._param_names = [n for names in group_names for n in names]
            wrapped_optimizer = self.wrap_optimizer(rebuild_optimizer(stage, optimizer, group_names, lr_scheduler))
        if criterion is not None and self.sp_size > 1:
            criterion = RowShardedCriterion(criterion, rows, count=self.loss_count)
        self._checkpoint_io = PipelineCheckpointIO(stage_keys, key_meta, self.pp_rank, self._group(self.pp_mesh),
                                                   self.device, fallback=FullStateFSDPReader(self))
        return (self.wrap_model(stage, PipelineOnlyModule(stage)), wrapped_optimizer, criterion, dataloader,
                lr_scheduler)

    def execute_pipeline(self, data_iter: Iterator[Any], model: ModelWrapper, criterion: Callable,
                         optimizer: OptimizerWrapper | None = None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict[str, Any]:
        """Forward + backward of the next batch of `data_iter` through the pipeline, as gradient
        accumulation over `num_microbatches` equal micro-batches; then, outside `no_sync`, the
        gradient all-reduce over dp. `optimizer.step()` stays the caller's. Returns "loss" (the
        mean micro-batch loss, on every rank) when `return_loss`, "metrics" (the criterion's,
        averaged over micro-batches), and "outputs" (last stage only; under sp they refer to this
        rank's rows, as `shard_batch` gives them) when `return_outputs`."""
        if self._runner is None:
            raise RuntimeError(f"execute_pipeline needs pp_size > 1 and a boosted model (pp_size={self.pp_size}); "
                               "with pp_size=1 call the model and booster.backward() directly")
        if not isinstance(model, ModelWrapper) or not isinstance(model.module, PipelineOnlyModule):
            raise ValueError("execute_pipeline: pass the model booster.boost() returned")
        if self.rng_mesh is not None and model.training:  # tp / sp peers draw the same identities
            sync_rng_state(self._group(self.rng_mesh), self.device)
        result = self._runner.run(next(data_iter), criterion, return_outputs=return_outputs)
        if self._syncing and not self.zero_stage:  # FSDP2 stages reduced theirs in the schedule
            self._all_reduce_grads()
        if not return_loss:
            result["loss"] = None
        return result

    def _fully_shard_stage(self, module: nn.Module, plan: ParallelPlan) -> None:
        """FSDP2 over dp × sp on one module a PipelineStage runs: the planned blocks it holds,
        then the module itself as the root (torch's stage recognises an FSDP root: it keeps
        gradients unreduced across micro-batches and reduce-scatters them after the last one).
        The pipeline runner scales the loss by sp, as `backward` does without stages."""
        from torch.distributed.fsdp import fully_shard

        kwargs = self._fully_shard_kwargs(module)
        for name in plan.blocks:
            block = _find_submodule(module.stage, name)
            if block is not None:
                fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)

    def _fully_shard_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """fully_shard's arguments: the dp × sp mesh, resharding after forward under ZeRO-3 only,
        the compute dtype as parameter dtype with fp32 reductions, empty parameters ignored."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"mesh": self.grad_mesh, "reshard_after_forward": self.zero_stage == 3}
        compute = self.precision.torch_dtype
        if compute is not None:
            # inputs stay as given: a table's values must not be rounded to the compute dtype
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                                       cast_forward_inputs=False)
        empty = {p for p in model.parameters() if p.numel() == 0}
        if empty:
            kwargs["ignored_params"] = empty
        return kwargs

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerWrapper:
        return OptimizerWrapper(optimizer, scaler=self.precision.make_scaler(), grad_norm_fn=self.grad_norm,
                                found_inf_fn=self._found_inf_anywhere)

    # --- gradients -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """loss.backward() (scaled under fp16), then, outside `no_sync`, the gradient reduction
        over dp × sp (FSDP2 does its own inside backward, for all but ep-sharded experts)."""
        if self.zero_stage and self.sp_size > 1:
            loss = loss * self.sp_size  # FSDP averages over dp × sp; sp ranks' gradients must add up
        optimizer.backward(loss)
        if self._syncing:
            self._all_reduce_grads()

    def _all_reduce_grads(self) -> None:
        """Sum gradients over the ranks holding the same parameters and divide by dp, in buckets:
        everything but the experts over dp × sp (unless FSDP2 did), ep-sharded experts over the
        dp × sp ranks holding the same experts (an expert's gradient already sums its ep peers'
        tokens; under ZeRO with sp the loss was scaled by sp, so they divide by dp × sp)."""
        with torch.no_grad():
            if not self.zero_stage:
                dense = [p for p in self._params if id(p) not in self._expert_params]
                self._all_reduce_grads_in(self._group(self.grad_mesh), dense, self.dp_size)
            experts = [p for p in self._params if id(p) in self._expert_params]
            if experts:
                divisor = self.dp_size * (self.sp_size if self.zero_stage else 1)
                self._all_reduce_grads_in(self._group(self.expert_grad_mesh), experts, divisor)

    def _all_reduce_grads_in(self, group: Any, params: list[nn.Parameter], divisor: int) -> None:
        """Sum `params`' gradients over `group` (None: this rank alone), divide by `divisor`. A
        parameter without a gradient on some rank counts as zero there; one without any stays None."""
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        if group is not None:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
        grads = []
        for p, anywhere in zip(params, has.tolist()):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_shard(p.grad))
        if group is None:
            for g in grads if divisor > 1 else ():
                g.div_(divisor)
            return
        for bucket in _buckets(grads, int(self.bucket_cap_mb * 2**20)):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if divisor > 1:
                flat.div_(divisor)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without reducing them; the first
        backward outside reduces the accumulated sum."""
        if self.zero_stage and self._runner is not None:
            raise RuntimeError("no_sync() under pp_size > 1 with zero_stage 2/3 is not supported: torch's "
                               "PipelineStage reduce-scatters FSDP gradients at the end of every "
                               "execute_pipeline call. Accumulate by calling execute_pipeline repeatedly without "
                               "no_sync (the sharded gradients add up), or raise num_microbatches")
        if self.zero_stage:
            if self._fsdp_module is None:
                raise RuntimeError("no_sync() before boost(): there is no FSDP module yet")
            self._fsdp_module.set_requires_gradient_sync(False)
            self._syncing = False  # the experts, outside FSDP
            try:
                yield
            finally:
                self._fsdp_module.set_requires_gradient_sync(True)
                self._syncing = True
            return
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The global norm: over meshes (`hybrid_grad_norm`), then over pipeline stages."""
        norm = hybrid_grad_norm(grads, norm_type)
        if self.pp_size > 1:
            norm = pipeline_grad_norm(norm.to(self.device), norm_type, self._group(self.pp_mesh))
        return norm

    def clip_grad_norm_(self, optimizer: OptimizerWrapper, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip to the global norm, scaling each mesh's gradients in its own foreach call."""
        params = optimizer._params_with_grad()
        norm = optimizer._unscale_and_norm(params, norm_type)  # fp16: unscale once, agree on overflow
        if optimizer._found_inf:  # the step will be skipped; leave the gradients alone
            return norm
        for group in _by_mesh(params, lambda p: p.grad).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def _found_inf_anywhere(self, found: torch.Tensor) -> torch.Tensor:
        """fp16: all ranks skip a step if any rank's gradient (shard) overflowed."""
        flag = found.to(self.device, torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def __repr__(self) -> str:
        return (f"HybridParallelPlugin(dp={self.dp_size}, ep={self.ep_size}, pp={self.pp_size}, sp={self.sp_size}, "
                f"tp={self.tp_size}, "
                f"zero_stage={self.zero_stage}, device={self.device}, precision={self.precision.dtype!r})")


def _check_layout(world: int, tp: int, sp: int, pp: int, zero_stage: int) -> tuple[int, int, int, int]:
    """Validate sizes against the world size (no communication); errors give the numbers.
    Returns (tp, sp, pp, zero_stage)."""
    for name, size in (("tp_size", tp), ("sp_size", sp), ("pp_size", pp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    if zero_stage == 1:
        raise ValueError("zero_stage must be 0 (replicated), 2 or 3 (FSDP2 over dp × sp), got 1: sharding the "
                         "optimizer state alone is LowLevelZeroPlugin(stage=1), which runs no tensor or "
                         "row-sequence parallelism; here use zero_stage=2 (gradients and optimizer state sharded)")
    if zero_stage not in (0, 2, 3):
        raise ValueError(f"zero_stage must be 0 (replicated), 2 or 3 (FSDP2 over dp × sp), got {zero_stage!r}")
    if world % (tp * sp * pp):
        raise ValueError(f"world size {world} is not divisible by tp × sp × pp = {tp} × {sp} × {pp} = {tp * sp * pp} "
                         f"(dp = world / (tp × sp × pp) must be a whole number)")
    return tp, sp, pp, zero_stage


def _check_ep(dp: int, ep: int, pp: int) -> int:
    """Expert-parallel ranks: a factor of the data-parallel ranks; not with pipeline stages."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep_size must be an int >= 1, got {ep!r}")
    if dp % ep:
        raise ValueError(f"ep_size={ep} must divide the data-parallel ranks dp = world / (tp × sp × pp) = {dp}: "
                         "expert-parallel ranks are data-parallel ranks that hold different experts")
    if ep > 1 and pp > 1:
        raise ValueError(f"ep_size={ep} with pp_size={pp}: a model with experts declares no pipeline stages")
    return ep


def _check_microbatches(pp: int, num_microbatches: int | None) -> int:
    """Micro-batches per batch under pp (default pp); 1 without pipeline stages."""
    if num_microbatches is None:
        return pp
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if pp == 1 and num_microbatches != 1:
        raise ValueError(f"num_microbatches={num_microbatches} applies to pipeline stages (pp_size > 1); with "
                         "pp_size=1 accumulate gradients with booster.no_sync instead")
    if num_microbatches < pp:
        raise ValueError(f"the 1F1B schedule needs at least one micro-batch per stage: num_microbatches="
                         f"{num_microbatches} < pp_size={pp}")
    return num_microbatches


def parallelize_stage_tensor(stage: nn.Module, tp_mesh: Any, styles: dict[str, str]) -> dict[str, str]:
    """Tensor parallelism on one pipeline stage: the layers of `styles` (resolved and checked on
    the whole model by `check_tp_layout`) that the stage holds, under the same names (a stage
    keeps the model's), become DTensor colwise / rowwise shards over `tp_mesh`. Their inputs and
    outputs stay plain tensors, so the activations the stages exchange are whole. Returns the
    styles applied."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    held = {name: style for name, style in styles.items() if _find_submodule(stage, name) is not None}
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if held:
        parallelize_module(stage, tp_mesh, {name: make[style]() for name, style in held.items()})
    return held


def _find_submodule(module: nn.Module, name: str) -> nn.Module | None:
    """`module.get_submodule(name)`, or None when it does not hold one by that name."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most `cap_bytes` (one tensor
    may exceed it alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > cap_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket
