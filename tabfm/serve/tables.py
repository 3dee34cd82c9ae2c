"""Request tables -> DataFrames, checked against the server's limits before any model work.

Every refusal is an ApiError naming the field ("context", "query"), and the column, row or limit
where it knows them: 413 for a table over a limit (rows, columns, categories, classes), 422 for
content the estimators cannot take (ragged records, an unknown target column, text where the
context has numbers, columns that differ between context and query, an empty table).
"""
from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np
import pandas as pd

from tabfm.data.readers import parse_iso_dates  # the CSV reader's rule: ISO text -> datetimes

from . import wire
from .config import ServeConfig
from .errors import ApiError, invalid, too_large


def _check_shape(field: str, n_rows: int, n_cols: int, config: ServeConfig) -> None:
    if n_cols > config.max_columns:
        raise too_large(field, "columns", n_cols, config.max_columns, "--max-columns")
    if n_rows > config.max_rows:
        raise too_large(field, "rows", n_rows, config.max_rows, "--max-rows")


def json_table(table: Any, field: str, config: ServeConfig) -> pd.DataFrame:
    """A validated JSON table (records or columns, see tabfm.serve.schemas) as a DataFrame."""
    if isinstance(table, list):  # records
        if not table:
            raise invalid(f"{field} has no rows", field=field, error="empty_table")
        names = list(table[0])
        _check_shape(field, len(table), len(names), config)
        want = set(names)
        for i, record in enumerate(table):
            if record.keys() != want:
                missing, extra = sorted(want - record.keys()), sorted(record.keys() - want)
                raise invalid(f"{field} row {i} has other columns than row 0: missing {missing}, extra {extra} "
                              "(records must all have the same keys; a missing value is null)",
                              field=field, row=i, column=(missing or extra)[0], error="ragged_table")
        columns = {name: [record[name] for record in table] for name in names}
    else:
        columns = table
        lengths = {name: len(values) for name, values in columns.items()}
        n_rows = max(lengths.values(), default=0)
        _check_shape(field, n_rows, len(columns), config)
        short = next((name for name, n in lengths.items() if n != n_rows), None)
        if short is not None:
            raise invalid(f"{field} column {short!r} has {lengths[short]} values, other columns {n_rows} "
                          "(columns must all have the same length)", field=field, column=short, error="ragged_table")
    frame = pd.DataFrame({name: pd.Series(values, dtype=None if values else object) for name, values in columns.items()})
    return check_table(parse_iso_dates(frame), field, config)


def body_table(body: bytes, media: str, field: str, config: ServeConfig) -> pd.DataFrame:
    """The one table of a CSV, Arrow IPC (stream or file) or Parquet request body."""
    what = {wire.CSV: "CSV", wire.ARROW_STREAM: "Arrow IPC stream", wire.ARROW_FILE: "Arrow IPC file"}.get(media, "Parquet")
    try:
        if media == wire.CSV:
            frame = parse_iso_dates(pd.read_csv(io.BytesIO(body), low_memory=False))
            header = next(csv.reader(io.StringIO(body.split(b"\n", 1)[0].decode("utf-8", "replace").strip())), [])
            dup = next((h for i, h in enumerate(header) if h in header[:i]), None)
            if dup is not None:
                raise invalid(f"{field}: duplicate column name {dup!r} in the CSV header", field=field, column=dup)
        else:
            frame = wire.arrow_to_frame(body, wire.PARQUET if media in (wire.PARQUET, *wire.PARQUET_ALIASES) else media)
    except ApiError:
        raise
    except Exception as err:  # noqa: BLE001 - any parser failure is the body's fault
        why = " ".join(str(err).split())[:300] or type(err).__name__
        raise ApiError(400, "unreadable_body", f"{field}: the body is not a readable {what} ({why})", field=field) from None
    _check_shape(field, len(frame), frame.shape[1], config)
    return check_table(frame, field, config)


