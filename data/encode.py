"""Encode real tables (pandas DataFrame or numpy array) into TableBatch-ready tensors.

`encode_frame(frame)` infers a type per source column, fits a `TableSchema` and returns the
encoded table: `x` float32 (n_rows, n_encoded) holding numbers or integer category codes,
NaN = missing; `kind` int8 (tabfm.data.batch NUMERIC / CATEGORICAL); `cardinality` int64. The schema
is reusable on new frames (`transform`), saves to JSON, and decodes encoded values back into a
frame (`inverse_transform`).

Policies
- Types: bool dtypes -> boolean; datetime64 (or objects that are all datetimes/dates) -> datetime;
  other numeric dtypes (integers too) -> numeric; pandas "category" -> categorical; strings ->
  categorical, or text when they have more than `max_categories` distinct values or at least
  `text_min_unique` distinct values making up at least `text_unique_ratio` of the non-missing cells.
  A numeric or categorical column with a single distinct value -> constant; an all-missing column
  -> constant (flagged all_missing) whatever its dtype or override. Booleans and datetimes with a
  single value keep their type and get the `constant` flag. Integer columns are categorical only
  by override, or with `EncodeConfig.categorical_max_int=k` (integers all in 0..k). Overrides
  (numeric, boolean, categorical, datetime, text) replace inference; "text" also accepts
  mixed-type columns (every value read as its str()).
- Categories are sorted; unseen values at transform time become NaN (missing) with one
  UserWarning per column naming it and example values. A constant column seeing another value
  is treated the same way.
- NaN (and None, pd.NA, NaT) = missing. +-inf in a numeric column is not missing: when the fitted
  column held +-inf, the value is clipped to the fitted finite [min, max] and an extra categorical
  column "<name>.inf" (0 finite, 1 +inf, 2 -inf; NaN where missing) keeps it distinct; an inf in
  a column fitted without inf is clipped the same way with a UserWarning. Finite values beyond
  float32 range raise ValueError.
- Datetime -> numeric parts "<name>.epoch" (days since 1970-01-01 UTC), .year, .month, .day,
  .dayofweek (Monday = 0), and .hour only if a fitted value had a time of day. Time-zone-aware
  columns compute parts in the fitted zone; mixing naive and aware raises ValueError.
- Text -> "<name>.hash" (categorical: crc32 of the lower-cased, whitespace-collapsed string
  modulo `text_buckets`, deterministic across runs), "<name>.len" (characters) and
  "<name>.words" (whitespace-separated words).
- Limits (EncodeConfig defaults from tabfm.data.schema): max_rows 1,000,000, max_columns 1,000
  source columns, max_categories 1,000 for columns that are categorical by dtype or override.
- inverse_transform: numeric/boolean/categorical/constant are exact; datetime is rebuilt from
  the epoch part only (float32: about +-2 minutes for present-day dates); text cannot be
  inverted and comes back missing.
"""
from __future__ import annotations

import json
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
import torch
from pandas.api.types import (
    infer_dtype,
    is_bool_dtype,
    is_datetime64_any_dtype,
    is_integer_dtype,
    is_numeric_dtype,
    is_string_dtype,
    is_timedelta64_dtype,
)

from .batch import TableBatch
from .schema import (
    BOOLEAN_T,
    CATEGORICAL_T,
    CONSTANT_T,
    DATETIME_T,
    INF_NEG,
    INF_POS,
    NUMERIC_T,
    SCHEMA_FORMAT,
    SCHEMA_VERSION,
    TEXT_PARTS,
    TEXT_T,
    ColumnSpec,
    EncodeConfig,
    EncodedColumn,
)

OVERRIDE_TYPES = (NUMERIC_T, BOOLEAN_T, CATEGORICAL_T, DATETIME_T, TEXT_T)

