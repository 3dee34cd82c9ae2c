"""GeminiPlugin (single process): chunked params/grads/Adam state over device, host and disk
tiers train exactly like SingleProcessPlugin, stay within the device budget, and exchange
checkpoints with it in both directions."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tabfm.parallel import Booster, DeviceBudgetError, GeminiPlugin, SingleProcessPlugin
from tabfm.parallel.gemini import TensorState, choose_chunk_size

torch.set_num_threads(1)
TOL = dict(atol=1e-6, rtol=0)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def make_opt(model: nn.Module, groups: bool = False) -> torch.optim.Optimizer:
    if groups:
        decay = [p for n, p in model.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
        return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 6, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(48, 1, generator=g)


def train(booster: Booster, model: nn.Module, opt, steps: int, clip: float = 0.5, start: int = 0,
          device: str = "cpu"):
    x, y = (t.to(device) for t in data())
    losses, norms = [], []
    for s in range(start, start + steps):
        xs, ys = x.roll(s, 0), y.roll(s, 0)
        loss = nn.functional.mse_loss(model(xs), ys)
        booster.backward(loss, opt)
        norms.append(float(booster.clip_grad_norm_(opt, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def reference(steps: int = 5, groups: bool = False, device: str = "cpu"):
    """Losses, clipped-gradient norms and final state (on CPU) of the plain single-process run."""
    booster = Booster(SingleProcessPlugin(device))
    m = make_model()
    model, opt, *_ = booster.boost(m, make_opt(m, groups))
    losses, norms = train(booster, model, opt, steps, device=device)
    return losses, norms, {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}


def assert_matches(ref, losses, norms, model: nn.Module, tol: dict | None = None) -> None:
    """Losses, clipped-gradient norms and final parameters equal the reference run's (`reference()`)."""
    tol = TOL if tol is None else tol
    ref_losses, ref_norms, ref_state = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **tol)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v.detach().cpu(), ref_state[k], **tol)


CONFIGS = {
    "all_device": dict(),
    "params_host": dict(offload_param_frac=1.0, offload_optim_frac=1.0),
    "optim_disk": dict(disk_optim_frac=1.0),
    "mix": dict(offload_param_frac=0.5, offload_optim_frac=0.25, disk_optim_frac=0.5),
    "params_host_optim_device": dict(offload_param_frac=0.5),
}


def gemini(budget: int | None = None, **kw):
    groups = kw.pop("groups", False)
    plugin = GeminiPlugin(device_budget_bytes=budget, chunk_size=kw.pop("chunk_size", 2048), **kw)
    booster = Booster(plugin)
    m = make_model()
    model, opt, *_ = booster.boost(m, make_opt(m, groups))
    return plugin, booster, m, model, opt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process_reference(name):
    ref_losses, ref_norms, ref_state = reference()
    plugin, booster, m, model, opt = gemini(budget=None, **CONFIGS[name])
    try:
        losses, norms = train(booster, model, opt, 5)
        assert_matches((ref_losses, ref_norms, ref_state), losses, norms, m)
        assert ref_norms[0] > 0.5  # clipping really happened
        rep = plugin.memory_report()
        assert rep["n_chunks"] >= 4
        if "disk" in name or name == "mix":
            assert "disk" in rep["optim_tiers"] and rep["disk_bytes_read"] > 0 and rep["max_disk_buffers"] <= 3
        if "host" in name or name == "mix":
            assert "host" in rep["param_tiers"]
    finally:
        plugin.close()


def test_param_groups_match_reference():
    ref_losses, _, ref_state = reference(groups=True)
    plugin, booster, m, model, opt = gemini(groups=True, offload_param_frac=0.5, disk_optim_frac=0.5)
    try:
        losses, _ = train(booster, model, opt, 5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, ref_state[k], **TOL)
    finally:
        plugin.close()


