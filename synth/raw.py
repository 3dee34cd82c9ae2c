"""Raw mode: a SynthTable as a pandas DataFrame with real-world dtypes.

Numeric features get a random unit and offset (ints when they are whole numbers), and
some become datetime columns; categorical features become strings, pandas categoricals,
integer codes, booleans (2 categories) or free text (a sentence per category, usually
with row-level filler words so the column reads as text). Missing cells are
NaN / NaT / None / <NA> as the dtype dictates. The target is the last column, "target".
This is the slow, pandas path that exercises tabfm.data.encode end to end.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from tabfm.data.batch import CATEGORICAL
from .config import PriorConfig
from .table import CLASSIFICATION, SynthTable

TARGET = "target"

WORDS = np.array(
    "red green blue amber violet north south east west river stone forest harbor valley "
    "engine signal market garden copper silver winter summer autumn spring quiet rapid "
    "gentle bright narrow broad ancient modern coastal urban rural alpine desert island "
    "meadow canyon bridge tower station library museum theater kitchen window ladder "
    "lantern compass anchor falcon otter badger heron maple cedar willow orchid basil "
    "pepper ginger honey velvet linen cotton marble granite".split()
)
_EPOCH_2000 = 946_684_800  # seconds since 1970 at 2000-01-01


def _labels(rng: np.random.Generator, k: int, words: int) -> np.ndarray:
    """k distinct labels of `words` random words each (object array)."""
    picks = WORDS[rng.integers(0, len(WORDS), size=(k, words))]
    labels = [" ".join(p) for p in picks]
    seen: dict[str, int] = {}
    for i, s in enumerate(labels):  # make duplicates distinct (k is small)
        if s in seen:
            labels[i] = f"{s} {i}"
        seen[labels[i]] = i
    return np.array(labels, dtype=object)


def _free_text(rng: np.random.Generator, codes: np.ndarray, k: int) -> np.ndarray:
    """A sentence of 3-8 words per category; usually each row also appends 1-2 random
    filler words, so the column has many distinct strings like real free text."""
    text = _labels(rng, k, int(rng.integers(3, 9)))[codes]
    if rng.random() < 0.75:
        n = len(codes)
        filler = WORDS[rng.integers(0, len(WORDS), size=(2, n))].astype(object)
        two = rng.random(n) < 0.5
        text = text + " " + np.where(two, filler[0] + " " + filler[1], filler[0])
    return text


def _with_missing(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    out = values.astype(object)
    out[missing] = None
    return out


def _numeric(rng: np.random.Generator, col: np.ndarray, cfg: PriorConfig) -> pd.Series:
    """A number column in a random unit, or a datetime column with prob p_datetime."""
    miss = np.isnan(col)
    if rng.random() < cfg.p_datetime:
        lo, hi = np.nanmin(col, initial=np.inf), np.nanmax(col, initial=-np.inf)
        u = (col - lo) / (hi - lo) if hi > lo else np.zeros_like(col)
        start = _EPOCH_2000 + rng.uniform(-25, 20) * 365.25 * 86400
        span = 10 ** rng.uniform(4.0, 9.0)  # hours .. decades
        seconds = np.floor(start + u * span)
        stamps = pd.to_datetime(seconds, unit="s")
        if rng.random() < 0.5:
            stamps = stamps.floor("D")
        return pd.Series(stamps)
    whole = np.all(col[~miss] == np.round(col[~miss]))
    scale = 1.0 if whole and rng.random() < 0.5 else 10 ** rng.uniform(-1.0, 3.0)
    shift = 0.0 if rng.random() < 0.5 else scale * rng.normal(0.0, 3.0)
    if whole and scale == 1.0:
        shift = float(np.round(shift))
    vals = col * scale + shift
    if whole and scale == 1.0:  # whole numbers stay integers (nullable Int64 when cells are missing)
        ints = np.where(miss, 0, vals).astype(np.int64)
        return pd.Series(pd.array(_with_missing(ints, miss), dtype="Int64")) if miss.any() else pd.Series(ints)
    if rng.random() < 0.5:
        vals = np.round(vals, int(rng.integers(0, 4)))
    return pd.Series(vals)


def _categorical(rng: np.random.Generator, col: np.ndarray, k: int, cfg: PriorConfig) -> pd.Series:
    """Codes as bool / free text / string / pandas category / integer column."""
    miss = np.isnan(col)
    codes = np.where(miss, 0, col).astype(np.int64)
    if k == 2 and rng.random() < cfg.p_bool:
        flags = codes == 1
        if miss.any():
            return pd.Series(pd.array(_with_missing(flags, miss), dtype="boolean"))
        return pd.Series(flags)
    if rng.random() < cfg.p_text:
        return pd.Series(_with_missing(_free_text(rng, codes, k), miss))
    style = rng.random()
    if style < 0.2:  # integer-coded categories (zip codes, ids)
        ids = np.sort(rng.choice(1000, size=k, replace=False))[codes]
        return pd.Series(pd.array(_with_missing(ids, miss), dtype="Int64")) if miss.any() else pd.Series(ids)
    strings = _with_missing(_labels(rng, k, 1)[codes], miss)
    if style < 0.5:
        return pd.Series(pd.Categorical(strings))
    return pd.Series(strings)


def _target(rng: np.random.Generator, table: SynthTable, cfg: PriorConfig) -> pd.Series:
    y = table.X[:, table.target].astype(np.float64)
    if table.task == CLASSIFICATION:
        codes = y.astype(np.int64)
        k = int(table.cardinality[table.target])
        if rng.random() < cfg.p_string_target:
            return pd.Series(_labels(rng, k, 1)[codes])
        return pd.Series(codes)
    return pd.Series(y * 10 ** rng.uniform(-1.0, 3.0) + rng.normal(0.0, 3.0))


def to_frame(table: SynthTable, rng: np.random.Generator, cfg: PriorConfig) -> pd.DataFrame:
    """The table as a DataFrame: feature columns x0.., then "target" (never missing)."""
    X = table.X.astype(np.float64)
    cols: dict[str, pd.Series] = {}
    name = 0
    for j in range(X.shape[1]):
        if j == table.target:
            continue
        if table.kind[j] == CATEGORICAL:
            cols[f"x{name}"] = _categorical(rng, X[:, j], int(table.cardinality[j]), cfg)
        else:
            cols[f"x{name}"] = _numeric(rng, X[:, j], cfg)
        name += 1
    cols[TARGET] = _target(rng, table, cfg)
    return pd.DataFrame(cols)
