"""Low-rank adapters (LoRA) on the blocks' projections, for parameter-efficient fine-tuning.

`add_adapters(model, rank, alpha, targets)` puts W -> W + (alpha / rank) B A on every targeted
`nn.Linear` weight as a torch parametrization (`torch.nn.utils.parametrize`, public API), and
freezes every other parameter. Every reader of `linear.weight` (the layer's forward, the row
attention's cached-query path, an export) sees the adapted weight, so nothing in the model
changes for adapters. B starts at zero: an adapted model computes exactly what its base does
until the first step. `merge_adapters(state)` folds the adapters of a state dict into plain
weights (what an export holds: one ordinary safetensors file the estimators load). Under tensor
parallelism the engine splits each adapter beside its weight, as `LowRankUpdate.tp_shard_dims` declares
(tabfm.parallel.tensor_parallel: parametrized layers); the parameter names stay the same.

Our own small module rather than `peft`: peft wraps layers in its own classes (and pulls in
transformers), which the row attention's direct weight reads and the engine's plans by module
name would have to learn; a parametrization keeps every name and read as it was.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

# the attention projections and the MLP of every block (the "attention and MLP projections")
DEFAULT_TARGETS = ("blocks.*.col_attn.qkv", "blocks.*.col_attn.out", "blocks.*.row_attn.qkv",
                   "blocks.*.row_attn.out", "blocks.*.mlp.fc1", "blocks.*.mlp.fc2")
_ORIGINAL, _A, _B = ".parametrizations.weight.original", ".parametrizations.weight.0.lora_a", \
    ".parametrizations.weight.0.lora_b"


@dataclass(frozen=True)
class LoraConfig:
    """rank r of B (out x r) A (r x in); alpha: the update is scaled by alpha / r (alpha = r: by 1);
    targets: fnmatch patterns over the model's module names."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not self.targets:
            raise ValueError("LoRA targets: name at least one module pattern")

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "scale": self.scale}


class LowRankUpdate(nn.Module):
    """The parametrization W -> W + scale * B @ A (A: Kaiming-uniform as nn.Linear's, B: zeros)."""

    def __init__(self, out_features: int, in_features: int, rank: int, scale: float,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.lora_b @ self.lora_a)

    def tp_shard_dims(self, style: str) -> dict[str, int | None]:
        """How tensor parallelism splits the adapter beside a weight it splits by `style` (the engine's
        protocol for parametrized layers, tabfm.parallel.tensor_parallel): {parameter: the dim sharded
        over the tp ranks, None: replicated}. B @ A then comes out split as the weight is, with no
        communication: colwise (W's output rows, dim 0, split) shards B's rows; rowwise (W's input
        columns, dim 1, split) shards A's columns; the rank-r factor is whole on every rank."""
        if style == "colwise":
            return {"lora_b": 0, "lora_a": None}
        if style == "rowwise":
            return {"lora_a": 1, "lora_b": None}
        raise ValueError(f"LowRankUpdate: no tensor-parallel layout for style {style!r} (colwise or rowwise)")


def adapter_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Names of the nn.Linear modules the patterns select; ValueError naming a pattern that selects none
    (of the default patterns, only if none selects anything: a mixture-of-experts block has no fc1/fc2)."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = []
    lenient = tuple(targets) == DEFAULT_TARGETS
    for pattern in targets:
        hit = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
        if not hit and lenient:
            continue
        if not hit:
            raise ValueError(f"LoRA target {pattern!r} matches no linear layer of the model "
                             f"(e.g. {', '.join(linears[:6])}, ...)")
        chosen += [n for n in hit if n not in chosen]
    if not chosen:
        raise ValueError(f"LoRA targets {list(targets)} match no linear layer of the model")
    return chosen


def add_adapters(model: nn.Module, config: LoraConfig) -> list[str]:
    """Adapt the targeted linears in place and freeze every other parameter; returns the adapted
    module names. Call it before the engine wraps the model (the optimizer then sees only the
    adapters: `[p for p in model.parameters() if p.requires_grad]`)."""
    names = adapter_targets(model, config.targets)
    model.requires_grad_(False)
    for name in names:
        linear = model.get_submodule(name)
        if parametrize.is_parametrized(linear, "weight"):
            raise ValueError(f"{name}: already adapted (add_adapters was called twice)")
        w = linear.weight
        update = LowRankUpdate(w.shape[0], w.shape[1], config.rank, config.scale, device=w.device, dtype=w.dtype)
        parametrize.register_parametrization(linear, "weight", update)
        linear.parametrizations.weight.original.requires_grad_(False)
    return names


def has_adapters(state: dict[str, torch.Tensor]) -> bool:
    return any(k.endswith(_A) for k in state)


def merge_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict of an adapted model as the base model's: each W + scale * B A under the
    layer's plain `weight` name (computed in float64, stored in W's dtype)."""
    merged = {}
    for key, value in state.items():
        if key.endswith(_A) or key.endswith(_B):
            continue
        if key.endswith(_ORIGINAL):
            stem = key[: -len(_ORIGINAL)]
            a, b = state[stem + _A].double(), state[stem + _B].double()
            merged[stem + ".weight"] = (value.double() + scale * (b @ a)).to(value.dtype)
        else:
            merged[key] = value
    return merged


def adapter_parameters(model: nn.Module) -> dict[str, int]:
    """{"adapter": trainable adapter parameters, "total": all parameters}, for logs and reports."""
    adapter = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b")))
    return {"adapter": adapter, "total": sum(p.numel() for p in model.parameters())}
