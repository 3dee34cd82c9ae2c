"""Evaluations run during training: held-out synthetic tables and scikit-learn's bundled datasets."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from tabfm.data import encode_frame
from tabfm.synth.stream import StreamConfig, SynthStream
from tabfm.inference import forward_eval, target_batch
from tabfm.model import masked_cell_loss
from tabfm.model.predict import class_probabilities

HELD_OUT_SEED_OFFSET = 1_000_003  # held-out synthetic tables come from a seed training never uses


def heldout_batches(cfg: StreamConfig, seed: int, n_batches: int) -> list:
    """The fixed held-out synthetic batches of a run with `seed` (a seed its training never uses)."""
    stream = SynthStream(cfg, seed=seed + HELD_OUT_SEED_OFFSET)
    return [stream.batch_at(p) for p in range(n_batches)]


@torch.no_grad()
def batch_metrics(model: nn.Module, batches: list) -> dict[str, float]:
    """Masked-cell metrics of `model` over `batches`, each averaged over the cells it applies to."""
    device = next(model.parameters()).device
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for batch in batches:
        _, metrics = masked_cell_loss(model(batch.to(device)), batch.to(device))
        for key, weight_key in (("loss", "cells"), ("cat_nll", "cat_cells"), ("num_nll", "num_cells"), ("cat_acc", "cat_cells")):
            w = metrics[weight_key]
            if w > 0:
                sums[key] = sums.get(key, 0.0) + metrics[key] * w
                weights[key] = weights.get(key, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums}


def synthetic_eval(cfg: StreamConfig, seed: int, n_batches: int) -> Callable[[nn.Module], dict[str, float]]:
    """Mean masked-cell metrics on a fixed set of held-out synthetic batches."""
    batches = heldout_batches(cfg, seed, n_batches)
    return lambda model: batch_metrics(model, batches)


SKLEARN_DATASETS = ("breast_cancer", "wine", "iris")


def sklearn_eval(names: tuple[str, ...] = SKLEARN_DATASETS, seed: int = 0,
                 context_features: str = "none") -> Callable[[nn.Module], dict[str, float]]:
    """ROC-AUC and accuracy of in-context classification on a stratified 50/50 split of each dataset,
    one n-way pass with the model's `context_features` (what its pretraining episodes showed it)."""
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    tasks = []
    for name in names:
        frame = getattr(datasets, f"load_{name}")(as_frame=True)
        X, y = frame.data, frame.target.to_numpy()
        classes, codes = np.unique(y, return_inverse=True)
        tr, te = train_test_split(np.arange(len(y)), train_size=0.5, stratify=codes, random_state=seed)
        enc_tr, schema = encode_frame(X.iloc[tr])
        enc_te, _ = encode_frame(X.iloc[te], schema=schema)
        batch = target_batch(enc_tr.x.numpy(), codes[tr], enc_te.x.numpy(), enc_tr.kind.numpy(),
                             enc_tr.cardinality.numpy(), len(classes), context_features, seed)
        tasks.append((name, batch, codes[te], len(classes)))

    def run(model: nn.Module) -> dict[str, float]:
        from sklearn.metrics import roc_auc_score

        out: dict[str, float] = {}
        for name, batch, y_te, k in tasks:
            probs = class_probabilities(forward_eval(model, batch))[:, :k].double()
            probs = (probs.clamp_min(1e-15) / probs.clamp_min(1e-15).sum(-1, keepdim=True)).cpu().numpy()
            auc = roc_auc_score(y_te, probs[:, 1]) if k == 2 else roc_auc_score(y_te, probs, multi_class="ovr")
            out[f"{name}_auc"] = float(auc)
            out[f"{name}_acc"] = float((probs.argmax(1) == y_te).mean())
        out["mean_auc"] = float(np.mean([out[f"{n}_auc"] for n, *_ in tasks]))
        return out

    return run
