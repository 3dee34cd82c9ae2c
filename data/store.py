"""Table stores: a directory of Parquet files, one table each, described by a header in the footer.

Each `NAME.parquet` carries, in its Parquet key-value metadata under `tabfm.header`, a small
JSON header: format/version, name, n_rows, n_cols, column names, column kinds (numeric,
categorical, boolean, datetime, text: tabfm.data.encode's inference), target column (or null), task
("classification" | "regression" | "imputation" | null) and free-form extras (source, seed, ...).
So a loader can list, size and bucket a whole corpus by reading footers only, and read the rows
of a table when it needs them.

Policies
- `list_store` reads only Parquet footers, never row data. A `.parquet` file without a header
  is an error naming the file (write it with `write_table`, or read plain Parquet with
  `tabfm.data.readers.read_tables`): kinds need the data, and a store is meant to be listed cheaply.
  A truncated or corrupt file is an error naming the file. Hidden files (`.NAME...tmp`, the
  temporaries of unfinished writes) and other files are ignored.
- `write_table` is atomic: the file is written to a hidden temporary in the store directory,
  fsynced, then renamed over `NAME.parquet`, so a crash leaves either the old table or the new
  one, never a partial file that `list_store` would see. `clean_temp_files` removes leftovers
  (only while no other process writes to the store).
- Dtypes round-trip through pandas' Parquet metadata (numbers, nullable ints and booleans,
  categoricals, datetimes with their unit and zone); object columns of strings come back as
  pandas' `str` dtype.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .encode import _natural_type, fit_column
from .schema import BOOLEAN_T, CATEGORICAL_T, CONSTANT_T, DATETIME_T, NUMERIC_T, TEXT_T, EncodeConfig

HEADER_KEY = b"tabfm.header"
HEADER_FORMAT, HEADER_VERSION = "tabfm.table", 1
SUFFIX = ".parquet"
TEMP_SUFFIX = ".tmp"
KINDS = (NUMERIC_T, CATEGORICAL_T, BOOLEAN_T, DATETIME_T, TEXT_T)
TASKS = ("classification", "regression", "imputation")
PREDICTION_TASKS = ("classification", "regression")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_FIELDS = ("format", "version", "name", "n_rows", "n_cols", "columns", "kinds", "target", "task", "extra")


class NoHeaderError(ValueError):
    """A readable Parquet file that carries no tabfm header (plain Parquet, not a store table)."""


@dataclass(frozen=True)
class TableHeader:
    """What a store knows about one table without reading its rows."""

    name: str
    path: Path
    n_rows: int
    n_cols: int
    columns: tuple[str, ...]
    kinds: tuple[str, ...]
    target: str | None = None
    task: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)

    @property
    def cost(self) -> int:
        """Cells of the table, n_rows * n_cols (what batching by cost balances)."""
        return self.n_rows * self.n_cols

    def kind(self, column: str) -> str:
        """The kind of one column."""
        try:
            return self.kinds[self.columns.index(column)]
        except ValueError:
            raise KeyError(f"table {self.name!r} has no column {column!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON header stored in the file (everything but the path)."""
        return {"format": HEADER_FORMAT, "version": HEADER_VERSION, "name": self.name, "n_rows": self.n_rows,
                "n_cols": self.n_cols, "columns": list(self.columns), "kinds": list(self.kinds),
                "target": self.target, "task": self.task, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str | PathLike) -> "TableHeader":
        """Parse and check a stored header; errors name the file."""
        where = str(path)
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: tabfm header is not a JSON object")
        if d.get("format") != HEADER_FORMAT or d.get("version") != HEADER_VERSION:
            raise ValueError(f"{where}: not a {HEADER_FORMAT} v{HEADER_VERSION} header "
                             f"(format={d.get('format')!r}, version={d.get('version')!r})")
        missing = [k for k in _FIELDS if k not in d]
        if missing:
            raise ValueError(f"{where}: tabfm header lacks fields {missing}")
        columns, kinds = d["columns"], d["kinds"]
        if not (isinstance(columns, list) and isinstance(kinds, list) and len(columns) == len(kinds) == d["n_cols"]):
            raise ValueError(f"{where}: tabfm header has n_cols={d['n_cols']!r} but {len(columns)} columns "
                             f"and {len(kinds)} kinds")
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise ValueError(f"{where}: tabfm header has unknown kind {bad[0]!r}; expected one of {KINDS}")
        header = cls(name=d["name"], path=Path(path), n_rows=int(d["n_rows"]), n_cols=int(d["n_cols"]),
                     columns=tuple(columns), kinds=tuple(kinds), target=d["target"], task=d["task"],
                     extra=dict(d["extra"] or {}))
        _check_target_task(header.name, header.columns, header.kinds, header.target, header.task, where)
        return header


