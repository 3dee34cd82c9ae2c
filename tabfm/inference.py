"""In-context prediction: the core every estimator builds on. No weight is updated.

A prediction table = context rows (fully visible; rows other rows attend to) followed by
query rows whose hidden cells the model must predict. Query rows are not context, so a
query row's prediction depends only on the context and on the row itself: splitting the
query rows into chunks gives the same answers as one big pass, and the context can be
encoded once (`ContextPredictor`, the model's `encode_context`) and reused by every chunk,
so a chunk costs only its own rows.

With an exported graph (`tabfm.model.onnx_export.OnnxModel`, the estimators' `backend="onnx"`) there is
no cache: `OnnxContextPredictor` runs the context together with every chunk of query rows (the same
answers, within the export's tolerance, at the cost of the context rows in every pass).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.data.context_features import ContextFeatureSpec, context_features, feature_refs
from tabfm.model import ContextCache, ModelOutput
from tabfm.model.onnx_export import OnnxModel

# fn(output, values) -> (N, ...) tensor for the N query cells; values = their true values (NaN = unknown)
CellFn = Callable[[ModelOutput, torch.Tensor], torch.Tensor]
# query rows per forward pass (every pass padded to exactly this many, see ContextPredictor.predict)
DEFAULT_CHUNK_SIZE = 256


def query_batch(context_x: np.ndarray, query_x: np.ndarray, query_mask: np.ndarray, kind: np.ndarray,
                cardinality: np.ndarray, feature_ref: np.ndarray | None = None) -> TableBatch:
    """One table: context rows, then query rows whose `query_mask` cells are hidden (values kept for
    scoring); feature_ref (C, 3): what its context-feature columns estimate (None: it has none).
    Without context rows it is a batch of query rows for `TabFM.forward_queries`."""
    n_ctx = len(context_x)
    x = np.concatenate([context_x, query_x]).astype(np.float32, copy=False)
    context = np.zeros(len(x), dtype=bool)
    context[:n_ctx] = True
    query = np.zeros(x.shape, dtype=bool)
    query[n_ctx:] = query_mask
    return TableBatch.from_table(torch.from_numpy(x), torch.from_numpy(np.asarray(kind, dtype=np.int8)),
                                 torch.from_numpy(np.asarray(cardinality, dtype=np.int64)),
                                 torch.from_numpy(context), torch.from_numpy(query), validate=n_ctx > 0,
                                 feature_ref=None if feature_ref is None else torch.from_numpy(
                                     np.asarray(feature_ref, dtype=np.int64)))


def with_target(x: np.ndarray, y: np.ndarray | None, kind: np.ndarray, cardinality: np.ndarray,
                n_classes: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features + the target as the last column (NaN when y is None); the kind/cardinality that go with it.

    n_classes: number of target classes (categorical target, codes 0..n-1) or None (numeric target).
    """
    col = np.full(len(x), np.nan, dtype=np.float32) if y is None else np.asarray(y, dtype=np.float32)
    return (np.concatenate([np.asarray(x, dtype=np.float32), col[:, None]], axis=1),
            np.append(np.asarray(kind, dtype=np.int8), CATEGORICAL if n_classes else NUMERIC),
            np.append(np.asarray(cardinality, dtype=np.int64), n_classes or 0))


