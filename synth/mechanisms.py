"""Node mechanisms of the structural causal model, vectorised over rows.

A node's value is a function of its parents' values plus Gaussian noise. Roots draw from
a normal / uniform / mixed distribution (optionally as mixtures of a few prototypes, which
makes rows non-iid). Other nodes are one of: a small random neural map with an activation
drawn from a set, a random decision tree, or a nearest-prototype discretiser that also
yields a categorical code. Node outputs are standardised before noise so that depth
neither explodes nor collapses the scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .config import PriorConfig
from .graph import Dag

ROOT, MLP, TREE, DISCRETE = 0, 1, 2, 3


def _rank(a: np.ndarray) -> np.ndarray:
    """Ranks along rows, scaled to [-0.5, 0.5]."""
    n = a.shape[-1]
    out = np.empty_like(a)
    np.put_along_axis(out, np.argsort(a, axis=-1), np.broadcast_to(np.linspace(-0.5, 0.5, n), a.shape), axis=-1)
    return out


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "identity": lambda a: a,
    "tanh": np.tanh,
    "relu": lambda a: np.maximum(a, 0.0),
    "sigmoid": lambda a: 0.5 * (1.0 + np.tanh(0.5 * a)),
    "sine": np.sin,
    "abs": np.abs,
    "square": np.square,
    "step": lambda a: (a > 0).astype(a.dtype),
    "sign": np.sign,
    "rank": _rank,
    "modulo": lambda a: np.mod(a, 1.0),
    "exp": lambda a: np.exp(np.clip(a, -8.0, 4.0)),
    "log_abs": lambda a: np.log(np.abs(a) + 1e-3),
    "gauss": lambda a: np.exp(-np.square(a)),
    "softplus": lambda a: np.logaddexp(0.0, a),
}


@dataclass
class ScmSample:
    """values (n_nodes, n_rows) float64; kind[i] in ROOT/MLP/TREE/DISCRETE;
    codes[i] = (int64 codes, k) for discretiser nodes."""

    values: np.ndarray
    kind: np.ndarray
    codes: dict[int, tuple[np.ndarray, int]]


def standardize(v: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance along the last axis (constant rows become zero)."""
    if v.ndim == 1:  # the hot path: one node, fewer numpy calls than mean/std
        d = v - v.sum() / v.shape[0]
        s = float(np.sqrt(d @ d / v.shape[0]))
        return d / s if s > 1e-12 else d
    d = v - v.mean(axis=-1, keepdims=True)
    std = np.sqrt((d * d).mean(axis=-1, keepdims=True))
    return d / np.where(std > 1e-12, std, 1.0)


def _draw(rng: np.random.Generator, dist: str, shape: tuple[int, int]) -> np.ndarray:
    if dist == "normal":
        return rng.standard_normal(shape)
    if dist == "uniform":
        return rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), shape)
    # mixed: each root (row of the result) is normal, uniform or heavy-tailed
    which = rng.integers(0, 3, size=(shape[0], 1))
    out = np.where(which == 0, rng.standard_normal(shape), rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), shape))
    return np.where(which == 2, rng.standard_t(3.0, shape) / np.sqrt(3.0), out)


def sample_roots(cfg: PriorConfig, rng: np.random.Generator, n_roots: int, n_rows: int) -> np.ndarray:
    """(n_roots, n_rows) cause values; iid rows, or prototype mixtures with prob p_non_iid."""
    dist = cfg.root_distributions[int(rng.integers(len(cfg.root_distributions)))]
    if rng.random() >= cfg.p_non_iid:
        return _draw(rng, dist, (n_roots, n_rows))
    n_proto = int(rng.integers(2, max(2, min(10, n_rows)) + 1))
    protos = _draw(rng, dist, (n_roots, n_proto))
    logits = rng.standard_normal((n_rows, n_proto)) * np.exp(rng.uniform(np.log(0.5), np.log(5.0)))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    jitter = rng.uniform(0.05, 0.5)
    return standardize(protos @ w.T + jitter * _draw(rng, dist, (n_roots, n_rows)))


