"""`optimizer.step()` time of the pretraining optimizers on one model, side by side in one process.

    python benchmarks/optimizer_step.py                     # tiny preset, 1 thread, 20 timed steps
    python benchmarks/optimizer_step.py --preset small --steps 10 --out runs/optimizer_step.json

Rows (all on the same model and the same random gradients):
    adamw            torch.optim.AdamW (decay on matrices only): the default
    muon             tabfm's MuonAdamW: Newton-Schulz in the device's default (fp32 on CPU)
    muon-bf16-ns     MuonAdamW with Newton-Schulz in bf16 (torch.optim.Muon's numerics)
    torch-muon       torch.optim.Muon + AdamW stepped in turn (the pre-MuonAdamW recipe)

Prints a table (ms per step and the ratio to AdamW) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tabfm.model import ModelConfig, TabFM
from tabfm.train.optim import _groups, build_optimizer


def _torch_muon(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    named = [(n, p) for n, p in model.named_parameters()]
    hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    rest = [(n, p) for n, p in named if id(p) not in ids]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(_groups(rest, 0.01), lr=1e-3, betas=(0.9, 0.95))]


def time_steps(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> float:
    """Median ms of one step of every optimizer in `optimizers` (after 2 warm-up steps)."""
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for o in optimizers:
            o.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1000.0 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/optimizer_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for name in ("adamw", "muon", "muon-bf16-ns", "torch-muon"):
        torch.manual_seed(0)
        model = TabFM(ModelConfig.preset(args.preset))
        if name == "torch-muon":
            opts = _torch_muon(model)
        else:
            opt = build_optimizer(model, "adamw" if name == "adamw" else "muon", lr=1e-3)
            if name == "muon-bf16-ns":
                for group in opt.param_groups:
                    group["ns_dtype"] = "bfloat16"
            opts = [opt]
        rows[name] = time_steps(model, opts, args.steps)
    base = rows["adamw"]
    print(f"optimizer.step(), preset {args.preset}, {args.threads} thread(s), median of {args.steps}")
    print(f"{'optimizer':<14}{'ms/step':>10}{'x AdamW':>10}")
    for name, ms in rows.items():
        print(f"{name:<14}{ms:>10.1f}{ms / base:>10.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "steps": args.steps,
                               "ms_per_step": rows, "cpu_bf16_native": "avx512_bf16" in Path("/proc/cpuinfo").read_text()
                               if Path("/proc/cpuinfo").exists() else None}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
