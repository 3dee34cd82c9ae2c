"""Episodes: which rows a table shows as context and which cells it hides as queries.

One generated table becomes one training question. Prediction episodes
(classification, regression) hide the target column of the non-context rows;
imputation episodes show every row and hide a random subset of observed cells.
The hidden cells keep their true values in x (the loss needs them); the model only
sees them through TableBatch.visible_x(). `pack` stacks B tables of one shape into
a TableBatch without copying more than once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tabfm.data.batch import NUMERIC, PAD, TableBatch
from tabfm.data.context_features import ContextFeatureSpec, context_features, feature_refs, ridge_baseline
from tabfm.data.masking import hide_cells
from .table import CLASSIFICATION, REGRESSION, SynthTable

IMPUTATION = "imputation"
TASKS = (CLASSIFICATION, REGRESSION, IMPUTATION)


@dataclass(frozen=True)
class Episode:
    """The question asked of one table: context rows (R,) and query cells (R, C), both bool; with
    context features, what each column estimates (C, 3), as TableBatch.feature_ref (None: nothing)."""

    task: str
    context: np.ndarray
    query: np.ndarray
    feature_ref: np.ndarray | None = None


def prediction_episode(table: SynthTable, rng: np.random.Generator, context_fraction: tuple[float, float]) -> Episode:
    """Label a random fraction of rows as context; query the target of all other rows.

    The number of context rows is clamped to [1, R-1] so every episode has both
    something to learn from and something to predict.
    """
    n_rows, n_cols = table.shape
    if n_rows < 2:
        raise ValueError(f"a prediction episode needs at least 2 rows, got {n_rows}")
    lo, hi = context_fraction
    n_ctx = int(np.clip(round(rng.uniform(lo, hi) * n_rows), 1, n_rows - 1))
    context = np.zeros(n_rows, dtype=bool)
    context[rng.permutation(n_rows)[:n_ctx]] = True
    query = np.zeros((n_rows, n_cols), dtype=bool)
    query[~context, table.target] = True
    return Episode(task=table.task, context=context, query=query)


def imputation_episode(table: SynthTable, rng: np.random.Generator, mask_fraction: tuple[float, float],
                       mechanisms: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> Episode:
    """Show every row; hide a fraction f ~ U(mask_fraction) of the observed cells.

    `mechanisms` are the shares of MCAR / MAR / MNAR masks (tabfm.data.masking.hide_cells, shared
    with the store's episodes). Already-missing (NaN) cells are never queried: they have no value
    to score. At least one cell is hidden when any is observed, so the episode is never empty.
    """
    query = hide_cells(table.X, rng, mask_fraction, mechanisms)
    return Episode(task=IMPUTATION, context=np.ones(table.shape[0], dtype=bool), query=query)


def with_residual_target(table: SynthTable, episode: Episode, rng: np.random.Generator) -> SynthTable:
    """A regression episode's table with its target replaced by what a context-fitted ridge misses
    (tabfm.data.context_features.ridge_baseline: out of fold for the context rows, the full fit for
    the query rows): the question TabFMRegressor's linear residual asks of the model."""
    if episode.task != REGRESSION:
        raise ValueError(f"a residual target needs a regression episode, got {episode.task!r}")
    features = np.flatnonzero(np.arange(table.shape[1]) != table.target)
    ctx, query = episode.context, ~episode.context
    x = table.X
    base_c, base_q = ridge_baseline(x[ctx][:, features], x[query][:, features], table.kind[features],
                                    table.cardinality[features], x[ctx, table.target], rng)
    grown = x.copy()
    grown[ctx, table.target] = x[ctx, table.target] - base_c
    grown[query, table.target] = x[query, table.target] - base_q
    return SynthTable(X=grown, kind=table.kind, cardinality=table.cardinality, target=table.target, task=table.task)


def with_context_features(table: SynthTable, episode: Episode, spec: ContextFeatureSpec,
                          rng: np.random.Generator) -> tuple[SynthTable, Episode]:
    """A prediction episode with its context features (tabfm.data.context_features) appended as numeric
    columns after the table's own; an imputation episode (no target) comes back unchanged."""
    if episode.task == IMPUTATION:
        return table, episode
    features = np.flatnonzero(np.arange(table.shape[1]) != table.target)
    ctx, query = episode.context, ~episode.context
    y = table.X[ctx, table.target]
    n_classes = int(table.cardinality[table.target]) if table.task == CLASSIFICATION else None
    x = table.X[:, features]
    extra_c, extra_q = context_features(x[ctx], x[query], table.kind[features], table.cardinality[features],
                                        y, n_classes, spec, rng)
    extra = np.zeros((table.shape[0], extra_c.shape[1]), dtype=np.float32)
    extra[ctx], extra[query] = extra_c, extra_q
    width = extra.shape[1]
    grown = SynthTable(X=np.hstack([table.X, extra]),
                       kind=np.concatenate([table.kind, np.full(width, NUMERIC, dtype=table.kind.dtype)]),
                       cardinality=np.concatenate([table.cardinality, np.zeros(width, dtype=table.cardinality.dtype)]),
                       target=table.target, task=table.task)
    query_cells = np.hstack([episode.query, np.zeros((table.shape[0], width), dtype=bool)])
    n_own = table.shape[1]
    refs = feature_refs(n_own + width, slice(n_own, None), table.target, spec, n_classes)
    return grown, Episode(task=episode.task, context=episode.context, query=query_cells, feature_ref=refs)


def pack(tables: Sequence[SynthTable], episodes: Sequence[Episode], rows: int, cols: int) -> TableBatch:
    """Stack tables (each at most rows x cols) and their episodes into one padded TableBatch."""
    if len(tables) != len(episodes) or not tables:
        raise ValueError(f"pack needs one episode per table and at least one table; got {len(tables)} tables, {len(episodes)} episodes")
    b = len(tables)
    x = np.zeros((b, rows, cols), dtype=np.float32)
    kind = np.full((b, cols), PAD, dtype=np.int8)
    card = np.zeros((b, cols), dtype=np.int64)
    row_valid = np.zeros((b, rows), dtype=bool)
    col_valid = np.zeros((b, cols), dtype=bool)
    context = np.zeros((b, rows), dtype=bool)
    query = np.zeros((b, rows, cols), dtype=bool)
    ref = np.full((b, cols, 3), -1, dtype=np.int64)
    for i, (t, e) in enumerate(zip(tables, episodes)):
        r, c = t.shape
        if r > rows or c > cols:
            raise ValueError(f"table {i} has shape {(r, c)}, larger than the batch shape {(rows, cols)}")
        x[i, :r, :c] = t.X
        kind[i, :c] = t.kind
        card[i, :c] = t.cardinality
        row_valid[i, :r] = True
        col_valid[i, :c] = True
        context[i, :r] = e.context
        query[i, :r, :c] = e.query
        if e.feature_ref is not None:
            ref[i, :c] = e.feature_ref
    return TableBatch(
        x=torch.from_numpy(x),
        kind=torch.from_numpy(kind),
        cardinality=torch.from_numpy(card),
        row_valid=torch.from_numpy(row_valid),
        col_valid=torch.from_numpy(col_valid),
        context=torch.from_numpy(context),
        query=torch.from_numpy(query),
        feature_ref=torch.from_numpy(ref),
    )
