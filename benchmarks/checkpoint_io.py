"""Single-process checkpoint save/load time: the one DCP checkpoint IO against plain safetensors.

    python benchmarks/checkpoint_io.py                          # tiny, small, base; 5 rounds
    python benchmarks/checkpoint_io.py --presets tiny --rounds 3 --json runs/checkpoint_io.json
    python benchmarks/checkpoint_io.py --quick                  # tiny, 1 round (the smoke test)

Every plugin now writes checkpoints through `ShardedCheckpointIO` (torch.distributed.checkpoint,
safetensors shards); single-process runs used to write full tensors with one `save_weights` call.
Rows per model preset, all on one AdamW-stepped model in one process, rounds alternated:
    dcp        Booster(SingleProcessPlugin).save_checkpoint / load_checkpoint (model, optimizer, scheduler)
    full       the same tensors written and read as full safetensors files (`state_io.save_weights`,
               `save_state`): what the old single-process writer did, the floor for these bytes
Before each load the weights are zeroed; a row records whether both loads brought them back exactly.
Prints a table (median ms, ratio dcp / full, checkpoint MiB) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tabfm.model import ModelConfig, TabFM
from tabfm.parallel import Booster, SingleProcessPlugin, checkpoint_dir
from tabfm.parallel.checkpoint import atomic_directory
from tabfm.parallel.state_io import load_state, load_weights, save_state, save_weights

from common import machine_info


def _stepped(preset: str) -> tuple[Booster, torch.nn.Module, object, object]:
    torch.manual_seed(0)
    model = TabFM(ModelConfig.preset(preset))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    booster = Booster(SingleProcessPlugin("cpu"))
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad()
    return booster, model, opt, sched


def _mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def bench(preset: str, rounds: int, root: Path) -> dict:
    booster, model, opt, sched = _stepped(preset)
    times: dict[str, list[float]] = {"dcp_save": [], "dcp_load": [], "full_save": [], "full_load": []}
    size = {}
    saved = {k: v.clone() for k, v in model.unwrap().state_dict().items()}
    exact = True

    def wipe() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()

    def same() -> bool:
        return all(torch.equal(v, saved[k]) for k, v in model.unwrap().state_dict().items())

    for r in range(rounds):
        t = time.perf_counter()
        path = booster.save_checkpoint(checkpoint_dir(root / "dcp", r), model=model, optimizer=opt, lr_scheduler=sched)
        times["dcp_save"].append(time.perf_counter() - t)
        wipe()
        t = time.perf_counter()
        booster.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched)
        times["dcp_load"].append(time.perf_counter() - t)
        exact &= same()
        size["dcp"] = _mib(path)

        full = checkpoint_dir(root / "full", r)
        t = time.perf_counter()
        with atomic_directory(full) as tmp:
            save_weights(model.unwrap().state_dict(), tmp / "model.safetensors")
            save_state(opt.state_dict(), tmp / "optimizer")
            save_state(sched.state_dict(), tmp / "scheduler")
        times["full_save"].append(time.perf_counter() - t)
        wipe()
        t = time.perf_counter()
        model.unwrap().load_state_dict(load_weights(full / "model.safetensors"))
        opt.load_state_dict(load_state(full / "optimizer"))
        sched.load_state_dict(load_state(full / "scheduler"))
        times["full_load"].append(time.perf_counter() - t)
        exact &= same()
        size["full"] = _mib(full)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    return {"preset": preset, "parameters": params, "ms": med, "mib": size, "round_trip_exact": exact,
            "save_ratio": med["dcp_save"] / med["full_save"], "load_ratio": med["dcp_load"] / med["full_load"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small,base")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="benchmarks/results/checkpoint_io.json")
    ap.add_argument("--quick", action="store_true", help="tiny, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.presets, args.rounds = "tiny", 1
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            rows.append(bench(preset, args.rounds, Path(tmp) / preset))
            shutil.rmtree(Path(tmp) / preset)
    print(f"{'preset':<7} {'params':>9} {'MiB':>7} {'dcp save':>9} {'full save':>10} {'ratio':>6} "
          f"{'dcp load':>9} {'full load':>10} {'ratio':>6} {'exact':>6}   (median ms of {args.rounds} rounds)")
    for r in rows:
        m = r["ms"]
        print(f"{r['preset']:<7} {r['parameters']:>9,} {r['mib']['dcp']:>7.1f} {m['dcp_save']:>9.1f} "
              f"{m['full_save']:>10.1f} {r['save_ratio']:>5.2f}x {m['dcp_load']:>9.1f} {m['full_load']:>10.1f} "
              f"{r['load_ratio']:>5.2f}x {str(r['round_trip_exact']):>6}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "rounds": args.rounds, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
