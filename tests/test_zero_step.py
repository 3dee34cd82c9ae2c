"""ZeRO-2 / FSDP speed paths, each against an independent reference.

- `adam_step_on_local_shards` (torch's functional Adam over the local shards) against the
  optimizer's own `step()` over the DTensor parameters: bitwise equal parameters and state,
  over AdamW and Adam, several param groups (amsgrad in one), a scheduler changing lr, and
  through the booster with fp16 loss scaling and clipping. Both paths run the same torch
  kernels on the same numbers in the same order, so the tolerance is zero.
- `RingAllGather` / `RingReduceScatter` against gloo's own collectives: the all-gather and the
  2-rank reduce-scatter bitwise; at 3 ranks the reduce-scatter adds in another order than
  gloo, so within 1e-6 (and tests/test_fsdp.py's 4-rank run matches a single process to 1e-5).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 3))


def _groups(model: nn.Module, kind: str) -> list[dict]:
    """Two param groups with their own hyperparameters (amsgrad in the second)."""
    params = list(model.parameters())
    return [{"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
            {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0 if kind == "adam" else 0.05, "amsgrad": True}]


def _make_opt(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(_groups(model, kind), betas=(0.8, 0.95), eps=1e-7)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [_local(v).clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _train_pair(rank: int, world: int, kind: str) -> dict:
    """The same FSDP2 model twice: one optimizer steps itself (DTensor), one through the
    local-shard step; a StepLR changes both optimizers' lr after every second step."""
    from torch.distributed.fsdp import fully_shard

    from tabfm.parallel.plugins.zero import adam_step_on_local_shards

    models = [copy.deepcopy(_net()) for _ in range(2)]
    for m in models:
        fully_shard(m, reshard_after_forward=False)
    opts = [_make_opt(m, kind) for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    steppers = [lambda o: o.step(), adam_step_on_local_shards]
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(7, 6, generator=g)
        for m, o, s, step in zip(models, opts, scheds, steppers):
            o.zero_grad()
            m(x).square().mean().backward()
            step(o)
            s.step()
    params = [[_local(p).clone() for p in m.parameters()] for m in models]
    return {"params": params, "state": [_state(o) for o in opts],
            "steps": [[float(s["step"]) for s in o.state.values()] for o in opts],
            "state_is_dtensor": all(hasattr(v, "to_local") for s in opts[1].state.values()
                                    for k, v in s.items() if k != "step"),
            "lr": [o.param_groups[0]["lr"] for o in opts]}


def _booster_fp16(rank: int, world: int) -> dict:
    """LowLevelZeroPlugin(stage=2, fp16) with AdamW, clipping and a scheduler: the booster's
    local-shard step against the same run with the optimizer's own DTensor step."""
    from tabfm.parallel import Booster, LowLevelZeroPlugin
    from tabfm.parallel.plugins.zero import RingAllGather, RingReduceScatter, adam_step_on_local_shards

    out = {}
    for name in ("local", "dtensor"):
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp16"))
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
        out[f"{name}_step_fn"] = getattr(opt.step_fn, "__name__", None)
        fsdp = model.unwrap()
        out["comms"] = [type(fsdp._get_fsdp_state()._fsdp_param_group._all_gather_comm).__name__,
                        type(fsdp._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__]
        if name == "dtensor":
            opt.step_fn = None  # the reference: AdamW.step over the DTensor shards
        g = torch.Generator().manual_seed(10 + rank)
        opt.scaler.scale = 2.0 ** 8
        norms, skipped = [], []
        for i in range(6):
            x = torch.randn(8, 6, generator=g) * (1e4 if i == 2 else 1.0)  # step 2 overflows in fp16
            opt.zero_grad()
            booster.backward(model(x).float().square().mean(), opt)
            norms.append(float(booster.clip_grad_norm_(opt, 0.5)))
            opt.step()
            sched.step()
            skipped.append(opt.last_step_skipped)
        out[name] = {"params": [_local(p).clone() for p in model.unwrap().parameters()],
                     "state": _state(opt.unwrap()), "norms": norms, "skipped": skipped}
    assert out["comms"] == [RingAllGather.__name__, RingReduceScatter.__name__]
    assert out["local_step_fn"] == adam_step_on_local_shards.__name__
    return out


def _collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tabfm.parallel.plugins.zero import RingAllGather, RingReduceScatter

    g = torch.Generator().manual_seed(rank)
    n = 5 * world
    inp = torch.randn(world * n, generator=g) * (rank + 1)
    out = {}
    for op in ("SUM", "AVG"):
        theirs, mine = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_single(theirs, inp.clone(), op=getattr(dist.ReduceOp, op))
        RingReduceScatter()(mine, inp.clone(), dist.group.WORLD, getattr(dist.ReduceOp, op))
        out[f"rs_{op}"] = (theirs, mine)
    shard = inp[:n].clone()
    theirs, mine = torch.empty(world * n), torch.empty(world * n)
    dist.all_gather_single(theirs, shard)
    RingAllGather()(mine, shard, dist.group.WORLD)
    out["ag"] = (theirs, mine)
    with pytest.raises(NotImplementedError):
        RingReduceScatter()(torch.empty(n), inp.clone(), dist.group.WORLD, dist.ReduceOp.MAX)
    return out


def _layout_check(rank: int, world: int) -> str:
    """A gradient laid out unlike its parameter (here Replicate for a Shard(0) parameter) must
    raise: the elementwise update over local tensors would be wrong."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate

    from tabfm.parallel.plugins.zero import adam_step_on_local_shards

    model = _net()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    p = next(model.parameters())
    p.grad = p.detach().redistribute(p.device_mesh, [Replicate()])
    try:
        adam_step_on_local_shards(opt)
    except RuntimeError as e:
        return str(e)
    return ""


def _workers(rank: int, world: int) -> dict:
    out = {"collectives": _collectives(rank, world)}
    if world == 2:
        out.update(adamw=_train_pair(rank, world, "adamw"), adam=_train_pair(rank, world, "adam"),
                   booster=_booster_fp16(rank, world), layout=_layout_check(rank, world))
    return out


@pytest.fixture(scope="module")
def results_2():
    return run_distributed(_workers, world_size=2, timeout_s=240)


@pytest.fixture(scope="module")
def results_3():
    return run_distributed(_workers, world_size=3, timeout_s=240)


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_local_shard_step_equals_dtensor_step(results_2, kind):
    for r in results_2:
        res = r[kind]
        _assert_equal(*res["params"])
        _assert_equal(*res["state"])  # exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad group) and step
        assert res["steps"][0] == res["steps"][1] == [5.0] * len(res["steps"][0])
        assert res["state_is_dtensor"]  # the optimizer's state stays DTensors (checkpointable as before)
        assert res["lr"][0] == res["lr"][1] == pytest.approx(1e-2 * 0.25)  # the scheduler drove both


@pytest.mark.slow
def test_booster_zero2_fp16_local_step_equals_dtensor_step(results_2):
    for r in results_2:
        local, ref = r["booster"]["local"], r["booster"]["dtensor"]
        assert local["skipped"] == ref["skipped"] and local["skipped"][2] and not any(local["skipped"][3:])
        assert local["norms"][:2] + local["norms"][3:] == ref["norms"][:2] + ref["norms"][3:]  # [2]: inf/nan
        _assert_equal(local["params"], ref["params"])
        _assert_equal(local["state"], ref["state"])


@pytest.mark.slow
def test_local_shard_step_refuses_gradients_laid_out_unlike_the_parameter(results_2):
    for r in results_2:
        assert "must be laid out like the parameter" in r["layout"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ring_collectives_equal_gloo(results_2, results_3, world):
    for r in (results_2 if world == 2 else results_3):
        for name, (theirs, mine) in r["collectives"].items():
            if world == 2 or name == "ag":  # two addends (or none): no order to differ in
                assert torch.equal(theirs, mine), name
            else:  # three addends, summed in another order than gloo's: rounding-level gaps
                torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6, msg=name)


def test_local_shard_step_on_plain_tensors_and_with_hooks():
    """Without DTensors the local step is AdamW.step itself (bitwise); with a step hook it
    defers to optimizer.step(), which runs the hook."""
    from tabfm.parallel.plugins.zero import adam_step_on_local_shards, local_shard_step_supported

    a, b = _net(), _net()
    oa, ob = _make_opt(a, "adamw"), _make_opt(b, "adamw")
    calls = []
    for i in range(3):
        if i == 2:
            ob.register_step_pre_hook(lambda *args: calls.append(1))
        x = torch.randn(4, 6)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().mean().backward()
        oa.step()
        adam_step_on_local_shards(ob)
    _assert_equal([p.detach() for p in a.parameters()], [p.detach() for p in b.parameters()])
    assert calls == [1]
    assert local_shard_step_supported(oa)
    assert not local_shard_step_supported(torch.optim.SGD(a.parameters(), lr=0.1))
    assert not local_shard_step_supported(torch.optim.AdamW(a.parameters(), differentiable=True))