_F32_MAX = float(np.finfo(np.float32).max)
# what pandas' infer_dtype may say about an object column, and the type it reads as ("" = all missing)
_OBJECT_KINDS = {
    "string": CATEGORICAL_T, "boolean": BOOLEAN_T, "integer": NUMERIC_T, "floating": NUMERIC_T,
    "mixed-integer-float": NUMERIC_T, "decimal": NUMERIC_T, "timedelta": NUMERIC_T, "timedelta64": NUMERIC_T,
    "datetime": DATETIME_T, "datetime64": DATETIME_T, "date": DATETIME_T, "empty": "",
}
_CATEGORY_VALUE_TYPES = (str, bool, int, float)
_DATETIME_PART_FN: dict[str, Callable[[pd.Series], pd.Series]] = {
    "year": lambda d: d.dt.year, "month": lambda d: d.dt.month, "day": lambda d: d.dt.day,
    "dayofweek": lambda d: d.dt.day_of_week, "hour": lambda d: d.dt.hour,
}


# =========================================================================== input checks
def as_frame(frame: Any) -> pd.DataFrame:
    """A DataFrame as is; a 2-D numpy array as a frame with columns "x0".."x{p-1}"."""
    if isinstance(frame, pd.DataFrame):
        return frame
    if isinstance(frame, np.ndarray):
        if frame.ndim != 2:
            raise ValueError(f"expected a 2-D array (rows, columns), got shape {frame.shape}")
        return pd.DataFrame(frame, columns=[f"x{j}" for j in range(frame.shape[1])])
    raise TypeError(f"expected a pandas DataFrame or a 2-D numpy array, got {type(frame).__name__}")


def _check_frame(df: pd.DataFrame, config: EncodeConfig) -> None:
    """Column names are unique non-empty strings; the frame is non-empty and within limits."""
    for c in df.columns:
        if not isinstance(c, str) or not c:
            raise ValueError(f"column names must be non-empty strings; got {c!r} ({type(c).__name__})")
    dup = df.columns[df.columns.duplicated()].unique().tolist()
    if dup:
        raise ValueError(f"duplicate column names: {dup}")
    n, p = df.shape
    if p == 0:
        raise ValueError("empty frame: it has no columns")
    if n == 0:
        raise ValueError("empty frame: it has no rows")
    if p > config.max_columns:
        raise ValueError(f"frame has {p} columns, more than max_columns={config.max_columns} "
                         f"(first column over the limit: {df.columns[config.max_columns]!r})")
    if n > config.max_rows:
        raise ValueError(f"frame has {n} rows, more than max_rows={config.max_rows}")


