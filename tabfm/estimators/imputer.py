"""TabFMImputer: fill every missing cell of a table from the rest of it, in context.

Two strategies (`strategy`). "columns" (the default): each column with missing cells is a target,
predicted from the row's other columns exactly as TabFMRegressor (numeric columns) or
TabFMClassifier (categorical and boolean columns) predict one: the fitted rows where that column
is observed are the context, with the context features the model was pretrained with (MissForest's
layout, one supervised model per column, with the foundation model in place of the forest), numeric
columns by the regressor's default mixed members (half on the ridge residual, half on the column
itself, weighted per row by their predictive variances): on features with cells missing at the
imputation suite's rates (filled with their means) the ridge alone is a poor baseline (every member
on its residual was worse than none), but where the residual half is surer it still helps (subset
of BENCHMARKS.md "Imputation: mixed column regressors": 0.8531 -> 0.8455 standardised RMSE). It
costs one supervised prediction (n_estimators members) per column with missing cells and round.
Later rounds (`n_rounds`) show the other missing cells filled with the previous round's estimates,
in the query rows and the fitted rows alike, as MissForest iterates. Datetime columns, and every
column of a one-column table, take the joint path (one round).

"joint": the fitted rows are the context; each row to fill is a query row whose missing cells are
hidden cells to predict (its observed cells stay visible to it), all in one pass per member and
column group. Numeric cells get the
predictive mean (members averaged); categorical and boolean cells the most probable category
(members' probabilities averaged, decoded with the schema); datetimes are predicted through
their epoch part. Columns the model cannot predict are filled with their most frequent fitted
value, with a UserWarning: text columns (hashed, not invertible), categorical columns with
more categories than the model's head, and constant columns. All-missing columns have nothing
to learn from and stay missing (UserWarning). Observed cells come back exactly as given;
output is the input's format: a DataFrame with its index, columns and dtypes, or an array of
the input's dtype.

Rounds of the joint strategy (`n_rounds`, like MICE / MissForest): round 1 predicts every missing cell of a row at once,
with the row's other missing cells hidden too. Each later round re-predicts them with the other
missing cells visible, filled with the previous round's estimates (ensemble-averaged, in the
encoded space: numeric predictive mean, categorical most probable code). A member cannot show a
cell and predict it in one pass, so within each of its column groups it splits a row's missing
source columns into at most `round_parts` parts, dealt in turn from a seeded order of the group's
columns (drawn per member, group and round from the member's seed: fixed at fit, so a row's answer
depends only on the row and the fitted rows), and runs one pass per part, that part hidden. A row
with one missing column in a group (or round_parts=1) has nothing to show: its answer there is
round 1's, reused without a pass. Cost: each extra round adds up to `round_parts` passes of the
rows with missing cells per member and column group (and one context encoding per member and
group). The fitted rows (the context) are never filled; observed cells never change.
"""
from __future__ import annotations

import warnings
from os import PathLike
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.base import TransformerMixin
from sklearn.utils.validation import check_is_fitted
from torch import nn

from tabfm.data.batch import CATEGORICAL
from tabfm.data.schema import BOOLEAN_T, CATEGORICAL_T, DATETIME_T, NUMERIC_T, ColumnSpec
from tabfm.model import ModelOutput
from tabfm.model.predict import class_probabilities, numeric_mean
from tabfm.weights import DEFAULT_MODELS

from .base import (DEFAULT_CHUNK_SIZE, DEFAULT_MAX_COLUMNS, DEFAULT_MAX_COLUMNS_SUPERVISED, DEFAULT_MAX_CONTEXT_ROWS,
                   DEFAULT_N_ESTIMATORS, Runtime, TabFMEstimator)
from .classifier import TabFMClassifier
from .ensemble import Member, subsample
from .local_context import check_size
from .regressor import TabFMRegressor

MODEL_TYPES = (NUMERIC_T, BOOLEAN_T, CATEGORICAL_T, DATETIME_T)
TARGET_TYPES = (NUMERIC_T, BOOLEAN_T, CATEGORICAL_T)  # what strategy="columns" predicts as a supervised target
STRATEGIES = ("columns", "joint")
DEFAULT_STRATEGY = "columns"
COLUMN_KEY = 13  # keys a column's supervised seed apart from the members' other draws
DEFAULT_N_ROUNDS = 1
DEFAULT_ROUND_PARTS = 4
DEFAULT_LOCAL_CONTEXT = 0  # the column estimators' local contexts: off until measured (BENCHMARKS.md)
ROUND_KEY = 11  # keys a member's per-round order of its columns apart from its other choices (anomaly uses 7-9)


