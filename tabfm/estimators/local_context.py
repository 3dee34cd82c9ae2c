"""Local contexts: query rows predicted from the training rows nearest to them.

A table larger than a few hundred rows can hold a boundary more detailed than the model draws
from one context of all its rows (the tiny model on phoneme: ROC-AUC 0.924 from 2,048 rows,
random forest 0.952). Shown only the rows near a query, the model has a simpler function to
read (retrieval of the context, as LoCalPFN does for TabPFN). Query rows are grouped by the
nearest of M centres (k-means on the training rows, fitted once at fit) so a group shares one
context: the `size` training rows nearest to its centre.

Distances are measured in a space where each column counts as much as it tells about the
target: numeric columns as standardised ranks, categorical ones one-hot; every column scaled by
its correlation with the target (class indicators, or the target's ranks) on the training rows,
so a noise column does not decide who is near.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning

from tabfm.data.batch import CATEGORICAL

LOCAL_CONTEXT_ROWS = 512  # the default size of a local context (BENCHMARKS.md "Local contexts")
CLUSTERS_PER_CONTEXT = 4  # centres per `size` training rows: groups overlap, every query near its centre
MAX_CLUSTERS = 32  # bounds the passes: each group is one pass over its own context


@dataclass
class LocalContexts:
    """The fitted grouping: the embedding of rows, the centres and each centre's context rows."""

    numeric: np.ndarray  # encoded column indices read as ranks
    sorted_values: list[np.ndarray]  # each numeric column's training values, sorted (for ranks)
    categorical: np.ndarray  # encoded column indices read one-hot
    cardinality: np.ndarray  # their code counts
    weights: np.ndarray  # (d,) scale of each embedding column
    centers: np.ndarray  # (M, d)
    rows: list[np.ndarray]  # the training rows of each centre's context

    @classmethod
    def of(cls, x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray, target: np.ndarray, size: int,
           seed: int) -> "LocalContexts | None":
        """Fitted on the encoded training rows `x` and `target` ((n,) numbers or (n, k) class
        indicators); None when the table has no more than `size` rows (a local context would be all
        of it)."""
        n = len(x)
        if n <= size:
            return None
        num = np.flatnonzero(kind != CATEGORICAL)
        cat = np.flatnonzero(kind == CATEGORICAL)
        sorted_values = [np.sort(v[np.isfinite(v)]) for v in x[:, num].T]
        local = cls(num, sorted_values, cat, cardinality[cat].astype(np.int64), np.ones(0), np.zeros((0, 0)), [])
        z = local._embed(x, weighted=False)
        local.weights = relevance(z, target)
        z = z * local.weights
        m = min(MAX_CLUSTERS, math.ceil(CLUSTERS_PER_CONTEXT * n / size), n)
        with warnings.catch_warnings():  # fewer distinct rows than centres: some centres coincide, harmless
            warnings.simplefilter("ignore", ConvergenceWarning)
            km = KMeans(n_clusters=m, n_init=3, random_state=seed % 2**31).fit(z)
        local.centers = km.cluster_centers_
        dist = sq_distances(local.centers, z)  # (M, n)
        local.rows = [np.sort(np.argsort(d, kind="stable")[:size]) for d in dist]
        return local

    def _embed(self, x: np.ndarray, weighted: bool = True) -> np.ndarray:
        parts = []
        for j, values in zip(self.numeric, self.sorted_values):
            col = x[:, j]
            if len(values) == 0:
                parts.append(np.zeros((len(x), 1)))
                continue
            # rank in (0, 1), mid-rank of ties; standardised as a uniform (missing: the middle)
            rank = (np.searchsorted(values, col, "left") + np.searchsorted(values, col, "right")) / (2 * len(values))
            parts.append(np.where(np.isfinite(col), (rank - 0.5) * math.sqrt(12), 0.0)[:, None])
        for j, k in zip(self.categorical, self.cardinality):
            codes = x[:, j]
            hot = np.zeros((len(x), max(int(k), 1)))
            ok = np.isfinite(codes) & (codes >= 0) & (codes < k)
            hot[np.flatnonzero(ok), codes[ok].astype(np.int64)] = 1.0 / math.sqrt(2)
            parts.append(hot)
        z = np.hstack(parts) if parts else np.zeros((len(x), 0))
        return z * self.weights if weighted else z

    def groups(self, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(query row indices, context training rows) for each centre nearest to some row of `x`."""
        z = self._embed(x)
        nearest = sq_distances(z, self.centers).argmin(1)
        return [(np.flatnonzero(nearest == c), self.rows[c]) for c in np.unique(nearest)]


def sq_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) squared Euclidean distances, without an (len(a), len(b), d) array."""
    return np.maximum((a ** 2).sum(1)[:, None] - 2.0 * a @ b.T + (b ** 2).sum(1)[None, :], 0.0)


def relevance(z: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(d,) each embedding column's absolute correlation with the target, root-sum-squared over
    its columns (class indicators), scaled to a maximum of 1; all ones when none correlates."""
    t = target.reshape(len(target), -1).astype(np.float64)
    zc, tc = z - z.mean(0), t - t.mean(0)
    zs, ts = zc.std(0), tc.std(0)
    corr = (zc.T @ tc) / len(z) / np.outer(np.where(zs > 0, zs, np.inf), np.where(ts > 0, ts, np.inf))
    w = np.sqrt((corr ** 2).sum(1))
    return w / w.max() if w.max() > 0 else np.ones(z.shape[1])
