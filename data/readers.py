"""Read real tables from CSV files, Parquet files, table stores, directories or DataFrames.

`read_tables(source, target=None, task=None)` returns one `SourceTable(name, frame, target, task,
source)` per table. `source` is a CSV/TSV file, a Parquet file (plain, or a store table whose
header supplies target and task), a directory of them (not recursive; hidden files skipped), a
DataFrame, a 2-D array, a {name: DataFrame} mapping, or a list of any of these. Names are file
stems, mapping keys, or "frame0", "frame1", ... for bare DataFrames; they must be unique.

Errors are ValueErrors that say where: the file and line of a ragged CSV row ("a.csv line 17:
expected 5 fields, saw 7"), an unclosed quote, or the first byte that is not valid in the
encoding (with its offset and a hint to pass `encoding=`); the file and its columns for an empty
table or a missing target column. CSV rows with fewer fields than the header are read with the
missing fields as missing values (the usual CSV convention). ISO-8601 date/time columns in CSV
files are parsed as datetimes (`parse_dates=False` keeps them strings).
"""
from __future__ import annotations

import csv
import re
import warnings
from os import PathLike
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .encode import as_frame
from .store import TASKS, NoHeaderError, _listing, _why, read_header, read_table

CSV_SUFFIXES = {".csv": ",", ".tsv": "\t"}
PARQUET_SUFFIXES = (".parquet", ".pq")
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")
_EXPECTED = re.compile(r"Expected (\d+) fields in line (\d+), saw (\d+)")
_EOF_QUOTE = re.compile(r"EOF inside string starting at row (\d+)")


class SourceTable(NamedTuple):
    """One table read from a source: its name, rows, target column and task (None when unknown)."""

    name: str
    frame: pd.DataFrame
    target: str | None
    task: str | None
    source: str  # the file it came from, or "<DataFrame NAME>"


# ------------------------------------------------------------------ CSV
def _records(path: Path, encoding: str, sep: str) -> Iterator[tuple[int, list[str]]]:
    """(first physical line, fields) of each CSV record, as Python's csv module reads them."""
    with open(path, newline="", encoding=encoding) as f:
        reader = csv.reader(f, delimiter=sep)
        line = 0
        for fields in reader:
            yield line + 1, fields
            line = reader.line_num


def _bad_byte_message(path: Path, encoding: str, err: UnicodeDecodeError) -> str:
    """Where the first byte that `encoding` cannot decode lies: line, column, file offset."""
    hint = "pass encoding=, e.g. encoding='latin-1' or encoding='cp1252'"
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode(encoding)
            except UnicodeDecodeError as e:
                byte = raw[e.start]
                return (f"{path} line {lineno}: byte 0x{byte:02x} at offset {offset + e.start} (column {e.start + 1}) "
                        f"is not valid {encoding} ({e.reason}); the file is not {encoding}-encoded: {hint}")
            except LookupError:
                break
            offset += len(raw)
    return f"{path}: cannot decode the file as {encoding} ({err}); {hint}"


def _parser_message(path: Path, err: Exception, encoding: str, sep: str) -> str:
    """A pandas ParserError as 'FILE line N: what is wrong', with the physical line of the record."""
    text = str(err)
    m = _EXPECTED.search(text)
    if m:
        want, line, saw = (int(v) for v in m.groups())
        try:  # pandas counts records, not lines (quoted newlines): find the physical line
            records = ((start, fields) for start, fields in _records(path, encoding, sep) if fields)
            next(records, None)  # the header
            for start, fields in records:
                if len(fields) == saw:
                    line = start
                    break
        except (csv.Error, UnicodeDecodeError):
            pass
        return (f"{path} line {line}: expected {want} fields, saw {saw} "
                f"(check the separator, sep={sep!r}, and quoting)")
    if _EOF_QUOTE.search(text):
        line = None
        try:
            for start, _ in _records(path, encoding, sep):
                line = start
        except (csv.Error, UnicodeDecodeError):
            pass
        at = f" line {line}" if line is not None else ""
        return f"{path}{at}: a quoted field opened here is never closed (end of file inside quotes)"
    return f"{path}: cannot parse as CSV with sep={sep!r}: {text.strip()}"


def parse_iso_dates(df: pd.DataFrame) -> pd.DataFrame:
    """String columns whose every value is an ISO-8601 date or date-time become datetimes."""
    for name in df.columns:
        s = df[name]
        if not (s.dtype == object or pd.api.types.is_string_dtype(s.dtype)) or isinstance(s.dtype, pd.CategoricalDtype):
            continue
        present = s.dropna()
        if present.empty or not all(isinstance(v, str) and _ISO_DATE.match(v) for v in present.iloc[:100]):
            continue
        if not bool(present.astype(str).str.fullmatch(_ISO_DATE.pattern).all()):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                df[name] = pd.to_datetime(s, format="ISO8601")
        except (ValueError, TypeError, OverflowError):
            pass  # e.g. mixed time zones: keep the strings
    return df


