"""Ensemble members: what varies between the `n_estimators` passes over one table, and how it is undone.

Each member sees the table
- with its feature columns in a random order, split into random groups of at most
  `max_columns` encoded columns when there are more (a source column's encoded parts stay together);
- with the codes of every categorical feature relabelled by a random permutation
  (the model gives codes identity, not order, so this changes its random code vectors, not the data);
- for classification, with the class codes of the target relabelled (`class_perm`), undone on
  the probabilities: P(class c) = P_member(code class_perm[c]);
- with its own context rows when there are more than `max_context_rows` (`subsample`);
- with its numeric features as they are or as normal scores of their context ranks
  (`numeric`, see `quantile_normal`): members that differ in preprocessing average out the
  model's sensitivity to skewed or heavy-tailed features (as TabPFN ensembles over transforms).
Every random choice comes from the member's seed, so a member is a pure function of
(random_state, member index) and does not depend on the query rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.special import ndtri

from tabfm.data.batch import CATEGORICAL


@dataclass(frozen=True)
class Member:
    """One ensemble member's view of the table."""

    seed: int
    column_groups: list[np.ndarray]  # encoded feature column indices of each table this member runs
    code_perms: dict[int, np.ndarray] = field(default_factory=dict)  # column -> perm: code c shown as perm[c]
    class_perm: np.ndarray | None = None  # target class c shown as class_perm[c]
    numeric: str = "raw"  # "raw" or "quantile": how numeric features are shown (see quantile_normal)

    def rng(self, *keys: int) -> np.random.Generator:
        """A generator for one further choice (e.g. context rows of fold k), keyed so choices stay independent."""
        return np.random.default_rng([self.seed, *keys])

    def view(self, x: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """x[:, columns] as this member shows it: categorical codes relabelled."""
        out = np.array(x[:, columns], dtype=np.float32)
        for j, col in enumerate(columns):
            perm = self.code_perms.get(int(col))
            if perm is not None:
                present = ~np.isnan(out[:, j])
                out[present, j] = perm[out[present, j].astype(np.int64)]
        return out

    def unpermute_codes(self, column: int, probs: np.ndarray) -> np.ndarray:
        """Probabilities (N, k) over the member's codes of `column` -> over the original codes."""
        perm = self.code_perms.get(int(column))
        return probs if perm is None else probs[:, perm]

    def unpermute_classes(self, probs: np.ndarray) -> np.ndarray:
        """Probabilities (N, n_classes) over the member's class codes -> over the original classes."""
        return probs if self.class_perm is None else probs[:, self.class_perm]


def column_groups(rng: np.random.Generator, units: list[np.ndarray], max_columns: int, cover_all: bool) -> list[np.ndarray]:
    """Random groups of encoded columns with at most `max_columns` each (a unit = one source column's parts).

    cover_all: every unit lands in some group (imputation, anomaly scoring); otherwise only the
    first group, a random subset (prediction of a separate target).
    """
    groups, current, width = [], [], 0
    for u in rng.permutation(len(units)):
        w = len(units[u])
        if current and width + w > max_columns:
            groups.append(np.concatenate(current))
            if not cover_all:
                return groups
            current, width = [], 0
        current.append(units[u])
        width += w
    if current:
        groups.append(np.concatenate(current))
    return groups


NUMERIC_TRANSFORMS = ("raw", "quantile", "mixed")


def make_members(seed: int, n_members: int, units: list[np.ndarray], kind: np.ndarray, cardinality: np.ndarray,
                 max_columns: int, cover_all: bool, n_classes: int | None = None, numeric: str = "raw") -> list[Member]:
    """The members of an ensemble, each from its own child seed of `seed`.

    numeric: "raw" or "quantile" for every member, or "mixed": even members raw, odd members quantile.
    """
    if numeric not in NUMERIC_TRANSFORMS:
        raise ValueError(f"numeric transform must be one of {NUMERIC_TRANSFORMS}, got {numeric!r}")
    members = []
    for i, child in enumerate(np.random.SeedSequence(seed).spawn(n_members)):
        m_seed = int(child.generate_state(1)[0])
        rng = np.random.default_rng(m_seed)
        groups = column_groups(rng, units, max_columns, cover_all)
        perms = {int(j): rng.permutation(int(cardinality[j]))
                 for j in np.flatnonzero((kind == CATEGORICAL) & (cardinality >= 2))}
        class_perm = rng.permutation(n_classes) if n_classes and n_classes >= 2 else None
        shown = ("raw", "quantile")[i % 2] if numeric == "mixed" else numeric
        members.append(Member(m_seed, groups, perms, class_perm, shown))
    return members


def quantile_normal(context: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Normal scores of `values` under the empirical distribution of `context` (one column; NaN kept).

    Each distinct context value maps to the standard-normal quantile of its mid-rank,
    (rank_left + rank_right) / 2n, clipped to [1/2n, 1 - 1/2n]; values between context values are
    interpolated linearly, values beyond them get the extreme scores. A column with fewer than
    two distinct context values is returned unchanged.
    """
    seen = np.sort(context[~np.isnan(context)])
    uniq = np.unique(seen)
    if len(uniq) < 2:
        return values
    n = len(seen)
    mid = (np.searchsorted(seen, uniq, "left") + np.searchsorted(seen, uniq, "right")) / (2.0 * n)
    scores = ndtri(np.clip(mid, 0.5 / n, 1.0 - 0.5 / n))
    out = np.interp(values, uniq, scores)
    out[np.isnan(values)] = np.nan
    return out.astype(values.dtype, copy=False)


def subsample(rng: np.random.Generator, pool: np.ndarray, size: int, strata: np.ndarray | None = None) -> np.ndarray:
    """Sorted rows of `pool` (all of them when it has <= size rows), stratified by `strata` when given.

    Stratified: each stratum first gets one row while size allows (no class vanishes from a
    subsampled context), the remaining rows are shared in proportion (largest remainders).
    """
    pool = np.asarray(pool)
    if len(pool) <= size:
        return pool
    if strata is None:
        return np.sort(rng.choice(pool, size, replace=False))
    labels, inverse, counts = np.unique(strata, return_inverse=True, return_counts=True)
    base = np.ones_like(counts) if size >= len(labels) else np.zeros_like(counts)  # one row per stratum first
    share = (counts - base) * (size - base.sum()) / (counts - base).sum()  # then the rest in proportion
    alloc = base + np.floor(share).astype(np.int64)
    for k in np.argsort(-(share - np.floor(share)), kind="stable")[: size - alloc.sum()]:  # largest remainders
        alloc[k] += 1
    picked = [rng.choice(pool[inverse == k], alloc[k], replace=False) for k in range(len(labels)) if alloc[k]]
    return np.sort(np.concatenate(picked))
