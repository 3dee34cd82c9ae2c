"""What every TabFM estimator shares: parameters, input checks, the encoded training table,
the ensemble members, and running the model on a prediction table.

fit() only encodes and stores the training table (`train_x_`, `schema_`); the model is loaded
(and cached per process, see tabfm.weights) when predictions are first asked for.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted, column_or_1d
from torch import nn

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.data.encode import TableSchema, encode_frame
from tabfm.inference import (DEFAULT_CHUNK_SIZE, CellFn, ContextPredictor, append_context_features, context_predictor,
                             predict_rows, with_target)
from tabfm.model.onnx_export import is_onnx_file, onnx_model_of  # onnxruntime is imported only when used
from tabfm.weights import DEFAULT_MODEL, load_model

from .ensemble import NUMERIC_TRANSFORMS, Member, make_members, quantile_normal, subsample
from .linear import LinearScores, worth_showing
from .local_context import LOCAL_CONTEXT_ROWS, LocalContexts, check_size
from tabfm.data.neighbors import Neighbors, neighbor_sizes

DEFAULT_N_ESTIMATORS = 4
DEFAULT_MAX_CONTEXT_ROWS = 2048
DEFAULT_MAX_COLUMNS = 100
# classifier / regressor: each member shows the model at most 32 encoded columns (the shipped weights saw
# tables wider than 32 columns only with < 512 rows) while its neighbour and linear features read every column
DEFAULT_MAX_COLUMNS_SUPERVISED = 32
DEFAULT_N_NEIGHBORS = (5, 20)
PRECISIONS = ("auto", "fp32", "bf16")
BACKENDS = ("torch", "onnx")
CATEGORICAL_MODES = ("ordinal", "identity")
MULTICLASS = ("auto", "ovr", "native", "ecoc")
PROGRESS_MIN_PASSES = 8  # progress=None draws a bar from this many model passes in one call


@dataclass
class Runtime:
    """The loaded model and how to run it."""

    model: nn.Module  # the TabFM; with backend="onnx" its exported graph (tabfm.model.onnx_export.OnnxModel)
    device: torch.device
    autocast: torch.dtype | None
    id_seed: int = 0  # salt of the model's eval-mode column identities (one per ensemble member)

    def for_member(self, member: Member) -> "Runtime":
        """The runtime an ensemble member runs with: its own column-identity salt."""
        return dataclasses.replace(self, id_seed=int(member.seed) & 0xFFFFFFFF)

    @property
    def context_features(self) -> str:
        """The model's context features (ModelConfig.context_features): "none" for a model pretrained
        without; otherwise every prediction shows it those columns, and only those (module doc)."""
        return getattr(self.model.config, "context_features", "none")

    @property
    def max_categories(self) -> int:
        """Width K of the model's categorical head: codes 0..K-1 can be predicted."""
        return int(self.model.config.max_categories)


@dataclass
class View:
    """One member's view of the table for a separate target: its context rows (indices into the
    training rows), context and query features, their kinds and cardinalities as the model gets
    them, the rows' nearest context neighbours (None unless n_neighbors) and the context-fitted
    linear scores (None unless the estimator uses them: linear features, the regressor's residual);
    source_kind / source_card: the columns' kinds as encoded (what context features measure
    distances by, whatever `kind` shows the model)."""

    rows: np.ndarray
    ctx: np.ndarray
    query: np.ndarray
    kind: np.ndarray
    card: np.ndarray
    neighbors: Neighbors | None = None
    linear: LinearScores | None = None
    source_kind: np.ndarray | None = None
    source_card: np.ndarray | None = None

    def subset(self, sel: np.ndarray) -> "View":
        """The view with only the context rows where the boolean mask `sel` is set."""
        idx = np.flatnonzero(sel)
        nb = self.neighbors.subset(idx) if self.neighbors is not None else None
        lin = self.linear.subset(idx) if self.linear is not None else None
        return dataclasses.replace(self, rows=self.rows[idx], ctx=self.ctx[idx], neighbors=nb, linear=lin)