def check_table(frame: pd.DataFrame, field: str, config: ServeConfig) -> pd.DataFrame:
    """Column names, emptiness and the categories limit of one table."""
    bad = next((c for c in frame.columns if not isinstance(c, str) or not c.strip()), None)
    if bad is not None:
        raise invalid(f"{field}: column names must be non-empty strings, got {bad!r}", field=field, column=str(bad))
    if frame.shape[1] == 0:
        raise invalid(f"{field} has no columns", field=field, error="empty_table")
    if len(frame) == 0:
        raise invalid(f"{field} has no rows", field=field, error="empty_table")
    for name in frame.columns:
        s = frame[name]
        if s.dtype == object or isinstance(s.dtype, pd.CategoricalDtype) or pd.api.types.is_string_dtype(s.dtype):
            n = int(s.nunique(dropna=True))
            if n > config.max_categories:
                raise too_large(field, "categories", n, config.max_categories, "--max-categories", column=name)
    return frame


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)) or pd.isna(v)


def split_target(frame: pd.DataFrame, target: str, task: str, config: ServeConfig) -> tuple[pd.DataFrame, pd.Series]:
    """(features, target) of a context; refuses an unknown target, missing targets, text targets
    for regression and more classes than --max-classes."""
    if target not in frame.columns:
        raise invalid(f"target column {target!r} is not in the context (columns: {list(frame.columns)[:50]})",
                      field="target", column=target, error="unknown_column")
    y = frame[target]
    missing = np.flatnonzero(y.isna().to_numpy())
    if len(missing):
        raise invalid(f"target column {target!r} is missing in {len(missing)} context row(s), first row "
                      f"{int(missing[0])}; drop those rows or fill the target", field="context", column=target,
                      row=int(missing[0]), error="missing_target")
    if frame.shape[1] < 2:
        raise invalid(f"the context holds only the target column {target!r}: no feature column to predict from",
                      field="context", error="empty_table")
    if task == "regression" and (not pd.api.types.is_numeric_dtype(y.dtype) or pd.api.types.is_bool_dtype(y.dtype)):
        row = next((i for i, v in enumerate(y.tolist()) if not _is_number(v)), 0)
        raise invalid(f"regression target {target!r} must be numeric; context row {row} holds {y.iloc[row]!r} "
                      "(use classify for class labels)", field="context", column=target, row=row,
                      error="not_numeric")
    if task == "classification":
        n = int(y.nunique())
        if n > config.max_classes:
            raise too_large("context", "classes", n, config.max_classes, "--max-classes", column=target)
    return frame.drop(columns=[target]), y


def match_columns(query: pd.DataFrame, columns: list[str], field: str = "query", drop: str | None = None) -> pd.DataFrame:
    """The query's columns in the context's order; 422 naming what is missing or extra. A column
    named `drop` (the target) is ignored."""
    if drop is not None and drop in query.columns:
        query = query.drop(columns=[drop])
    missing = [c for c in columns if c not in query.columns]
    extra = [c for c in query.columns if c not in set(columns)]
    if missing or extra:
        raise invalid(f"{field} has other columns than the context: missing {missing[:20]}, extra {extra[:20]}",
                      field=field, column=(missing or extra)[0], error="column_mismatch")
    return query[columns]


def numeric_columns(frame: pd.DataFrame) -> dict[str, bool]:
    """Which columns of a context hold numbers (bool columns do not count)."""
    return {name: bool(pd.api.types.is_numeric_dtype(frame[name].dtype) and not pd.api.types.is_bool_dtype(frame[name].dtype))
            for name in frame.columns}


def check_numbers(numeric: dict[str, bool], query: pd.DataFrame, field: str = "query") -> None:
    """Where a context column holds numbers, the query's cells of that column must too (or be missing)."""
    for name in query.columns:
        if numeric.get(name) and not pd.api.types.is_numeric_dtype(query[name].dtype):
            values = query[name].tolist()
            row = next((i for i, v in enumerate(values) if not _is_number(v)), None)
            if row is not None:
                raise invalid(f"{field} column {name!r} row {row} holds {values[row]!r}, but the context's "
                              f"{name!r} is numeric: send a number or null", field=field, column=name, row=row,
                              error="not_numeric")
