"""Tensor parallelism from a model's plan: DTensor `parallelize_module` over a 1-D "tp" mesh.

    styles = parallelize_tensor(model, mesh["tp"], model.parallel_plan())

The plan's `tp_plan` maps fnmatch patterns of submodule names to "colwise" | "rowwise";
each pattern is expanded against `model.named_modules()` and every match becomes a
`ColwiseParallel` (output features sharded: whole heads of a head-major fused qkv, or a
slice of the MLP width) or `RowwiseParallel` (input features sharded, output all-reduced).
Inputs and outputs stay plain local tensors, so the model's own code runs unchanged: an
attention module sees `heads / tp` heads in the width it receives. Nothing here knows the
model; the checks name the modules and the numbers.

Parametrized layers (`torch.nn.utils.parametrize`, e.g. low-rank adapters W -> W + B A): a
planned linear whose `weight` is parametrized keeps its parametrizations. Its original weight
is split as the style says; each parametrization splits its own parameters by the rule it
declares, `tp_shard_dims(style) -> {parameter name: dim sharded over tp, or None: replicated}`,
chosen so that its output is split as the weight is (an adapter beside a colwise weight shards
B's rows, beside a rowwise one A's columns). A parametrization without the rule is refused.
Gradients of replicated parameters come out of DTensor autograd as partial sums over the tp
ranks; a hook all-reduces them to replicated gradients, so the optimizer steps on whole ones.
"""
from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from .plan import ParallelPlan

__all__ = ["resolve_tp_plan", "check_tp_layout", "parallelize_tensor", "parametrization_shard_dims"]


