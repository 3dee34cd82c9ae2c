"""Which observed cells an imputation episode hides: MCAR, MAR or MNAR masks.

One function serves the synthetic prior's episodes (synth.episodes) and the store's
(data.table_episodes), so pretraining on either sees the missingness an imputation benchmark poses.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Sequence

import numpy as np

MECHANISMS = ("MCAR", "MAR", "MNAR")


def mechanism_shares(shares: Sequence[float], owner: str) -> tuple[float, float, float]:
    """`shares` of MCAR / MAR / MNAR masks, normalised; a ValueError naming `owner` when they are not 3
    non-negative numbers with a positive sum."""
    ok = (isinstance(shares, (tuple, list)) and len(shares) == 3
          and all(isinstance(u, numbers.Real) and not isinstance(u, bool) and u >= 0 for u in shares) and sum(shares) > 0)
    if not ok:
        raise ValueError(f"{owner} = {shares!r}: must be 3 non-negative shares (MCAR, MAR, MNAR) with a positive sum")
    total = float(sum(shares))
    return tuple(float(u) / total for u in shares)  # type: ignore[return-value]


def hide_cells(x: np.ndarray, rng: np.random.Generator, mask_fraction: tuple[float, float],
               mechanisms: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> np.ndarray:
    """A (rows, cols) bool mask of observed cells of `x` to hide: a fraction f ~ U(mask_fraction) of
    the cells the drawn mechanism may hide, at least one when any cell is observed.

    MCAR hides cells uniformly. MAR weights each row's cells by a logistic score of one fully
    observed driver column, which stays visible (no such column: MNAR's weights). MNAR
    (self-masking) weights each cell by a logistic score of its own standardised value. Slopes are
    ±U(1, 3) per episode. NaN cells are never hidden: they have no value to score. Under MCAR only
    (the default) the draws are exactly a uniform fraction and a uniform choice, as before
    mechanisms existed.
    """
    n_rows, n_cols = x.shape
    observed = np.flatnonzero(~np.isnan(x).ravel())
    lo, hi = mask_fraction
    f = rng.uniform(lo, hi)
    mechanism = "MCAR"
    if mechanisms[0] < 1.0:
        mechanism = MECHANISMS[int(rng.choice(3, p=np.asarray(mechanisms, dtype=float) / sum(mechanisms)))]
    weights = None
    if mechanism != "MCAR" and observed.size > 1:
        v = x.astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-missing column: its z is 0, never hidden
            z = np.nan_to_num((v - np.nanmean(v, axis=0)) / (np.nanstd(v, axis=0) + 1e-9))
        score = z  # MNAR: each cell's own value
        full = np.flatnonzero(~np.isnan(v).any(axis=0))
        if mechanism == "MAR" and full.size and n_cols > 1:
            driver = int(rng.choice(full))
            score = np.repeat(z[:, driver:driver + 1], n_cols, axis=1)
            score[:, driver] = np.nan  # the driver stays visible
        slope = rng.uniform(1.0, 3.0) * rng.choice((-1.0, 1.0))
        s = score.ravel()[observed]
        observed, s = observed[~np.isnan(s)], s[~np.isnan(s)]
        w = 1.0 / (1.0 + np.exp(-np.clip(slope * s, -30.0, 30.0)))
        weights = w / w.sum() if w.size else None
    k = min(max(int(round(f * observed.size)), 1), observed.size)
    hidden = np.zeros(n_rows * n_cols, dtype=bool)
    if k:
        hidden[rng.choice(observed, size=k, replace=False, p=weights)] = True
    return hidden.reshape(n_rows, n_cols)
