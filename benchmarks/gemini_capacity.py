"""Gemini capacity: the largest model that trains under a fixed device budget, per placement.

Model: a stack of `Linear(d, d)` layers (AdamW, fp32). Full training state = 16 bytes per
parameter (master, grad, exp_avg, exp_avg_sq). Under a fixed device budget (default 256 MiB,
CPU memory accounted by the chunk manager) and a fixed host budget (default 2x the device
budget), three placements:

  all-device   everything resident in the device budget
  host         params+grads and/or Adam state on host (the best static fractions on a 0.25
               grid); host-param chunks visit the device only while their layer runs
  disk         Adam state on disk (streamed, 3 chunk buffers on host), params+grads split
               between device and host (best fraction on the grid)

Capacity = the most layers whose `GeminiPlugin.estimate` fits both budgets (binary search on a
meta-device model, no allocation), then verified by really training one step at that size
(peak device bytes must stay under the budget). Step time: a model that fits all three ways
(half the all-device capacity), timed with everything offloaded (host: all params and state
on host; disk: params on host, state on disk) relative to all-device, and with placement="auto"
(params homed on host, optimizer state on host, the budget a farthest-next-use cache).

    python benchmarks/gemini_capacity.py            # 256 MiB device budget, d=1024
    python benchmarks/gemini_capacity.py --quick    # 16 MiB, d=256: seconds
    python benchmarks/gemini_capacity.py --precision-layers 7   # only: fp32 vs bf16 vs fp16 chunks, 7 layers
    python benchmarks/gemini_capacity.py --two-ranks 7 --d 512  # only: 2 ranks (gloo) vs 1, 7 layers
    python benchmarks/gemini_capacity.py --device cuda          # device tier = CUDA memory (1 GiB
                                                                 # budget, d=4096, batch 2048 by default)
Writes benchmarks/results/gemini_capacity.json (gemini_precision.json, gemini_two_ranks.json;
--device cuda: gemini_capacity_cuda.json). On CUDA the budget still counts the bytes the manager
holds in the device tier; each run also records torch.cuda.max_memory_allocated (that plus the
activations and input of the timed batch), and step times are measured after a
torch.cuda.synchronize().
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tabfm.parallel import Booster  # noqa: E402
from tabfm.parallel.gemini import GeminiPlugin  # noqa: E402

MODES = {  # the fully offloaded placements used for the step-time comparison
    "all-device": dict(),
    "host": dict(offload_param_frac=1.0, offload_optim_frac=1.0),
    "disk": dict(offload_param_frac=1.0, disk_optim_frac=1.0),
}
MiB = 1 << 20
DEVICE = "cpu"  # set by --device: the GeminiPlugin device tier every run uses


def make_model(d: int, layers: int, device: str = "cpu") -> nn.Module:
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])


GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def placements(mode: str) -> list[dict]:
    """Static placements a mode may use (capacity takes the best): all-device none; host:
    any params/optimizer fractions on host; disk: any params fraction on host, optimizer on disk."""
    if mode == "all-device":
        return [{}]
    if mode == "host":
        return [dict(offload_param_frac=p, offload_optim_frac=o) for p in GRID for o in GRID]
    return [dict(offload_param_frac=p, disk_optim_frac=1.0) for p in GRID]


def fits(mode: str, d: int, layers: int, budget: int, host_budget: int) -> dict | None:
    """The first placement of `mode` under which `layers` layers fit both budgets, or None."""
    meta = make_model(d, layers, "meta")
    opt = torch.optim.AdamW(meta.parameters())
    for cfg in placements(mode):
        est = GeminiPlugin(device_budget_bytes=budget, device=DEVICE, **cfg).estimate(meta, opt)
        if est["device_bytes"] <= budget and est["host_bytes"] <= host_budget:
            return cfg
    return None


def capacity(mode: str, d: int, budget: int, host_budget: int, max_layers: int) -> int:
    lo, hi = 0, 1
    while hi <= max_layers and fits(mode, d, hi, budget, host_budget) is not None:
        lo, hi = hi, hi * 2
    hi = min(hi, max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mode, d, mid, budget, host_budget) is not None else (lo, mid)
    return lo


def run(cfg: dict, d: int, layers: int, budget: int, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    plugin = GeminiPlugin(device_budget_bytes=budget, device=DEVICE, **cfg)
    booster = Booster(plugin)
    m = make_model(d, layers)  # built on CPU: its parameters move into the chunks' tiers
    model, opt, *_ = booster.boost(m, torch.optim.AdamW(m.parameters(), lr=1e-4))
    cuda = plugin.device.type == "cuda"
    x = torch.randn(batch, d, device=plugin.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            booster.backward(loss, opt)
            booster.clip_grad_norm_(opt, 1.0)
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rep = plugin.memory_report()
    finally:
        plugin.close()
        del model, opt, m, x
        if cuda:
            torch.cuda.empty_cache()
    out = {"step_s": min(times[1:] or times), "peak_device_bytes": rep["device_peak_bytes"],
           "n_chunks": rep["n_chunks"], "padding_frac": rep["padding_frac"], "prefetch_hits": rep["prefetch_hits"],
           "non_model_bytes": rep["non_model_bytes"]}
    if cuda:
        out["cuda_max_allocated_bytes"] = rep["cuda_max_allocated_bytes"]
    return out


RESULTS = Path(__file__).resolve().parent / "results"


def _rank_worker(rank: int, world: int, port: int, cfg: dict, d: int, layers: int, budget: int, steps: int,
                 batch: int, queue) -> None:
    """One rank of the 2-rank row: join a gloo group, train with each chunk sharded over the ranks."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, run(cfg, d, layers, budget, steps, batch // world)))
    finally:
        dist.destroy_process_group()


