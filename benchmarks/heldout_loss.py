"""Held-out masked-cell loss of exported models on synthetic streams, side by side.

The same fixed held-out batches (the pretraining evaluation's: seed + HELD_OUT_SEED_OFFSET) for
every model, so weights trained on different streams or with other depths compare on equal
terms. Each model reads the tables with its own context features (ModelConfig.context_features,
what its pretraining showed it): the batches of a stream with context features hold fewer tables
(their cell budget), so every model is scored on exactly those tables and query cells, models
without features on the same tables without the extra columns. Prints a table (loss,
categorical NLL and accuracy, numeric NLL per model and stream) and writes JSON.

    python benchmarks/heldout_loss.py --models tabfm-tiny,runs/x/export --streams pretrain-wide,pretrain-mixed
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tabfm.synth.stream import StreamConfig
from tabfm.train.evaluate import batch_metrics, heldout_batches
from tabfm.weights import load_model

from common import machine_info


def paired_batches(stream: str, contracts: list[str], seed: int, n: int) -> dict[str, list]:
    """Held-out batches of `stream` for each context-feature contract, over the same tables: those of
    the batches with features (the fewest tables per batch) for every contract."""
    built = {c: heldout_batches(StreamConfig.preset(stream, context_features=c), seed, n) for c in contracts}
    fewest = [min(len(built[c][i]) for c in contracts) for i in range(n)]
    return {c: [b[:k] for b, k in zip(built[c], fewest)] for c in contracts}


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
    loaded = [(name, load_model(name).eval()) for name in models]
    contracts = sorted({m.config.context_features for _, m in loaded})
    batches = {s: paired_batches(s, contracts, args.seed, args.batches) for s in streams}
    rows = []
    for name, model in loaded:
        params = sum(p.numel() for p in model.parameters())
        for stream, by_contract in batches.items():
            t0 = time.process_time()
            metrics = batch_metrics(model, by_contract[model.config.context_features])
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