def resolve_tp_plan(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """{submodule name: style} for every module a pattern of `tp_plan` matches (in module order).

    A pattern that matches nothing, or two patterns giving one module different styles, is
    an error: a typo in a plan must not silently leave a layer replicated."""
    names = [n for n, _ in model.named_modules() if n]
    styles: dict[str, str] = {}
    for pattern, style in tp_plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tp_plan pattern {pattern!r} matches no submodule of {type(model).__name__}")
        for name in hits:
            if styles.get(name, style) != style:
                raise ValueError(f"tp_plan gives {name!r} two styles: {styles[name]!r} and {style!r}")
            styles[name] = style
    order = {n: i for i, n in enumerate(names)}
    return dict(sorted(styles.items(), key=lambda kv: order[kv[0]]))


def check_tp_layout(model: nn.Module, plan: ParallelPlan, tp: int) -> dict[str, str]:
    """Check that `tp` ranks can split the model as planned (no communication); return the
    resolved styles. Heads must divide evenly (`plan.num_heads`), and so must every sharded
    width: output features of colwise layers, input features of rowwise ones."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if plan.num_heads % tp:
        raise ValueError(f"tensor parallelism splits attention heads: num_heads={plan.num_heads} is not "
                         f"divisible by tp={tp}")
    styles = resolve_tp_plan(model, plan.tp_plan)
    for name, style in styles.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"tp_plan: {name!r} is a {type(module).__name__}; only nn.Linear layers are split")
        width, what = ((module.out_features, "output") if style == "colwise" else (module.in_features, "input"))
        if width % tp:
            raise ValueError(f"tensor parallelism: {name} ({style}) has {width} {what} features, not divisible "
                             f"by tp={tp}")
        parametrization_shard_dims(module, name, style, tp)
    return styles


def parametrization_shard_dims(linear: nn.Linear, name: str, style: str, tp: int = 1) -> list[dict[str, int | None]]:
    """For a planned linear whose weight is parametrized: each parametrization's declared split of its
    parameters under `style` ({parameter: shard dim or None}), checked against `tp` ranks; [] when
    nothing is parametrized. Errors name the layer and what is missing (no communication)."""
    if not parametrize.is_parametrized(linear):
        return []
    others = sorted(set(linear.parametrizations.keys()) - {"weight"})
    if others:
        raise ValueError(f"tensor parallelism: {name} has parametrized {others}; only a parametrized weight "
                         "can be split")
    chain = linear.parametrizations.weight
    if not chain.is_tensor:
        raise ValueError(f"tensor parallelism: {name}.weight is parametrized through several original tensors "
                         "(a right_inverse returning a sequence); only one original weight can be split")
    rules = []
    for i, p in enumerate(chain):
        what = f"{name}.parametrizations.weight.{i} ({type(p).__name__})"
        rule_of = getattr(p, "tp_shard_dims", None)
        if not callable(rule_of):
            raise TypeError(f"tensor parallelism: {what} declares no tp_shard_dims(style) -> {{parameter: shard dim "
                            "or None}}: the engine cannot tell how to split its parameters beside the weight")
        rule = dict(rule_of(style))
        params = dict(p.named_parameters())
        buffers = [n for n, _ in p.named_buffers()]
        if buffers:
            raise ValueError(f"tensor parallelism: {what} holds buffers {buffers}; only parameters can be split")
        if set(rule) != set(params):
            raise ValueError(f"tensor parallelism: {what}.tp_shard_dims({style!r}) names {sorted(rule)}, but its "
                             f"parameters are {sorted(params)}")
        for pname, dim in rule.items():
            shape = tuple(params[pname].shape)
            if dim is None:
                continue
            if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
                raise ValueError(f"tensor parallelism: {what}.{pname} of shape {list(shape)}: shard dim {dim!r} "
                                 "is not one of its dims")
            if shape[dim] % tp:
                raise ValueError(f"tensor parallelism: {what}.{pname} has {shape[dim]} entries on dim {dim}, not "
                                 f"divisible by tp={tp}")
        rules.append(rule)
    return rules


def parallelize_tensor(model: nn.Module, tp_mesh, plan: ParallelPlan) -> dict[str, str]:
    """Shard the planned Linear layers over `tp_mesh` (in place); return {name: style}.

    Parameters become DTensors (`Shard(0)` colwise, `Shard(1)` rowwise) scattered from the
    mesh's rank 0; the caller must rebuild its optimizer around them. Parameters keep their
    names, those of parametrized weights included (see the module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = check_tp_layout(model, plan, tp_mesh.size())
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    # torch's styles split every parameter a linear holds, and a parametrized one holds its original
    # weight and the parametrizations' parameters under dotted names, which they cannot re-register:
    # take the parametrizations off (the plain original weight returns), split, put them back split
    held = {name: _take_parametrizations(model.get_submodule(name)) for name in styles}
    parallelize_module(model, tp_mesh, {name: make[style]() for name, style in styles.items()})
    for name, chain in held.items():
        _restore_parametrizations(model.get_submodule(name), chain, styles[name], tp_mesh)
    return styles


def _take_parametrizations(linear: nn.Module) -> list[nn.Module]:
    """The weight's parametrizations, removed (the module's `weight` is its original parameter again)."""
    if not parametrize.is_parametrized(linear, "weight"):
        return []
    chain = list(linear.parametrizations.weight)
    parametrize.remove_parametrizations(linear, "weight", leave_parametrized=False)
    return chain


def _restore_parametrizations(linear: nn.Module, chain: list[nn.Module], style: str, tp_mesh: Any) -> None:
    """Split each parametrization's parameters over `tp_mesh` by its `tp_shard_dims(style)` (from the
    mesh's rank 0, as parallelize_module does) and register it again on the now split weight."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for p in chain:
        for pname, dim in p.tp_shard_dims(style).items():
            old = p.get_parameter(pname)
            placements = [Replicate() if dim is None else Shard(dim)]
            new = nn.Parameter(distribute_tensor(old.detach(), tp_mesh, placements, src_data_rank=0),
                               requires_grad=old.requires_grad)
            if dim is None and new.requires_grad:
                new.register_hook(_replicated_grad(placements))
            p.register_parameter(pname, new)
        parametrize.register_parametrization(linear, "weight", p)


def _replicated_grad(placements: list[Any]) -> Any:
    """A gradient hook: a replicated parameter's gradient arrives as partial sums over the tp ranks
    (each rank's share of the weight's gradient); all-reduce it to the parameter's placement. Under
    FSDP2 the parameters are re-created (without this hook) and FSDP redistributes them itself."""
    from torch.distributed.tensor import DTensor

    def hook(grad: Any) -> Any:
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
            return grad.redistribute(grad.device_mesh, placements)
        return grad

    return hook