def test_budget_holds_and_params_really_move():
    # resident: chunks with params on device; the rest is fetched per module and released
    probe, *_ = gemini(**CONFIGS["mix"])
    resident = probe.manager.resident_bytes_needed()
    landing = probe.estimate(probe.module.module, probe.optimizer.optim, manager=probe.manager)["grad_landing_bytes"]
    probe.close()
    budget = resident + 2 * 2048 * 4 + landing  # room for two fetched chunks and one module's fresh gradients
    plugin, booster, m, model, opt = gemini(budget=budget, **CONFIGS["mix"])
    seen = []

    def check(mod, args):
        for p in mod.parameters(recurse=False):
            t = plugin.manager.tensors[p]
            if t.chunk.param_tier == "host":  # computing from the device copy, not the host master
                assert t.state is TensorState.COMPUTE
                assert p.data_ptr() != t.chunk.view(t.chunk.master, t).data_ptr()
                seen.append(p.data_ptr() == t.chunk.view(t.chunk.compute, t).data_ptr())

    handles = [mod.register_forward_pre_hook(check) for mod in m.modules() if list(mod.parameters(recurse=False))]
    in_backward = []
    collect = plugin.manager.collect_grad

    def spy(p):  # a host chunk's gradient arrives while the chunk is fetched for backward
        t = plugin.manager.tensors[p]
        if t.chunk.param_tier == "host":
            in_backward.append(t.chunk.compute is not None and t.state is TensorState.COMPUTE
                               and p.data_ptr() == t.chunk.view(t.chunk.compute, t).data_ptr())
        collect(p)

    plugin.manager.collect_grad = spy
    try:
        ref_losses, _, _ = reference(steps=3)
        losses, _ = train(booster, model, opt, 3)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        rep = plugin.memory_report()
        assert seen and all(seen)
        assert in_backward and all(in_backward)
        n_host = rep["param_tiers"].count("host")
        assert rep["fetches"] == rep["evictions"] > 0 and rep["cached_chunks"] == 0
        # unbounded budget: forward copies stay cached for the backward, so fewer fetches
        roomy, b2, m2, model2, opt2 = gemini(**CONFIGS["mix"])
        train(b2, model2, opt2, 3)
        assert roomy.memory_report()["fetches"] < rep["fetches"] <= 2 * n_host * 3
        roomy.close()
        assert rep["device_peak_bytes"] <= budget
        assert rep["device_peak_bytes"] > rep["device_resident_bytes"] == resident  # fetches came and went
        assert all(t.state is TensorState.HOLD and t.chunk.refs == 0 for t in plugin.manager.order)
    finally:
        for h in handles:
            h.remove()
        plugin.close()


def test_budget_too_small_names_the_numbers():
    match = r"device budget 1000 bytes cannot hold.*\d+ resident.*largest module fetch"
    with pytest.raises(DeviceBudgetError, match=match):
        gemini(budget=1000)
    with pytest.raises(DeviceBudgetError, match=r"cannot hold"):
        gemini(budget=9000, offload_param_frac=1.0, offload_optim_frac=1.0, chunk_size=4096)


def test_disk_files_exist_during_training_and_go_at_close(tmp_path):
    plugin, booster, m, model, opt = gemini(disk_optim_frac=1.0, disk_dir=tmp_path)
    root = plugin.disk.root
    assert root.parent == tmp_path
    train(booster, model, opt, 2)
    files = plugin.disk.files()
    assert len(files) == plugin.manager.report()["n_chunks"]
    assert all(f.stat().st_size == 2 * 2048 * 4 and f.with_suffix(".json").is_file() for f in files)
    plugin.close()
    assert not root.exists() and tmp_path.exists()


def test_chunk_size_search_limits_padding():
    numels = [p.numel() for p in make_model().parameters()]
    size, waste = choose_chunk_size(numels)
    assert size >= max(numels)
    assert waste <= min(choose_chunk_size.__globals__["pack_waste"](numels, s)
                        for s in (max(numels), 2 * max(numels), 4096))
    plugin, *_ = gemini(chunk_size=None)
    rep = plugin.memory_report()
    assert rep["padding_frac"] < 0.25 and rep["n_chunks"] >= 4
    plugin.close()


@pytest.mark.parametrize("direction", ["gemini_to_single", "single_to_gemini"])
def test_checkpoint_round_trip(tmp_path, direction):
    ref_losses, ref_norms, ref_state = reference(steps=6)
    cfg = CONFIGS["mix"]
    if direction == "gemini_to_single":
        plugin, booster, m, model, opt = gemini(**cfg)
    else:
        booster = Booster(SingleProcessPlugin("cpu"))
        m = make_model()
        model, opt, *_ = booster.boost(m, make_opt(m))
        plugin = None
    train(booster, model, opt, 3)
    booster.save_checkpoint(tmp_path / "step_000003", model=model, optimizer=opt)
    if plugin is not None:
        plugin.close()

    if direction == "gemini_to_single":
        booster2 = Booster(SingleProcessPlugin("cpu"))
        m2 = make_model(seed=7)
        model2, opt2, *_ = booster2.boost(m2, make_opt(m2))
        plugin2 = None
    else:
        plugin2, booster2, m2, model2, opt2 = gemini(**cfg)
        m2.load_state_dict(make_model(seed=7).state_dict())  # different starting weights: load must overwrite
    try:
        booster2.load_checkpoint(tmp_path / "step_000003", model=model2, optimizer=opt2)
        losses, norms = train(booster2, model2, opt2, 3, start=3)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), **TOL)
        for k, v in m2.state_dict().items():
            torch.testing.assert_close(v, ref_state[k], **TOL)
        sd = opt2.state_dict()
        assert len(sd["state"]) == len(list(m2.parameters()))
        assert float(sd["state"][0]["step"]) == 6.0
    finally:
        if plugin2 is not None:
            plugin2.close()


