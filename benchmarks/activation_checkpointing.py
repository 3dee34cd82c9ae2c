"""`tabfm pretrain --activation-checkpointing` on vs off: activation memory kept for backward and step time.

Each preset runs the same stream batches (seed 0) from the same weights twice, without and with
every block checkpointed (`tabfm.parallel.checkpoint_blocks`). Activation memory is measured
directly, not from the process's size: the bytes of every tensor autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks` around the forward; a checkpointed block saves only
its inputs, its recomputation happens in backward). Reported: the mean saved bytes per batch,
the median step time (forward + backward + AdamW) of the two runs side by side, their ratio, and
the largest loss difference. Prints a table, writes JSON.

    python benchmarks/activation_checkpointing.py              # tiny and small, ~3 min on one core
    python benchmarks/activation_checkpointing.py --quick      # a smaller model, a few steps
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.parallel import checkpoint_blocks
from tabfm.synth import StreamConfig
from tabfm.synth.dataset import SynthDataset

from common import machine_info


def run(model: TabFM, batches: list) -> tuple[list[int], list[float], list[float]]:
    """(bytes saved for backward, seconds, loss) per AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved, times, losses = [], [], []
    for batch in batches:
        kept = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[0] += t.numel() * t.element_size()
            return t

        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = masked_cell_loss(model(batch), batch)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        saved.append(kept[0])
        losses.append(float(loss.detach()))
    return saved, times, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 1-block model, the tiny stream, 3 steps")
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--stream", default="pretrain")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="benchmarks/results/activation_checkpointing.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    presets = ["tiny"] if args.quick else args.presets.split(",")
    stream, steps = ("tiny", 3) if args.quick else (args.stream, args.steps)
    it = iter(SynthDataset(StreamConfig.preset(stream), seed=0))
    batches = [next(it) for _ in range(steps)]
    rows = []
    for name in presets:
        cfg = ModelConfig.preset(name, **({"n_layers": 1, "d_model": 32, "n_heads": 2} if args.quick else {}))
        torch.manual_seed(0)
        plain = TabFM(cfg).train()
        ckpt = copy.deepcopy(plain)
        checkpoint_blocks(ckpt, ckpt.parallel_plan())
        torch.manual_seed(1)
        p_saved, p_times, p_loss = run(plain, batches)
        torch.manual_seed(1)
        c_saved, c_times, c_loss = run(ckpt, batches)
        rows.append({"preset": name, "blocks": cfg.n_layers,
                     "saved_mib_plain": float(np.mean(p_saved)) / 2**20, "saved_mib_ckpt": float(np.mean(c_saved)) / 2**20,
                     "memory_ratio": float(np.mean(c_saved) / np.mean(p_saved)),
                     "step_s_plain": float(np.median(p_times)), "step_s_ckpt": float(np.median(c_times)),
                     "time_ratio": float(np.sum(c_times) / np.sum(p_times)),
                     "max_loss_diff": float(np.max(np.abs(np.subtract(p_loss, c_loss))))})
    print(f"stream {stream}, {steps} steps, AdamW, fp32, {args.threads} thread(s); memory = bytes autograd saves for backward")
    print(f"{'preset':>7} {'blocks':>6} {'saved MiB off':>14} {'saved MiB on':>13} {'x memory':>9} "
          f"{'step s off':>11} {'step s on':>10} {'x time':>7} {'max |dloss|':>12}")
    for r in rows:
        print(f"{r['preset']:>7} {r['blocks']:>6} {r['saved_mib_plain']:>14.1f} {r['saved_mib_ckpt']:>13.1f} "
              f"{r['memory_ratio']:>9.2f} {r['step_s_plain']:>11.3f} {r['step_s_ckpt']:>10.3f} {r['time_ratio']:>7.2f} "
              f"{r['max_loss_diff']:>12.2e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "stream": stream, "steps": steps,
                                           "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
