"""Auto placement: a warm-up step records the chunk schedule and the activation bytes; after it
the device budget (minus those bytes) is a cache with farthest-next-use eviction and prefetch.
Training equals the no-offload single-process reference, the budget holds, and the eviction
rule is optimal on recorded schedules (checked against a brute-force search)."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from parallel import Booster, DeviceBudgetError, GeminiPlugin
from parallel.gemini import AutoPolicy, LRUPolicy
from parallel.gemini.placement import belady_fetches
from tests.test_gemini import TOL, make_model, make_opt, reference, train

CHUNK = 2048


def auto(budget=None, **kw):
    plugin = GeminiPlugin(placement="auto", device_budget_bytes=budget, chunk_size=CHUNK, **kw)
    booster = Booster(plugin)
    m = make_model()
    model, opt, *_ = booster.boost(m, make_opt(m))
    return plugin, booster, m, model, opt


def landing_bytes(plugin) -> int:
    """The most gradient bytes one module's backward hands over (reserved while it runs)."""
    return plugin.estimate(plugin.module.module, plugin.optimizer.optim, manager=plugin.manager)["grad_landing_bytes"]


def measured_non_model_bytes(**kw) -> int:
    plugin, booster, m, model, opt = auto(**kw)
    train(booster, model, opt, 1)
    rep = plugin.memory_report()
    plugin.close()
    return rep["non_model_bytes"]


@pytest.mark.parametrize("cfg", [dict(), dict(offload_optim_frac=0.5, disk_optim_frac=0.5)], ids=["optim_device", "optim_host_disk"])
def test_auto_matches_reference_within_budget(cfg):
    non_model = measured_non_model_bytes(**cfg)
    assert non_model > 48 * 32 * 4  # at least one saved (48, 32) fp32 activation
    probe, *_ = auto(**cfg)
    resident = probe.manager.resident_bytes_needed()
    n_chunks = len(probe.manager.chunks)
    landing = landing_bytes(probe)
    probe.close()
    budget = resident + non_model + 3 * CHUNK * 4 + landing  # three chunks at once + one module's fresh grads
    ref_losses, ref_norms, ref_state = reference(steps=5)
    plugin, booster, m, model, opt = auto(budget=budget, **cfg)
    try:
        losses, norms = train(booster, model, opt, 5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, ref_state[k], **TOL)
        rep = plugin.memory_report()
        assert rep["policy"] == "auto" and set(rep["param_tiers"]) == {"host"} and n_chunks >= 4
        assert rep["non_model_bytes"] == non_model
        assert rep["device_peak_bytes"] <= budget
        assert rep["device_resident_bytes"] == resident + non_model  # the activations stay reserved
        assert rep["evictions"] > 0  # the cache was really too small for the model
        assert rep["prefetches"] > 0 and rep["prefetch_hits"] > 0  # fetched ahead, then used
    finally:
        plugin.close()


def test_auto_refuses_a_budget_without_room_for_the_activations():
    probe, *_ = auto()
    resident = probe.manager.resident_bytes_needed()
    landing = landing_bytes(probe)
    probe.close()
    plugin, booster, m, model, opt = auto(budget=resident + 2 * CHUNK * 4 + landing)  # fits chunks, not activations
    try:
        with pytest.raises(DeviceBudgetError, match="non-model memory"):
            train(booster, model, opt, 1)
    finally:
        plugin.close()


def simulate(policy, trace: list[int], capacity: int, warmup: list[int] | None = None) -> int:
    """Fetch count of a cache of `capacity` chunks serving `trace` with `policy`'s victims."""
    if warmup is not None:
        for c in warmup:
            policy.on_acquire(c)
        policy.end_warmup()
    cached: "OrderedDict[int, None]" = OrderedDict()
    fetches = 0
    for c in trace:
        if c in cached:
            cached.move_to_end(c)
        else:
            if len(cached) == capacity:
                del cached[policy.victim(cached)]
            cached[c] = None
            fetches += 1
        policy.on_acquire(c)
    return fetches


@pytest.mark.parametrize("seed", range(6))
def test_farthest_next_use_is_optimal_on_the_recorded_schedule(seed):
    rng = random.Random(seed)
    trace = [rng.randrange(5) for _ in range(14)]
    for capacity in (1, 2, 3):
        best = belady_fetches(trace, capacity)
        assert simulate(AutoPolicy(), trace, capacity, warmup=trace) == best
        assert simulate(LRUPolicy(), trace, capacity) >= best


def test_forward_backward_schedule_prefetches_the_next_chunk():
    policy = AutoPolicy(prefetch_depth=2)
    schedule = [0, 1, 2, 3, 3, 2, 1, 0]  # forward, then backward in reverse
    for c in schedule:
        policy.on_acquire(c)
    policy.end_warmup()
    policy.on_acquire(0)
    assert policy.prefetch(lambda i: False) == [1, 2]
    assert policy.prefetch(lambda i: i == 1) == [2, 3]
    for c in (1, 2, 3):
        policy.on_acquire(c)
    # end of forward: chunk 0 is needed last, 3 first
    assert policy.victim(OrderedDict.fromkeys([0, 1, 2])) == 0
    assert policy.next_use(3) == 0 and policy.next_use(0) == 3