def _check_overrides(overrides: Mapping[str, str] | None, columns: pd.Index) -> dict[str, str]:
    """Overrides name existing columns and allowed types."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a dict column -> type, got {type(overrides).__name__}")
    for name, t in overrides.items():
        if name not in columns:
            raise ValueError(f"override for column {name!r}, which is not in the frame")
        if t not in OVERRIDE_TYPES:
            raise ValueError(f"column {name!r}: cannot override to type {t!r}; expected one of {OVERRIDE_TYPES}")
    return dict(overrides)


def _type_examples(s: pd.Series, most: int = 4) -> str:
    """'int (e.g. 1), str (e.g. 'a')': the value types of a column, for error messages."""
    seen: dict[str, Any] = {}
    for v in s.dropna():
        seen.setdefault(type(v).__name__, v)
        if len(seen) >= most:
            break
    return ", ".join(f"{t} (e.g. {v!r})" for t, v in sorted(seen.items()))


def _check_object(s: pd.Series, name: str) -> str:
    """What an object column holds (an `_OBJECT_KINDS` key); ValueError for mixed or unsupported values."""
    kind = infer_dtype(s, skipna=True)
    if kind in _OBJECT_KINDS:
        return kind
    types = _type_examples(s)
    if "," in types:
        raise ValueError(f"column {name!r} mixes value types: {types}; cast it to one type or override it to 'text'")
    raise ValueError(f"column {name!r} holds unsupported values: {types}")


def _first_value(s: pd.Series | np.ndarray) -> Any:
    return pd.Series(s).dropna().iloc[0]


# =========================================================================== value conversion
def _as_float(s: pd.Series, name: str) -> np.ndarray:
    """float64 values of a numeric-like column (NaN = missing); ValueError naming the column otherwise."""
    dt = s.dtype
    if isinstance(dt, pd.CategoricalDtype):
        return _as_float(s.astype(object), name)
    if is_datetime64_any_dtype(dt):
        raise ValueError(f"column {name!r} holds datetimes; use type 'datetime', not 'numeric'")
    if is_timedelta64_dtype(dt):
        return s.dt.total_seconds().to_numpy(dtype=np.float64, na_value=np.nan)
    if is_bool_dtype(dt) or is_numeric_dtype(dt):
        if getattr(dt, "kind", "") == "c":
            raise ValueError(f"column {name!r} holds complex numbers ({dt}), which are not supported")
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    if dt == object:
        kind = _check_object(s, name)
        if kind in ("timedelta", "timedelta64"):
            return _as_float(pd.to_timedelta(s), name)
        if kind == "boolean":
            return pd.array(s.to_numpy(), dtype="boolean").to_numpy(dtype=np.float64, na_value=np.nan)
        if _OBJECT_KINDS[kind] == DATETIME_T:
            raise ValueError(f"column {name!r} holds datetimes; use type 'datetime', not 'numeric'")
    v = pd.to_numeric(s, errors="coerce")
    bad = v.isna() & s.notna()
    if bad.any():
        raise ValueError(f"column {name!r} is numeric but holds {s[bad].iloc[0]!r}, which is not a number")
    return v.to_numpy(dtype=np.float64, na_value=np.nan)


def _check_float32(v: np.ndarray, name: str) -> None:
    """Finite values must stay finite in float32 (a huge number must not silently become inf)."""
    finite = v[np.isfinite(v)]
    if finite.size and np.abs(finite).max() > _F32_MAX:
        worst = finite[np.argmax(np.abs(finite))]
        raise ValueError(f"column {name!r} holds {worst!r}, beyond the float32 range (+-{_F32_MAX:.3g})")


def _as_bool(s: pd.Series, name: str) -> np.ndarray:
    """0/1 float values of a boolean column (bools, or numbers 0 and 1); NaN = missing."""
    dt = s.dtype
    if is_bool_dtype(dt):
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    numeric = is_numeric_dtype(dt) or (dt == object and _OBJECT_KINDS.get(_check_object(s, name)) in (NUMERIC_T, BOOLEAN_T, ""))
    if not numeric:
        raise ValueError(f"column {name!r} is boolean but holds {_first_value(s)!r}")
    v = _as_float(s, name)
    bad = ~np.isnan(v) & (v != 0) & (v != 1)
    if bad.any():
        raise ValueError(f"column {name!r} is boolean but holds {v[bad][0]!r} (only True/False or 0/1)")
    return v


def _as_datetime(s: pd.Series, name: str) -> pd.Series:
    """datetime64 values (naive or tz-aware) of a datetime-like column; ValueError naming the column otherwise."""
    dt = s.dtype
    if is_datetime64_any_dtype(dt):
        return s
    if isinstance(dt, pd.CategoricalDtype):
        s = s.astype(object)
    elif is_numeric_dtype(dt) or is_bool_dtype(dt) or is_timedelta64_dtype(dt):
        raise ValueError(f"column {name!r} holds numbers ({dt}), not datetimes; "
                         "convert it with pd.to_datetime(..., unit=...) first")
    if s.dtype == object:
        kind = _check_object(s, name)
        if _OBJECT_KINDS[kind] not in (DATETIME_T, CATEGORICAL_T, ""):
            raise ValueError(f"column {name!r} holds {kind} values, not datetimes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pandas' "could not infer format" notice
        try:  # one format inferred from the first value (fast) ...
            out = pd.to_datetime(s)
        except (ValueError, TypeError, OverflowError):
            try:  # ... else each value on its own
                out = pd.to_datetime(s, format="mixed")
            except (ValueError, TypeError, OverflowError) as err:
                raise ValueError(f"column {name!r}: cannot read values as datetimes "
                                 f"(e.g. {_first_value(s)!r}): {err}") from err
    return pd.Series(out, index=s.index)


def _as_text(s: pd.Series) -> pd.Series:
    """Values as pandas strings (str() of non-strings), <NA> = missing."""
    return s.astype(object).astype("string")


def _is_strings(s: pd.Series) -> bool:
    """The column holds strings (string dtype, or object column of str)."""
    if s.dtype == object:
        return infer_dtype(s, skipna=True) == "string"
    return is_string_dtype(s.dtype) and not isinstance(s.dtype, pd.CategoricalDtype)


def _category_codes(s: pd.Series, categories: list) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes into `categories` (-1 = missing or unseen) and the mask of non-missing cells."""
    index = pd.Index(categories, dtype=object if not categories else None)
    if isinstance(s.dtype, pd.CategoricalDtype):
        raw = s.cat.codes.to_numpy()
        lookup = np.append(index.get_indexer(s.cat.categories), -1)  # raw -1 (missing) -> -1
        return lookup[raw], raw >= 0
    return index.get_indexer(s), s.notna().to_numpy()