def mlp_node(cfg: PriorConfig, rng: np.random.Generator, x: np.ndarray, u: list[float]) -> np.ndarray:
    """Random one-hidden-layer map of parents x (p, n) -> (n,); u: 3 uniforms for width, gain, activation."""
    p = x.shape[0]
    h = 1 + int(u[0] * cfg.max_hidden)
    gain = 0.5 * 5.0 ** u[1]  # log-uniform in [0.5, 2.5]
    act = ACTIVATIONS[cfg.activations[int(u[2] * len(cfg.activations))]]
    w = rng.standard_normal(h * (p + 2))  # one draw: w1 (h, p), b1 (h,), w2 (h,)
    w1 = w[: h * p].reshape(h, p) * (gain / np.sqrt(p))
    b1 = w[h * p : h * (p + 1), None]
    return w[h * (p + 1) :] @ act(w1 @ x + b1)


def tree_node(cfg: PriorConfig, rng: np.random.Generator, x: np.ndarray, u: list[float]) -> np.ndarray:
    """Random full binary decision tree on parents x (p, n) -> leaf values (n,).

    Internal node t splits on parent feat[t] at a threshold taken from a random row,
    so splits fall inside the data. Evaluated level by level with index arithmetic."""
    p, n = x.shape
    depth = 1 + int(u[0] * cfg.max_tree_depth)
    n_internal = 2**depth - 1
    feat = rng.integers(0, p, size=n_internal)
    thresh = x[feat, rng.integers(0, n, size=n_internal)]
    leaf_value = rng.standard_normal(2**depth)
    node = np.zeros(n, dtype=np.int64)
    cols = np.arange(n)
    for _ in range(depth):
        node = 2 * node + 1 + (x[feat[node], cols] > thresh[node])
    return leaf_value[node - n_internal]


def discretize_node(
    cfg: PriorConfig, rng: np.random.Generator, x: np.ndarray, u: list[float]
) -> tuple[np.ndarray, int, np.ndarray]:
    """Nearest-prototype discretiser of parents x (p, n): (codes, k, numeric value per row).

    Prototypes are k random rows in a randomly rescaled parent space; each row takes
    the code of its nearest prototype, and passes a random per-category value on."""
    p, n = x.shape
    k = min(2 + int(u[0] * (cfg.max_categories - 1)), n)
    xs = x * np.exp(rng.uniform(-1.0, 1.0, size=(p, 1)))
    protos = xs[:, rng.choice(n, size=k, replace=False)]  # (p, k)
    dist = (protos * protos).sum(axis=0)[None, :] - 2.0 * (xs.T @ protos)  # (n, k) up to a per-row constant
    codes = dist.argmin(axis=1)
    return codes, k, rng.standard_normal(k)[codes]


def run_scm(cfg: PriorConfig, rng: np.random.Generator, dag: Dag, n_rows: int) -> ScmSample:
    """Evaluate every node of `dag` on n_rows rows in topological order."""
    n_nodes = dag.n_nodes
    is_root = dag.is_root
    values = np.empty((n_nodes, n_rows))
    values[is_root] = sample_roots(cfg, rng, int(is_root.sum()), n_rows)
    u = rng.random(n_nodes)
    kind = np.select([is_root, u < cfg.p_tree_node, u < cfg.p_tree_node + cfg.p_discretize_node], [ROOT, TREE, DISCRETE], MLP)
    sigma = np.exp(rng.uniform(np.log(cfg.noise_std[0]), np.log(cfg.noise_std[1])))
    noise = rng.standard_normal((n_nodes, n_rows)) * sigma
    params = rng.random((n_nodes, 3)).tolist()  # per-node shape parameters (width, depth, k, ...)
    codes: dict[int, tuple[np.ndarray, int]] = {}
    kinds = kind.tolist()
    for i in np.flatnonzero(~is_root).tolist():
        x = values[dag.parents[i]]
        if kinds[i] == MLP:
            v = mlp_node(cfg, rng, x, params[i])
        elif kinds[i] == TREE:
            v = tree_node(cfg, rng, x, params[i])
        else:
            c, k, v = discretize_node(cfg, rng, x, params[i])
            codes[i] = (c, k)
        values[i] = standardize(v) + noise[i]
    return ScmSample(values=values, kind=kind.astype(np.int8), codes=codes)
