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

OUTPUTS = ("mean", "median")
F32_MAX = float(np.finfo(np.float32).max)


class TabFMRegressor(RegressorMixin, SupervisedTabFMEstimator):
    """sklearn regressor: the training rows are the context, no weight is updated.

    predict(X, output="mean" | "median"); predict_quantiles(X, [0.1, 0.9]) -> (n_rows, n_levels).
    y must be numeric and finite.

    numeric          default "quantile" here (numeric features as normal scores of their context
                     ranks; offline regression suite 0.663 -> 0.680 mean R^2 over "raw").
    linear_residual  the model predicts the residual of a context-fitted ridge regression, which
                     is added back (module doc; default True).
    Other parameters: see SupervisedTabFMEstimator and TabFMEstimator.
    """

    def __init__(self, model: str | PathLike | nn.Module = DEFAULT_MODELS["regression"], n_estimators: int = DEFAULT_N_ESTIMATORS,
                 random_state: int | np.random.RandomState | None = 0, device: str = "auto",
                 precision: str = "auto", max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS,
                 max_columns: int = DEFAULT_MAX_COLUMNS_SUPERVISED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: bool | None = None,
                 categorical: str = "ordinal", numeric: str = "quantile",
                 n_neighbors: int | tuple[int, ...] = DEFAULT_N_NEIGHBORS, linear_features: bool = True,
                 linear_residual: bool = True, backend: str = "torch") -> None:
        super().__init__(model=model, n_estimators=n_estimators, random_state=random_state, device=device,
                         precision=precision, max_context_rows=max_context_rows, max_columns=max_columns,
                         chunk_size=chunk_size, progress=progress, categorical=categorical, numeric=numeric, n_neighbors=n_neighbors,
                         linear_features=linear_features, backend=backend)
        self.linear_residual = linear_residual

    def _uses_linear(self, legacy: bool) -> bool:
        return (bool(self.linear_features) and legacy) or bool(self.linear_residual)  # the residual: any model

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
        """Members' averaged mean (n,) and quantiles (n, len(levels))."""
        _, x = self._encode(X)
        rt = self._runtime()

        def fn(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
            mean = numeric_mean(output)[:, None]
            return torch.cat([mean, numeric_quantiles(output, levels)], 1) if levels else mean

        members = self._members(cover_all=False)
        total = np.zeros((len(x), 1 + len(levels)))
        with self._bar(len(members), "predict") as bar:
            for m in members:
                view = self._supervised_view(m, x, classes=False, rt=rt)
                y, shift = self.y_[view.rows], np.zeros((len(x), 1))
                if self.linear_residual and view.linear is not None:  # the model sees what the context-fitted ridge misses
                    base_c, base_q = view.linear.features(y, dtype=np.float64, ridge=True)
                    y, shift = y - base_c[:, 0], base_q
                out = self._predict_target(rt.for_member(m), view, y, None, fn, feature_targets=y)
                total += out.reshape(len(x), -1) + shift  # mean and every quantile move with the baseline
                bar.update()
        total = self._finite(total / len(members), "predictions")
        return total[:, 0], total[:, 1:]
