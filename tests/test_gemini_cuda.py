"""GeminiPlugin's device tier on CUDA (`device="cuda"`), and what of it can be checked without a GPU.

On any machine:
  - device selection: "auto" resolves to CUDA exactly when torch sees one; "cuda" without CUDA is
    an error naming the problem (never a silent CPU run); nonsense devices are refused.
  - the CUDA control flow on CPU tensors: a stand-in tier (`FakeCudaTier`) that says it is CUDA
    but allocates CPU tensors drives the CUDA-only paths (host-tier gradients collected in a
    device-tier buffer and written back asynchronously, drained in order; fetch events waited for
    before use or eviction) and must still equal the no-offload reference exactly.
On a CUDA machine (skipped elsewhere):
  - equality with the no-offload reference (SingleProcessPlugin on CUDA, torch AdamW) for every
    placement, with tensors really in CUDA memory / pinned host memory;
  - the budget against torch.cuda.max_memory_allocated during a forward + backward;
  - prefetch overlap: the h2d copies of prefetched chunks run while the previous module computes.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tabfm.parallel import Booster, GeminiPlugin
from tabfm.parallel.gemini import plugin as plugin_mod
from tabfm.parallel.gemini.tiers import DeviceTier, resolve_device
from tests.test_gemini import CONFIGS, assert_matches, make_model, make_opt, reference, train

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


# --- device selection (any machine) ---------------------------------------------------------------
def test_auto_resolves_to_cuda_exactly_when_available():
    want = "cuda" if CUDA else "cpu"
    assert GeminiPlugin(device="auto").device.type == want
    assert GeminiPlugin().device == torch.device("cpu")  # the default stays the CPU tier


@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is missing")
def test_cuda_without_cuda_is_a_clear_error():
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(RuntimeError, match=r"CUDA device tier.*torch.cuda.is_available\(\) is False"):
            GeminiPlugin(device=device)


def test_unknown_devices_are_refused():
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda'"):
        GeminiPlugin(device="gpu")
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        resolve_device("meta")


def test_cpu_tier_is_plain_memory():
    tier = DeviceTier(torch.device("cpu"))
    assert not tier.cuda and tier.h2d is None and tier.memory() == {}
    t = tier.zeros(8, host=True)
    assert t.device.type == "cpu" and not t.is_pinned()  # pinning needs an accelerator
    staging, event = tier.write_back(t)
    assert staging is t and event is None


# --- the CUDA control flow, run on CPU tensors ------------------------------------------------------
class FakeEvent:
    """Completes on the second query (so non-blocking drains really find copies in flight)."""

    def __init__(self, log: list) -> None:
        self.queries, self.done, self.log = 0, False, log

    def query(self) -> bool:
        self.queries += 1
        return self.done or self.queries > 1

    def synchronize(self) -> None:
        self.done = True


class FakeCudaTier(DeviceTier):
    """Says it is CUDA (so the manager takes its CUDA paths) but allocates CPU tensors; records
    every fetch event and every wait for one."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda, self.h2d, self.d2h, self.timeline = torch.device("cpu"), True, None, None, None
        self.recorded: list = []
        self.waited: list = []
        self.write_backs = 0

    def empty(self, n, dtype=torch.float32, host=False):
        return torch.empty(n, dtype=dtype)

    def copy_in(self, dst, src):
        dst.copy_(src)

    def fetch_stream(self):
        return contextlib.nullcontext()

    def record(self, stream):
        ev = FakeEvent(self.recorded)
        self.recorded.append(ev)
        return ev

    def wait(self, event):
        if event is not None:
            self.waited.append(event)

    def write_back(self, src):
        self.write_backs += 1
        return src.clone(), FakeEvent([])

    def synchronize(self):
        pass

    def memory(self):
        return {}


@pytest.mark.parametrize("name", ["params_host", "mix", "auto"])
def test_cuda_control_flow_on_cpu_equals_reference(monkeypatch, name):
    monkeypatch.setattr(plugin_mod, "DeviceTier", FakeCudaTier)
    cfg = dict(placement="auto", disk_optim_frac=0.5) if name == "auto" else CONFIGS[name]
    ref_losses, ref_norms, ref_state = reference()
    with torch.device("meta"):
        meta = make_model.__globals__["Net"]()
    est = GeminiPlugin(chunk_size=2048, **cfg).estimate(meta, make_opt(meta))
    budget = est["device_bytes"] + (256 << 10 if name == "auto" else 0)  # auto: + activations (~150 KiB)
    plugin = GeminiPlugin(device_budget_bytes=budget, chunk_size=2048, **cfg)
    booster = Booster(plugin)
    m = make_model()
    model, opt, *_ = booster.boost(m, make_opt(m))
    try:
        losses, norms = train(booster, model, opt, 5)
        assert_matches((ref_losses, ref_norms, ref_state), losses, norms, m)
        tier, mgr = plugin.manager.tier, plugin.manager
        assert tier.write_backs > 0 and not mgr.pending  # host gradients went back and were all drained
        assert len(tier.recorded) == mgr.fetches and set(map(id, tier.waited)) == set(map(id, tier.recorded))
        rep = plugin.memory_report()
        assert rep["device_peak_bytes"] <= budget and rep["device_resident_bytes"] == mgr.budget.resident_bytes
        assert all(c.grad_full is None for c in mgr.chunks)
    finally:
        plugin.close()