class TabFMEstimator(BaseEstimator):
    """Base of the TabFM estimators (not used directly).

    model             shipped model name (each estimator's default: tabfm.weights.DEFAULT_MODELS, the
                      weights measured best for its task), path of an export directory
                      (model.safetensors + config.json), or a TabFM module (moved to `device`).
    n_estimators      ensemble members (see tabfm.estimators.ensemble); outputs are averaged.
    random_state      seed (int, default 0), RandomState or None (a fresh seed per fit); drawn from at
                      fit, it fixes every random choice of the fitted estimator's predictions, so two
                      identical calls give identical answers (as TabPFN's estimators do).
    device            "auto" (CUDA when available, else CPU), or a torch device string.
    precision         "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32" or "bf16".
    max_context_rows  at most this many training rows are context per member (random subsample,
                      stratified by class for classification).
    max_columns       at most this many encoded feature columns per table; more are split into random
                      groups (random subsets per member for classification/regression).
    chunk_size        query rows per forward pass, every pass padded to exactly this many, so a row's
                      answer does not depend, not even in the last bit, on the rows predicted with it.
    progress          a progress bar over the model passes of a prediction call: None (default) draws
                      one when the call makes at least PROGRESS_MIN_PASSES passes and stderr is a
                      terminal; True always; False never.
    backend           "torch" (default) runs the model in torch; "onnx" runs its exported graph in
                      onnxruntime (CPU, fp32; `pip install "tabfm[onnx]"`, an ImportError naming it
                      otherwise): `model` is then a .onnx file of `tabfm export --onnx`, or a model
                      that is exported once per process (seconds to a minute). No context cache
                      there: every pass runs the context rows with its chunk of query rows.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODEL, n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None, backend: str = "torch") -> None:
        self.model = model
        self.n_estimators = n_estimators
        self.random_state = random_state
        self.device = device
        self.precision = precision
        self.max_context_rows = max_context_rows
        self.max_columns = max_columns
        self.chunk_size = chunk_size
        self.progress = progress
        self.backend = backend

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.categorical = True
        tags.input_tags.string = True
        return tags

    # ------------------------------------------------------------------ parameters
    def _check_params(self) -> None:
        for name in ("n_estimators", "max_context_rows", "max_columns", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        neighbor_sizes(getattr(self, "n_neighbors", 0))
        if not isinstance(getattr(self, "linear_features", False), (bool, np.bool_)):
            raise ValueError(f"linear_features must be True or False, got {self.linear_features!r}")
        if getattr(self, "multiclass", MULTICLASS[0]) not in MULTICLASS:
            raise ValueError(f"multiclass must be one of {MULTICLASS}, got {self.multiclass!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self._backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self._backend!r}")
        if getattr(self, "categorical", CATEGORICAL_MODES[0]) not in CATEGORICAL_MODES:
            raise ValueError(f"categorical must be one of {CATEGORICAL_MODES}, got {self.categorical!r}")
        if self.progress not in (None, True, False):
            raise ValueError(f"progress must be None, True or False, got {self.progress!r}")
        if getattr(self, "numeric", NUMERIC_TRANSFORMS[0]) not in NUMERIC_TRANSFORMS:
            raise ValueError(f"numeric must be one of {NUMERIC_TRANSFORMS}, got {self.numeric!r}")

    def _bar(self, passes: int, what: str) -> Any:
        """A tqdm bar over the `passes` model passes of one prediction call (see `progress`)."""
        from tqdm.auto import tqdm

        show = self.progress if self.progress is not None else passes >= PROGRESS_MIN_PASSES and sys.stderr.isatty()
        return tqdm(total=passes, desc=f"{type(self).__name__}.{what}", unit="pass", disable=not show, leave=False,
                    file=sys.stderr)

    @property
    def _backend(self) -> str:
        return getattr(self, "backend", BACKENDS[0])  # estimators pickled before the parameter existed

    def _runtime(self) -> Runtime:
        """Load (or reuse) the model on the configured device."""
        self._check_params()
        if self._backend == "onnx":
            return self._onnx_runtime()
        if is_onnx_file(self.model):
            raise ValueError(f"model={str(self.model)!r} is an ONNX graph: it runs with backend='onnx'")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" \
            else torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but this torch ({torch.__version__}, "
                             f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}) has no CUDA "
                             "device; use device='cpu' or 'auto'")
        if isinstance(self.model, nn.Module):
            # a module already there is used as it is: .to() would re-register the parameters of one that an
            # engine holds gathered (fine-tuning's held-out evaluation under FSDP)
            on = {p.device for p in self.model.parameters()}
            model = self.model if on == {device} else self.model.to(device)
        else:
            model = load_model(self.model, device)
        cast = {"fp32": None, "bf16": torch.bfloat16, "auto": torch.bfloat16 if device.type == "cuda" else None}
        return Runtime(model, device, cast[self.precision])

    def _onnx_runtime(self) -> Runtime:
        """backend="onnx": the model's exported graph in onnxruntime, on the CPU in fp32 (chosen here,
        once; nothing falls back to torch)."""
        if self.device not in ("auto", "cpu"):
            raise ValueError(f"backend='onnx' runs on onnxruntime's CPU; device={self.device!r} needs backend='torch'")
        if self.precision == "bf16":
            raise ValueError("backend='onnx' runs the exported graph in fp32; precision='bf16' needs backend='torch'")
        source = self.model if isinstance(self.model, nn.Module) or is_onnx_file(self.model) \
            else load_model(self.model, "cpu")
        return Runtime(onnx_model_of(source), torch.device("cpu"), None)

    # ------------------------------------------------------------------ inputs
    def _as_frame(self, X: Any, fitting: bool) -> pd.DataFrame:
        """X as a frame with string column names; records (fit) or checks (predict) the columns."""
        if isinstance(X, pd.DataFrame):
            frame, named = X, all(isinstance(c, str) and c for c in X.columns)
        else:
            if hasattr(X, "toarray"):
                raise TypeError("sparse input is not supported; pass a dense array or a DataFrame")
            arr = np.asarray(X)
            if arr.ndim != 2:
                raise ValueError(f"expected a 2-D table (rows, columns), got an array of shape {arr.shape}; "
                                 "Reshape your data (e.g. x.reshape(-1, 1) for a single column)")
            frame, named = pd.DataFrame(arr), False
        n_rows, width = frame.shape
        if width == 0 or n_rows == 0:
            what = "feature" if width == 0 else "sample"
            raise ValueError(f"Found array with 0 {what}(s) (shape={frame.shape}) while a minimum of 1 is required.")
        complex_cols = [c for c, dt in frame.dtypes.items() if getattr(dt, "kind", "") == "c"]
        if complex_cols:
            raise ValueError(f"Complex data not supported: columns {complex_cols}")
        if fitting:
            self.n_features_in_ = width
            if named:
                self.feature_names_in_ = np.asarray(frame.columns, dtype=object)
            elif hasattr(self, "feature_names_in_"):
                del self.feature_names_in_
            return frame if named else frame.set_axis([f"x{j}" for j in range(width)], axis=1)

        names = getattr(self, "feature_names_in_", None)
        if names is not None and named:
            missing = [c for c in names if c not in frame.columns]
            extra = [c for c in frame.columns if c not in set(names)]
            if missing or extra:
                raise ValueError(f"X has other columns than at fit: missing {missing}, extra {extra}")
            return frame[list(names)]
        if width != self.n_features_in_:
            raise ValueError(f"X has {width} features, but {type(self).__name__} is expecting {self.n_features_in_} "
                             "features as input")
        if names is not None:
            warnings.warn(f"X has no column names, but {type(self).__name__} was fitted with column names; "
                          "columns are matched by position", UserWarning, stacklevel=3)
            return frame.set_axis(list(names), axis=1)
        return frame.set_axis([f"x{j}" for j in range(width)], axis=1)

    def _fit_table(self, X: Any) -> pd.DataFrame:
        """Encode and store the training table; returns the frame it encoded."""
        self._check_params()
        frame = self._as_frame(X, fitting=True)
        enc, schema = encode_frame(frame)
        self.schema_: TableSchema = schema
        self.train_x_: np.ndarray = enc.x.numpy()
        # drawn at fit (as sklearn estimators do): a fitted estimator predicts the same way every call
        self.ensemble_seed_ = int(check_random_state(self.random_state).randint(0, 2**31 - 1))
        return frame

    def _encode(self, X: Any) -> tuple[pd.DataFrame, np.ndarray]:
        """The frame (columns in fitted order) and encoded values of new rows, with the fitted schema."""
        check_is_fitted(self, "train_x_")
        frame = self._as_frame(X, fitting=False)
        return frame, self.schema_.transform(frame).x.numpy()

    def _check_y(self, y: Any, n_rows: int) -> np.ndarray:
        """y as a 1-D array with as many entries as X has rows and no missing value."""
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        arr = y.to_numpy() if isinstance(y, (pd.Series, pd.DataFrame, pd.Index)) else np.asarray(y)
        if arr.ndim == 2 and arr.shape[1] == 1:
            arr = column_or_1d(arr, warn=True)
        if arr.ndim != 1:
            raise ValueError(f"y must be 1-D (one target per row), got shape {arr.shape}")
        if len(arr) != n_rows:
            raise ValueError(f"X has {n_rows} rows but y has {len(arr)}; they must match")
        missing = int(pd.isna(arr).sum())
        if missing:
            raise ValueError(f"y has {missing} missing value(s) (NaN/None) out of {len(arr)}; "
                             "drop those rows or fill the target first")
        return arr

    # ------------------------------------------------------------------ layout
    @property
    def _kind(self) -> np.ndarray:
        return self.schema_.kind.numpy()

    @property
    def _card(self) -> np.ndarray:
        return self.schema_.cardinality.numpy()

    def _units(self) -> list[np.ndarray]:
        """Encoded column indices of each source column (kept together when columns are split)."""
        starts = np.cumsum([0] + [len(c.encoded_columns()) for c in self.schema_.columns])
        return [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]

    def _members(self, cover_all: bool, n_classes: int | None = None) -> list[Member]:
        """The ensemble members, fixed at fit by random_state."""
        return make_members(self.ensemble_seed_, self.n_estimators, self._units(), self._kind, self._card, self.max_columns,
                            cover_all=cover_all, n_classes=n_classes, numeric=getattr(self, "numeric", "raw"))

    # ------------------------------------------------------------------ running
    def _predict(self, rt: Runtime, context_x: np.ndarray, query_x: np.ndarray, query_mask: np.ndarray,
                 kind: np.ndarray, cardinality: np.ndarray, fn: CellFn,
                 feature_ref: np.ndarray | None = None) -> np.ndarray:
        return predict_rows(rt.model, context_x, query_x, query_mask, kind, cardinality, fn,
                            chunk_size=self.chunk_size, device=rt.device, autocast_dtype=rt.autocast,
                            id_seed=rt.id_seed, feature_ref=feature_ref)

    def _finite(self, values: np.ndarray, what: str) -> np.ndarray:
        """`values` (the estimator's answer) if every entry is finite; otherwise refuse to answer."""
        bad = int((~np.isfinite(np.asarray(values, dtype=float))).sum())
        if bad:
            raise ValueError(f"the model ({self.model!r}) gave NaN or infinity for {bad} {what}: its weights are damaged "
                             "or the input holds values it cannot represent (check for extreme magnitudes); refusing "
                             "to answer with them")
        return values

    def _context(self, rt: Runtime, context_x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray,
                 feature_ref: np.ndarray | None = None) -> ContextPredictor:
        """A context encoded once, for many `predict` calls (see tabfm.inference.ContextPredictor)."""
        return context_predictor(rt.model, context_x, kind, cardinality, rt.device, rt.autocast, rt.id_seed,
                                 feature_ref)


class SupervisedTabFMEstimator(TabFMEstimator):
    """Base of the estimators that predict a separate target (classifier, regressor).

    categorical  how categorical features reach the model: "ordinal" (default) shows each
                 member's randomly relabelled codes as numbers, so every member sees the
                 categories in its own random order (as TabPFN does); "identity" feeds them as
                 categorical cells with random code identities. With the shipped weights ordinal
                 is far stronger on categorical tables (docs/estimators.md, BENCHMARKS.md). The target itself
                 is always categorical (classification) or numeric (regression).
    numeric      how numeric features reach the model: "raw" (standardised by the model's encoder),
                 "quantile" (normal scores of their ranks among the member's context rows, so skew
                 and outliers vanish), or "mixed" (members alternate raw / quantile and the ensemble
                 averages both views; the same passes). Defaults: "mixed" for the classifier (public
                 suite with `tabfm-tiny-cf`: ROC-AUC 0.9129 raw, 0.9150 quantile, 0.9158 mixed),
                 "quantile" for the regressor (BENCHMARKS.md).
    max_columns  as in TabFMEstimator, default 32 here: a wider table shows each member a random
                 subset of 32 encoded columns, while the neighbour and linear features below are
                 computed over every column (digits, 61 columns: ROC-AUC 0.989 -> 0.998; BENCHMARKS.md).
    n_neighbors  neighbourhood sizes (default (5, 20); an int k is (k,); 0 = off): show the model,
                 as extra feature columns (on top of max_columns), the target's mean over each
                 row's k nearest context rows for each k (classification: the share of the class;
                 leave-one-out on the context rows; see tabfm.data.neighbors). With the
                 shipped weights the largest gain measured (docs/estimators.md, BENCHMARKS.md).
    linear_features  show the model, as one more extra feature column per target, the score of a
                 linear model of the target fitted on the context rows (logistic regression for a
                 class, ridge for a number; out-of-fold on the context rows), where on the
                 context rows it orders them by the target about as well as the neighbour
                 means do or better (see tabfm.estimators.linear). Default True.
    Other parameters: see TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODEL, n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS_SUPERVISED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 categorical: str = "ordinal", numeric: str = "raw",
                 n_neighbors: int | tuple[int, ...] = DEFAULT_N_NEIGHBORS, linear_features: bool = True,
                 local_context: int = LOCAL_CONTEXT_ROWS, backend: str = "torch") -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, backend=backend)
        self.categorical = categorical
        self.numeric = numeric
        self.n_neighbors = n_neighbors
        self.linear_features = linear_features
        self.local_context = local_context

    def _check_params(self) -> None:
        super()._check_params()
        check_size(self.local_context)

    def _fit_local(self, target: np.ndarray, classes: bool) -> None:
        """Group the training rows for the local members (None: no local members; module
        tabfm.estimators.local_context). target: (n,) class labels (classes) or numbers."""
        size = min(int(self.local_context), int(self.max_context_rows))
        # local members are members 2, 3, 6, 7, ... (_is_local): fewer than 3 members have none to group for
        self.local_: LocalContexts | None = None if size == 0 or self.n_estimators < 3 else LocalContexts.of(
            self.train_x_, self._kind, self._card, target, classes, size, self.ensemble_seed_)

    def _is_local(self, i: int) -> bool:
        """Member i reads local contexts: every second pair of members (0, 1 global; 2, 3 local; ...),
        so each alternating choice (numeric view, residual) is made on both kinds of context."""
        return getattr(self, "local_", None) is not None and (i // 2) % 2 == 1

    def _views(self, member: Member, i: int, x: np.ndarray, classes: bool, rt: Runtime) -> list[tuple[np.ndarray, View]]:
        """(query row indices, view) pairs that cover x once: one view of all rows, or, for a local
        member, one view per group of rows with that group's local context."""
        if not self._is_local(i):
            return [(np.arange(len(x)), self._supervised_view(member, x, classes, rt))]
        return [(q, self._supervised_view(member, x[q], classes, rt, rows=rows)) for q, rows in self.local_.groups(x)]

    def _uses_linear(self, legacy: bool) -> bool:
        """Does a view need the context-fitted linear scores (View.linear)? For the linear feature
        columns only with a `legacy` model (one pretrained without context features)."""
        return bool(self.linear_features) and legacy

    def _supervised_view(self, member: Member, x_query: np.ndarray, classes: bool, rt: Runtime,
                         rows: np.ndarray | None = None) -> View:
        """A member's view of the table for the target `self.y_` (see View); classes: y_ holds class
        codes (the context is then stratified by class); rows: its context rows (default: a random
        subsample of max_context_rows). A model with context features gets no other extra column
        (the legacy neighbour / linear features are for models without)."""
        if rows is None:
            rows = subsample(member.rng(0), np.arange(len(self.train_x_)), self.max_context_rows,
                             self.y_ if classes else None)
        # neighbour and linear features read every column, the model the member's own (max_columns)
        legacy = rt.context_features == "none"
        sizes = neighbor_sizes(self.n_neighbors) if legacy else ()
        cols = member.column_groups[0]
        want_linear = self._uses_linear(legacy)
        read = np.arange(self.train_x_.shape[1]) if sizes or want_linear else cols
        ctx, query = member.view(self.train_x_[rows], read), member.view(x_query, read)
        # a linear model reads the features as they are (a rank transform would bend linear relations)
        linear = LinearScores.of(ctx, query, self._kind, self._card, member.rng(0, 1)) if want_linear else None
        if member.numeric == "quantile":
            for j in np.flatnonzero(self._kind[read] == NUMERIC):
                query[:, j] = quantile_normal(ctx[:, j], query[:, j])
                ctx[:, j] = quantile_normal(ctx[:, j], ctx[:, j])
        neighbors = Neighbors.of(ctx, query, self._kind, self._card, sizes, self.y_[rows], classes) if sizes else None
        if read is not cols:
            ctx, query = ctx[:, cols], query[:, cols]
        kind, card = self._kind[cols], self._card[cols]
        if self.categorical == "ordinal":  # the member's relabelled codes, read as numbers
            kind, card = np.where(kind == CATEGORICAL, NUMERIC, kind), np.where(kind == CATEGORICAL, 0, card)
        return View(rows, ctx, query, kind, card, neighbors, linear, self._kind[cols], self._card[cols])

    def _predict_target(self, rt: Runtime, view: View, context_y: np.ndarray, n_classes: int | None, fn: CellFn,
                        feature_targets: np.ndarray | None = None) -> np.ndarray:
        """fn of the model's output for the target cell of every query row (target = last column).

        feature_targets (n_context, m): the view's neighbour means (m per neighbourhood size) and
        linear scores (those worth showing, at most m) of these targets are shown as extra numeric
        feature columns (see tabfm.data.neighbors and tabfm.estimators.linear).
        """
        context_x, query_x, kind, cardinality = view.ctx, view.query, view.kind, view.card
        refs = None
        if rt.context_features != "none":  # exactly the columns its pretraining episodes carried
            context_x, query_x, kind, cardinality, refs = append_context_features(
                context_x, query_x, kind, cardinality, context_y, n_classes, rt.context_features,
                np.random.default_rng([rt.id_seed, 1]), design=(view.source_kind, view.source_card))
            feature_targets = None
        extras = []
        if feature_targets is not None and view.neighbors is not None:
            extras.append(view.neighbors.features(feature_targets))
        if feature_targets is not None and view.linear is not None and self.linear_features:
            lin_c, lin_q = view.linear.features(feature_targets)
            keep = worth_showing(lin_c, extras[0][0] if extras else None, feature_targets)
            if keep.any():
                extras.append((lin_c[:, keep], lin_q[:, keep]))
        if extras:
            extra_c = np.hstack([c for c, _ in extras])
            extra_q = np.hstack([q for _, q in extras])
            context_x, query_x = np.hstack([context_x, extra_c]), np.hstack([query_x, extra_q])
            kind = np.concatenate([kind, np.full(extra_c.shape[1], NUMERIC, dtype=kind.dtype)])
            cardinality = np.concatenate([cardinality, np.zeros(extra_c.shape[1], dtype=cardinality.dtype)])
        ctx, kind_t, card_t = with_target(context_x, context_y, kind, cardinality, n_classes)
        qx, _, _ = with_target(query_x, None, kind, cardinality, n_classes)
        mask = np.zeros(qx.shape, dtype=bool)
        mask[:, -1] = True
        return self._predict(rt, ctx, qx, mask, kind_t, card_t, fn, refs)