def test_grad_accumulation_with_no_sync():
    x, y = data()
    results = []
    for plugin in (SingleProcessPlugin("cpu"), GeminiPlugin(chunk_size=2048, offload_param_frac=0.5,
                                                            disk_optim_frac=0.5)):
        booster = Booster(plugin)
        m = make_model()
        model, opt, *_ = booster.boost(m, make_opt(m))
        for _ in range(2):
            for i, (xb, yb) in enumerate(zip(x.chunk(3), y.chunk(3))):
                with booster.no_sync(model, opt):
                    booster.backward(nn.functional.mse_loss(model(xb), yb) / 3, opt)
            opt.step()
            opt.zero_grad()
        results.append({k: v.clone() for k, v in m.state_dict().items()})
        if isinstance(plugin, GeminiPlugin):
            plugin.close()
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], **TOL)


def test_refuses_what_this_slice_does_not_do():
    with pytest.raises(ValueError, match="static"):
        GeminiPlugin(placement="fastest")
    with pytest.raises(ValueError, match="auto"):
        GeminiPlugin(placement="auto", offload_param_frac=0.5)
    with pytest.raises(ValueError, match="precision"):
        GeminiPlugin(precision="fp8")
    with pytest.raises(ValueError, match="shard_param_frac"):
        GeminiPlugin(placement="auto", shard_param_frac=0.5)
    with pytest.raises(ValueError, match="shard_param_frac"):
        GeminiPlugin(shard_param_frac=1.5)
    with pytest.raises(TypeError, match="Adam"):
        m = make_model()
        Booster(GeminiPlugin()).boost(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_estimate_on_meta_model_matches_real_run():
    cfg = dict(offload_param_frac=0.5, offload_optim_frac=0.25, disk_optim_frac=0.5)
    with torch.device("meta"):
        meta = Net()
    est = GeminiPlugin(chunk_size=2048, **cfg).estimate(meta, make_opt(meta))
    plugin, booster, m, model, opt = gemini(budget=est["device_bytes"], **cfg)
    try:
        train(booster, model, opt, 2)
        rep = plugin.memory_report()
        assert rep["device_peak_bytes"] <= est["device_bytes"]
        assert rep["device_resident_bytes"] == est["device_resident_bytes"]
        assert est["disk_bytes"] == sum(f.stat().st_size for f in plugin.disk.files())
    finally:
        plugin.close()


def test_clipping_twice_and_lr_scheduler_follow_torch():
    def loop(booster, model, opt, sched):
        x, y = data()
        for _ in range(3):
            booster.backward(nn.functional.mse_loss(model(x), y), opt)
            n1 = float(booster.clip_grad_norm_(opt, 0.5))
            n2 = float(booster.clip_grad_norm_(opt, 0.2))
            opt.step()
            opt.zero_grad()
            sched.step()
        return n1, n2

    out = []
    for plugin in (SingleProcessPlugin("cpu"), GeminiPlugin(chunk_size=2048, offload_param_frac=0.5,
                                                            disk_optim_frac=0.5)):
        booster = Booster(plugin)
        m = make_model()
        o = make_opt(m)
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        model, opt, _, _, sched = booster.boost(m, o, lr_scheduler=sched)
        norms = loop(booster, model, opt, sched)
        out.append((norms, {k: v.clone() for k, v in m.state_dict().items()}))
        if isinstance(plugin, GeminiPlugin):
            plugin.close()
    torch.testing.assert_close(torch.tensor(out[1][0]), torch.tensor(out[0][0]), **TOL)
    for k in out[0][1]:
        torch.testing.assert_close(out[1][1][k], out[0][1][k], **TOL)


def test_capacity_benchmark_quick(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cap.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "gemini_capacity.py"), "--quick", "--budget-mib", "4",
                    "--d", "128", "--out", str(out)], check=True, capture_output=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert 0 < rows["all-device"]["max_layers"] < rows["host"]["max_layers"] <= rows["disk"]["max_layers"]
    assert all(r["verified_peak_device_mib"] <= 4 for r in rows.values())
