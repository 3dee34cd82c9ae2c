"""Held-out masked-cell loss of exported models on synthetic streams, side by side.

The same fixed held-out batches (the pretraining evaluation's: seed + HELD_OUT_SEED_OFFSET) for
every model, so weights trained on different streams or with other depths compare on equal
terms. Prints a table (loss, categorical NLL and accuracy, numeric NLL per model and stream)
and writes JSON.

    python benchmarks/heldout_loss.py --models tabfm-tiny,runs/x/export --streams pretrain-wide,pretrain-mixed
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tabfm.synth.stream import StreamConfig
from tabfm.train.evaluate import synthetic_eval
from tabfm.weights import load_model

from common import machine_info


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True, help="comma-separated shipped names or export directories")
    p.add_argument("--streams", default="pretrain-wide,pretrain-mixed", help="StreamConfig presets")
    p.add_argument("--batches", type=int, default=32, help="held-out batches per stream")
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (held-out batches derive from it)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/heldout_loss.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models, streams = args.models.split(","), args.streams.split(",")
    evals = {s: synthetic_eval(StreamConfig.preset(s), args.seed, args.batches) for s in streams}
    rows = []
    for name in models:
        model = load_model(name).eval()
        params = sum(p.numel() for p in model.parameters())
        for stream, run in evals.items():
            t0 = time.process_time()
            with torch.no_grad():
                metrics = run(model)
            rows.append({"model": name, "layers": model.config.n_layers, "parameters": params, "stream": stream,
                         **metrics, "cpu_s": time.process_time() - t0})
    print(f"\nheld-out masked-cell metrics, {args.batches} batches per stream, fp32\n")
    print("| model | layers | stream | loss | cat NLL | cat acc | num NLL | CPU s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} | {r['stream']} | {r['loss']:.4f} | {r['cat_nll']:.4f} | "
              f"{r['cat_acc']:.4f} | {r['num_nll']:.4f} | {r['cpu_s']:.0f} |")
    machine = {k: v for k, v in machine_info().items() if k not in ("backend", "torch_threads_per_rank")}
    out = {"args": vars(args), "machine": {**machine, "torch_threads": args.threads}, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()
