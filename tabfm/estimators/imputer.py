"""TabFMImputer: fill every missing cell of a table from the rest of it, in context.

The fitted rows are the context; each row to fill is a query row whose missing cells are
hidden cells to predict (its observed cells stay visible to it). Numeric cells get the
predictive mean (members averaged); categorical and boolean cells the most probable category
(members' probabilities averaged, decoded with the schema); datetimes are predicted through
their epoch part. Columns the model cannot predict are filled with their most frequent fitted
value, with a UserWarning: text columns (hashed, not invertible), categorical columns with
more categories than the model's head, and constant columns. All-missing columns have nothing
to learn from and stay missing (UserWarning). Observed cells come back exactly as given;
output is the input's format: a DataFrame with its index, columns and dtypes, or an array of
the input's dtype.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.base import TransformerMixin
from sklearn.utils.validation import check_is_fitted

from tabfm.data.batch import CATEGORICAL
from tabfm.data.schema import BOOLEAN_T, CATEGORICAL_T, DATETIME_T, NUMERIC_T, ColumnSpec
from tabfm.model import ModelOutput
from tabfm.model.predict import class_probabilities, numeric_mean

from .base import Runtime, TabFMEstimator
from .ensemble import subsample

MODEL_TYPES = (NUMERIC_T, BOOLEAN_T, CATEGORICAL_T, DATETIME_T)


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

    See the module docstring for what each column type gets. Parameters: see TabFMEstimator.
    """

    def fit(self, X: Any, y: Any = None) -> "TabFMImputer":
        frame = self._fit_table(X)
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
        decoded = self.schema_.inverse_transform(self._impute_encoded(rt, x, imputable))

        filled: list[pd.Series] = []
        fallback, empty = [], []
        for j, spec in enumerate(self.schema_.columns):
            s, miss = frame[spec.name], missing[:, j]
            if not miss.any():
                filled.append(s)
            elif imputable[j]:
                filled.append(_fill(s, miss, decoded[spec.name].to_numpy()))
            elif self.modes_[spec.name] is not None:
                fallback.append(spec.name)
                filled.append(_fill(s, miss, self.modes_[spec.name]))
            else:
                empty.append(spec.name)
                filled.append(s)
        if fallback:
            warnings.warn(f"columns {fallback} cannot be predicted by the model (text, constant, or more categories "
                          "than its head): missing cells filled with the most frequent fitted value", UserWarning,
                          stacklevel=2)
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
    def _imputable(self, spec: ColumnSpec, rt: Runtime) -> bool:
        """The model predicts this source column (through its first encoded part)."""
        first = spec.encoded_columns()[0]
        return spec.type in MODEL_TYPES and (first.kind != CATEGORICAL or first.cardinality <= rt.max_categories)

    def _impute_encoded(self, rt: Runtime, x: np.ndarray, imputable: list[bool]) -> np.ndarray:
        """x with its missing cells in imputable columns replaced by the ensemble's point predictions."""
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

        members = self._members(cover_all=True)
        passes = [(m, group) for m in members for group in m.column_groups if query[:, group].any()]
        with self._bar(len(passes), "transform") as bar:
            for m, group in passes:
                ctx_rows = subsample(m.rng(0), np.arange(len(self.train_x_)), self.max_context_rows)
                sub = query[:, group]
                out = self._predict(rt.for_member(m), m.view(self.train_x_[ctx_rows], group), m.view(x, group), sub,
                                    kind[group], card[group], fn)
                out = self._finite(out, "imputed cells")
                r, c = np.nonzero(sub)
                ids = cell_id[r, group[c]]
                means[ids] += out[:, k]
                for j in np.unique(c):
                    col = int(group[j])
                    if kind[col] == CATEGORICAL:
                        sel = c == j
                        probs[ids[sel], : card[col]] += m.unpermute_codes(col, out[sel, : card[col]])
                bar.update()
        out_x = x.copy()
        is_cat = kind[cols] == CATEGORICAL
        out_x[rows[is_cat], cols[is_cat]] = probs[is_cat].argmax(1)
        out_x[rows[~is_cat], cols[~is_cat]] = means[~is_cat] / len(members)
        return out_x

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
