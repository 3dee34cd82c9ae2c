"""Turning SCM nodes into a classification target.

A continuous node is cut into K classes at rank thresholds (random class shares) or at
value thresholds; a discretiser node may use its own categories (grouped into K). Classes
smaller than a minimum count are merged into a neighbour, so every class 0..K'-1 is
present (2 <= K' <= K), and the class ids are randomly permuted. Classes cut from one node
are ordered along it; `nominal_classes` draws unordered ones instead: each row takes the
class with the largest of K noisy linear scores of several nodes (a multinomial logit).
"""
from __future__ import annotations

import math

import numpy as np


def _min_count(n_rows: int, k: int) -> int:
    """Fewest rows a class may have: ~1% of rows, at least 2 when there is room, at least 1."""
    return max(1, min(n_rows // (2 * k), max(2, math.ceil(0.01 * n_rows))))


def _cut(value: np.ndarray, thresholds: np.ndarray, min_count: int) -> np.ndarray:
    """Labels by thresholds; merges under-filled classes into their smaller neighbour."""
    thr = list(np.sort(thresholds))
    while True:
        labels = np.searchsorted(np.asarray(thr), value, side="right")
        counts = np.bincount(labels, minlength=len(thr) + 1)
        if not thr or counts.min() >= min_count:
            return labels
        c = int(counts.argmin())
        if c == 0:
            del thr[0]
        elif c == len(thr):
            del thr[-1]
        else:  # merge with the smaller neighbour: drop the threshold between them
            del thr[c - 1 if counts[c - 1] <= counts[c + 1] else c]


def _from_categories(rng: np.random.Generator, codes: np.ndarray, k: int, n_classes: int, min_count: int) -> np.ndarray:
    """Group k categories into at most n_classes classes; merge tiny classes into the largest."""
    group = rng.permutation(k) % n_classes if k > n_classes else np.arange(k)
    labels = group[codes]
    counts = np.bincount(labels, minlength=n_classes)
    small = (counts > 0) & (counts < min_count)
    if small.any() and (counts >= min_count).any():
        labels = np.where(small[labels], int(counts.argmax()), labels)
    _, labels = np.unique(labels, return_inverse=True)
    return labels


def make_classes(
    rng: np.random.Generator,
    value: np.ndarray,
    max_classes: int,
    codes: tuple[np.ndarray, int] | None = None,
    p_equal_shares: float = 0.0,
) -> np.ndarray:
    """int64 labels 0..K'-1 for a node, every class present, 2 <= K' <= max_classes (n_rows >= 2).

    With probability `p_equal_shares` the node is cut at equal-share rank thresholds (K' = K unless
    ties in the node merge classes); p_equal_shares = 0 draws no extra random number."""
    n = value.shape[0]
    k = min(int(rng.integers(2, max_classes + 1)), max(2, n // 2))
    min_count = _min_count(n, k)
    labels = None
    if p_equal_shares > 0 and rng.random() < p_equal_shares:
        labels = _cut(value, np.sort(value)[(np.arange(1, k) * n) // k], min_count)
        if labels.max() < 1:  # a (near-)constant node: equal shares of the rank order instead
            labels = (np.argsort(np.argsort(value, kind="stable"), kind="stable") * k) // n
    elif codes is not None and rng.random() < 0.5:
        labels = _from_categories(rng, codes[0], codes[1], k, min_count)
    if labels is None or labels.max() < 1:
        if rng.random() < 0.5:  # rank thresholds with random class shares
            mix = rng.random()
            shares = (1.0 - mix) / k + mix * rng.dirichlet(np.ones(k))
            pos = np.clip(np.round(np.cumsum(shares)[:-1] * n).astype(np.int64), 0, n - 1)
            thresholds = np.sort(value)[pos]
        else:  # value thresholds inside the bulk of the distribution
            lo, hi = np.quantile(value, [0.05, 0.95])
            thresholds = rng.uniform(lo, hi, size=k - 1)
        labels = _cut(value, thresholds, min_count)
        if labels.max() < 1:  # everything merged: fall back to a median split
            labels = _cut(value, np.array([np.median(value)]), 1)
        if labels.max() < 1:  # constant node: arbitrary split keeps the contract
            labels = (np.argsort(np.argsort(value, kind="stable")) >= n // 2).astype(np.int64)
    _, labels = np.unique(labels, return_inverse=True)
    return rng.permutation(int(labels.max()) + 1)[labels].astype(np.int64)


NOMINAL_NODES = 6  # a nominal target reads at most this many nodes
NOMINAL_SHARPNESS = (0.5, 4.0)  # log-uniform scale of the scores against unit Gumbel noise


def nominal_classes(rng: np.random.Generator, nodes: np.ndarray, max_classes: int) -> np.ndarray:
    """int64 labels 0..K'-1 of a nominal target, every class present, 2 <= K' <= max_classes.

    nodes (p, n): the values of the nodes the target reads (the target node and its causal
    neighbours). Row i takes argmax_k (s * (w_k . z_i + b_k) + g_ik): z the standardised nodes,
    w_k, b_k standard normal (b halved), s log-uniform in NOMINAL_SHARPNESS, g unit Gumbel noise.
    Small classes merge into the largest (as for categories); the class ids are permuted."""
    nodes = np.atleast_2d(np.asarray(nodes, dtype=np.float64))
    p, n = nodes.shape
    k = min(int(rng.integers(2, max_classes + 1)), max(2, n // 2))
    std = nodes.std(axis=1, keepdims=True)
    z = np.divide(nodes - nodes.mean(axis=1, keepdims=True), std, out=np.zeros_like(nodes), where=std > 0)
    w, b = rng.standard_normal((k, p)), 0.5 * rng.standard_normal((k, 1))
    sharpness = np.exp(rng.uniform(*np.log(NOMINAL_SHARPNESS)))
    scores = sharpness * (w @ z + b) + rng.gumbel(size=(k, n))
    labels = _from_categories(rng, scores.argmax(axis=0), k, k, _min_count(n, k))
    if labels.max() < 1:  # everything in one class: split the rows at the median of the first score
        labels = (scores[0] > np.median(scores[0])).astype(np.int64)
        if labels.max() < 1:
            labels = (np.argsort(np.argsort(scores[0], kind="stable")) >= n // 2).astype(np.int64)
    return rng.permutation(int(labels.max()) + 1)[labels].astype(np.int64)