def read_csv(path: str | PathLike, encoding: str = "utf-8", sep: str | None = None,
             parse_dates: bool = True) -> pd.DataFrame:
    """One CSV (or TSV) file as a DataFrame; ValueError naming the file and line on bad input."""
    path = Path(path)
    sep = sep or CSV_SUFFIXES.get(path.suffix.lower(), ",")
    try:
        df = pd.read_csv(path, sep=sep, encoding=encoding, low_memory=False)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ValueError(_bad_byte_message(path, encoding, err)) from None
    except LookupError as err:
        raise ValueError(f"{path}: unknown encoding {encoding!r} ({err})") from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty file, no header line") from None
    except pd.errors.ParserError as err:
        raise ValueError(_parser_message(path, err, encoding, sep)) from None
    # pandas renames duplicate header names ("a", "a.1"): say so instead
    header = next((f for _, f in _records(path, encoding, sep) if f), [])
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise ValueError(f"{path} line 1: duplicate column name {name!r}")
        seen.add(name)
    if df.shape[1] == 1:
        other = next((d for d in (";", "\t", "|", ",") if d != sep and d in str(df.columns[0])), None)
        if other is not None:
            raise ValueError(f"{path}: read as one column {str(df.columns[0])[:60]!r} with sep={sep!r}; "
                             f"the header looks {other!r}-separated: pass sep={other!r}")
    return parse_iso_dates(df) if parse_dates else df


# ------------------------------------------------------------------ Parquet
def read_parquet(path: str | PathLike) -> tuple[pd.DataFrame, str | None, str | None]:
    """A Parquet file's rows, target and task: a store table through tabfm.data.store (header checked),
    a plain Parquet file with target and task None."""
    path = Path(path)
    try:
        header = read_header(path)
    except NoHeaderError:
        header = None
    if header is not None:
        return read_table(path), header.target, header.task
    try:
        frame = pq.read_table(path).to_pandas()
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file, it may be truncated or corrupt ({_why(err)})") from None
    return frame.reset_index(drop=True), None, None


# ------------------------------------------------------------------ sources
def _table_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")
                   and (p.suffix.lower() in CSV_SUFFIXES or p.suffix.lower() in PARQUET_SUFFIXES))
    if not files:
        raise ValueError(f"{directory}: no tables found (looked for *.csv, *.tsv, *.parquet, *.pq)")
    return files


def _read_file(path: Path, encoding: str, sep: str | None, parse_dates: bool) -> SourceTable:
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        return SourceTable(path.stem, read_csv(path, encoding, sep, parse_dates), None, None, str(path))
    if suffix in PARQUET_SUFFIXES:
        frame, target, task = read_parquet(path)
        return SourceTable(path.stem, frame, target, task, str(path))
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected .csv, .tsv, .parquet or .pq")


def _collect(source: Any, encoding: str, sep: str | None, parse_dates: bool, counter: list[int]) -> list[SourceTable]:
    if isinstance(source, (pd.DataFrame, np.ndarray)):
        name = f"frame{counter[0]}"
        counter[0] += 1
        return [SourceTable(name, as_frame(source), None, None, f"<DataFrame {name}>")]
    if isinstance(source, Mapping):
        out = []
        for name, frame in source.items():
            if not isinstance(frame, (pd.DataFrame, np.ndarray)):
                raise TypeError(f"table {name!r}: expected a DataFrame or 2-D array, got {type(frame).__name__}")
            out.append(SourceTable(str(name), as_frame(frame), None, None, f"<DataFrame {name}>"))
        return out
    if isinstance(source, (str, PathLike)):
        path = Path(source)
        if path.is_dir():
            return [_read_file(p, encoding, sep, parse_dates) for p in _table_files(path)]
        if not path.exists():
            raise ValueError(f"{path}: no such file or directory")
        return [_read_file(path, encoding, sep, parse_dates)]
    if isinstance(source, Sequence):
        return [t for s in source for t in _collect(s, encoding, sep, parse_dates, counter)]
    raise TypeError(f"cannot read tables from {type(source).__name__}: pass a path, a DataFrame, "
                    "a {name: DataFrame} mapping or a list of these")


def _finish(t: SourceTable, target: str | None, task: str | None) -> SourceTable:
    """Check the table is not empty and has the target; resolve target and task."""
    frame = t.frame
    if frame.shape[1] == 0:
        raise ValueError(f"{t.source}: empty table, it has no columns")
    if frame.shape[0] == 0:
        raise ValueError(f"{t.source}: empty table, it has no rows (columns: {_listing(frame.columns)})")
    tgt = target if target is not None else t.target
    if tgt is not None and tgt not in frame.columns:
        raise ValueError(f"{t.source}: no target column {tgt!r}; the columns are: {_listing(frame.columns)}")
    tsk = task if task is not None else (t.task if tgt == t.target else None)
    return t._replace(target=tgt, task=tsk)


def read_tables(source: Any, target: str | None = None, task: str | None = None, *, encoding: str = "utf-8",
                sep: str | None = None, parse_dates: bool = True) -> list[SourceTable]:
    """Every table in `source` (see the module docstring), checked and with target/task resolved.

    target / task: apply to every table (a table without `target` is an error naming it and its
    columns); when None, a store table's header supplies them. encoding / sep / parse_dates
    apply to CSV files (sep defaults to ',' for .csv and tab for .tsv).
    """
    if task is not None and task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {TASKS}")
    tables = [_finish(t, target, task) for t in _collect(source, encoding, sep, parse_dates, [0])]
    if not tables:
        raise ValueError(f"no tables in {source!r}")
    seen: dict[str, str] = {}
    for t in tables:
        if t.name in seen:
            raise ValueError(f"two tables are named {t.name!r}: {seen[t.name]} and {t.source}; rename one")
        seen[t.name] = t.source
    return tables
