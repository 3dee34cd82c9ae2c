"""Auto placement: a warm-up step records the chunk schedule and the activation bytes; after it
the device bytes left over (budget - activations - the parameter cache) hold the optimizer
state of as many chunks as fit (disk chunks first, then host, in step order), and the cache is
managed with farthest-next-use eviction and prefetch. Training equals the no-offload
single-process reference, the budget holds, the optimizer tiers follow the budget, and the
eviction rule is optimal on recorded schedules (checked against a brute-force search)."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from tabfm.parallel import Booster, DeviceBudgetError, GeminiPlugin
from tabfm.parallel.gemini import AutoPolicy, LRUPolicy
from tabfm.parallel.gemini.placement import belady_fetches, device_optim_chunks
from tests.test_gemini import TOL, assert_matches, make_model, make_opt, reference, train

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


@pytest.mark.parametrize("cfg", [dict(), dict(disk_optim_frac=0.5)], ids=["optim_host", "optim_host_disk"])
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
        assert_matches((ref_losses, ref_norms, ref_state), losses, norms, m)
        rep = plugin.memory_report()
        assert rep["policy"] == "auto" and set(rep["param_tiers"]) == {"host"} and n_chunks >= 4
        assert rep["non_model_bytes"] == non_model
        assert rep["device_peak_bytes"] <= budget
        assert rep["device_resident_bytes"] == resident + non_model  # the activations stay reserved
        assert rep["evictions"] > 0  # the cache was really too small for the model
        assert rep["prefetches"] > 0 and rep["prefetch_hits"] > 0  # fetched ahead, then used
    finally:
        plugin.close()


STATE = 2 * CHUNK * 4  # bytes of one chunk's Adam state (exp_avg + exp_avg_sq, fp32)


def cache_and_activations(**cfg) -> tuple[int, int, int]:
    """(activation bytes, parameter cache bytes, chunks) of an unbudgeted auto run's warm-up."""
    plugin, booster, m, model, opt = auto(**cfg)
    train(booster, model, opt, 1)
    rep = plugin.memory_report()
    plugin.close()
    assert rep["param_cache_bytes"] >= rep["fetch_bytes"] + landing_bytes(plugin)  # a module's copy + its grads
    assert rep["device_optim_chunks"] == rep["n_chunks"]  # no budget: every chunk's state moved to device
    return rep["non_model_bytes"], rep["param_cache_bytes"], rep["n_chunks"]


@pytest.mark.parametrize("extra", [0, 1, 3, 99])
def test_auto_places_optimizer_state_in_the_budget_left_over(extra, tmp_path):
    """Budget = activations + parameter cache + room for `extra` chunks' Adam state: exactly that
    many chunks (at most all) move their state to device after the warm-up, disk ones first; the
    rest stay on host/disk. Training equals the reference and the peak stays under the budget."""
    cfg = dict(disk_optim_frac=0.5, disk_dir=tmp_path)
    non_model, cache, n = cache_and_activations(**cfg)
    budget = non_model + cache + extra * STATE + STATE // 2  # half a chunk's state more: not enough for another
    ref_losses, ref_norms, ref_state = reference(steps=5)
    plugin, booster, m, model, opt = auto(budget=budget, **cfg)
    try:
        n_disk = round(0.5 * n)
        disk = list(range(n - n_disk, n))
        assert plugin.memory_report()["optim_tiers"] == ["host"] * (n - n_disk) + ["disk"] * n_disk  # warm-up
        losses, norms = train(booster, model, opt, 5)
        assert_matches((ref_losses, ref_norms, ref_state), losses, norms, m)
        rep = plugin.memory_report()
        k = min(extra, n)
        promoted = (disk + list(range(n - n_disk)))[:k]  # disk chunks first, then host, in step order
        expect = ["device" if i in promoted else "disk" if i in disk else "host" for i in range(n)]
        assert rep["optim_tiers"] == expect and rep["device_optim_chunks"] == k
        assert rep["param_cache_bytes"] == cache and rep["non_model_bytes"] == non_model
        assert rep["device_resident_bytes"] == non_model + k * STATE  # the moved state stays reserved
        assert rep["device_peak_bytes"] <= budget
        assert len(plugin.disk.files()) == n_disk - sum(i in disk for i in promoted)  # moved state left the disk
        if extra < n:
            assert budget - rep["device_resident_bytes"] - cache < STATE  # no room was left unused
    finally:
        plugin.close()


def test_auto_optimizer_state_grows_with_the_budget():
    """More budget, more chunks' optimizer state on device (and never fewer)."""
    non_model, cache, n = cache_and_activations()
    moved = []
    for extra in range(0, n + 2, 2):
        plugin, booster, m, model, opt = auto(budget=non_model + cache + extra * STATE)
        train(booster, model, opt, 1)
        rep = plugin.memory_report()
        plugin.close()
        moved.append(rep["device_optim_chunks"])
        assert rep["optim_tiers"] == ["device"] * moved[-1] + ["host"] * (n - moved[-1])  # step order
    assert moved == [min(e, n) for e in range(0, n + 2, 2)]


def test_auto_resume_carries_optimizer_state_into_its_new_tier(tmp_path):
    """A checkpoint loaded before the warm-up ends: the Adam state read back into host/disk
    chunks is carried along when the budget moves it to device (values, not zeros)."""
    cfg = dict(disk_optim_frac=0.5, disk_dir=tmp_path / "disk")
    non_model, cache, n = cache_and_activations(**cfg)
    budget = non_model + cache + 2 * STATE
    ref_losses, _, ref_state = reference(steps=6)
    plugin, booster, m, model, opt = auto(budget=budget, **cfg)
    train(booster, model, opt, 3)
    booster.save_checkpoint(tmp_path / "step_000003", model=model, optimizer=opt)
    plugin.close()
    plugin, booster, m, model, opt = auto(budget=budget, **cfg)
    try:
        booster.load_checkpoint(tmp_path / "step_000003", model=model, optimizer=opt)
        losses, _ = train(booster, model, opt, 3, start=3)
        assert plugin.memory_report()["device_optim_chunks"] == 2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), **TOL)
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, ref_state[k], **TOL)
    finally:
        plugin.close()


def test_device_optim_chunks_order_and_fit():
    class C:
        def __init__(self, index, tier, shard=10):
            self.index, self.optim_tier, self.shard_nbytes = index, tier, shard

    chunks = [C(0, "device"), C(1, "host"), C(2, "host"), C(3, "disk"), C(4, "disk")]
    assert [c.index for c in device_optim_chunks(chunks, None)] == [3, 4, 1, 2]
    assert [c.index for c in device_optim_chunks(chunks, 59)] == [3, 4]
    assert [c.index for c in device_optim_chunks(chunks, 19)] == []
    assert [c.index for c in device_optim_chunks(chunks, 80)] == [3, 4, 1, 2]


def test_auto_refuses_offload_optim_frac():
    with pytest.raises(ValueError, match="offload_optim_frac"):
        GeminiPlugin(placement="auto", offload_optim_frac=0.5)


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