def append_context_features(
    context_x: np.ndarray, query_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray, y_context: np.ndarray,
    n_classes: int | None, name: str, rng: np.random.Generator,
    design: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Features with a model's context features (ModelConfig.context_features `name`, built by
    tabfm.data.context_features as in its pretraining episodes) appended as numeric columns; "none" returns
    them unchanged. design: the (kind, cardinality) the features' distances read when the model is
    shown other kinds (e.g. categorical codes as numbers); default: kind, cardinality.

    The fifth result is the `TableBatch.feature_ref` rows (C + 1, 3) of the returned columns followed
    by the target, which `with_target` appends last: what each context-feature column estimates."""
    spec = ContextFeatureSpec.named(name)
    n_own = np.asarray(kind).shape[0]
    if spec is None:
        return context_x, query_x, kind, cardinality, feature_refs(n_own + 1, slice(0), n_own, None, n_classes)
    d_kind, d_card = design if design is not None else (kind, cardinality)
    extra_c, extra_q = context_features(context_x, query_x, d_kind, d_card, y_context, n_classes, spec, rng)
    width = extra_c.shape[1]
    refs = feature_refs(n_own + width + 1, slice(n_own, n_own + width), n_own + width, spec, n_classes)
    return (np.hstack([np.asarray(context_x, dtype=np.float32), extra_c]),
            np.hstack([np.asarray(query_x, dtype=np.float32), extra_q]),
            np.concatenate([np.asarray(kind, dtype=np.int8), np.full(width, NUMERIC, dtype=np.int8)]),
            np.concatenate([np.asarray(cardinality, dtype=np.int64), np.zeros(width, dtype=np.int64)]), refs)


def target_batch(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
    n_classes: int | None, context_features: str = "none", seed: int = 0,
) -> TableBatch:
    """One table: features (encoded; plus the model's `context_features`, seeded by `seed`) + the
    target as the last column, hidden on the test rows."""
    x_train, x_test, kind, cardinality, refs = append_context_features(
        x_train, x_test, kind, cardinality, y_train, n_classes, context_features, np.random.default_rng(seed))
    ctx, kind_t, card_t = with_target(x_train, y_train, kind, cardinality, n_classes)
    qx, _, _ = with_target(x_test, None, kind, cardinality, n_classes)
    mask = np.zeros(qx.shape, dtype=bool)
    mask[:, -1] = True
    return query_batch(ctx, qx, mask, kind_t, card_t, refs)


@contextlib.contextmanager
def _inference(model: nn.Module, device: torch.device, autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """Eval mode (restored after), inference_mode, and bf16 autocast when asked for. A model that
    FSDP shards (fine-tuning's held-out evaluation) runs under no_grad instead: the parameters its
    units gather would otherwise be inference tensors that its next training step cannot update."""
    was_training = model.training
    model.eval()
    try:
        with _no_autograd(model), torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                                    enabled=autocast_dtype is not None):
            yield
    finally:
        model.train(was_training)


def _no_autograd(model: nn.Module) -> contextlib.AbstractContextManager:
    from torch.distributed.fsdp import FSDPModule

    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    return torch.no_grad() if sharded else torch.inference_mode()


def _device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else next(model.parameters()).device


def forward_eval(model: nn.Module, batch: TableBatch, device: torch.device | str | None = None,
                 autocast_dtype: torch.dtype | None = None, id_seed: int = 0) -> ModelOutput:
    """Model output for the query cells of `batch`, in eval mode under inference_mode.

    autocast_dtype: None runs in the model's dtype (fp32); torch.bfloat16 autocasts (for CUDA).
    """
    device = _device_of(model, device)
    with _inference(model, device, autocast_dtype):
        return model(batch.to(device), id_seed=id_seed)


class ContextPredictor:
    """One context table, encoded once; `predict` answers any number of query rows against it.

    Every chunk of query rows reuses the context's cached keys/values (`TabFM.encode_context`),
    so it costs its own rows only; answers equal one `forward_eval` over context + queries.
    """

    def __init__(self, model: nn.Module, context_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                 device: torch.device | str | None = None, autocast_dtype: torch.dtype | None = None,
                 id_seed: int = 0, feature_ref: np.ndarray | None = None) -> None:
        self.model, self.kind, self.cardinality, self.feature_ref = model, kind, cardinality, feature_ref
        self.device, self.autocast_dtype = _device_of(model, device), autocast_dtype
        no_query = np.zeros((0, len(kind)), dtype=np.float32)
        batch = query_batch(context_x, no_query, no_query.astype(bool), kind, cardinality, feature_ref)
        with _inference(model, self.device, autocast_dtype):
            self.cache: ContextCache = model.encode_context(batch.to(self.device), id_seed=id_seed)

    def predict(self, query_x: np.ndarray, query_mask: np.ndarray, fn: CellFn,
                chunk_size: int = DEFAULT_CHUNK_SIZE) -> np.ndarray:
        """fn(output, values) for every `query_mask` cell, in row-major order, as float64 numpy.

        Query rows go through the model `chunk_size` at a time; rows without a query cell are skipped.
        Every pass holds exactly `chunk_size` rows (the last one padded with copies of its last row,
        whose answers are dropped): with one shape for every pass, a row's answer is the same to the
        last bit whichever rows are predicted with it (sklearn's subset invariance).
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        rows = np.flatnonzero(np.asarray(query_mask).any(1))
        parts = []
        for start in range(0, len(rows), chunk_size):
            take = rows[start:start + chunk_size]
            padded = np.concatenate([take, np.full(chunk_size - len(take), take[-1])])
            parts.append(self._chunk(query_x[padded], query_mask[padded], fn, len(take)))
        return np.concatenate(parts) if parts else np.empty((0,))

    def _chunk(self, query_x: np.ndarray, query_mask: np.ndarray, fn: CellFn, n_rows: int) -> np.ndarray:
        """fn's answers for the query cells of the first `n_rows` rows of one pass, in row-major order."""
        empty = np.zeros((0, len(self.kind)), dtype=np.float32)
        batch = query_batch(empty, query_x, query_mask, self.kind, self.cardinality, self.feature_ref)
        with _inference(self.model, self.device, self.autocast_dtype):
            out = self.model.forward_queries(batch.to(self.device), self.cache)
            b, r, c = out.index.unbind(1)
            values = batch.x.to(out.index.device)[b, r, c]
            answers = fn(out, values).detach().to("cpu", torch.float64).numpy()
            return answers[(r < n_rows).cpu().numpy()]


class OnnxContextPredictor(ContextPredictor):
    """`ContextPredictor`'s interface over an exported graph (`OnnxModel`): no cached keys/values,
    so every pass runs the context rows with the chunk of query rows (the graph is the full forward)."""

    def __init__(self, model: OnnxModel, context_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                 id_seed: int = 0, feature_ref: np.ndarray | None = None) -> None:
        self.model, self.kind, self.cardinality, self.id_seed = model, kind, cardinality, id_seed
        self.feature_ref = feature_ref
        self.context_x = np.asarray(context_x, dtype=np.float32)

    def _chunk(self, query_x: np.ndarray, query_mask: np.ndarray, fn: CellFn, n_rows: int) -> np.ndarray:
        batch = query_batch(self.context_x, query_x, query_mask, self.kind, self.cardinality, self.feature_ref)
        out = self.model(batch, id_seed=self.id_seed)
        b, r, c = out.index.unbind(1)
        with torch.inference_mode():
            answers = fn(out, batch.x[b, r, c]).detach().to(torch.float64).numpy()
        return answers[(r < len(self.context_x) + n_rows).numpy()]


def context_predictor(model: nn.Module | OnnxModel, context_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                      device: torch.device | str | None = None, autocast_dtype: torch.dtype | None = None,
                      id_seed: int = 0, feature_ref: np.ndarray | None = None) -> ContextPredictor:
    """The predictor for `model`: a `ContextPredictor` (cached context) for a torch module, an
    `OnnxContextPredictor` for an exported graph (which runs on onnxruntime's CPU, in fp32).
    feature_ref (C, 3): what the table's context-feature columns estimate (TableBatch.feature_ref)."""
    if isinstance(model, OnnxModel):
        return OnnxContextPredictor(model, context_x, kind, cardinality, id_seed, feature_ref)
    return ContextPredictor(model, context_x, kind, cardinality, device, autocast_dtype, id_seed, feature_ref)


def predict_rows(model: nn.Module | OnnxModel, context_x: np.ndarray, query_x: np.ndarray, query_mask: np.ndarray,
                 kind: np.ndarray, cardinality: np.ndarray, fn: CellFn, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 device: torch.device | str | None = None, autocast_dtype: torch.dtype | None = None,
                 id_seed: int = 0, feature_ref: np.ndarray | None = None) -> np.ndarray:
    """fn(output, values) for every `query_mask` cell, in row-major order, as float64 numpy
    (a `context_predictor` used once). Exact: query rows never see each other."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not np.asarray(query_mask).any():
        return np.empty((0,))
    predictor = context_predictor(model, context_x, kind, cardinality, device, autocast_dtype, id_seed, feature_ref)
    return predictor.predict(query_x, query_mask, fn, chunk_size)
