"""The private torch names the engine relies on, in one place, each with why no public one does.

Everything else in `tabfm.parallel` uses torch's public API. A torch upgrade that renames or
changes one of these fails tests/test_torch_internals.py, which checks each against its public
equivalent where one exists, loudly and here, rather than deep inside a training step.
"""
from __future__ import annotations

import torch

__all__ = ["adam_init_group", "checkpoint_module", "dtensor_storage", "foreach_unscale_", "fsdp_lazy_init",
           "mark_optimizer_stepped", "queue_backward_callback", "rebind_scheduler", "step_hooks_registered",
           "sync_zero_param_groups"]


def foreach_unscale_(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply `tensors` (plain tensors of one device) by `inv_scale` in place and set `found_inf`
    (one float32 element) to 1.0 if any element is inf or NaN.

    Private: torch.amp.GradScaler's fused kernel (`torch._amp_foreach_non_finite_check_and_unscale_`)
    has no public form for a list of tensors; our loss scaler unscales the local shards of DTensor
    gradients and agrees on overflow across ranks (parallel.precision), which GradScaler does not.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def dtensor_storage(t: torch.Tensor) -> torch.Tensor:
    """The local tensor a DTensor holds, itself rather than a view of it.

    Private: the public `DTensor.to_local()` returns a new autograd view on every call, while a
    sharded optimizer step (parallel.plugins.zero) keeps this rank's shard as its state and must
    update the very tensor the DTensor holds, under a stable identity.
    """
    return t._local_tensor  # type: ignore[attr-defined]


def queue_backward_callback(fn) -> None:
    """Run `fn()` once the backward pass now running has finished (call it from a backward hook).

    Private: autograd's engine (`torch.autograd.Variable._execution_engine.queue_callback`) is the
    only way to act after the last gradient of a backward lands, whichever module produced it;
    Gemini (parallel.gemini.hooks) moves the finished gradients off the device there, as FSDP does.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def step_hooks_registered(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` would run step pre/post hooks, the optimizer's own or global ones.

    Private: torch keeps them in dicts (`_optimizer_step_pre_hooks`, ...) with no public query; the
    local-shard Adam step (parallel.plugins.zero) must fall back to `optimizer.step()` when any exist.
    """
    from torch.optim import optimizer as optim_module

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks)


def adam_init_group(optimizer: torch.optim.Optimizer, group: dict, params: list, grads: list, exp_avgs: list,
                    exp_avg_sqs: list, max_exp_avg_sqs: list, steps: list) -> bool:
    """torch Adam/AdamW's own bookkeeping for one param group before its update: fills the lists with
    the group's parameters that have gradients, their gradients and state (created lazily, like
    the parameters: DTensors for DTensor parameters); returns whether any is complex.

    Private: `Adam._init_group`. The local-shard step (parallel.plugins.zero) runs torch's public
    functional `adam` on local shards and needs exactly the state `optimizer.step()` would create,
    so that `state_dict()`, checkpoints and resharding see the optimizer's own tensors.
    """
    return optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)


def sync_zero_param_groups(zero: "torch.distributed.optim.ZeroRedundancyOptimizer") -> None:
    """Copy ZeroRedundancyOptimizer's global param-group hyperparameters to its local optimizer now.

    Private: `ZeroRedundancyOptimizer._sync_param_groups`; ZeRO copies them only at its next step,
    and a ZeRO optimizer built from a user's optimizer (parallel.plugins.zero) must carry that
    optimizer's per-group settings (and a scheduler's `initial_lr`) from the start.
    """
    zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)


def checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Recompute `module`'s activations in backward instead of keeping them, in place.

    Private: torch's composable activation checkpointing (`torch.distributed._composable.checkpoint`,
    the sibling of `fully_shard` and `replicate`) keeps the module tree and parameter names as they
    are, so checkpoints, optimizer state and tensor-parallel plans of runs with and without it name
    the same tensors. Its public alternatives either rename every parameter (`checkpoint_wrapper`,
    itself in a private module) or must be called inside the model's forward
    (`torch.utils.checkpoint.checkpoint`), which would put engine code into the model.
    """
    from torch.distributed._composable import checkpoint

    return checkpoint(module)


def fsdp_lazy_init(root: torch.nn.Module) -> None:
    """Set up a `fully_shard`-ed model as the root of its FSDP units, as its first forward would.

    Private: FSDP2 does this only in the root's first forward (`FSDPState._lazy_init`), and code
    that first calls an inner unit directly (the estimators' cached-context inference calls the
    blocks, not the model's forward) would make that unit a root of its own, after which the
    model's forward refuses to run. No public call does it; idempotent.
    """
    root._get_fsdp_state()._lazy_init()  # type: ignore[attr-defined]


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell an lr scheduler driving `optimizer` that a step ran, when the step ran elsewhere.

    Private: torch's schedulers wrap `optimizer.step` to set `optimizer._opt_called` and warn
    ("lr_scheduler.step() before optimizer.step()") when it is unset; Gemini's chunks step the
    parameters instead of the inner optimizer (parallel.gemini.optim).
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


def rebind_scheduler(scheduler: "torch.optim.lr_scheduler.LRScheduler", optimizer: torch.optim.Optimizer) -> None:
    """Make `scheduler` drive `optimizer` (a rebuilt copy of the one it was made on), as if made on it.

    Private: a scheduler wraps its optimizer's `step` at construction (marked
    `_wrapped_by_lr_sched`, setting `_opt_called`) and warns "optimizer.step() has been overridden"
    at its first step when the optimizer it drives lacks that wrapper. Plugins that rebuild the
    optimizer around shards (parallel.plugins.zero) hand the scheduler the new one; no public call
    re-attaches a scheduler, and building a new one would lose the user's scheduler object.
    """
    import functools

    scheduler.optimizer = optimizer
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        mark_optimizer_stepped(optimizer)
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