# ------------------------------------------------------------------ checks
def check_name(name: str) -> str:
    """A table name is a safe file name: letters, digits, '.', '_', '-', starting with a letter or digit."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"table name {name!r} is not a safe file name: use 1-200 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    if name.endswith(SUFFIX) or name.endswith(TEMP_SUFFIX):
        raise ValueError(f"table name {name!r} must not end in {SUFFIX!r} or {TEMP_SUFFIX!r} (the store adds {SUFFIX!r})")
    return name


def _check_target_task(name: str, columns: tuple[str, ...], kinds: tuple[str, ...], target: str | None,
                       task: str | None, where: str | None = None) -> None:
    at = where or f"table {name!r}"
    if task is not None and task not in TASKS:
        raise ValueError(f"{at}: task {task!r} is not one of {TASKS} (or None)")
    if target is not None:
        if target not in columns:
            raise ValueError(f"{at}: target column {target!r} is not in the table; columns are: {_listing(columns)}")
        if task == "regression" and kinds[columns.index(target)] != NUMERIC_T:
            raise ValueError(f"{at}: regression target {target!r} is {kinds[columns.index(target)]}, not numeric")
    elif task in PREDICTION_TASKS:
        raise ValueError(f"{at}: task {task!r} needs a target column (target=None)")


def _why(err: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(err).split())


def _listing(columns: Any, limit: int = 40) -> str:
    """'a, b, c' (the first `limit` names, then how many more)."""
    cols = [str(c) for c in columns]
    more = f", ... ({len(cols) - limit} more)" if len(cols) > limit else ""
    return ", ".join(cols[:limit]) + more


def _check_frame(name: str, frame: pd.DataFrame) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"table {name!r}: expected a pandas DataFrame, got {type(frame).__name__}")
    for c in frame.columns:
        if not isinstance(c, str) or not c:
            raise ValueError(f"table {name!r}: column names must be non-empty strings; got {c!r}")
    dup = frame.columns[frame.columns.duplicated()].unique().tolist()
    if dup:
        raise ValueError(f"table {name!r}: duplicate column names {dup}")
    if frame.shape[1] == 0:
        raise ValueError(f"table {name!r} is empty: it has no columns")
    if frame.shape[0] == 0:
        raise ValueError(f"table {name!r} is empty: it has no rows (columns: {_listing(frame.columns)})")


def infer_kinds(frame: pd.DataFrame, config: EncodeConfig | None = None) -> tuple[str, ...]:
    """The kind of each column, from tabfm.data.encode's type inference.

    Constant and all-missing columns get the kind their values would have (a constant string
    column is categorical, an all-missing float column numeric).
    """
    config = config or EncodeConfig()
    kinds = []
    for name in frame.columns:
        s = frame[name]
        spec = fit_column(s, name, config)
        kinds.append(spec.type if spec.type != CONSTANT_T else (spec.value_type or _natural_type(s, name)))
    return tuple(kinds)


# ------------------------------------------------------------------ write
def write_table(store_dir: str | PathLike, name: str, frame: pd.DataFrame, target: str | None = None,
                task: str | None = None, **extra: Any) -> TableHeader:
    """Write `frame` as `store_dir/NAME.parquet` with its header, atomically; returns the header.

    `extra` (JSON-serialisable: source, seed, ...) is stored in the header as is. An existing
    table of the same name is replaced.
    """
    check_name(name)
    _check_frame(name, frame)
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"table {name!r}: extra header fields must be JSON-serialisable: {err}") from None
    try:
        kinds = infer_kinds(frame)
    except ValueError as err:
        raise ValueError(f"table {name!r}: {err}") from None
    columns = tuple(frame.columns)
    _check_target_task(name, columns, kinds, target, task)
    store = Path(store_dir)
    path = store / f"{name}{SUFFIX}"
    header = TableHeader(name=name, path=path, n_rows=len(frame), n_cols=len(columns), columns=columns,
                         kinds=kinds, target=target, task=task, extra=dict(extra))
    try:
        table = pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError) as err:
        raise ValueError(f"table {name!r} cannot be stored as Parquet: {err}") from None
    meta = dict(table.schema.metadata or {})
    meta[HEADER_KEY] = json.dumps(header.to_dict(), allow_nan=False).encode("utf-8")
    table = table.replace_schema_metadata(meta)
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return header


def clean_temp_files(store_dir: str | PathLike) -> list[Path]:
    """Remove the temporaries of unfinished writes (killed runs); returns what was removed.

    Only safe while no other process is writing to the store.
    """
    store = Path(store_dir)
    if not store.is_dir():
        return []
    removed = []
    for p in store.iterdir():
        if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    return sorted(removed)


# ------------------------------------------------------------------ read headers
def _metadata(path: Path) -> pq.FileMetaData:
    """The Parquet footer of `path`; ValueError naming the file when it is not readable Parquet."""
    try:
        return pq.read_metadata(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file, it may be truncated or corrupt ({_why(err)})") from None


def _header_from_metadata(path: Path, md: pq.FileMetaData) -> TableHeader:
    raw = (md.metadata or {}).get(HEADER_KEY)
    if raw is None:
        raise NoHeaderError(f"{path}: Parquet file without a tabfm header (key {HEADER_KEY.decode()!r}); "
                            "write it with tabfm.data.store.write_table, or read plain Parquet with tabfm.data.readers.read_tables")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: tabfm header is not valid JSON ({err})") from None
    header = TableHeader.from_dict(d, path)
    names = md.schema.to_arrow_schema().names
    if md.num_rows != header.n_rows or list(names) != list(header.columns):
        raise ValueError(f"{path}: header says {header.n_rows} rows x columns {_listing(header.columns, 8)}, "
                         f"the file holds {md.num_rows} rows x columns {_listing(names, 8)}")
    return header


def read_header(path: str | PathLike) -> TableHeader:
    """The header of one store file, from its Parquet footer only.

    Raises NoHeaderError (a ValueError) for plain Parquet files, ValueError naming the file for
    truncated or corrupt files and headers that disagree with the file.
    """
    path = Path(path)
    return _header_from_metadata(path, _metadata(path))


def list_store(store_dir: str | PathLike) -> list[TableHeader]:
    """Headers of every table in a store, sorted by name; reads Parquet footers only, never rows."""
    store = Path(store_dir)
    if not store.is_dir():
        raise ValueError(f"{store}: not a directory (a table store is a directory of NAME{SUFFIX} files)")
    files = sorted(p for p in store.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".") and p.is_file())
    headers = []
    for p in files:
        h = read_header(p)
        if h.name != p.stem:
            raise ValueError(f"{p}: header names the table {h.name!r} but the file is {p.name!r}; "
                             f"rename the file to {h.name}{SUFFIX} or rewrite the table")
        headers.append(h)
    return sorted(headers, key=lambda h: h.name)


# ------------------------------------------------------------------ read rows
def read_table(header_or_path: TableHeader | str | PathLike) -> pd.DataFrame:
    """The rows of one store table, columns in stored order.

    Given a TableHeader (from list_store), the file's current header must still match it
    (rows, columns, kinds, target, task), so a table replaced since listing is an error.
    """
    expected = header_or_path if isinstance(header_or_path, TableHeader) else None
    path = expected.path if expected is not None else Path(header_or_path)
    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file, it may be truncated or corrupt ({_why(err)})") from None
    try:
        current = _header_from_metadata(path, pf.metadata)
        if expected is not None:
            keys = ("n_rows", "columns", "kinds", "target", "task")
            changed = [k for k in keys if getattr(expected, k) != getattr(current, k)]
            if changed:
                raise ValueError(f"{path}: the table changed since it was listed ({', '.join(changed)} differ); "
                                 "list the store again")
        try:
            frame = pf.read().to_pandas()
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: cannot read the rows, the file may be corrupt ({_why(err)})") from None
    finally:
        pf.close()
    if list(frame.columns) != list(current.columns) or len(frame) != current.n_rows:
        raise ValueError(f"{path}: rows read ({len(frame)} x {_listing(frame.columns, 8)}) do not match the header "
                         f"({current.n_rows} x {_listing(current.columns, 8)})")
    return frame