# --- on a CUDA GPU ------------------------------------------------------------------------------------
CUDA_TOL = dict(atol=2e-5, rtol=2e-5)  # fused CUDA Adam vs torch's foreach CUDA Adam: float rounding


@needs_cuda
@pytest.mark.parametrize("name", [*CONFIGS, "auto"])
def test_cuda_matches_no_offload_reference(name):
    ref_losses, ref_norms, ref_state = reference(device="cuda")
    cfg = dict(placement="auto", disk_optim_frac=0.5) if name == "auto" else CONFIGS[name]
    plugin = GeminiPlugin(device="cuda", chunk_size=2048, **cfg)
    booster = Booster(plugin)
    m = make_model()
    model, opt, *_ = booster.boost(m, make_opt(m))
    try:
        losses, norms = train(booster, model, opt, 5, device="cuda")
        assert_matches((ref_losses, ref_norms, ref_state), losses, norms, m, CUDA_TOL)
        for c in plugin.manager.chunks:  # each shard really lives in its tier
            assert c.master.is_cuda == (c.param_tier == "device")
            assert c.master.is_cuda or c.master.is_pinned()
            if c.optim_tier != "disk":
                assert c.exp_avg.is_cuda == (c.optim_tier == "device")
        rep = plugin.memory_report()
        assert rep["device"].startswith("cuda") and rep["cuda_max_allocated_bytes"] > 0
    finally:
        plugin.close()


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_budget_against_torch_allocator(precision):
    """Params and optimizer state on host, the tightest budget; one measured forward + backward:
    torch's allocated-bytes peak rises by the manager's accounted peak, within activations."""
    D, LAYERS, BATCH = 1024, 6, 4
    SLACK = 2 << 20  # activations of a 4-row batch + allocator rounding; a fetched chunk is 4 MiB (2 in bf16)
    cfg = dict(chunk_size=D * D + D, offload_param_frac=1.0, offload_optim_frac=1.0, precision=precision)
    with torch.device("meta"):
        meta = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
    # the CUDA tier's estimate: it adds the gradient buffers of host-shard chunks (the first GPU run
    # took the CPU tier's, 8.4 of the 16.8 MB, and the budget check refused it)
    budget = GeminiPlugin(device="cuda", **cfg).estimate(meta, torch.optim.AdamW(meta.parameters()))["device_bytes"]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
    plugin = GeminiPlugin(device="cuda", device_budget_bytes=budget, **cfg)
    booster = Booster(plugin)
    wrapped, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(BATCH, D, device="cuda")
    try:
        for _ in range(2):  # warm-up: cuBLAS workspaces, allocator pools
            booster.backward(wrapped(x).float().pow(2).mean(), opt)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        m = plugin.manager
        before, before_acc = torch.cuda.memory_allocated(), m.budget.resident_bytes
        torch.cuda.reset_peak_memory_stats()
        m.budget.reset_peak()
        booster.backward(wrapped(x).float().pow(2).mean(), opt)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        accounted = m.budget.peak_bytes - before_acc
        info = dict(measured=measured, accounted=accounted, budget=budget, peak=m.budget.peak_bytes)
        assert m.budget.peak_bytes <= budget, info
        assert accounted >= 2 * m.report()["fetch_bytes"], info
        assert measured <= accounted + SLACK, info  # nothing large on the GPU that the budget misses
        # and the accounting describes real memory (loosely: a gradient write-back stays accounted
        # until drained, possibly after the allocator already reused its block)
        assert measured >= accounted // 2, info
    finally:
        plugin.close()


@needs_cuda
def test_cuda_prefetch_overlaps_compute():
    """auto placement: in a forward, chunk i+1's h2d copy (issued when module i is acquired) runs
    on the side stream while module i's kernels run: most copy time lies inside compute time."""
    D, LAYERS, ROWS = 4096, 8, 8192
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
    plugin = GeminiPlugin(device="cuda", placement="auto", chunk_size=D * D + D, prefetch_depth=1)
    booster = Booster(plugin)
    wrapped, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(ROWS, D, device="cuda")
    try:
        for _ in range(2):  # the first step is the warm-up that records the schedule
            booster.backward(wrapped(x).float().pow(2).mean() * 1e-6, opt)
            opt.step()
            opt.zero_grad()
        compute: list = []

        def pre(mod, args):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            compute.append([ev, None])

        def post(mod, args, out):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            compute[-1][1] = ev

        hooks = [h for layer in model for h in (layer.register_forward_pre_hook(pre),
                                                 layer.register_forward_hook(post))]
        tier = plugin.manager.tier
        tier.timeline = []
        torch.cuda.synchronize()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        hits = plugin.manager.prefetch_hits
        with torch.no_grad():
            wrapped(x)
        torch.cuda.synchronize()
        tier.timeline, copies = None, tier.timeline
        for h in hooks:
            h.remove()
        spans = [(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in compute]
        copy_spans = [(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in copies]
        copy_ms = sum(e - s for s, e in copy_spans)
        inside = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in copy_spans for cs, ce in spans)
        info = dict(copy_ms=copy_ms, inside_ms=inside, compute_ms=sum(e - s for s, e in spans), copies=len(copies),
                    prefetch_hits=plugin.manager.prefetch_hits - hits)
        assert plugin.manager.prefetch_hits - hits >= LAYERS - 2, info
        assert inside >= 0.5 * copy_ms, info
    finally:
        plugin.close()
