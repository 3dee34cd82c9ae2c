"""ModelConfig: every architectural choice of the table transformer, as one dataclass.

Presets (parameter counts from `TabFM(ModelConfig.preset(name)).num_parameters()`):

    preset  d_model  layers  heads  mlp_ratio  thinking rows  n_bins  parameters
    tiny         96       4      4        2.0              0      64      0.48 M
    small       128      10      4        2.0              8     128      2.05 M
    base        192      12      6        2.0             16     128      5.46 M

`tiny` is sized to train on 2 CPU cores in a couple of hours; `base` matches TabPFN v2's
width and depth (d=192, 12 layers, 6 heads, MLP 384). The weights do not depend on
`max_categories` (the categorical head scores codes by their identity vectors), so that
field may be raised at inference time without retraining.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any


CODE_IDS = ("fixed", "per_column")
CONTEXT_FEATURES = ("none", "knn-linear", "knn")  # tabfm.data.context_features.ContextFeatureSpec.NAMES (a test keeps them equal)
FIXED_CODE_SEED = 0x5EED  # the seed of the shared code identities when code_ids == "fixed"


@dataclass
class ModelConfig:
    """Architecture of `TabFM`. Validated on construction; `ValueError` names the bad field.

    d_model                 token width of every cell.
    n_layers                number of blocks (column attention -> row attention -> MLP).
    n_heads                 attention heads (both attentions); must divide d_model.
    mlp_ratio               MLP hidden width = int(d_model * mlp_ratio).
    max_categories          width K of the categorical head: codes 0..K-1 can be predicted;
                            query cells of columns with more categories are not scored.
    n_bins                  bins of the numeric ("bar") distribution, two of them half-normal tails.
    bin_range               inner bins cover [-bin_range, bin_range] on the standardised scale.
    id_dim                  width of the random identity vectors (columns, categorical codes).
    code_ids                "fixed": code k has the same random identity vector in every table
                            and column (learns in-context classification far faster on CPU
                            budgets); "per_column": fresh identities per table and column.
    n_thinking_rows         learned extra rows added to every table's context.
    dropout                 dropout on attention weights and residual branches.
    norm_eps                RMSNorm epsilon.
    context_features        what the model reads beyond a table's own columns: the name of a
                            tabfm.data.context_features spec ("none", "knn-linear", "knn") whose extra
                            columns every prediction episode of its pretraining carried. Not
                            architecture (the weights do not depend on it) but part of the input
                            contract: the estimators build the same columns for such a model.
    context_refs            True: the model also reads what each context-feature column estimates
                            (TableBatch.feature_ref): the encoder adds to its identity projections of
                            the target column's identity, the class code's identity vector and a learned
                            vector per estimator, and adds each estimate to the cell it estimates, so a
                            one-pass multi-class prediction knows which column speaks for which class.
                            All of it starts at zero: a warm start from a model without them computes
                            exactly its function (tabfm.model.growth.add_context_refs).
    cells_per_token         G: the blocks run on tokens of G cells of a row (TabPFN v2 packs 2),
                            so attention and MLPs cost ~1/G per cell. Which cells share a token
                            follows the columns' identity vectors (content-derived in eval mode,
                            so predictions still do not depend on column order; random per step
                            in training). 1 = one token per cell.
    moe_experts             E: 0 (default) = every block's MLP is dense; E >= 1 = the MLPs of the
                            blocks `moe_layer` names are mixtures of E expert MLPs of the dense
                            one's size (tabfm/model/moe.py), so parameters grow ~E-fold there while
                            each token's compute grows only k-fold.
    moe_top_k               k: experts per token (1 <= k <= E; 1 when dense). Token-choice top-k:
                            k >= 2 gates renormalised to sum to 1, k = 1 the router probability.
    moe_every               n: blocks i with (i + 1) % n == 0 are MoE (1: all, 2: every second);
                            n <= n_layers, so that at least one is.
    moe_capacity_factor     in training an expert takes ceil(factor * tokens * k / E) token
                            assignments; the rest are dropped (the residual carries them).
                            Eval mode drops none.
    moe_aux_weight          weight of the load-balancing loss (Switch / GShard) in masked_cell_loss.
    moe_z_weight            weight of the router z-loss (ST-MoE) in masked_cell_loss.
    """

    d_model: int = 96
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 2.0
    max_categories: int = 10
    n_bins: int = 64
    bin_range: float = 10.0
    id_dim: int = 32
    code_ids: str = "fixed"
    n_thinking_rows: int = 0
    dropout: float = 0.0
    norm_eps: float = 1e-5
    cells_per_token: int = 1
    context_features: str = "none"
    context_refs: bool = False
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    moe_capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01
    moe_z_weight: float = 0.001

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    def moe_layer(self, i: int) -> bool:
        """Whether block i's MLP is a mixture of experts."""
        return self.moe_experts > 0 and (i + 1) % self.moe_every == 0

    # --------------------------------------------------------------- validation
    def validate(self) -> "ModelConfig":
        def need(ok: bool, field_name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"ModelConfig.{field_name} = {getattr(self, field_name)!r}: {what}")

        for name in ("d_model", "n_layers", "n_heads", "max_categories", "n_bins", "id_dim", "n_thinking_rows",
                     "cells_per_token", "moe_experts", "moe_top_k", "moe_every"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), name, "must be an int")
        need(self.d_model >= 1, "d_model", "must be >= 1")
        need(self.n_layers >= 1, "n_layers", "must be >= 1")
        need(self.n_heads >= 1, "n_heads", "must be >= 1")
        need(self.d_model % self.n_heads == 0, "d_model", f"must be divisible by n_heads = {self.n_heads}")
        need(self.mlp_ratio > 0 and int(self.d_model * self.mlp_ratio) >= 1, "mlp_ratio", "must give an MLP width >= 1")
        need(self.max_categories >= 2, "max_categories", "must be >= 2")
        need(self.n_bins >= 4, "n_bins", "must be >= 4 (two tails and at least two inner bins)")
        need(self.bin_range > 0, "bin_range", "must be > 0")
        need(self.id_dim >= 1, "id_dim", "must be >= 1")
        need(self.code_ids in CODE_IDS, "code_ids", f"must be one of {', '.join(CODE_IDS)}")
        need(self.n_thinking_rows >= 0, "n_thinking_rows", "must be >= 0")
        need(self.cells_per_token >= 1, "cells_per_token", "must be >= 1")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        need(self.norm_eps > 0, "norm_eps", "must be > 0")
        need(self.context_features in CONTEXT_FEATURES, "context_features",
             f"must be one of {', '.join(CONTEXT_FEATURES)}")
        need(isinstance(self.context_refs, bool), "context_refs", "must be True or False")
        need(not self.context_refs or self.context_features != "none", "context_refs",
             "needs context features to refer to (context_features is 'none')")
        need(self.moe_experts >= 0, "moe_experts", "must be >= 0 (0: dense MLPs)")
        need(self.moe_top_k >= 1, "moe_top_k", "must be >= 1")
        need(self.moe_top_k <= max(self.moe_experts, 1), "moe_top_k",
             f"must be <= moe_experts = {self.moe_experts}" + (" (a dense model routes nothing; set moe_experts)"
                                                               if self.moe_experts == 0 else ""))
        need(self.moe_every >= 1, "moe_every", "must be >= 1")
        need(self.moe_experts == 0 or self.moe_every <= self.n_layers, "moe_every",
             f"must be <= n_layers = {self.n_layers}, or no block would be a mixture of experts")
        for name in ("moe_capacity_factor", "moe_aux_weight", "moe_z_weight"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                 "must be a finite number")
        need(self.moe_capacity_factor > 0, "moe_capacity_factor", "must be > 0")
        need(self.moe_aux_weight >= 0, "moe_aux_weight", "must be >= 0")
        need(self.moe_z_weight >= 0, "moe_z_weight", "must be >= 0")
        return self

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset ('tiny', 'small', 'base'), optionally with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown ModelConfig preset {name!r}; choose from {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain dict for config.json."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`; unknown keys are an error (a typo must not pass silently)."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k not in RETIRED_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


# fields older exports carry that no longer describe the weights (read and ignored)
RETIRED_FIELDS = {
    "activation_checkpointing",  # an engine setting now: tabfm.parallel.checkpoint_blocks, --activation-checkpointing
}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=96, n_layers=4, n_heads=4, mlp_ratio=2.0, n_bins=64, n_thinking_rows=0),
    "small": ModelConfig(d_model=128, n_layers=10, n_heads=4, mlp_ratio=2.0, n_bins=128, n_thinking_rows=8),
    "base": ModelConfig(d_model=192, n_layers=12, n_heads=6, mlp_ratio=2.0, n_bins=128, n_thinking_rows=16),
}
