"""TableBatch: the one tensor contract between data sources and the model.

A padded batch of B tables with up to R rows and C columns. Everything a model
needs to know about which cells are visible, hidden or padding travels here, so
nothing downstream re-derives it (see docs/design.md, "TableBatch").
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

PAD, NUMERIC, CATEGORICAL = 0, 1, 2
KIND_NAMES = {PAD: "padding", NUMERIC: "numeric", CATEGORICAL: "categorical"}


@dataclass
class TableBatch:
    """B tables of up to R rows x C columns.

    x            float32 (B, R, C)  numbers, or integer codes 0..k-1 of categorical cells; NaN = missing
    kind         int8    (B, C)     0 padding, 1 numeric, 2 categorical
    cardinality  int64   (B, C)     number of categories (0 for numeric and padding columns)
    row_valid    bool    (B, R)     real rows (False = padding)
    col_valid    bool    (B, C)     real columns (False = padding)
    context      bool    (B, R)     rows other rows may attend to
    query        bool    (B, R, C)  hidden cells the model must predict (true values stay in x)
    feature_ref  int64   (B, C, 3)  what a context-feature column (tabfm.data.context_features) estimates:
                                    (the column it estimates, the class code whose share it estimates or -1
                                    for a numeric target, its estimator 0..); all -1 for every other column.
                                    Optional: left out, every column is a table's own (all -1).
    """

    x: torch.Tensor
    kind: torch.Tensor
    cardinality: torch.Tensor
    row_valid: torch.Tensor
    col_valid: torch.Tensor
    context: torch.Tensor
    query: torch.Tensor
    feature_ref: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.feature_ref is None:
            b, c = self.kind.shape[:2]
            self.feature_ref = torch.full((b, c, 3), -1, dtype=torch.int64, device=self.kind.device)

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> tuple[int, int, int]:
        b, r, c = self.x.shape
        return int(b), int(r), int(c)

    @property
    def num_cells(self) -> int:
        """Real (non-padding) cells in the batch."""
        return int((self.row_valid[:, :, None] & self.col_valid[:, None, :]).sum())

    def __len__(self) -> int:
        return self.shape[0]

    # ------------------------------------------------------------- construction
    @classmethod
    def from_table(
        cls,
        x: torch.Tensor,
        kind: torch.Tensor,
        cardinality: torch.Tensor,
        context: torch.Tensor | None = None,
        query: torch.Tensor | None = None,
        validate: bool = True,
        feature_ref: torch.Tensor | None = None,
    ) -> "TableBatch":
        """A batch of one unpadded table: x (R, C), kind/cardinality (C,), context (R,), query (R, C),
        feature_ref (C, 3) (default: all -1, no context-feature column).

        validate=False skips `validate`, for query rows alone against an already encoded context
        (`TabFM.forward_queries`), which has no context rows by design."""
        x = torch.as_tensor(x, dtype=torch.float32)
        if x.dim() != 2:
            raise ValueError(f"from_table expects x of shape (rows, cols), got {tuple(x.shape)}")
        r, c = x.shape
        context = torch.ones(r, dtype=torch.bool) if context is None else torch.as_tensor(context, dtype=torch.bool)
        query = torch.zeros(r, c, dtype=torch.bool) if query is None else torch.as_tensor(query, dtype=torch.bool)
        batch = cls(
            x=x[None],
            kind=torch.as_tensor(kind, dtype=torch.int8)[None],
            cardinality=torch.as_tensor(cardinality, dtype=torch.int64)[None],
            row_valid=torch.ones(1, r, dtype=torch.bool),
            col_valid=torch.ones(1, c, dtype=torch.bool),
            context=context[None],
            query=query[None],
            feature_ref=None if feature_ref is None else torch.as_tensor(feature_ref, dtype=torch.int64)[None],
        )
        if validate:
            batch.validate()
        return batch

    @staticmethod
    def collate(tables: Sequence["TableBatch"], pad_columns: bool = False) -> "TableBatch":
        """Concatenate batches that share R and C along the batch axis; with pad_columns, batches
        of fewer columns first get padding columns up to the widest (e.g. episodes with and
        without context features)."""
        if not tables:
            raise ValueError("collate needs at least one TableBatch")
        if pad_columns:
            width = max(t.shape[2] for t in tables)
            tables = [t.pad_columns(width) for t in tables]
        shapes = {t.shape[1:] for t in tables}
        if len(shapes) != 1:
            raise ValueError(f"collate needs tables of one shape (rows, cols); got {sorted(shapes)}")
        return TableBatch(**{f.name: torch.cat([getattr(t, f.name) for t in tables]) for f in fields(TableBatch)})

    def pad_columns(self, cols: int) -> "TableBatch":
        """The batch with padding columns appended up to `cols` columns."""
        extra = cols - self.shape[2]
        if extra < 0:
            raise ValueError(f"pad_columns: the batch has {self.shape[2]} columns, more than {cols}")
        if extra == 0:
            return self
        b, r, _ = self.shape

        def grow(t: torch.Tensor, fill: int | float | bool, dims: tuple[int, ...]) -> torch.Tensor:
            return torch.cat([t, torch.full(dims, fill, dtype=t.dtype)], dim=-1)

        return TableBatch(x=grow(self.x, 0.0, (b, r, extra)), kind=grow(self.kind, PAD, (b, extra)),
                          cardinality=grow(self.cardinality, 0, (b, extra)), row_valid=self.row_valid,
                          col_valid=grow(self.col_valid, False, (b, extra)), context=self.context,
                          query=grow(self.query, False, (b, r, extra)),
                          feature_ref=torch.cat([self.feature_ref, torch.full((b, extra, 3), -1, dtype=torch.int64,
                                                                              device=self.feature_ref.device)], dim=1))

    # ----------------------------------------------------------------- moving
    def to(self, device: torch.device | str | None = None, non_blocking: bool = False) -> "TableBatch":
        return TableBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def pin_memory(self) -> "TableBatch":
        return TableBatch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    def __getitem__(self, idx) -> "TableBatch":
        """Select tables along the batch axis (int, slice or index tensor); keeps the batch dim."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return TableBatch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def slice_rows(self, start: int, stop: int) -> "TableBatch":
        """Rows [start, stop) of every table (used by row-sequence parallelism)."""
        per_row = {"x", "row_valid", "context", "query"}
        return TableBatch(
            **{f.name: (getattr(self, f.name)[:, start:stop] if f.name in per_row else getattr(self, f.name)) for f in fields(self)}
        )

    def visible_x(self) -> torch.Tensor:
        """x with query cells blanked to NaN: what a forward pass may read."""
        return self.x.masked_fill(self.query, float("nan"))

    # ------------------------------------------------------------- validation
    def validate(self) -> "TableBatch":
        """Check shapes, dtypes and invariants; raise ValueError naming what is wrong."""
        if self.x.dim() != 3:
            raise ValueError(f"TableBatch.x must be (B, R, C); got shape {tuple(self.x.shape)}")
        b, r, c = self.shape
        expect = {
            "x": ((b, r, c), (torch.float32,)),
            "kind": ((b, c), (torch.int8,)),
            "cardinality": ((b, c), (torch.int64, torch.int32)),
            "row_valid": ((b, r), (torch.bool,)),
            "col_valid": ((b, c), (torch.bool,)),
            "context": ((b, r), (torch.bool,)),
            "query": ((b, r, c), (torch.bool,)),
            "feature_ref": ((b, c, 3), (torch.int64,)),
        }
        for name, (shape, dtypes) in expect.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"TableBatch.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"TableBatch.{name} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype not in dtypes:
                raise ValueError(f"TableBatch.{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
            if t.device != self.x.device:
                raise ValueError(f"TableBatch.{name} is on {t.device} but x is on {self.x.device}")

        kind = self.kind.long()
        bad = ~((kind == PAD) | (kind == NUMERIC) | (kind == CATEGORICAL))
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"TableBatch.kind[{i}, {j}] = {int(kind[i, j])}; allowed 0 (padding), 1 (numeric), 2 (categorical)")
        mismatch = self.col_valid != (kind != PAD)
        if mismatch.any():
            i, j = mismatch.nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j}: col_valid={bool(self.col_valid[i, j])} but kind={int(kind[i, j])}")
        cat = kind == CATEGORICAL
        if (self.cardinality[cat] < 1).any():
            i, j = (cat & (self.cardinality < 1)).nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j} is categorical with cardinality {int(self.cardinality[i, j])} (< 1)")
        if (self.cardinality[~cat] != 0).any():
            i, j = (~cat & (self.cardinality != 0)).nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j} is not categorical but has cardinality {int(self.cardinality[i, j])}")

        # categorical codes must be integers in [0, cardinality)
        valid_cell = self.row_valid[:, :, None] & self.col_valid[:, None, :]
        cat_cell = valid_cell & cat[:, None, :] & ~torch.isnan(self.x)
        if cat_cell.any():
            vals = self.x[cat_cell]
            card = self.cardinality[:, None, :].expand(b, r, c)[cat_cell].to(vals.dtype)
            wrong = (vals != vals.round()) | (vals < 0) | (vals >= card)
            if wrong.any():
                k = int(wrong.nonzero()[0])
                i, rr, j = cat_cell.nonzero()[k].tolist()
                raise ValueError(
                    f"table {i} row {rr} column {j}: categorical code {float(vals[k])} is not an integer in [0, {int(card[k])})"
                )

        if (self.context & ~self.row_valid).any():
            i, rr = (self.context & ~self.row_valid).nonzero()[0].tolist()
            raise ValueError(f"table {i} row {rr} is a context row but is padding")
        if (self.query & ~valid_cell).any():
            i, rr, j = (self.query & ~valid_cell).nonzero()[0].tolist()
            raise ValueError(f"table {i} cell ({rr}, {j}) is a query cell but is padding")
        self._validate_feature_ref(kind)
        has_rows = self.row_valid.any(1)
        no_ctx = has_rows & ~self.context.any(1)
        if no_ctx.any():
            raise ValueError(f"table {int(no_ctx.nonzero()[0])} has rows but no context rows")
        return self

    def _validate_feature_ref(self, kind: torch.Tensor) -> None:
        """A context-feature column is a valid numeric column that estimates another valid column of its
        table (a class code below that column's cardinality, or -1 for a numeric one)."""
        ref = self.feature_ref
        col, code, est = ref.unbind(-1)
        marked = col >= 0
        if ((~marked) & ((code != -1) | (est != -1))).any() or (marked & (est < 0)).any():
            i, j = (((~marked) & ((code != -1) | (est != -1))) | (marked & (est < 0))).nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j}: feature_ref {ref[i, j].tolist()} is neither all -1 nor "
                             "(column >= 0, code, estimator >= 0)")
        if not marked.any():
            return
        c = self.shape[2]
        if (col >= c).any():
            i, j = (col >= c).nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j}: feature_ref names column {int(col[i, j])}, but the table has {c}")
        target = col.clamp(min=0)
        t_kind = kind.gather(1, target)
        t_card = self.cardinality.gather(1, target)
        bad = marked & ((kind != NUMERIC) | (t_kind == PAD) | (target == torch.arange(c, device=col.device))
                        | ((t_kind == CATEGORICAL) & ((code < 0) | (code >= t_card)))
                        | ((t_kind == NUMERIC) & (code != -1)))
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"table {i} column {j} (kind {int(kind[i, j])}): feature_ref {ref[i, j].tolist()} must "
                             f"mark a numeric column estimating another real column (kind {int(t_kind[i, j])}, "
                             f"cardinality {int(t_card[i, j])}), with a class code below its cardinality "
                             "or -1 for a numeric one")