def _codes_to_float(codes: np.ndarray) -> np.ndarray:
    return np.where(codes >= 0, codes, np.nan).astype(np.float64)


def _warn_unseen(name: str, values: pd.Series) -> None:
    examples = pd.unique(values.astype(object))[:3].tolist()
    warnings.warn(f"column {name!r}: {len(values)} value(s) not seen at fit time (e.g. {examples}) "
                  "encoded as missing (NaN)", UserWarning, stacklevel=4)


def _py(v: Any) -> Any:
    """A numpy scalar as the plain Python value (JSON-serialisable)."""
    return v.item() if isinstance(v, np.generic) else v


def _sorted_categories(values: Any, name: str) -> list:
    """Distinct values as sorted plain Python scalars (str, bool, int or float)."""
    cats = [_py(v) for v in values]
    bad = [v for v in cats if not isinstance(v, _CATEGORY_VALUE_TYPES)]
    if bad:
        raise ValueError(f"column {name!r}: categories must be strings, numbers or booleans; got {bad[0]!r} "
                         f"({type(bad[0]).__name__})")
    if any(isinstance(v, str) for v in cats) and not all(isinstance(v, str) for v in cats):
        raise ValueError(f"column {name!r} mixes strings and numbers among its categories: "
                         f"{_type_examples(pd.Series(cats, dtype=object))}")
    return sorted(cats)


# =========================================================================== fitting one column
def _natural_type(s: pd.Series, name: str) -> str:
    """The type inferred from dtype and values, before the constant and text rules."""
    dt = s.dtype
    if isinstance(dt, pd.CategoricalDtype):
        return CATEGORICAL_T
    if is_bool_dtype(dt):
        return BOOLEAN_T
    if is_datetime64_any_dtype(dt):
        return DATETIME_T
    if is_timedelta64_dtype(dt) or is_numeric_dtype(dt):
        return NUMERIC_T
    if dt == object:
        return _OBJECT_KINDS[_check_object(s, name)] or NUMERIC_T
    if is_string_dtype(dt):
        return CATEGORICAL_T
    raise ValueError(f"column {name!r} has unsupported dtype {dt}")


def _constant_spec(name: str, value_type: str, value: Any) -> ColumnSpec:
    return ColumnSpec(name, CONSTANT_T, categories=[_py(value)], value_type=value_type, constant=True)


def _fit_numeric(s: pd.Series, name: str, config: EncodeConfig, overridden: bool) -> ColumnSpec:
    v = _as_float(s, name)
    _check_float32(v, name)
    finite = v[np.isfinite(v)]
    uniq = np.unique(finite)
    pos, neg = bool((v == np.inf).any()), bool((v == -np.inf).any())
    has_inf = pos or neg
    if not overridden:
        if not has_inf and len(uniq) == 1:
            return _constant_spec(name, NUMERIC_T, float(uniq[0]))
        cmax = config.categorical_max_int
        if cmax is not None and is_integer_dtype(s.dtype) and uniq[0] >= 0 and uniq[-1] <= cmax:
            return _fit_categorical(s, name, config, overridden=False)
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    return ColumnSpec(name, NUMERIC_T, has_inf=has_inf, lo=lo, hi=hi, constant=len(uniq) + pos + neg <= 1)


def _fit_boolean(s: pd.Series, name: str, config: EncodeConfig, overridden: bool) -> ColumnSpec:
    v = _as_bool(s, name)
    return ColumnSpec(name, BOOLEAN_T, categories=[False, True], constant=len(np.unique(v[~np.isnan(v)])) <= 1)


def _n_distinct(s: pd.Series) -> int:
    """Distinct non-missing values (read as strings when they are unhashable)."""
    try:
        return int(s.nunique())
    except TypeError:
        return int(_as_text(s).nunique())


def _looks_like_text(n_unique: int, n_present: int, config: EncodeConfig) -> bool:
    return n_unique > config.max_categories or (
        n_unique >= config.text_min_unique and n_unique >= config.text_unique_ratio * n_present)


