"""Random causal DAGs for the prior.

Nodes are numbered in topological order (every edge goes from a lower to a higher index).
Each subgraph grows like a growing network with redirection (GNR): a new node picks an
earlier node of its subgraph and, with the redirection probability, moves on to that
node's first parent; it may then draw a few more parents. A table's graph is either one
such network or several disjoint ones merged, so some columns are independent of others.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import PriorConfig


@dataclass
class Dag:
    """parents[i]: int64 array of node i's parents (all < i); empty for roots.
    component[i]: which disjoint subgraph node i belongs to."""

    parents: list[np.ndarray]
    component: np.ndarray

    @property
    def n_nodes(self) -> int:
        return len(self.parents)

    @property
    def is_root(self) -> np.ndarray:
        return np.array([len(p) == 0 for p in self.parents], dtype=bool)

    def neighbours(self, node: int) -> np.ndarray:
        """Parents and children of `node` (its direct causal neighbours), sorted."""
        kids = [i for i in range(node + 1, self.n_nodes) if node in self.parents[i].tolist()]
        return np.unique(np.concatenate([self.parents[node], np.asarray(kids, dtype=np.int64)]))


def _component_sizes(cfg: PriorConfig, rng: np.random.Generator, n_nodes: int) -> list[int]:
    """One subgraph, or 2-3 disjoint ones of at least 2 nodes each."""
    if n_nodes < 4 or rng.random() >= cfg.p_disjoint_subgraphs:
        return [n_nodes]
    k = int(rng.integers(2, min(3, n_nodes // 2) + 1))
    return [2 + int(e) for e in rng.multinomial(n_nodes - 2 * k, np.full(k, 1.0 / k))]


def _grow(cfg: PriorConfig, rng: np.random.Generator, start: int, size: int, redirect: float) -> list[np.ndarray]:
    """GNR subgraph over nodes start..start+size-1 with a sampled number of roots."""
    frac = rng.uniform(*cfg.root_fraction)
    n_roots = min(max(round(frac * size), 1), size - 1) if size > 1 else 1
    # all randomness drawn up front; the loop below is plain integer bookkeeping
    u_pick = rng.random(size).tolist()
    u_redirect = rng.random(size).tolist()
    n_extra = rng.integers(0, cfg.max_parents, size=size).tolist()  # 0..max_parents-1 more parents
    u_extra = rng.random((size, cfg.max_parents - 1)).tolist()
    parents: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(n_roots)]
    first: list[int] = [-1] * n_roots  # first parent of each node (for redirection)
    for local in range(n_roots, size):
        j = int(u_pick[local] * local)
        if first[j] >= 0 and u_redirect[local] < redirect:
            j = first[j]
        first.append(j)
        ps = {j, *(int(u * local) for u in u_extra[local][: n_extra[local]])}
        parents.append(np.array(sorted(ps), dtype=np.int64) + start)
    return parents


def sample_dag(cfg: PriorConfig, rng: np.random.Generator, n_nodes: int) -> Dag:
    """A random DAG over n_nodes >= 1 nodes in topological order."""
    if n_nodes < 1:
        raise ValueError(f"sample_dag needs n_nodes >= 1, got {n_nodes}")
    redirect = float(rng.uniform(*cfg.p_redirect))
    parents: list[np.ndarray] = []
    component = np.empty(n_nodes, np.int64)
    start = 0
    for c, size in enumerate(_component_sizes(cfg, rng, n_nodes)):
        parents.extend(_grow(cfg, rng, start, size, redirect))
        component[start:start + size] = c
        start += size
    return Dag(parents=parents, component=component)
