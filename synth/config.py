"""PriorConfig: every knob of the synthetic-table prior, validated at construction.

Defaults follow the spirit of the TabPFN v2 / TabICL priors: random causal graphs of
small neural maps, trees and discretisers, with warping, quantisation, categoricals and
missing cells layered on top. `PriorConfig()` is the default prior; presets are made with
`dataclasses.replace(PriorConfig(), field=value)`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

# Names of the activations a neural node may draw (implemented in tabfm.synth.mechanisms).
ACTIVATION_NAMES: tuple[str, ...] = (
    "identity", "tanh", "relu", "sigmoid", "sine", "abs", "square", "step",
    "sign", "rank", "modulo", "exp", "log_abs", "gauss", "softplus",
)
# Root (cause) distributions; "mixed" draws one of the others per root node.
ROOT_DISTRIBUTIONS: tuple[str, ...] = ("normal", "uniform", "mixed")


@dataclass(frozen=True)
class PriorConfig:
    """Knobs of the prior. Probabilities are per table unless a comment says per column/node."""

    # --- task and target
    p_classification: float = 0.5  # P(task is classification); the stream may override it (0 or 1)
    max_classes: int = 10  # classification targets have 2..max_classes classes, all present
    # P(a classification target is cut at equal-share rank thresholds, so a draw of K classes keeps all K;
    # otherwise random shares and value cuts merge small classes and 10-class targets are ~2% of them).
    # 0 (the default) draws nothing extra: the stream of earlier stages is unchanged
    p_equal_class_shares: float = 0.0
    # P(a classification target is nominal: the argmax of K random linear scores of the target node and
    # its causal neighbours, plus Gumbel noise, as a multinomial logit draws a class; otherwise one node
    # is cut at thresholds and its classes are ordered along it). 0 (the default) draws nothing extra
    p_nominal_classes: float = 0.0

    # --- causal graph
    hidden_nodes: tuple[float, float] = (0.25, 1.0)  # unobserved extra SCM nodes, as a fraction of n_cols
    root_fraction: tuple[float, float] = (0.1, 0.4)  # share of nodes of each subgraph that are roots (causes)
    p_redirect: tuple[float, float] = (0.0, 0.6)  # growing-network redirection probability range
    max_parents: int = 3  # a node draws 1..max_parents parents
    p_disjoint_subgraphs: float = 0.2  # P(graph is 2-3 disjoint subgraphs: some columns independent of target)

    # --- node mechanisms
    activations: tuple[str, ...] = ACTIVATION_NAMES  # activations neural nodes draw from
    max_hidden: int = 6  # hidden width of a node's random neural map is 1..max_hidden
    p_tree_node: float = 0.2  # P(a non-root node is a random decision tree)
    max_tree_depth: int = 4  # trees have depth 1..max_tree_depth
    p_discretize_node: float = 0.15  # P(a non-root node is a nearest-prototype discretiser (categorical))
    noise_std: tuple[float, float] = (0.01, 0.3)  # per-table node noise std, log-uniform in this range
    root_distributions: tuple[str, ...] = ROOT_DISTRIBUTIONS  # a table draws one of these for its roots
    p_non_iid: float = 0.1  # P(rows are mixtures of a few shared prototypes instead of iid)

    # --- post-processing of feature columns
    p_warp: float = 0.3  # P(a numeric column is Kumaraswamy-warped) per column
    p_quantize: float = 0.15  # P(a numeric column is quantised to a few levels) per column
    categorical_fraction: tuple[float, float] = (0.0, 0.5)  # per-table share of feature columns made categorical
    max_categories: int = 12  # categorical features have 2..max_categories categories

    # --- missing cells (never in the target)
    p_missing: float = 0.3  # P(a table has missing cells)
    missing_rate: tuple[float, float] = (0.01, 0.3)  # expected share of missing feature cells, uniform
    p_mcar: float = 0.4  # relative weight of missing-completely-at-random
    p_mar: float = 0.3  # relative weight of missing-at-random (driven by observed columns)
    p_mnar: float = 0.3  # relative weight of missing-not-at-random (driven by the cell's own value)

    # --- raw DataFrame mode (tabfm.synth.raw.to_frame), per column
    p_datetime: float = 0.1  # P(a numeric feature becomes a datetime column)
    p_text: float = 0.1  # P(a categorical feature becomes a free-text column)
    p_bool: float = 0.5  # P(a 2-category feature becomes a boolean column)
    p_string_target: float = 0.5  # P(a class target is written as string labels, else ints)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def mechanism_weights(self) -> tuple[float, float, float]:
        """Normalised (mcar, mar, mnar) probabilities."""
        total = self.p_mcar + self.p_mar + self.p_mnar
        return self.p_mcar / total, self.p_mar / total, self.p_mnar / total


_PROBABILITIES = (
    "p_classification", "p_equal_class_shares", "p_nominal_classes", "p_disjoint_subgraphs", "p_tree_node", "p_discretize_node", "p_non_iid",
    "p_warp", "p_quantize", "p_missing", "p_mcar", "p_mar", "p_mnar",
    "p_datetime", "p_text", "p_bool", "p_string_target",
)
# field -> (lowest allowed, highest allowed) for both ends of a (lo, hi) range
_RANGES = {
    "hidden_nodes": (0.0, math.inf),
    "root_fraction": (0.0, 1.0),
    "p_redirect": (0.0, 1.0),
    "noise_std": (0.0, math.inf),
    "categorical_fraction": (0.0, 1.0),
    "missing_rate": (0.0, 1.0),
}
# field -> smallest allowed value
_MIN_INTS = {"max_classes": 2, "max_parents": 1, "max_hidden": 1, "max_tree_depth": 1, "max_categories": 2}


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"PriorConfig.{name}={value!r}: {why}")


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _validate(cfg: PriorConfig) -> None:
    """Raise ValueError naming the first bad field and its value."""
    names = {f.name for f in fields(cfg)}
    assert set(_PROBABILITIES) | set(_RANGES) | set(_MIN_INTS) | {"activations", "root_distributions"} == names
    for name in _PROBABILITIES:
        v = getattr(cfg, name)
        if not _is_number(v) or not 0.0 <= v <= 1.0:
            raise _bad(name, v, "must be a probability in [0, 1]")
    for name, low in _MIN_INTS.items():
        v = getattr(cfg, name)
        if not _is_int(v) or v < low:
            raise _bad(name, v, f"must be an int >= {low}")
    for name, (low, high) in _RANGES.items():
        v = getattr(cfg, name)
        if not (isinstance(v, tuple) and len(v) == 2 and all(_is_number(e) for e in v)):
            raise _bad(name, v, "must be a (low, high) tuple of two finite numbers")
        if not low <= v[0] <= v[1] <= high:
            raise _bad(name, v, f"must satisfy {low} <= low <= high <= {high}")
    if cfg.noise_std[0] <= 0:
        raise _bad("noise_std", cfg.noise_std, "low end must be > 0 (log-uniform range)")
    if cfg.p_tree_node + cfg.p_discretize_node > 1.0:
        why = f"p_tree_node + p_discretize_node must be <= 1 (p_tree_node={cfg.p_tree_node})"
        raise _bad("p_discretize_node", cfg.p_discretize_node, why)
    if cfg.p_mcar + cfg.p_mar + cfg.p_mnar <= 0:
        raise _bad("p_mcar", cfg.p_mcar, "p_mcar + p_mar + p_mnar must be > 0")
    for name, known in (("activations", ACTIVATION_NAMES), ("root_distributions", ROOT_DISTRIBUTIONS)):
        v = getattr(cfg, name)
        if not isinstance(v, tuple) or len(v) == 0:
            raise _bad(name, v, "must be a non-empty tuple of names")
        unknown = [a for a in v if a not in known]
        if unknown:
            raise _bad(name, v, f"unknown names {unknown}; known: {list(known)}")