def _fit_categorical(s: pd.Series, name: str, config: EncodeConfig, overridden: bool) -> ColumnSpec:
    declared = isinstance(s.dtype, pd.CategoricalDtype)
    if declared:
        values = s.cat.categories  # the declared domain, observed or not
    else:
        if s.dtype == object:
            _check_object(s, name)
        values = pd.unique(s.dropna())
    k = len(values)
    if not declared and not overridden and _is_strings(s) and _looks_like_text(k, int(s.notna().sum()), config):
        return _fit_text(s, name, config, overridden)
    if k > config.max_categories:
        raise ValueError(f"column {name!r} has {k} categories, more than max_categories={config.max_categories}; "
                         "override its type to 'text' or raise the limit")
    categories = _sorted_categories(values, name)
    if k == 1 and not overridden:
        return _constant_spec(name, CATEGORICAL_T, categories[0])
    return ColumnSpec(name, CATEGORICAL_T, categories=categories, constant=s.nunique() <= 1)


def _fit_datetime(s: pd.Series, name: str, config: EncodeConfig, overridden: bool) -> ColumnSpec:
    d = _as_datetime(s, name)
    tz = None if d.dt.tz is None else str(d.dt.tz)
    present = d.notna()
    has_time = bool((d.dt.normalize() != d)[present].any())
    parts = ["epoch", "year", "month", "day", "dayofweek"] + (["hour"] if has_time else [])
    return ColumnSpec(name, DATETIME_T, parts=parts, tz=tz, constant=d.nunique() <= 1)


def _fit_text(s: pd.Series, name: str, config: EncodeConfig, overridden: bool) -> ColumnSpec:
    return ColumnSpec(name, TEXT_T, parts=list(TEXT_PARTS), buckets=config.text_buckets,
                      constant=_n_distinct(s) <= 1)


_FITTERS = {NUMERIC_T: _fit_numeric, BOOLEAN_T: _fit_boolean, CATEGORICAL_T: _fit_categorical,
            DATETIME_T: _fit_datetime, TEXT_T: _fit_text}


def fit_column(s: pd.Series, name: str, config: EncodeConfig, override: str | None = None) -> ColumnSpec:
    """Infer (or take from `override`) the type of one column and fit its spec."""
    if not s.notna().any():
        spec = ColumnSpec(name, CONSTANT_T, all_missing=True, constant=True)
    else:
        t = override if override is not None else _natural_type(s, name)
        spec = _FITTERS[t](s, name, config, overridden=override is not None)
    spec.dtype = str(s.dtype)
    spec.overridden = override is not None
    return spec


