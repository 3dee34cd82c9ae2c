"""The private torch names of tabfm.parallel.torch_internals still do what the engine needs.

Each is checked against a reference computed with public torch; a torch upgrade that breaks one
fails here, by name. A house-rule test checks no other engine module names a private torch API.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tabfm.parallel.torch_internals import (adam_init_group, checkpoint_module, dtensor_storage, foreach_unscale_,
                                            mark_optimizer_stepped, queue_backward_callback, rebind_scheduler,
                                            step_hooks_registered, sync_zero_param_groups)

from .dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def test_foreach_unscale_multiplies_in_place_and_flags_non_finite():
    a, b = torch.tensor([2.0, -4.0]), torch.tensor([8.0])
    found, inv = torch.zeros(1), torch.full((1,), 0.25)
    foreach_unscale_([a, b], found, inv)
    assert a.tolist() == [0.5, -1.0] and b.tolist() == [2.0] and found.item() == 0.0
    for bad in (float("inf"), float("nan")):
        found = torch.zeros(1)
        foreach_unscale_([torch.tensor([1.0, bad])], found, inv)
        assert found.item() == 1.0


def test_queue_backward_callback_runs_once_after_the_last_gradient():
    w1, w2 = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    seen = []

    def hook(grad):
        if not seen:
            queue_backward_callback(lambda: seen.append((w1.grad is not None, w2.grad is not None)))
        seen.append("hook")
        return grad

    y = (w1 * 2.0)
    y.register_hook(hook)
    (y * w2).sum().backward()
    assert seen[-1] == (True, True) and seen.count("hook") == 1  # after both leaves got their gradients


def test_step_hooks_registered_sees_own_and_global_hooks():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not step_hooks_registered(opt)
    handle = opt.register_step_pre_hook(lambda o, a, k: None)
    assert step_hooks_registered(opt)
    handle.remove()
    assert not step_hooks_registered(opt)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda o, a, k: None)
    try:
        assert step_hooks_registered(opt)
    finally:
        handle.remove()
    assert not step_hooks_registered(opt)


def test_adam_init_group_gives_the_state_step_creates():
    from torch.optim.adam import adam

    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(4, 3))
    mine = torch.nn.Parameter(ref.detach().clone())
    grad = torch.randn(4, 3)
    for p in (ref, mine):
        p.grad = grad.clone()
    ref_opt, opt = (torch.optim.AdamW([p], lr=0.1, weight_decay=0.01) for p in (ref, mine))
    ref_opt.step()
    group = opt.param_groups[0]
    lists: list[list] = [[] for _ in range(6)]
    with torch.no_grad():
        has_complex = adam_init_group(opt, group, *lists)
        params, grads, m, v, vmax, steps = lists
        assert params == [mine] and not has_complex and set(opt.state[mine]) >= {"exp_avg", "exp_avg_sq", "step"}
        beta1, beta2 = group["betas"]
        adam(params, grads, m, v, vmax, steps, amsgrad=False, has_complex=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
             foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
             grad_scale=None, found_inf=None, decoupled_weight_decay=group["decoupled_weight_decay"])
    assert torch.equal(mine, ref)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[mine][key], ref_opt.state[ref][key]), key


def _zero_worker(rank: int, world: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer([torch.nn.Parameter(torch.ones(4))], optimizer_class=torch.optim.AdamW, lr=1e-3)
    zero.param_groups[0]["lr"] = 0.5
    zero.param_groups[0]["initial_lr"] = 0.5
    sync_zero_param_groups(zero)
    return {"lr": zero.optim.param_groups[0]["lr"], "initial_lr": zero.optim.param_groups[0].get("initial_lr")}


@pytest.mark.slow
def test_sync_zero_param_groups_reaches_the_local_optimizer():
    for r in run_distributed(_zero_worker, world_size=2, timeout_s=120):
        assert r == {"lr": 0.5, "initial_lr": 0.5}


def _storage_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    local = dtensor_storage(dt)
    same_twice = local is dtensor_storage(dt)
    equal_public = torch.equal(local, dt.to_local())
    local.add_(100.0)  # an update of the storage is the DTensor's
    return {"same": same_twice, "equal": equal_public, "full": dt.full_tensor()}


@pytest.mark.slow
def test_dtensor_storage_is_the_local_shard_itself():
    results = run_distributed(_storage_worker, world_size=2, timeout_s=120)
    for r in results:
        assert r["same"] and r["equal"]
        assert r["full"].tolist() == (torch.arange(8.0) + 100.0).tolist()


def _lazy_init_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tabfm.parallel.torch_internals import fsdp_lazy_init

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4)
    fsdp_lazy_init(model)
    fsdp_lazy_init(model)  # idempotent
    model.unshard()
    inner = model[1](model[0](x))  # an inner unit called directly, then the model's forward still runs
    model.reshard()
    return {"inner": inner.detach(), "full": model(x).detach()}


def test_fsdp_lazy_init_lets_inner_units_run_before_the_roots_forward():
    """Without it, calling model[1] first makes it an FSDP root, and model(x) then raises."""
    for r in run_distributed(_lazy_init_worker, world_size=2, timeout_s=120):
        torch.testing.assert_close(r["inner"], r["full"])


def _scheduler_and_rebuilt():
    w = torch.nn.Parameter(torch.ones(2))
    old = torch.optim.AdamW([w], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(old, lambda s: 0.5 ** s)
    new = torch.optim.AdamW([{**old.param_groups[0], "params": [w]}])
    w.grad = torch.ones(2)
    return sched, new


def test_rebind_scheduler_drives_the_rebuilt_optimizer_without_torch_warning():
    """A rebuilt optimizer handed to the scheduler raw makes torch warn at the first step (the
    check this helper answers); rebound, the scheduler steps it silently and sets its lr."""
    import warnings

    sched, new = _scheduler_and_rebuilt()
    sched.optimizer = new
    new.step()
    with pytest.warns(UserWarning, match="overridden"):
        sched.step()
    sched, new = _scheduler_and_rebuilt()
    rebind_scheduler(sched, new)
    rebind_scheduler(sched, new)  # idempotent: one wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new.step()
        sched.step()
        sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.25)


def test_mark_optimizer_stepped_silences_the_step_order_warning():
    """A step that ran outside optimizer.step() (Gemini's chunks), marked, counts for the scheduler."""
    import warnings

    sched, _ = _scheduler_and_rebuilt()
    with pytest.warns(UserWarning, match="before"):
        sched.step()
    sched, _ = _scheduler_and_rebuilt()
    mark_optimizer_stepped(sched.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()


# torch.<...>._private, and the private torch attributes the engine once used on torch objects
PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._[a-z]\w*|\.(?:_local_tensor|_buffers|_parameters|_modules|_init_group|"
                     r"_sync_param_groups|_optimizer_step_\w+|_global_optimizer_\w+|_execution_engine|_opt_called|_wrapped_by_lr_sched)\b")


def test_checkpoint_module_recomputes_in_place_like_torch_utils_checkpoint():
    """Same gradients as the public torch.utils.checkpoint.checkpoint, the module's names and
    state-dict keys unchanged, and the forward run again in backward."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))

    x = torch.randn(5, 4)
    ref = net()
    torch.utils.checkpoint.checkpoint(ref, x, use_reentrant=False).square().sum().backward()
    mod = net()
    names, keys = [n for n, _ in mod.named_parameters()], list(mod.state_dict())
    calls = []
    mod[0].register_forward_hook(lambda m, a, o: calls.append(1))
    assert checkpoint_module(mod) is mod
    mod(x).square().sum().backward()
    assert [n for n, _ in mod.named_parameters()] == names and list(mod.state_dict()) == keys
    assert len(calls) == 2
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_no_other_engine_or_model_module_names_a_private_torch_api():
    offenders = []
    for folder in ("parallel", "tabfm", "data", "synth", "eval"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "torch_internals.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if PRIVATE.search(code):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "private torch names outside parallel/torch_internals.py:\n" + "\n".join(offenders)
