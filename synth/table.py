"""SynthTable: one generated table before it becomes part of a TableBatch."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLASSIFICATION, REGRESSION = "classification", "regression"


@dataclass
class SynthTable:
    """One synthetic table; the target is a column of X.

    X            float32 (n_rows, n_cols): numbers, categorical codes 0..k-1, NaN = missing
    kind         int8    (n_cols,): 1 numeric, 2 categorical (tabfm.data.batch constants)
    cardinality  int64   (n_cols,): categories per column, 0 for numeric
    target       index of the target column in X (never missing)
    task         "classification" (target categorical, 2..max_classes classes) or "regression"
    """

    X: np.ndarray
    kind: np.ndarray
    cardinality: np.ndarray
    target: int
    task: str

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.X.shape[0]), int(self.X.shape[1])