# =========================================================================== encoding one column
def _encode_numeric(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    v = _as_float(s, spec.name)
    _check_float32(v, spec.name)
    pos, neg = v == np.inf, v == -np.inf
    value = v.copy()
    value[pos], value[neg] = spec.hi, spec.lo
    if not spec.has_inf:
        if pos.any() or neg.any():
            warnings.warn(f"column {spec.name!r}: {int(pos.sum() + neg.sum())} +-inf value(s) but none at fit time; "
                          f"clipped to the fitted range [{spec.lo}, {spec.hi}]", UserWarning, stacklevel=4)
        return [value]
    flag = np.where(np.isnan(v), np.nan, 0.0)
    flag[pos], flag[neg] = INF_POS, INF_NEG
    return [value, flag]


def _encode_categorical(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    if s.dtype == object:
        _check_object(s, spec.name)
    codes, present = _category_codes(s, spec.categories)
    unseen = present & (codes < 0)
    if unseen.any():
        _warn_unseen(spec.name, s[unseen])
    return [_codes_to_float(codes)]


def _encode_boolean(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    return [_as_bool(s, spec.name)]


def _encode_constant(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    if spec.all_missing:
        present = s.notna().to_numpy()
        if present.any():
            _warn_unseen(spec.name, s[present])
        return [np.full(len(s), np.nan)]
    if spec.value_type == NUMERIC_T:
        v = _as_float(s, spec.name)
        codes, present = np.where(v == spec.categories[0], 0, -1), ~np.isnan(v)
        unseen = present & (codes < 0)
        if unseen.any():
            _warn_unseen(spec.name, s[unseen])
        return [_codes_to_float(codes)]
    return _encode_categorical(s, spec)


def _encode_datetime(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    d = _as_datetime(s, spec.name)
    tz = None if d.dt.tz is None else str(d.dt.tz)
    if (tz is None) != (spec.tz is None):
        raise ValueError(f"column {spec.name!r} was fitted with time zone {spec.tz} but got {tz}; "
                         "naive and time-zone-aware datetimes cannot be mixed")
    if tz is not None and tz != spec.tz:
        try:
            d = d.dt.tz_convert(spec.tz)
        except (ValueError, TypeError):  # a fixed offset pandas cannot parse back: keep the input's zone
            pass
    origin = pd.Timestamp("1970-01-01", tz="UTC" if tz is not None else None)
    out = []
    for part in spec.parts:
        values = (d - origin) / pd.Timedelta(days=1) if part == "epoch" else _DATETIME_PART_FN[part](d)
        out.append(values.to_numpy(dtype=np.float64, na_value=np.nan))
    return out


def _text_values(s: pd.Series) -> tuple[np.ndarray, list[str]]:
    """Codes (-1 = missing) into the distinct values of a column, each read as a string."""
    try:
        codes, uniques = pd.factorize(s)
    except TypeError:  # unhashable values (lists, dicts) under a "text" override
        codes, uniques = pd.factorize(_as_text(s))
    return codes, [u if isinstance(u, str) else str(u) for u in np.asarray(uniques, dtype=object).tolist()]


def _encode_text(s: pd.Series, spec: ColumnSpec) -> list[np.ndarray]:
    # work on distinct values only (crc32 has no vectorised form), then broadcast by code
    codes, uniques = _text_values(s)
    hashes, lengths, words = [], [], []
    for u in uniques:
        split = u.split()
        hashes.append(zlib.crc32(" ".join(split).lower().encode("utf-8")) % spec.buckets)
        lengths.append(len(u))
        words.append(len(split))
    feats = np.full((len(uniques) + 1, 3), np.nan)  # last row: code -1 (missing) -> NaN
    feats[:-1] = np.column_stack([hashes, lengths, words]) if uniques else np.empty((0, 3))
    rows = feats[codes]
    return [rows[:, 0], rows[:, 1], rows[:, 2]]


_ENCODERS = {NUMERIC_T: _encode_numeric, BOOLEAN_T: _encode_boolean, CATEGORICAL_T: _encode_categorical,
             DATETIME_T: _encode_datetime, TEXT_T: _encode_text, CONSTANT_T: _encode_constant}


# =========================================================================== decoding one column
def _decode_codes(name: str, x: np.ndarray, k: int) -> np.ndarray:
    """Validated integer codes (-1 where missing) from encoded floats."""
    present = ~np.isnan(x)
    bad = present & ((x != np.round(x)) | (x < 0) | (x >= k))
    if bad.any():
        raise ValueError(f"column {name!r}: {x[bad][0]!r} is not a category code in 0..{k - 1}")
    return np.where(present, x, -1).astype(np.int64)


def _restore_dtype(values: pd.Series, dtype: str) -> pd.Series:
    """Cast decoded values back to the source dtype where that is lossless; else leave them."""
    if not dtype:
        return values
    if dtype == "bool" and values.isna().any():
        dtype = "boolean"
    try:
        return values.astype(dtype)
    except (TypeError, ValueError):
        return values


def _decode_categorical(spec: ColumnSpec, cols: list[np.ndarray]) -> pd.Series:
    codes = _decode_codes(spec.name, cols[0], len(spec.categories))
    if spec.dtype == "category":
        return pd.Series(pd.Categorical.from_codes(codes, categories=spec.categories))
    lookup = np.empty(len(spec.categories) + 1, dtype=object)
    lookup[:-1] = spec.categories
    lookup[-1] = np.nan  # code -1
    return _restore_dtype(pd.Series(lookup[codes], dtype=object), spec.dtype)


def _decode_constant(spec: ColumnSpec, cols: list[np.ndarray]) -> pd.Series:
    if spec.all_missing:
        return _restore_dtype(pd.Series(np.full(len(cols[0]), np.nan)), spec.dtype)
    return _decode_categorical(spec, cols)


def _decode_numeric(spec: ColumnSpec, cols: list[np.ndarray]) -> pd.Series:
    value = cols[0].astype(np.float64)
    if spec.has_inf:
        flag = _decode_codes(f"{spec.name}.inf", cols[1], 3)
        value[flag == INF_POS], value[flag == INF_NEG] = np.inf, -np.inf
    if spec.dtype.startswith("timedelta"):
        return pd.Series(pd.to_timedelta(value, unit="s"))
    return pd.Series(value)


def _decode_datetime(spec: ColumnSpec, cols: list[np.ndarray]) -> pd.Series:
    days = cols[spec.parts.index("epoch")].astype(np.float64)
    d = pd.Series(pd.to_datetime(np.round(days * 86400.0), unit="s"))
    if spec.tz is not None:
        d = d.dt.tz_localize("UTC")
        try:
            d = d.dt.tz_convert(spec.tz)
        except (ValueError, TypeError):
            pass
    if "hour" not in spec.parts:  # fitted values were all dates (midnight): dates come back exact
        try:
            d = d.dt.round("D")
        except (ValueError, TypeError):  # a midnight that does not exist / is ambiguous in this zone
            pass
    return _restore_dtype(d, spec.dtype) if spec.dtype.startswith("datetime64") else d


def _decode_text(spec: ColumnSpec, cols: list[np.ndarray]) -> pd.Series:
    return _restore_dtype(pd.Series(np.full(len(cols[0]), np.nan), dtype=object), spec.dtype)


_DECODERS = {NUMERIC_T: _decode_numeric, BOOLEAN_T: _decode_categorical, CATEGORICAL_T: _decode_categorical,
             DATETIME_T: _decode_datetime, TEXT_T: _decode_text, CONSTANT_T: _decode_constant}


# =========================================================================== table level
@dataclass
class EncodedTable:
    """One encoded table: x float32 (n_rows, n_cols), kind int8 (n_cols,), cardinality int64 (n_cols,)."""

    x: torch.Tensor
    kind: torch.Tensor
    cardinality: torch.Tensor
    columns: list[str]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.x.shape[0]), int(self.x.shape[1])

    def to_batch(self, context: torch.Tensor | None = None, query: torch.Tensor | None = None) -> TableBatch:
        """A validated TableBatch of this one table (all rows context unless told otherwise)."""
        return TableBatch.from_table(self.x, self.kind, self.cardinality, context=context, query=query)


@dataclass
class TableSchema:
    """Fitted per-column specs of a table: encodes frames, decodes encoded values, saves to JSON."""

    columns: list[ColumnSpec]
    config: EncodeConfig = field(default_factory=EncodeConfig)

    # ------------------------------------------------------------ layout
    @property
    def names(self) -> list[str]:
        """Source column names, in order."""
        return [c.name for c in self.columns]

    @property
    def encoded_columns(self) -> list[EncodedColumn]:
        """Every encoded column (name, source, part, kind, cardinality), in tensor order."""
        return [e for c in self.columns for e in c.encoded_columns()]

    @property
    def encoded_names(self) -> list[str]:
        return [e.name for e in self.encoded_columns]

    @property
    def kind(self) -> torch.Tensor:
        return torch.tensor([e.kind for e in self.encoded_columns], dtype=torch.int8)

    @property
    def cardinality(self) -> torch.Tensor:
        return torch.tensor([e.cardinality for e in self.encoded_columns], dtype=torch.int64)

    def __getitem__(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"no column {name!r} in the schema")

    def encoded_indices(self, name: str) -> list[int]:
        """Positions in the encoded tensor of the columns that source column `name` expands into."""
        self[name]
        return [j for j, e in enumerate(self.encoded_columns) if e.source == name]

    # ------------------------------------------------------------ fit / transform
    @classmethod
    def fit(cls, frame: Any, overrides: Mapping[str, str] | None = None,
            config: EncodeConfig | None = None) -> "TableSchema":
        """Infer each column's type (or take it from `overrides`) and fit categories, ranges and parts."""
        config = config or EncodeConfig()
        df = as_frame(frame)
        _check_frame(df, config)
        overrides = _check_overrides(overrides, df.columns)
        schema = cls([fit_column(df[name], name, config, overrides.get(name)) for name in df.columns], config)
        schema._check_encoded_names()
        return schema

    def transform(self, frame: Any, allow_missing_columns: bool = False) -> EncodedTable:
        """Encode a frame with the fitted specs (columns matched by name; order follows the schema).

        allow_missing_columns: encode schema columns absent from the frame as all missing (e.g. a
        target column at predict time) instead of raising.
        """
        df = as_frame(frame)
        _check_frame(df, self.config)
        known = set(self.names)
        extra = [c for c in df.columns if c not in known]
        if extra:
            raise ValueError(f"columns not in the schema: {extra}")
        missing = [n for n in self.names if n not in df.columns]
        if missing and not allow_missing_columns:
            raise ValueError(f"columns missing from the frame: {missing}")
        x = np.full((len(df), len(self.encoded_columns)), np.nan, dtype=np.float32)
        j = 0
        for spec in self.columns:
            width = len(spec.encoded_columns())
            if spec.name in df.columns:
                parts = _ENCODERS[spec.type](df[spec.name], spec)
                for k, values in enumerate(parts):
                    x[:, j + k] = values
            j += width
        return EncodedTable(torch.from_numpy(x), self.kind, self.cardinality, self.encoded_names)

    @classmethod
    def fit_transform(cls, frame: Any, overrides: Mapping[str, str] | None = None,
                      config: EncodeConfig | None = None) -> tuple[EncodedTable, "TableSchema"]:
        schema = cls.fit(frame, overrides, config)
        return schema.transform(frame), schema

    def inverse_transform(self, x: torch.Tensor | np.ndarray) -> pd.DataFrame:
        """Decode encoded values (n_rows, n_encoded) back into a frame of the source columns.

        Codes become categories (source dtype restored where lossless), numbers pass through
        (float64; +-inf restored from the ".inf" flag), datetimes are rebuilt from the epoch part
        (to the second, float32 precision), text comes back missing. Invalid codes raise ValueError.
        """
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        arr = arr.astype(np.float64)
        n_enc = len(self.encoded_columns)
        if arr.ndim != 2 or arr.shape[1] != n_enc:
            raise ValueError(f"inverse_transform expects shape (rows, {n_enc}), got {arr.shape}")
        out, j = {}, 0
        for spec in self.columns:
            width = len(spec.encoded_columns())
            out[spec.name] = _DECODERS[spec.type](spec, [arr[:, j + k] for k in range(width)]).reset_index(drop=True)
            j += width
        return pd.DataFrame(out)

    def _check_encoded_names(self) -> None:
        seen: dict[str, str] = {}
        for e in self.encoded_columns:
            if e.name in seen:
                raise ValueError(f"encoded column name {e.name!r} is produced by source columns {seen[e.name]!r} and "
                                 f"{e.source!r}; rename one of them")
            seen[e.name] = e.source

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"format": SCHEMA_FORMAT, "version": SCHEMA_VERSION, "config": asdict(self.config),
                "columns": [c.to_dict() for c in self.columns]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TableSchema":
        if d.get("format") != SCHEMA_FORMAT or d.get("version") != SCHEMA_VERSION:
            raise ValueError(f"not a {SCHEMA_FORMAT} v{SCHEMA_VERSION} document: format={d.get('format')!r} "
                             f"version={d.get('version')!r}")
        schema = cls([ColumnSpec.from_dict(c) for c in d["columns"]], EncodeConfig(**d["config"]))
        schema._check_encoded_names()
        return schema

    def to_json(self, path: str | PathLike | None = None) -> str:
        """The schema as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, source: str | PathLike) -> "TableSchema":
        """Load from JSON text (a string starting with '{') or from a file path."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            text = source
        else:
            text = Path(source).read_text(encoding="utf-8")
        return cls.from_dict(json.loads(text))


def encode_frame(frame: Any, overrides: Mapping[str, str] | None = None, schema: TableSchema | None = None,
                 config: EncodeConfig | None = None) -> tuple[EncodedTable, TableSchema]:
    """Encode a DataFrame or 2-D array: fit a schema when none is given, else transform with `schema`."""
    if schema is None:
        return TableSchema.fit_transform(frame, overrides, config)
    if overrides or config is not None:
        raise ValueError("overrides and config apply when fitting a schema; do not pass them with schema=")
    return schema.transform(frame), schema
