"""TabFMRegressor: in-context regression with a full predictive distribution per row.

The model predicts a binned distribution of the target on the context-standardised scale;
tabfm.model.predict maps its mean and quantiles back to the original scale. Members are
combined by averaging means and averaging quantiles level by level (quantile averaging keeps
them monotone in the level); the median is the 0.5 quantile.

Linear residual (default): each member first fits a ridge regression of the target on the
context rows (tabfm.estimators.linear: out-of-fold predictions for the context rows, the
full-context fit for the query rows) and the model predicts in context what the ridge misses;
a row's distribution is the model's distribution of its residual shifted by its ridge
prediction. The model's numeric head has 64 bins over +-10 context standard deviations, so on
its own it resolves a target no finer than ~0.3 of its spread; the residual's spread is what
is left after the linear part (offline regression suite, 15 tables: mean R^2 0.680 -> 0.725;
BENCHMARKS.md).

Mixed (linear_residual="mixed", the default): even members predict the ridge residual, odd
members the target itself, and each row's prediction weights the two halves' averages by the
inverse of their predictive variances (spread from the 16 % and 84 % quantiles), so a row takes
the residual where the linear part explains it and the model alone where the ridge misleads it;
the same passes as either (offline regression suite, stage-17 tabfm-tiny-cf: mean R^2 0.738 residual, 0.721
model alone, 0.743 mixed; stage 23: 0.747 mixed; BENCHMARKS.md "Regression: residual and plain members,
weighted per row").
"""
from __future__ import annotations

from os import PathLike
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from sklearn.base import RegressorMixin
from torch import nn

from tabfm.model import ModelOutput
from tabfm.model.predict import numeric_mean, numeric_quantiles
from tabfm.weights import DEFAULT_MODELS

from .base import (DEFAULT_CHUNK_SIZE, DEFAULT_MAX_COLUMNS_SUPERVISED, DEFAULT_MAX_CONTEXT_ROWS, DEFAULT_N_ESTIMATORS,
                   DEFAULT_N_NEIGHBORS, SupervisedTabFMEstimator)
from .local_context import LOCAL_CONTEXT_ROWS

OUTPUTS = ("mean", "median")
SPREAD_LEVELS = [0.16, 0.84]  # a normal's mean -+ 1 sd: the spread that weights the two halves of a mixed ensemble
F32_MAX = float(np.finfo(np.float32).max)


