"""Turning a ModelOutput into answers on the ORIGINAL scale of each column.

Categorical cells: class probabilities. Numeric cells: mean, median, quantiles and the
NLL of given values, obtained from the bar distribution on the standardised scale z via
x = mean + std * z (so densities pick up a factor 1/std: NLL_x = NLL_z + log std).
Entries for cells of the other kind are NaN. These back the sklearn-style estimators:
classifier (probabilities), regressor (mean/median/quantiles), imputer (`point_prediction`)
and anomaly scores (`cell_nll` of each cell hidden in turn).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tabfm.data.batch import CATEGORICAL, NUMERIC

from .transformer import ModelOutput


def _numeric(output: ModelOutput) -> torch.Tensor:
    return output.kind == NUMERIC


def _categorical(output: ModelOutput) -> torch.Tensor:
    return output.kind == CATEGORICAL


def class_probabilities(output: ModelOutput) -> torch.Tensor:
    """(N, K) float32 probabilities over codes 0..K-1 (0 beyond the cardinality); NaN rows for numeric cells."""
    probs = torch.softmax(output.cat_logits.float(), dim=-1)
    return probs.masked_fill(~_categorical(output)[:, None], float("nan"))


def _to_original(output: ModelOutput, z: torch.Tensor) -> torch.Tensor:
    """z (N,) or (N, Q) on the standardised scale -> original scale; NaN for non-numeric cells."""
    mean, std = output.mean, output.std
    if z.dim() == 2:
        mean, std = mean[:, None], std[:, None]
    x = mean + std * z
    mask = _numeric(output) if z.dim() == 1 else _numeric(output)[:, None]
    return x.masked_fill(~mask, float("nan"))


def numeric_mean(output: ModelOutput) -> torch.Tensor:
    """(N,) float64 predictive mean of each numeric query cell, original scale."""
    return _to_original(output, output.bar.mean(output.num_logits))


def numeric_quantiles(output: ModelOutput, levels: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
    """(N, Q) float64 predictive quantiles at levels in (0, 1) (a float gives (N,)), original scale."""
    return _to_original(output, output.bar.quantile(output.num_logits, levels))


def numeric_median(output: ModelOutput) -> torch.Tensor:
    """(N,) float64 predictive median, original scale."""
    return numeric_quantiles(output, 0.5)


def numeric_nll(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
    """(N,) float64 density NLL of `values` (N,) on the original scale; NaN for non-numeric cells."""
    values = torch.as_tensor(values, dtype=torch.float64, device=output.num_logits.device)
    z = (values - output.mean) / output.std
    nll = output.bar.nll(output.num_logits, z.nan_to_num(0.0)) + torch.log(output.std)
    return nll.masked_fill(~_numeric(output) | torch.isnan(values), float("nan"))


def cell_nll(output: ModelOutput, values: torch.Tensor) -> torch.Tensor:
    """(N,) float64 NLL of `values` for every query cell: -log p(code) for categorical cells,
    the density NLL on the original scale for numeric ones. NaN where the value is NaN.
    Hiding each cell in turn and summing gives a row's anomaly score."""
    values = torch.as_tensor(values, dtype=torch.float64, device=output.num_logits.device)
    out = numeric_nll(output, values)
    cat = _categorical(output) & ~torch.isnan(values)
    k = output.cat_logits.shape[-1]
    codes = values.nan_to_num(0.0).long()
    in_head = (codes >= 0) & (codes < k)
    logp = torch.log_softmax(output.cat_logits.double(), dim=-1)
    cat_nll = -logp.gather(-1, codes.clamp(0, k - 1)[:, None])[:, 0]
    cat_nll = torch.where(in_head, cat_nll, float("inf"))
    return torch.where(cat, cat_nll, out)


def point_prediction(output: ModelOutput) -> torch.Tensor:
    """(N,) float64 best single value per cell: most probable code (categorical), mean (numeric)."""
    codes = output.cat_logits.argmax(-1).double()
    return torch.where(_categorical(output), codes, numeric_mean(output))
