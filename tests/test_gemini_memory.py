"""The device budget's accounting cross-checked against the process's real memory.

On CPU the "device" tier is ordinary process memory, so the bytes the chunk manager says it
holds in the device tier during a forward + backward (fetched compute copies, gradient buffers,
gradients as autograd hands them over) must appear in the process's resident set, and nothing
large may appear that it does not account for. A child process (so the allocator can be pinned)
trains a stack of Linear(1024, 1024) layers, one 4 MiB fp32 chunk per layer, params and optimizer
state on host, under the tightest budget `estimate` allows, and measures one forward + backward:

  measured   peak RSS during it (VmHWM, reset through /proc/self/clear_refs) - RSS before it
  accounted  the manager's peak device bytes during it - its device bytes before it

with glibc's mmap threshold pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor storage
above it is its own mapping, returned to the system when freed: RSS then follows live tensor
bytes to the page. `measured - accounted` must lie within SLACK, which covers what the budget
rightly leaves out: activations of a 4-row batch (16 KiB per layer) and autograd bookkeeping.
A fetched chunk is 4 MiB (2 MiB in bf16), so one copy unaccounted or kept alive is caught: the
negative control keeps autograd holding the copies the manager released (its saved-tensor
hook off) and the check must fail (measured 12.7 MB against 4.2 MB accounted). This check found
that bf16 gradients added into fp32 chunk buffers made a full-size fp32 temporary (torch's CPU
add casts the whole input first), and that the gradients autograd hands over before they enter a
chunk were not reserved; both are fixed. Not covered: the optimizer step (its host-tier
temporaries and the simulated device step copy are not device memory a CPU process can tell
apart).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLACK = 512 << 10  # bytes; measured - accounted was -64 KiB (fp32) and +80 KiB (bf16)
D, LAYERS, BATCH = 1024, 6, 4


def torch_gemm_temporary(precision: str) -> int:
    """Bytes torch itself allocates for a moment in the measured step beyond what any budget can see:
    on CPUs without AVX512-BF16 (e.g. an AVX2 EPYC) the backward of a bf16 Linear computes the
    weight gradient through a full fp32 temporary (measured: +4.1 MB for a 1024 x 1024 layer,
    bf16 weight and input alone, no chunk manager); CPUs with it, and fp32, need none."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return D * D * 4 if precision == "bf16" and "avx512_bf16" not in flags else 0


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def probe(precision: str, keep_released_copies: bool, placement: str = "static") -> dict:
    """Runs in the child: two warm-up steps, then one measured forward + backward. `auto`: the
    budget also has room for a prefetched copy and two chunks' optimizer state (plus 1 MiB for
    the measured activations), which the placement moves to device after its warm-up."""
    import torch
    from torch import nn

    from tabfm.parallel import Booster, GeminiPlugin

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
    cfg = dict(chunk_size=D * D + D, offload_param_frac=1.0, offload_optim_frac=1.0, precision=precision)
    if placement == "auto":
        cfg = dict(chunk_size=D * D + D, placement="auto", precision=precision)
    with torch.device("meta"):
        meta = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
    est = GeminiPlugin(**cfg).estimate(meta, torch.optim.AdamW(meta.parameters()))
    budget = est["device_bytes"]
    if placement == "auto":
        budget += est["largest_fetch_bytes"] + 2 * 2 * (D * D + D) * 4 + (1 << 20)
    plugin = GeminiPlugin(device_budget_bytes=budget, **cfg)
    booster = Booster(plugin)
    wrapped, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    if keep_released_copies:  # negative control: autograd keeps every copy it saw alive
        plugin.manager.pack = lambda t: t
    x = torch.randn(BATCH, D)

    def forward_backward():
        booster.backward(wrapped(x).float().pow(2).mean(), opt)

    for _ in range(2):
        forward_backward()
        opt.step()
        opt.zero_grad()
    m = plugin.manager
    before_rss, before_dev = _status("VmRSS"), m.budget.resident_bytes
    m.budget.reset_peak()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    forward_backward()
    out = {"measured": _status("VmHWM") - before_rss, "accounted": m.budget.peak_bytes - before_dev,
           "fetch_bytes": m.report()["fetch_bytes"], "fetches": m.fetches, "budget": budget,
           "peak": m.budget.peak_bytes, "device_optim_chunks": m.report()["device_optim_chunks"]}
    plugin.close()
    return out


def run_probe(precision: str, keep_released_copies: bool = False, placement: str = "static") -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, precision, str(int(keep_released_copies)), placement], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_device_accounting_matches_process_memory(precision):
    r = run_probe(precision)
    assert r["peak"] <= r["budget"]
    assert r["accounted"] >= 2 * r["fetch_bytes"]  # the step really moved chunks through the budget
    assert abs(r["measured"] - torch_gemm_temporary(precision) - r["accounted"]) <= SLACK, r


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_auto_placement_with_device_optimizer_state_matches_process_memory():
    """Auto: two chunks' optimizer state moved into the budget, the rest a prefetching cache."""
    r = run_probe("fp32", placement="auto")
    assert r["device_optim_chunks"] == 2
    assert r["peak"] <= r["budget"]
    assert r["accounted"] >= 2 * r["fetch_bytes"]
    assert abs(r["measured"] - r["accounted"]) <= SLACK, r


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_cross_check_catches_copies_the_accounting_misses():
    r = run_probe("bf16", keep_released_copies=True)
    extra = r["measured"] - torch_gemm_temporary("bf16") - r["accounted"]
    assert extra > SLACK + r["fetch_bytes"], r  # several released copies still alive


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], bool(int(sys.argv[2])), sys.argv[3])))