class TabFMRegressor(RegressorMixin, SupervisedTabFMEstimator):
    """sklearn regressor: the training rows are the context, no weight is updated.

    predict(X, output="mean" | "median"); predict_quantiles(X, [0.1, 0.9]) -> (n_rows, n_levels).
    y must be numeric and finite.

    numeric          default "quantile" here (numeric features as normal scores of their context
                     ranks; offline regression suite 0.663 -> 0.680 mean R^2 over "raw").
    linear_residual  True: the model predicts the residual of a context-fitted ridge regression,
                     which is added back; False: the target itself; "mixed" (default): half the
                     members each, weighted per row by their predictive variances (module doc).
    Other parameters: see SupervisedTabFMEstimator and TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODELS["regression"], n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS_SUPERVISED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 categorical: str = "ordinal", numeric: str = "quantile",
                 n_neighbors: int | tuple[int, ...] = DEFAULT_N_NEIGHBORS, linear_features: bool = True,
                 linear_residual: bool | str = "mixed", local_context: int = LOCAL_CONTEXT_ROWS,
                 backend: str = "torch") -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, categorical=categorical, numeric=numeric, n_neighbors=n_neighbors,
                         linear_features=linear_features, local_context=local_context, backend=backend)
        self.linear_residual = linear_residual

    def _uses_linear(self, legacy: bool) -> bool:
        return (bool(self.linear_features) and legacy) or bool(self.linear_residual)  # the residual: any model

    def _check_params(self) -> None:
        super()._check_params()
        if not (isinstance(self.linear_residual, (bool, np.bool_)) or self.linear_residual == "mixed"):
            raise ValueError(f"linear_residual must be True, False or 'mixed', got {self.linear_residual!r}")

    def fit(self, X: Any, y: Any) -> "TabFMRegressor":
        frame = self._fit_table(X)
        y = pd.Series(self._check_y(y, len(frame)))
        if y.dtype == object:
            y = y.infer_objects()
        if not pd.api.types.is_numeric_dtype(y.dtype):
            raise ValueError(f"regression target must be numeric, got dtype {y.dtype} (e.g. {y.iloc[0]!r}); "
                             "use TabFMClassifier for class labels")
        values = y.to_numpy(dtype=np.float64)
        bad = int((~np.isfinite(values)).sum())
        if bad:
            raise ValueError(f"y has {bad} infinite value(s); the regression target must be finite")
        if np.abs(values).max() > F32_MAX:
            raise ValueError(f"y holds {values[np.argmax(np.abs(values))]!r}, beyond the float32 range the model reads")
        self.y_ = values
        self._fit_local(values, classes=False)
        return self

    def predict(self, X: Any, output: str = "mean") -> np.ndarray:
        """Point predictions: the predictive "mean" (default) or "median" of each row."""
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        mean, quantiles = self._distribution(X, [0.5] if output == "median" else [])
        return mean if output == "mean" else quantiles[:, 0]

    def predict_quantiles(self, X: Any, quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> np.ndarray:
        """(n_rows, len(quantiles)) predictive quantiles at levels in (0, 1), original scale."""
        levels = np.asarray(quantiles, dtype=np.float64).reshape(-1)
        if levels.size == 0 or ((levels <= 0) | (levels >= 1)).any():
            raise ValueError(f"quantile levels must be a non-empty list of values in (0, 1), got {list(quantiles)}")
        return self._distribution(X, levels.tolist())[1]

    def _distribution(self, X: Any, levels: list[float]) -> tuple[np.ndarray, np.ndarray]:
        """Members' combined mean (n,) and quantiles (n, len(levels)): averaged over the members of
        each question (residual, target), the two weighted per row when both are asked (module doc)."""
        _, x = self._encode(X)
        rt = self._runtime()
        mixed = isinstance(self.linear_residual, str)  # "mixed" (checked)
        asked = levels + SPREAD_LEVELS if mixed else levels

        def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
            mean = numeric_mean(output)[:, None]
            return torch.cat([mean, numeric_quantiles(output, asked)], 1) if asked else mean

        members = self._members(cover_all=False)
        total = {True: np.zeros((len(x), 1 + len(asked))), False: np.zeros((len(x), 1 + len(asked)))}
        count = {True: 0, False: 0}
        with self._bar(len(members), "predict") as bar:
            for i, m in enumerate(members):
                residual = (i % 2 == 0) if mixed else bool(self.linear_residual)
                for q, view in self._views(m, i, x, classes=False, rt=rt):
                    y, shift = self.y_[view.rows], np.zeros((len(q), 1))
                    if residual and view.linear is not None:  # the model sees what the context-fitted ridge misses
                        base_c, base_q = view.linear.features(y, dtype=np.float64, ridge=True)
                        y, shift = y - base_c[:, 0], base_q
                    out = self._predict_target(rt.for_member(m), view, y, None, fn, feature_targets=y)
                    total[residual][q] += out.reshape(len(q), -1) + shift  # mean and quantiles move with the baseline
                count[residual] += 1
                bar.update()
        parts = {k: self._finite(total[k] / count[k], "predictions") for k in total if count[k]}
        (out,) = [precision_weighted(parts[True], parts[False])] if len(parts) == 2 else parts.values()
        return out[:, 0], out[:, 1:1 + len(levels)]


def precision_weighted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise a * w + b * (1 - w), w = var_b / (var_a + var_b) (0.5 where both are 0): the
    inverse-variance weighted mean of two predictions. a, b: (n, k) whose last two columns are the
    16 % and 84 % quantiles, so (q84 - q16)^2 is proportional to each row's variance."""
    var_a, var_b = (a[:, -1] - a[:, -2]) ** 2, (b[:, -1] - b[:, -2]) ** 2
    both = var_a + var_b
    w = np.divide(var_b, both, out=np.full(len(a), 0.5), where=both > 0)[:, None]
    return w * a + (1 - w) * b
