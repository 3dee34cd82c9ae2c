"""Tensor parallelism from a model's plan: DTensor `parallelize_module` over a 1-D "tp" mesh.

    styles = parallelize_tensor(model, mesh["tp"], model.parallel_plan())

The plan's `tp_plan` maps fnmatch patterns of submodule names to "colwise" | "rowwise";
each pattern is expanded against `model.named_modules()` and every match becomes a
`ColwiseParallel` (output features sharded: whole heads of a head-major fused qkv, or a
slice of the MLP width) or `RowwiseParallel` (input features sharded, output all-reduced).
Inputs and outputs stay plain local tensors, so the model's own code runs unchanged: an
attention module sees `heads / tp` heads in the width it receives. Nothing here knows the
model; the checks name the modules and the numbers.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from .plan import ParallelPlan

__all__ = ["resolve_tp_plan", "check_tp_layout", "parallelize_tensor"]


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
    return styles


def parallelize_tensor(model: nn.Module, tp_mesh, plan: ParallelPlan) -> dict[str, str]:
    """Shard the planned Linear layers over `tp_mesh` (in place); return {name: style}.

    Parameters become DTensors (`Shard(0)` colwise, `Shard(1)` rowwise) scattered from the
    mesh's rank 0; the caller must rebuild its optimizer around them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = check_tp_layout(model, plan, tp_mesh.size())
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: make[style]() for name, style in styles.items()})
    return styles
