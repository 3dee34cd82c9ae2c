"""How tables travel between `tabfm.client` and the server: content types, and a DataFrame as JSON
columns (Python scalars, missing = null, datetimes as ISO-8601 text) or as an Arrow IPC stream.

numpy, pandas and pyarrow only (core dependencies), so the client needs no server package.
Arrow keeps a frame's dtypes exactly (int / float / bool / text / category / datetime), which is why
the remote estimators send their tables that way; JSON is for everyone else (curl, the page).
"""
from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
import pandas as pd

JSON = "application/json"
CSV = "text/csv"
ARROW_STREAM = "application/vnd.apache.arrow.stream"
ARROW_FILE = "application/vnd.apache.arrow.file"
PARQUET = "application/vnd.apache.parquet"
PARQUET_ALIASES = ("application/x-parquet", "application/parquet")
TABLE_TYPES = (CSV, ARROW_STREAM, ARROW_FILE, PARQUET, *PARQUET_ALIASES)  # a body that is one table


def media_type(header: str | None) -> str:
    """'application/json; charset=utf-8' -> 'application/json' (empty header -> '')."""
    return (header or "").split(";", 1)[0].strip().lower()


def scalar(v: Any) -> Any:
    """One cell as a JSON value: numpy scalars unwrapped, dates as ISO text."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, (pd.Timestamp, dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, (str, bool, int, float)) or v is None:
        return v
    return str(v)


def column_cells(s: pd.Series) -> list[Any]:
    """A column's cells as JSON values (missing -> None)."""
    missing = s.isna().to_numpy()
    if pd.api.types.is_datetime64_any_dtype(s.dtype):
        return [None if m else v.isoformat() for v, m in zip(s, missing)]
    return [None if m else scalar(v) for v, m in zip(s.tolist(), missing)]


def frame_to_columns(frame: pd.DataFrame) -> dict[str, list[Any]]:
    """A DataFrame as the JSON "columns" orientation: {column name: [cells]}."""
    return {str(name): column_cells(frame[name]) for name in frame.columns}


def as_frame(table: Any) -> pd.DataFrame:
    """A DataFrame, a 2-D array (columns named x0, x1, ... as the estimators name them), a {column:
    [cells]} mapping or a list of {column: cell} records, as a DataFrame with string column names."""
    if isinstance(table, pd.DataFrame):
        frame = table
    elif isinstance(table, dict):
        frame = pd.DataFrame(table)
    elif isinstance(table, list) and (not table or isinstance(table[0], dict)):
        frame = pd.DataFrame.from_records(table)
    else:
        arr = np.asarray(table)
        if arr.ndim != 2:
            raise ValueError(f"expected a 2-D table (rows, columns), got an array of shape {arr.shape}")
        frame = pd.DataFrame(arr, columns=[f"x{j}" for j in range(arr.shape[1])])
    if not all(isinstance(c, str) for c in frame.columns):
        frame = frame.set_axis([f"x{j}" for j in range(frame.shape[1])], axis=1)
    return frame


def frame_to_arrow(frame: pd.DataFrame) -> bytes:
    """A DataFrame as an Arrow IPC stream (dtypes kept, the index dropped)."""
    import pyarrow as pa

    table = pa.Table.from_pandas(frame.reset_index(drop=True), preserve_index=False)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def arrow_to_frame(body: bytes, kind: str = ARROW_STREAM) -> pd.DataFrame:
    """The table of an Arrow IPC stream or file, or of a Parquet file, as a DataFrame."""
    import pyarrow as pa

    if kind == ARROW_STREAM:
        table = pa.ipc.open_stream(pa.BufferReader(body)).read_all()
    elif kind == ARROW_FILE:
        table = pa.ipc.open_file(pa.BufferReader(body)).read_all()
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(body))
    return table.to_pandas()
