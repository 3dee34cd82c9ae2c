"""Column schema: what each source column of a real table is and how it is encoded.

Pure, JSON-serialisable descriptions (no pandas): the limits and thresholds that
steer type inference (`EncodeConfig`), one `ColumnSpec` per source column, and the
`EncodedColumn`s each spec expands into. The code that fits and applies these
specs lives in `tabfm.data.encode`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .batch import CATEGORICAL, NUMERIC

# ------------------------------------------------------------------ column types
NUMERIC_T, BOOLEAN_T, CATEGORICAL_T, DATETIME_T, TEXT_T, CONSTANT_T = (
    "numeric", "boolean", "categorical", "datetime", "text", "constant")
COLUMN_TYPES = (NUMERIC_T, BOOLEAN_T, CATEGORICAL_T, DATETIME_T, TEXT_T, CONSTANT_T)

# ------------------------------------------------------------------ limits (documented defaults)
MAX_ROWS = 1_000_000          # rows per table at fit and transform
MAX_COLUMNS = 1_000           # source columns per table (encoded columns may be more: datetime -> 6, text -> 3)
MAX_CATEGORIES = 1_000        # categories of one categorical column; more distinct strings -> "text"
TEXT_MIN_UNIQUE = 32          # a string column with >= this many distinct values ...
TEXT_UNIQUE_RATIO = 0.5       # ... that are >= this fraction of its non-missing cells is "text"
TEXT_BUCKETS = 64             # text is hashed (crc32) into this many categories

# datetime parts: "epoch" (days since 1970-01-01 UTC) is always first; "hour" only if a fitted value has a time of day
DATETIME_PARTS = ("epoch", "year", "month", "day", "dayofweek", "hour")
# text parts: hashed bucket of the normalised string, its length in characters, its number of words
TEXT_PARTS = ("hash", "len", "words")
# numeric inf flag codes (extra column "<name>.inf", only when the fitted column held +-inf)
INF_FINITE, INF_POS, INF_NEG = 0, 1, 2

SCHEMA_FORMAT, SCHEMA_VERSION = "tabfm.table_schema", 1


@dataclass(frozen=True)
class EncodeConfig:
    """Limits and inference thresholds; stored with the schema so transforms repeat the fit."""

    max_rows: int = MAX_ROWS
    max_columns: int = MAX_COLUMNS
    max_categories: int = MAX_CATEGORIES
    text_min_unique: int = TEXT_MIN_UNIQUE
    text_unique_ratio: float = TEXT_UNIQUE_RATIO
    text_buckets: int = TEXT_BUCKETS
    # None: integer columns stay numeric. An int k: integer-dtype columns whose values all lie in 0..k
    # (small integer codes) are inferred categorical.
    categorical_max_int: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_columns", "max_categories", "text_min_unique", "text_buckets"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EncodeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.text_unique_ratio <= 1.0:
            raise ValueError(f"EncodeConfig.text_unique_ratio must be in (0, 1], got {self.text_unique_ratio}")
        if self.categorical_max_int is not None and self.categorical_max_int < 0:
            raise ValueError(f"EncodeConfig.categorical_max_int must be >= 0 or None, got {self.categorical_max_int}")


@dataclass(frozen=True)
class EncodedColumn:
    """One column of the encoded tensor and where it came from."""

    name: str            # "age", "when.year", "price.inf"
    source: str          # the source column ("when")
    part: str            # "" for one-to-one columns, else the part ("year", "inf", "hash", ...)
    kind: int            # tabfm.data.batch.NUMERIC or CATEGORICAL
    cardinality: int     # categories (0 for numeric)


@dataclass
class ColumnSpec:
    """How one source column was read at fit time and how it is encoded.

    type         one of COLUMN_TYPES
    dtype        the source pandas dtype (str), used to restore dtypes in inverse_transform
    categories   categorical: sorted categories, code i <-> categories[i]; boolean: [False, True];
                 constant: [the one value] (empty when all missing)
    value_type   constant only: "numeric" or "categorical" (how incoming values are compared), "" if all missing
    has_inf      numeric: the fitted column held +-inf, so an extra "<name>.inf" flag column is emitted
    lo, hi       numeric: fitted finite min / max; +-inf values are clipped to them
    parts        datetime: encoded parts (subset of DATETIME_PARTS); text: TEXT_PARTS
    tz           datetime: fitted time zone ("UTC", "Europe/Paris") or None for naive datetimes
    buckets      text: number of hash buckets
    all_missing, constant   data facts at fit time (set whatever the type)
    overridden   the type came from the user, not from inference
    """

    name: str
    type: str
    dtype: str = ""
    categories: list = field(default_factory=list)
    value_type: str = ""
    has_inf: bool = False
    lo: float = 0.0
    hi: float = 0.0
    parts: list[str] = field(default_factory=list)
    tz: str | None = None
    buckets: int = 0
    all_missing: bool = False
    constant: bool = False
    overridden: bool = False

    def __post_init__(self) -> None:
        if self.type not in COLUMN_TYPES:
            raise ValueError(f"column {self.name!r}: unknown type {self.type!r}; expected one of {COLUMN_TYPES}")

    def encoded_columns(self) -> list[EncodedColumn]:
        """The encoded columns this source column expands into, in order."""
        n, t = self.name, self.type
        if t == NUMERIC_T:
            cols = [EncodedColumn(n, n, "", NUMERIC, 0)]
            if self.has_inf:
                cols.append(EncodedColumn(f"{n}.inf", n, "inf", CATEGORICAL, 3))
            return cols
        if t in (BOOLEAN_T, CATEGORICAL_T):
            return [EncodedColumn(n, n, "", CATEGORICAL, len(self.categories))]
        if t == CONSTANT_T:  # all-missing columns have no category to code: a numeric column of NaN
            return [EncodedColumn(n, n, "", CATEGORICAL, 1) if self.categories else EncodedColumn(n, n, "", NUMERIC, 0)]
        if t == DATETIME_T:
            return [EncodedColumn(f"{n}.{p}", n, p, NUMERIC, 0) for p in self.parts]
        return [EncodedColumn(f"{n}.hash", n, "hash", CATEGORICAL, self.buckets),
                EncodedColumn(f"{n}.len", n, "len", NUMERIC, 0),
                EncodedColumn(f"{n}.words", n, "words", NUMERIC, 0)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ColumnSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"column spec {d.get('name')!r}: unknown fields {sorted(unknown)}")
        return cls(**d)