def run_ranks(cfg: dict, d: int, layers: int, budget: int, steps: int, batch: int, world: int = 2) -> list[dict]:
    """`run` on `world` gloo processes (the same global batch, split over them); one result per rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_worker, args=(r, world, port, cfg, d, layers, budget, steps, batch, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def two_rank_rows(d: int, layers: int, budget: int, steps: int, batch: int) -> list[dict]:
    """Step time and per-rank peak device bytes at 2 ranks vs 1, same model and global batch,
    for all-on-device and everything-on-host placements."""
    rows = []
    for mode in ("all-device", "host"):
        one = run(MODES[mode], d, layers, budget, steps, batch)
        two = run_ranks(MODES[mode], d, layers, budget, steps, batch)
        step2 = max(r["step_s"] for r in two)
        rows.append({"mode": mode, "layers": layers, "step_s_1rank": one["step_s"], "step_s_2ranks": step2,
                     "step_rel": step2 / one["step_s"], "peak_device_mib_1rank": one["peak_device_bytes"] / MiB,
                     "peak_device_mib_per_rank": max(r["peak_device_bytes"] for r in two) / MiB})
    return rows


def precision_rows(d: int, layers: int, budget: int, steps: int, batch: int, out: str | None) -> None:
    """Step time and peak device bytes of fp32 vs bf16 vs fp16 compute copies (fp32 masters and
    AdamW state either way), all on device and with everything on host."""
    rows = []
    for mode in ("all-device", "host"):
        for precision in ("fp32", "bf16", "fp16"):
            r = run(dict(MODES[mode], precision=precision), d, layers, budget, steps, batch)
            rows.append({"mode": mode, "precision": precision, "layers": layers, "step_s": r["step_s"],
                         "peak_device_mib": r["peak_device_bytes"] / MiB})
    print(f"Linear({d},{d}) x {layers}, batch {batch}, device budget {budget / MiB:.0f} MiB, 1 thread, "
          f"best of {steps - 1} timed steps")
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"] and b["precision"] == "fp32")["step_s"]
        print(f"{r['mode']:<11} {r['precision']:<5} {r['step_s']:.3f} s/step ({r['step_s'] / base:.2f}x fp32)  "
              f"peak device {r['peak_device_mib']:.1f} MiB")
    path = Path(out or RESULTS / "gemini_precision.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"d": d, "layers": layers, "batch": batch, "device_budget_bytes": budget,
                                "torch": torch.__version__, "rows": rows}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-mib", type=float, default=None)
    ap.add_argument("--host-mib", type=float, default=None, help="host budget (default 2x device budget)")
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-verify", action="store_true", help="skip the one-step run at each capacity")
    ap.add_argument("--out", default=None, help="default: results/gemini_capacity.json "
                    "(results/gemini_precision.json with --precision-layers)")
    ap.add_argument("--two-ranks", type=int, default=None, metavar="LAYERS",
                    help="only: step time and per-rank peak device bytes at 2 ranks (gloo) vs 1, this many layers")
    ap.add_argument("--precision-layers", type=int, default=None,
                    help="only time fp32 vs bf16 vs fp16 compute copies at this many layers (no capacity search)")
    ap.add_argument("--device", default="cpu", help="GeminiPlugin device tier: cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--batch", type=int, default=None, help="rows per step (default 32; 2048 on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (host-tier Adam runs on CPU)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = str(GeminiPlugin(device=args.device).device)  # resolves "auto"; CUDA missing: an error
    cuda = DEVICE.startswith("cuda")
    torch.set_num_threads(args.threads)
    budget = int((args.budget_mib or (16 if args.quick else 1024 if cuda else 256)) * MiB)
    host_budget = int(args.host_mib * MiB) if args.host_mib else 2 * budget
    d = args.d or (256 if args.quick else 4096 if cuda else 1024)
    steps = args.steps or (3 if args.quick else 4)
    batch = args.batch or (2048 if cuda else 32)
    per_layer = 16 * (d * d + d)
    if args.two_ranks:
        rows = two_rank_rows(d, args.two_ranks, budget, steps, batch)
        print(f"Linear({d},{d}) x {args.two_ranks}, global batch {batch}, budget {budget / MiB:.0f} MiB, 1 thread "
              f"per rank, best of {steps - 1} timed steps (2 ranks: the slower rank)")
        for r in rows:
            print(f"{r['mode']:<11} 1 rank {r['step_s_1rank']:.3f} s  2 ranks {r['step_s_2ranks']:.3f} s "
                  f"({r['step_rel']:.2f}x)  peak device {r['peak_device_mib_1rank']:.1f} MiB -> "
                  f"{r['peak_device_mib_per_rank']:.1f} MiB per rank")
        path = Path(args.out or RESULTS / "gemini_two_ranks.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"d": d, "layers": args.two_ranks, "batch": batch, "device_budget_bytes": budget,
                                    "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {path}")
        return
    if args.precision_layers:
        precision_rows(d, args.precision_layers, budget, steps, batch, args.out)
        return
    args.out = args.out or str(RESULTS / ("gemini_capacity_cuda.json" if cuda else "gemini_capacity.json"))

    rows = []
    for mode in MODES:
        n = capacity(mode, d, budget, host_budget, max_layers=4096)
        row = {"mode": mode, "max_layers": n, "max_params": n * (d * d + d),
               "train_state_mib": n * per_layer / MiB}
        row["placement"] = fits(mode, d, n, budget, host_budget) if n else None
        if not args.no_verify and n:
            v = run(row["placement"], d, n, budget, 1, batch)
            row["verified_peak_device_mib"] = v["peak_device_bytes"] / MiB
            if "cuda_max_allocated_bytes" in v:
                row["verified_cuda_max_allocated_mib"] = v["cuda_max_allocated_bytes"] / MiB
            assert v["peak_device_bytes"] <= budget
            assert fits(mode, d, n + 1, budget, host_budget) is None
        rows.append(row)

    n_time = max(1, rows[0]["max_layers"] // 2)  # fits all three ways
    base = None
    for row in rows:
        r = run(MODES[row["mode"]], d, n_time, budget, steps, batch)
        base = base or r["step_s"]
        row.update({"timed_layers": n_time, "step_s": r["step_s"], "step_rel": r["step_s"] / base,
                    "timed_peak_device_mib": r["peak_device_bytes"] / MiB, "n_chunks": r["n_chunks"],
                    "padding_frac": r["padding_frac"]})
        if "cuda_max_allocated_bytes" in r:
            row["timed_cuda_max_allocated_mib"] = r["cuda_max_allocated_bytes"] / MiB

    # auto placement at the same size and budget: params homed on host, the budget (minus the
    # activations measured in the warm-up step) a farthest-next-use cache with prefetch
    auto = run(dict(placement="auto"), d, n_time, budget, steps, batch)
    auto_row = {"mode": "auto", "timed_layers": n_time, "step_s": auto["step_s"], "step_rel": auto["step_s"] / base,
                "timed_peak_device_mib": auto["peak_device_bytes"] / MiB, "prefetch_hits": auto["prefetch_hits"],
                "non_model_mib": auto["non_model_bytes"] / MiB}
    if "cuda_max_allocated_bytes" in auto:
        auto_row["cuda_max_allocated_mib"] = auto["cuda_max_allocated_bytes"] / MiB

    print(f"device tier {DEVICE}, device budget {budget / MiB:.0f} MiB, host budget {host_budget / MiB:.0f} MiB, "
          f"Linear({d},{d}) layers, AdamW fp32 (16 B/param); step time at {n_time} layers, batch {batch}, "
          f"{args.threads} CPU thread(s)")
    print(f"{'mode':<11} {'max layers':>10} {'max params':>12} {'state MiB':>10} {'peak MiB':>9} "
          f"{'step s':>8} {'rel':>6}  placement at capacity")
    for r in rows:
        print(f"{r['mode']:<11} {r['max_layers']:>10} {r['max_params']:>12,} {r['train_state_mib']:>10.1f} "
              f"{r.get('verified_peak_device_mib', float('nan')):>9.1f} {r['step_s']:>8.3f} {r['step_rel']:>6.2f}  "
              f"{r['placement']}")
    print(f"auto (params on host, optimizer state on host) at {n_time} layers: {auto_row['step_s']:.3f} s/step "
          f"({auto_row['step_rel']:.2f}x), peak {auto_row['timed_peak_device_mib']:.1f} MiB incl. "
          f"{auto_row['non_model_mib']:.1f} MiB measured activations, {auto_row['prefetch_hits']} prefetch hits")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "device": DEVICE, "threads": args.threads}
    if cuda:
        env.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(torch.device(DEVICE)))
    out.write_text(json.dumps({"device_budget_bytes": budget, "host_budget_bytes": host_budget, "d": d,
                               "batch": batch, "quick": args.quick, **env, "rows": rows, "auto": auto_row},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
