"""The estimators the server runs: the in-process ones, keeping each member's encoded context.

A fitted in-process estimator encodes every member's context (`ContextPredictor`: the column
statistics and each block's row-attention keys/values) afresh on every predict call. A registered
context is asked again and again, so the served estimators keep those encodings, keyed by the exact
bytes of the context table the member built (its rows, features, target), and later calls only run
their query rows. The answers are the in-process estimators' to the last bit: `predict_rows` is
`ContextPredictor(...).predict(...)`, and a member's context does not depend on the query rows
(tests/test_serve.py compares them). What the encodings hold counts against --context-cache-mib.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from tabfm.estimators import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
from tabfm.inference import ContextPredictor


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside an encoded context (ContextCache: named tuples, dataclasses, lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(o) for o in vars(obj).values())
    return 0


class KeepsContexts:
    """Mixin over a TabFM estimator: `_context` remembers each encoded context it builds."""

    def _encoded(self) -> dict:
        return self.__dict__.setdefault("_encoded_contexts", {})

    def _context(self, rt: Any, context_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                 feature_ref: np.ndarray | None = None) -> ContextPredictor:
        x = np.ascontiguousarray(context_x, dtype=np.float32)
        digest = hashlib.blake2b(x.tobytes(), digest_size=16)
        parts = [np.asarray(kind, np.int64), np.asarray(cardinality, np.int64)]
        if feature_ref is not None:
            parts.append(np.asarray(feature_ref, np.int64))
        for part in parts:
            digest.update(np.ascontiguousarray(part).tobytes())
        key = (rt.id_seed, str(rt.device), str(rt.autocast), x.shape, feature_ref is None, digest.hexdigest())
        store = self._encoded()
        hit = store.get(key)
        if hit is None:
            hit = store[key] = super()._context(rt, x, kind, cardinality, feature_ref)
        return hit

    def _predict(self, rt: Any, context_x: np.ndarray, query_x: np.ndarray, query_mask: np.ndarray,
                 kind: np.ndarray, cardinality: np.ndarray, fn: Any, feature_ref: np.ndarray | None = None) -> np.ndarray:
        # tabfm.inference.predict_rows, with the context from _context
        if not np.asarray(query_mask).any():
            return np.empty((0,))
        return self._context(rt, context_x, kind, cardinality, feature_ref).predict(query_x, query_mask, fn,
                                                                                    self.chunk_size)

    def encoded_bytes(self) -> int:
        """Bytes the kept encodings hold."""
        return sum(_tensor_bytes(p.cache) for p in self._encoded().values())

    def drop_encoded(self) -> None:
        """Forget the kept encodings (the next call encodes again; answers unchanged)."""
        self._encoded().clear()

    def table_bytes(self) -> int:
        """Bytes of the fitted table the estimator holds."""
        return sum(int(getattr(getattr(self, name, None), "nbytes", 0) or 0)
                   for name in ("train_x_", "y_", "folds_", "offset_rows_"))


class ServedClassifier(KeepsContexts, TabFMClassifier):
    """TabFMClassifier that keeps its members' encoded contexts."""


class ServedRegressor(KeepsContexts, TabFMRegressor):
    """TabFMRegressor that keeps its members' encoded contexts."""


class ServedImputer(KeepsContexts, TabFMImputer):
    """TabFMImputer that keeps its members' encoded contexts, and (strategy="columns") its fitted
    per-column estimators with theirs."""

    column_estimators = {"regression": ServedRegressor, "classification": ServedClassifier}

    def _kept_columns(self) -> dict:
        return self.__dict__.setdefault("_column_estimators", {})

    def _column_estimator(self, j: int, table: Any, round_: int = 1, shown: Any = None) -> Any:
        kept = self._kept_columns()
        if (j, round_) not in kept:  # a round's fitted rows are a function of the fitted table alone
            kept[(j, round_)] = super()._column_estimator(j, table, round_, shown)
        return kept[(j, round_)]

    def encoded_bytes(self) -> int:
        return super().encoded_bytes() + sum(e.encoded_bytes() for e in self._kept_columns().values() if e is not None)

    def drop_encoded(self) -> None:
        super().drop_encoded()
        for e in self._kept_columns().values():
            if e is not None:
                e.drop_encoded()

    def table_bytes(self) -> int:
        table = getattr(self, "table_", None)  # the fitted frame the per-column estimators are fitted on
        own = 0 if table is None else int(table.memory_usage(deep=True).sum())
        return super().table_bytes() + own + sum(e.table_bytes() for e in self._kept_columns().values() if e is not None)


class ServedAnomalyDetector(KeepsContexts, TabFMAnomalyDetector):
    """TabFMAnomalyDetector that keeps its members' (and folds') encoded contexts."""


ESTIMATORS = {"classification": ServedClassifier, "regression": ServedRegressor, "imputation": ServedImputer,
              "anomaly": ServedAnomalyDetector}
