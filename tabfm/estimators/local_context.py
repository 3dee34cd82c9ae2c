"""Local contexts: query rows predicted from the training rows nearest to them.

A table larger than a few hundred rows can hold a boundary more detailed than the model draws
from one context of all its rows (the tiny model on phoneme: ROC-AUC 0.924 from 2,048 rows,
random forest 0.952). Shown only the rows near a query, the model has a simpler function to
read (retrieval of the context, as LoCalPFN does for TabPFN). Query rows are grouped by the
nearest of M centres (k-means on the training rows, fitted once at fit) so a group shares one
context: the `size` training rows nearest to its centre; for a class target, with each class's
nearest rows added in place of the farthest ones where the class would fall under a quarter of its
share of the training rows (MIN_CLASS_SHARE).

"Near" is the distance of the neighbour columns (tabfm.data.neighbors: `design` and
`relevance`, standardised numbers and one-hot categories, each coordinate scaled by how much it
tells about the target), so one table has one notion of nearness for every use.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning

from tabfm.data.neighbors import design, relevance

LOCAL_CONTEXT_ROWS = 512  # the default size of a local context (BENCHMARKS.md "Local contexts")
CLUSTERS_PER_CONTEXT = 4  # centres per `size` training rows: groups overlap, every query near its centre
MAX_CLUSTERS = 32  # bounds the passes: each group is one pass over its own context
# a class context keeps every class at no less than this fraction of its share of the training rows
# (BENCHMARKS.md "Local contexts keep every class"): a neighbourhood of one class alone makes the model
# certain, and wrong where the other class is rarer but present (ring: contexts without a class)
MIN_CLASS_SHARE = 0.25


@dataclass
class LocalContexts:
    """The fitted grouping: the training rows that define the distance, the centres and each
    centre's context rows."""

    train: np.ndarray  # the encoded training rows (design standardises queries by them)
    kind: np.ndarray
    cardinality: np.ndarray
    weights: np.ndarray  # (d,) relevance of each design coordinate
    centers: np.ndarray  # (M, d)
    rows: list[np.ndarray]  # the training rows of each centre's context

    @classmethod
    def of(cls, x: np.ndarray, kind: np.ndarray, cardinality: np.ndarray, target: np.ndarray, classes: bool,
           size: int, seed: int) -> "LocalContexts | None":
        """Fitted on the encoded training rows `x` and their `target` (class labels when `classes`,
        else numbers); None when the table has no more than `size` rows (a local context would be
        all of it)."""
        n = len(x)
        if n <= size:
            return None
        points, _ = design(x, x[:0], kind, cardinality)
        weights = relevance(points, np.asarray(target), classes)
        z = points * weights
        m = min(MAX_CLUSTERS, math.ceil(CLUSTERS_PER_CONTEXT * n / size), n)
        with warnings.catch_warnings():  # fewer distinct rows than centres: some centres coincide, harmless
            warnings.simplefilter("ignore", ConvergenceWarning)
            km = KMeans(n_clusters=m, n_init=3, random_state=seed % 2**31).fit(z)
        dist = sq_distances(km.cluster_centers_, z)  # (M, n)
        labels = np.unique(np.asarray(target), return_inverse=True)[1].reshape(-1) if classes else None
        rows = [context_rows(d, size, labels) for d in dist]
        return cls(x, kind, cardinality, weights, km.cluster_centers_, rows)

    def embed(self, x: np.ndarray) -> np.ndarray:
        """Rows of `x` as weighted design points of the training rows' space."""
        return design(self.train, x, self.kind, self.cardinality)[1] * self.weights

    def groups(self, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(query row indices, context training rows) for each centre nearest to some row of `x`."""
        nearest = sq_distances(self.embed(x), self.centers).argmin(1)
        return [(np.flatnonzero(nearest == c), self.rows[c]) for c in np.unique(nearest)]


def check_size(value) -> None:
    """The `local_context` parameter of the estimators that take it: rows, an int >= 0 (0 = off)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 0:
        raise ValueError(f"local_context must be an int >= 0 (rows; 0 = off), got {value!r}")


def context_rows(dist: np.ndarray, size: int, labels: np.ndarray | None = None) -> np.ndarray:
    """The `size` rows of smallest `dist` (sorted indices); with class `labels` (codes 0..K-1), first each
    class's nearest ceil(MIN_CLASS_SHARE * size * n_c / n) rows (all of a smaller class), then the nearest
    others. Where the plain nearest rows meet every floor, they are the answer."""
    order = np.argsort(dist, kind="stable")
    if labels is None:
        return np.sort(order[:size])
    counts = np.bincount(labels)
    floors = np.minimum(counts, np.ceil(MIN_CLASS_SHARE * size * counts / len(labels)).astype(int))
    keep = np.zeros(len(dist), dtype=bool)
    ranked = labels[order]
    for c, floor in enumerate(floors):
        keep[order[ranked == c][:floor]] = True
    keep[order[~keep[order]][:size - int(keep.sum())]] = True
    return np.flatnonzero(keep)


def sq_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) squared Euclidean distances, without an (len(a), len(b), d) array."""
    return np.maximum((a ** 2).sum(1)[:, None] - 2.0 * a @ b.T + (b ** 2).sum(1)[None, :], 0.0)