def column_seed(ensemble_seed: int, j: int) -> int:
    """random_state of the supervised estimator that strategy="columns" fits for source column j."""
    return int(np.random.SeedSequence([ensemble_seed, COLUMN_KEY, j]).generate_state(1)[0] & 0x7FFFFFFF)


def _fill(s: pd.Series, missing: np.ndarray, values: Any) -> pd.Series:
    """s with its missing cells taken from `values` (aligned array or scalar), in s's dtype where possible."""
    fill = pd.Series(values if np.ndim(values) else [values] * len(s), index=s.index)
    if pd.api.types.is_integer_dtype(s.dtype) and pd.api.types.is_float_dtype(fill.dtype):
        fill = fill.round()
    try:
        fill = fill.astype(s.dtype)
    except (TypeError, ValueError):
        pass
    return s.mask(pd.Series(missing, index=s.index), fill)


class TabFMImputer(TransformerMixin, TabFMEstimator):
    """sklearn transformer: fit(X) stores the table; transform(X) returns X with every NaN filled.

    See the module docstring for what each column type gets.

    strategy     "columns" (default): each column with missing cells is predicted from the other
                 columns by the supervised estimator of its type, the rows where it is observed as
                 context (module docstring). "joint": every missing cell of a row in one pass.
                 Public imputation suite: BENCHMARKS.md "Imputation, one column at a time".

    n_rounds     imputation rounds (int >= 1). 1 (the default): every missing cell is predicted
                 with the row's other missing cells hidden (joint: in one pass). Each further round
                 re-predicts them with the other missing cells filled with the previous round's
                 estimates (see the module docstring). "columns": a round costs one more supervised
                 prediction per column (and, for rows other than the fitted ones, one for the fitted
                 rows' own estimates); "joint": up to `round_parts` more passes per member and group.
    round_parts  at most this many parts (int >= 1, default 4) a row's missing source columns are
                 split into per member and column group in rounds after the first; a part is hidden
                 while the row's other missing cells show the previous estimates. A row's parts are
                 min(round_parts, its missing columns in the group); round_parts=1 hides them all
                 together, which is round 1 again (no extra pass). Used only when n_rounds > 1.
    local_context  strategy="columns": the column estimators' `local_context` (rows; 0 = off, the
                 default): members that read the observed rows nearest to the query instead of all
                 of them, on columns observed in more rows than that (tabfm.estimators.local_context).
    Other parameters: see TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODELS["imputation"], n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None, backend: str = "torch", n_rounds: int = DEFAULT_N_ROUNDS,
                 round_parts: int = DEFAULT_ROUND_PARTS, strategy: str = DEFAULT_STRATEGY,
                 local_context: int = DEFAULT_LOCAL_CONTEXT) -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, backend=backend)
        self.n_rounds = n_rounds
        self.round_parts = round_parts
        self.strategy = strategy
        self.local_context = local_context

    def __setstate__(self, state: dict[str, Any]) -> None:
        # an imputer pickled before the parameters existed: today's behaviour, and get_params / clone work
        state = dict(state)
        state.setdefault("n_rounds", DEFAULT_N_ROUNDS)
        state.setdefault("round_parts", DEFAULT_ROUND_PARTS)
        state.setdefault("strategy", "joint")  # what it did then
        state.setdefault("local_context", 0)
        super().__setstate__(state)

    def _check_params(self) -> None:
        super()._check_params()
        for name, default in (("n_rounds", DEFAULT_N_ROUNDS), ("round_parts", DEFAULT_ROUND_PARTS)):
            value = getattr(self, name, default)
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_size(getattr(self, "local_context", DEFAULT_LOCAL_CONTEXT))
        strategy = getattr(self, "strategy", DEFAULT_STRATEGY)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

    def fit(self, X: Any, y: Any = None) -> "TabFMImputer":
        frame = self._fit_table(X)
        self.table_ = frame.copy()  # strategy="columns" fits a supervised estimator per column on it
        self.modes_ = {}
        for spec in self.schema_.columns:
            counts = frame[spec.name].value_counts(dropna=True)
            self.modes_[spec.name] = None if counts.empty else counts.index[0]
        return self

    def transform(self, X: Any) -> Any:
        """X with every missing cell filled (observed cells unchanged), in X's format and dtypes."""
        check_is_fitted(self, "modes_")
        frame, x = self._encode(X)
        missing = frame.isna().to_numpy()
        if not missing.any():
            return X.copy() if isinstance(X, pd.DataFrame) else np.array(X)
        rt = self._runtime()
        imputable = [self._imputable(spec, rt) for spec in self.schema_.columns]
        by_column = [self._by_column(spec) for spec in self.schema_.columns]
        joint = [ok and not col for ok, col in zip(imputable, by_column)]
        joint_missing = any(j and missing[:, i].any() for i, j in enumerate(joint))
        decoded = self.schema_.inverse_transform(self._impute_encoded(rt, x, joint)) if joint_missing else None
        column_table = getattr(self, "table_", None)
        if any(by_column) and column_table is None:  # an imputer pickled before table_ existed
            column_table = self.schema_.inverse_transform(self.train_x_)
        targets = [j for j in range(len(by_column)) if by_column[j] and missing[:, j].any()]

        filled: list[pd.Series] = []
        fallback, empty = [], []
        columns = self._impute_by_column(frame, targets, column_table) if targets else {}
        by_column_frame = self._filled(frame, columns, {j: missing[:, j] for j in columns})
        for j, spec in enumerate(self.schema_.columns):
            s, miss = frame[spec.name], missing[:, j]
            if not miss.any():
                filled.append(s)
            elif by_column[j] and columns[j] is not None:
                filled.append(by_column_frame[spec.name])
            elif joint[j]:
                filled.append(_fill(s, miss, decoded[spec.name].to_numpy()))
            elif self.modes_[spec.name] is not None:
                fallback.append(spec.name)
                filled.append(_fill(s, miss, self.modes_[spec.name]))
            else:
                empty.append(spec.name)
                filled.append(s)
        if fallback:
            why = "text or constant" if any(by_column) else "text, constant, or more categories than its head"
            warnings.warn(f"columns {fallback} cannot be predicted by the model ({why}): missing cells filled with the "
                          "most frequent fitted value", UserWarning, stacklevel=2)
        if empty:
            warnings.warn(f"columns {empty} were all missing at fit: their missing cells stay missing",
                          UserWarning, stacklevel=2)
        return self._like_input(X, filled, self._positions(X))

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        """The output's column names: the input's (an imputer keeps every column), as sklearn's
        `set_output` needs them; input_features, if given, must be those names."""
        check_is_fitted(self, "n_features_in_")
        names = getattr(self, "feature_names_in_", None)
        if names is None:
            names = np.asarray([f"x{j}" for j in range(self.n_features_in_)], dtype=object)
        if input_features is not None:
            given = np.asarray(input_features, dtype=object)
            if len(given) != self.n_features_in_:
                raise ValueError(f"input_features has {len(given)} names, but {type(self).__name__} was fitted "
                                 f"on {self.n_features_in_} columns")
            if getattr(self, "feature_names_in_", None) is not None and not np.array_equal(given, names):
                raise ValueError(f"input_features {list(given)} differ from the fitted columns {list(names)}")
            names = given
        return names

    # ------------------------------------------------------------------ helpers
    def _by_column(self, spec: ColumnSpec) -> bool:
        """strategy="columns" predicts this column as a supervised target (needs another column to read)."""
        return (getattr(self, "strategy", DEFAULT_STRATEGY) == "columns" and spec.type in TARGET_TYPES
                and len(self.schema_.columns) > 1)

    def _impute_by_column(self, frame: pd.DataFrame, targets: list[int], table: pd.DataFrame) -> dict[int, np.ndarray | None]:
        """strategy="columns": each target column's values for its missing rows of `frame` (None where the
        column is observed in no fitted row), after `n_rounds` rounds. Round 1 shows a row's other missing
        cells as missing; round r > 1 shows every other target cell filled with round r - 1's estimates, in
        the query rows and in the fitted rows alike (the fitted table's own estimates, computed alongside,
        a round at a time, unless `frame` is that table), like MissForest's later iterations."""
        n_rounds = int(getattr(self, "n_rounds", DEFAULT_N_ROUNDS))
        same = frame.equals(table)
        miss = {j: frame[self.schema_.columns[j].name].isna().to_numpy() for j in targets}
        # rows other than the fitted ones: the fitted table's own estimates go along, a round behind
        t_miss = {} if same else {j: table[spec.name].isna().to_numpy() for j, spec in enumerate(self.schema_.columns)
                                  if self._by_column(spec) and table[spec.name].isna().any()}
        out: dict[int, np.ndarray | None] = {}
        t_out: dict[int, np.ndarray | None] = {}
        with self._bar((len(targets) + len(t_miss)) * n_rounds - len(t_miss), "transform[columns]") as bar:
            for round_ in range(1, n_rounds + 1):
                shown = frame if round_ == 1 else self._filled(frame, out, miss)
                shown_table = None if round_ == 1 else shown if same else self._filled(table, t_out, t_miss)
                now, t_now = {}, {}
                for j in sorted(set(targets) | (set(t_miss) if round_ < n_rounds else set())):
                    name = self.schema_.columns[j].name
                    est = self._column_estimator(j, table, round_, shown_table)
                    if j in miss:
                        now[j] = None if est is None else est.predict(shown.loc[miss[j]].drop(columns=[name]))
                        bar.update()
                    if j in t_miss and round_ < n_rounds:
                        rows = (table if shown_table is None else shown_table).loc[t_miss[j]].drop(columns=[name])
                        t_now[j] = None if est is None else est.predict(rows)
                        bar.update()
                out, t_out = now, t_now
        return out

    def _filled(self, frame: pd.DataFrame, values: dict[int, np.ndarray | None], miss: dict[int, np.ndarray]) -> pd.DataFrame:
        """frame with each column j's missing rows `miss[j]` set to `values[j]` (kept missing where None)."""
        out = frame.copy()
        for j, v in values.items():
            if v is None:
                continue
            spec = self.schema_.columns[j]
            numeric = spec.type == NUMERIC_T
            full = np.full(len(frame), np.nan) if numeric else np.empty(len(frame), dtype=object)
            full[miss[j]] = v if numeric else list(v)
            out[spec.name] = _fill(frame[spec.name], miss[j], full)
        return out

    # the supervised estimators strategy="columns" fits (the server swaps in ones that keep their encodings)
    column_estimators = {"regression": TabFMRegressor, "classification": TabFMClassifier}

    def _column_estimator(self, j: int, table: pd.DataFrame, round_: int = 1,
                          shown: pd.DataFrame | None = None) -> TabFMRegressor | TabFMClassifier | None:
        """The supervised estimator of column j's type, fitted on the rows of the fitted `table` where j is
        observed, the other columns as features: as `table` holds them (round 1), or as `shown` (the fitted
        table filled by the previous round; later rounds). None when j is observed in no fitted row."""
        spec = self.schema_.columns[j]
        observed = table[spec.name].notna().to_numpy()
        if not observed.any():
            return None
        params = dict(model=self.model, n_estimators=self.n_estimators, random_state=column_seed(self.ensemble_seed_, j),
                      device=self.device, precision=self.precision, max_context_rows=self.max_context_rows,
                      max_columns=min(self.max_columns, DEFAULT_MAX_COLUMNS_SUPERVISED), chunk_size=self.chunk_size,
                      progress=False, backend=self.backend,
                      local_context=int(self.local_context))
        y = table.loc[observed, spec.name]
        if spec.type == NUMERIC_T:  # half the members on the ridge residual, weighted per row (module doc)
            est = self.column_estimators["regression"](**params, linear_residual="mixed")
            y = y.astype(np.float64)
        else:
            if spec.type == BOOLEAN_T:
                y = y.astype(bool)  # object columns of True / False are not class labels to sklearn
            est = self.column_estimators["classification"](**params, max_classes=max(100, int(y.nunique())))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="y has a single class")  # then that class is the answer
            features = table if shown is None else shown
            return est.fit(features.loc[observed].drop(columns=[spec.name]), y)

    def _imputable(self, spec: ColumnSpec, rt: Runtime) -> bool:
        """The model predicts this source column (through its first encoded part)."""
        first = spec.encoded_columns()[0]
        return spec.type in MODEL_TYPES and (first.kind != CATEGORICAL or first.cardinality <= rt.max_categories)

    def _impute_encoded(self, rt: Runtime, x: np.ndarray, imputable: list[bool]) -> np.ndarray:
        """x with its missing cells in imputable columns replaced by the ensemble's point predictions
        (after `n_rounds` rounds, see the module docstring)."""
        k = rt.max_categories
        kind, card = self._kind, self._card
        model_col = np.zeros(x.shape[1], dtype=bool)
        for unit, ok in zip(self._units(), imputable):
            model_col[unit] = ok
        model_col &= (kind != CATEGORICAL) | (card <= k)
        query = np.isnan(x) & model_col[None, :]
        rows, cols = np.nonzero(query)
        cell_id = np.full(x.shape, -1)
        cell_id[rows, cols] = np.arange(len(rows))
        probs = np.zeros((len(rows), k))
        means = np.zeros(len(rows))

        def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
            # each cell's own answer only (the other head's is undefined), so a non-finite one is caught below
            is_cat = (output.kind == CATEGORICAL)[:, None]
            probs, mean = class_probabilities(output), numeric_mean(output)[:, None]
            return torch.cat([torch.where(is_cat, probs, 0.0), torch.where(is_cat, 0.0, mean)], 1)

        def add(m: Member, group: np.ndarray, sub: np.ndarray, out: np.ndarray, means: np.ndarray,
                probs: np.ndarray, keep: np.ndarray | None = None) -> None:
            """A member's answers `out` for the `sub` cells of `group` into the sums (only rows `keep`)."""
            r, c = np.nonzero(sub)
            if keep is not None:
                sel = keep[r]
                r, c, out = r[sel], c[sel], out[sel]
            ids = cell_id[r, group[c]]
            means[ids] += out[:, k]
            for j in np.unique(c):
                col = int(group[j])
                if kind[col] == CATEGORICAL:
                    sel = c == j
                    probs[ids[sel], : card[col]] += m.unpermute_codes(col, out[sel, : card[col]])

        n_rounds = int(getattr(self, "n_rounds", DEFAULT_N_ROUNDS))
        members = self._members(cover_all=True)
        passes = [(i, m, g, group) for i, m in enumerate(members) for g, group in enumerate(m.column_groups)
                  if query[:, group].any()]
        # later rounds: a row's parts in a group = min(round_parts, its missing source columns there); a row
        # with one part has nothing to show, so its round-1 answer stands (`fixed`, no pass)
        layout = {} if n_rounds == 1 else {(i, g): self._round_layout(group, query) for i, _, g, group in passes}
        n_parts = {key: int(p[p > 1].max(initial=0)) for key, (_, p) in layout.items()}
        fixed_means, fixed_probs = (np.zeros_like(means), np.zeros_like(probs)) if n_rounds > 1 else (None, None)
        with self._bar(len(passes) + (n_rounds - 1) * sum(n_parts.values()), "transform") as bar:
            for i, m, g, group in passes:
                ctx_rows = subsample(m.rng(0), np.arange(len(self.train_x_)), self.max_context_rows)
                sub = query[:, group]
                out = self._predict(rt.for_member(m), m.view(self.train_x_[ctx_rows], group), m.view(x, group), sub,
                                    kind[group], card[group], fn)
                out = self._finite(out, "imputed cells")
                add(m, group, sub, out, means, probs)
                if n_rounds > 1:
                    add(m, group, sub, out, fixed_means, fixed_probs, keep=layout[(i, g)][1] <= 1)
                bar.update()
            estimate = self._estimates(x, rows, cols, kind, means, probs, len(members))
            for round_ in range(2, n_rounds + 1):
                means, probs = fixed_means.copy(), fixed_probs.copy()
                for i, m, g, group in passes:
                    if not n_parts[(i, g)]:
                        continue
                    unit_pos, row_parts = layout[(i, g)]
                    part = self._round_parts_of(unit_pos, row_parts, query[:, group], m.rng(ROUND_KEY, g, round_))
                    ctx_rows = subsample(m.rng(0), np.arange(len(self.train_x_)), self.max_context_rows)
                    context = self._context(rt.for_member(m), m.view(self.train_x_[ctx_rows], group), kind[group],
                                            card[group])
                    shown = m.view(estimate, group)  # the previous round's estimates, as this member shows them
                    for p in range(n_parts[(i, g)]):
                        hide = part == p
                        if hide.any():
                            q = shown.copy()
                            q[hide] = np.nan
                            out = self._finite(context.predict(q, hide, fn, self.chunk_size), "imputed cells")
                            add(m, group, hide, out, means, probs)
                        bar.update()
                estimate = self._estimates(x, rows, cols, kind, means, probs, len(members))
        return estimate

    @staticmethod
    def _estimates(x: np.ndarray, rows: np.ndarray, cols: np.ndarray, kind: np.ndarray, means: np.ndarray,
                   probs: np.ndarray, n_members: int) -> np.ndarray:
        """x with the query cells (rows, cols) set to the members' summed answers: the most probable
        code of a categorical cell, the members' mean of a numeric one."""
        out_x = x.copy()
        is_cat = kind[cols] == CATEGORICAL
        out_x[rows[is_cat], cols[is_cat]] = probs[is_cat].argmax(1)
        out_x[rows[~is_cat], cols[~is_cat]] = means[~is_cat] / n_members
        return out_x

    def _round_layout(self, group: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For one column group (`query`: the missing cells the model predicts, all columns): the
        source column (0.. within the group) of each of its encoded columns, and each row's number
        of parts in the later rounds, min(round_parts, its missing source columns in the group)."""
        unit_of = np.zeros(query.shape[1], dtype=np.int64)
        for i, unit in enumerate(self._units()):
            unit_of[unit] = i
        _, unit_pos = np.unique(unit_of[group], return_inverse=True)
        missing = np.zeros((len(query), int(unit_pos.max(initial=-1)) + 1), dtype=bool)
        for j, col in enumerate(group):
            missing[:, unit_pos[j]] |= query[:, col]
        return unit_pos, np.minimum(missing.sum(1), int(getattr(self, "round_parts", DEFAULT_ROUND_PARTS)))

    @staticmethod
    def _round_parts_of(unit_pos: np.ndarray, row_parts: np.ndarray, sub: np.ndarray,
                        rng: np.random.Generator) -> np.ndarray:
        """Part (0 .. row_parts-1) of each missing cell `sub` (n_rows, group width) of one column group in
        one round, -1 elsewhere and in rows with a single part: each row's missing source columns, taken
        in a random order of the group's source columns drawn from `rng`, are dealt to its parts in turn."""
        n_units = int(unit_pos.max(initial=-1)) + 1
        missing = np.zeros((len(sub), n_units), dtype=bool)
        for j in range(sub.shape[1]):
            missing[:, unit_pos[j]] |= sub[:, j]
        order = rng.permutation(n_units)
        rank = np.empty_like(missing, dtype=np.int64)
        rank[:, order] = np.cumsum(missing[:, order], axis=1) - 1  # place among the row's missing columns
        unit_part = np.where(missing & (row_parts[:, None] > 1), rank % np.maximum(row_parts, 1)[:, None], -1)
        return np.where(sub, unit_part[:, unit_pos], -1)

    def _positions(self, X: Any) -> np.ndarray:
        """Position in X of each fitted column (frames may list them in another order)."""
        names = getattr(self, "feature_names_in_", None)
        if isinstance(X, pd.DataFrame) and names is not None and all(isinstance(c, str) for c in X.columns):
            return X.columns.get_indexer(list(names))
        return np.arange(self.n_features_in_)

    @staticmethod
    def _like_input(X: Any, columns: list[pd.Series], positions: np.ndarray) -> Any:
        """The filled columns (fitted order) in the input's container: a DataFrame like X, or an array of X's dtype."""
        if isinstance(X, pd.DataFrame):
            out = X.copy()
            for j, s in zip(positions, columns):
                out.isetitem(int(j), s.set_axis(X.index))
            return out
        arr = np.array(X)
        for j, s in zip(positions, columns):
            arr[:, j] = s.to_numpy(dtype=arr.dtype, na_value=np.nan) if arr.dtype.kind == "f" else s.to_numpy()
        return arr
