"""In-context prediction of one target column: the core every estimator builds on.

The training rows (features + known target) are the context; the test rows' target
cells are the query. No weight is updated.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.model import ModelOutput


def target_batch(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
    n_classes: int | None,
) -> TableBatch:
    """One table: features (encoded) + the target as the last column, hidden on the test rows.

    n_classes: number of target classes (categorical target, codes 0..n-1) or None (numeric target).
    """
    n_tr, n_te = len(x_train), len(x_test)
    x = np.concatenate([x_train, x_test]).astype(np.float32)
    y = np.concatenate([np.asarray(y_train, dtype=np.float32), np.full(n_te, np.nan, dtype=np.float32)])
    x = np.concatenate([x, y[:, None]], axis=1)
    kind = np.append(np.asarray(kind, dtype=np.int8), CATEGORICAL if n_classes else NUMERIC)
    card = np.append(np.asarray(cardinality, dtype=np.int64), n_classes or 0)
    context = np.zeros(n_tr + n_te, dtype=bool)
    context[:n_tr] = True
    query = np.zeros(x.shape, dtype=bool)
    query[n_tr:, -1] = True
    return TableBatch.from_table(torch.from_numpy(x), torch.from_numpy(kind), torch.from_numpy(card),
                                 torch.from_numpy(context), torch.from_numpy(query))


@torch.no_grad()
def forward_eval(model: nn.Module, batch: TableBatch, device: torch.device | str | None = None,
                 autocast_dtype: torch.dtype | None = None) -> ModelOutput:
    """Model output for the query cells of `batch`, in eval mode, no grad."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            return model(batch.to(device))
    finally:
        model.train(was_training)
