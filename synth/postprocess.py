"""Post-processing of SCM columns into realistic feature columns.

Kumaraswamy warping (skewed / bounded marginals), quantisation (few distinct numeric
levels), categorical columns (codes with identity but no order) and missing cells by
MCAR, MAR or MNAR mechanisms. All functions work on whole columns at once.
"""
from __future__ import annotations

import numpy as np

from .config import PriorConfig

MCAR, MAR, MNAR = "mcar", "mar", "mnar"


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, size=None) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


def kumaraswamy_warp(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """Warp each column of x (n, m) through a Kumaraswamy CDF with random a, b in [0.2, 5]."""
    lo, hi = x.min(axis=0), x.max(axis=0)
    u = (x - lo) / np.where(hi > lo, hi - lo, 1.0)
    a = _log_uniform(rng, 0.2, 5.0, x.shape[1])
    b = _log_uniform(rng, 0.2, 5.0, x.shape[1])
    return 1.0 - (1.0 - u**a) ** b


def quantize(rng: np.random.Generator, x: np.ndarray, max_levels: int = 20) -> np.ndarray:
    """Replace column x (n,) by the index (as float) of its bin between random data-point edges."""
    n = x.shape[0]
    levels = int(rng.integers(2, max(2, min(max_levels, n)) + 1))
    edges = np.sort(x[rng.choice(n, size=levels - 1, replace=False)])
    return np.searchsorted(edges, x, side="right").astype(np.float64)


def compact_codes(rng: np.random.Generator, codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Relabel codes to 0..k-1 (only categories present) in random order; returns (codes, k)."""
    present = np.bincount(codes) > 0
    k = int(present.sum())
    new_id = np.zeros(len(present), dtype=np.int64)
    new_id[present] = rng.permutation(k)
    return new_id[codes], k


def categorize(rng: np.random.Generator, x: np.ndarray, max_categories: int) -> tuple[np.ndarray, int]:
    """Cut a numeric column into 2..max_categories categories at random-share rank thresholds;
    codes are randomly permuted so they carry identity, not order."""
    n = x.shape[0]
    k = int(min(rng.integers(2, max_categories + 1), n))
    shares = rng.dirichlet(np.full(k, rng.uniform(0.5, 5.0)))
    pos = np.clip(np.round(np.cumsum(shares)[:-1] * n).astype(np.int64), 0, n - 1)
    codes = np.searchsorted(np.sort(x)[pos], x, side="right")
    return compact_codes(rng, codes)


def _sigmoid(a: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * a))


def _calibrated_probs(score: np.ndarray, rate: np.ndarray, iters: int = 30) -> np.ndarray:
    """sigmoid(score + c_j) with per-column offsets c_j chosen so the mean probability is rate_j."""
    lo = np.full(score.shape[1], -30.0)
    hi = np.full(score.shape[1], 30.0)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        too_high = _sigmoid(score + mid).mean(axis=0) > rate
        hi = np.where(too_high, mid, hi)
        lo = np.where(too_high, lo, mid)
    return _sigmoid(score + 0.5 * (lo + hi))


def _scores(rng: np.random.Generator, x: np.ndarray, is_cat: np.ndarray) -> np.ndarray:
    """Standardised per-column drivers; categorical codes get a random score per category."""
    z = np.empty_like(x)
    for j in range(x.shape[1]):
        col = x[:, j]
        if is_cat[j]:
            z[:, j] = rng.standard_normal(int(col.max()) + 1)[col.astype(np.int64)]
        else:
            z[:, j] = col
    std = z.std(axis=0)
    return (z - z.mean(axis=0)) / np.where(std > 1e-12, std, 1.0)


def missing_mask(cfg: PriorConfig, rng: np.random.Generator, x: np.ndarray, is_cat: np.ndarray) -> tuple[np.ndarray, str]:
    """Bernoulli mask (n, m) of missing cells for complete feature columns x, and the mechanism.

    MCAR: every cell missing with the sampled rate. MAR: a third of the columns stay
    observed and drive (logistically) the missingness of the others. MNAR: a cell's own
    value drives its missingness. Per-column offsets keep the expected share at the rate."""
    n, m = x.shape
    rate = float(rng.uniform(*cfg.missing_rate))
    mech = (MCAR, MAR, MNAR)[int(rng.choice(3, p=cfg.mechanism_weights))]
    if mech == MAR and m < 2:
        mech = MCAR
    if mech == MCAR or rate <= 0.0:
        return rng.random((n, m)) < rate, mech
    z = _scores(rng, x, is_cat)
    strength = rng.uniform(1.0, 3.0, size=m) * rng.choice([-1.0, 1.0], size=m)
    col_rate = np.full(m, rate)
    if mech == MNAR:
        score = z * strength
    else:
        drivers = np.zeros(m, dtype=bool)
        drivers[rng.choice(m, size=max(1, m // 3), replace=False)] = True
        w = rng.standard_normal((int(drivers.sum()), m))
        w /= np.linalg.norm(w, axis=0, keepdims=True)
        score = (z[:, drivers] @ w) * strength
        col_rate = np.where(drivers, 0.0, min(0.95, rate * m / int((~drivers).sum())))
    prob = np.where(col_rate > 0, _calibrated_probs(score, np.maximum(col_rate, 1e-9)), 0.0)
    return rng.random((n, m)) < prob, mech
