"""Low-rank adapters (tabfm.model.lora): identity at the start, only adapters train, the merged
state dict computes what the adapted model computes (plain and cached-context passes)."""
from __future__ import annotations

import pytest
import torch

from tabfm.model import TabFM
from tabfm.model.lora import DEFAULT_TARGETS, LoraConfig, add_adapters, adapter_parameters, merge_adapters

from .test_context_cache import split
from .test_model import SMALL, make_batch, model

torch.set_num_threads(1)


def outputs(m: TabFM, batch) -> torch.Tensor:
    out = m(batch, id_seed=3)
    return torch.cat([out.num_logits.flatten(), out.cat_logits.nan_to_num(0.0, 0.0, 0.0).flatten()])


def test_adapters_start_as_the_identity_and_only_they_train():
    base, adapted = model(), model()
    names = add_adapters(adapted, LoraConfig(rank=4, alpha=8))
    assert len(names) == 6 * SMALL["n_layers"]
    batch = make_batch()
    with torch.no_grad():
        assert torch.equal(outputs(base, batch), outputs(adapted, batch))  # B = 0: exactly the base model
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    counts = adapter_parameters(adapted)
    d, hidden = SMALL["d_model"], int(SMALL["d_model"] * 2.0)
    # r (out + in) per target: qkv and out of two attentions, fc1 and fc2
    per_block = 2 * 4 * ((3 * d + d) + (d + d)) + 4 * ((hidden + d) + (d + hidden))
    assert counts["adapter"] == SMALL["n_layers"] * per_block
    adapted.train()
    loss = outputs(adapted, batch).pow(2).mean()
    loss.backward()
    grads = {n for n, p in adapted.named_parameters() if p.grad is not None}
    assert grads == trainable
    # B = 0 at the start: A gets no gradient until B moves, B does
    assert all(adapted.get_parameter(n).grad.abs().sum() > 0 for n in grads if n.endswith("lora_b"))


def test_merged_weights_equal_the_adapted_model_in_every_pass():
    adapted = model(n_thinking_rows=2)
    add_adapters(adapted, LoraConfig(rank=3))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if n.endswith("lora_b"):
                p.normal_(0, 0.05)  # as after some training
    merged = TabFM(adapted.config).eval()
    merged.load_state_dict(merge_adapters(adapted.state_dict(), LoraConfig(rank=3).scale), strict=True)
    full, ctx, qry = split(make_batch(b=2, r=16, c=6, n_ctx=10))
    with torch.inference_mode():
        assert (outputs(adapted, full) - outputs(merged, full)).abs().max() < 1e-5
        assert (outputs(adapted, full) - outputs(model(n_thinking_rows=2), full)).abs().max() > 1e-3  # it did change
        # the cached-context path reads the row attention's weight directly: the adapted one
        a = adapted.forward_queries(qry, adapted.encode_context(ctx, id_seed=3)).num_logits
        b = merged.forward_queries(qry, merged.encode_context(ctx, id_seed=3)).num_logits
        assert (a - b).abs().max() < 1e-5


def test_bad_adapter_settings_name_the_problem():
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="alpha"):
        LoraConfig(rank=2, alpha=0)
    with pytest.raises(ValueError, match="'blocks.*.nope'"):
        add_adapters(model(), LoraConfig(rank=2, targets=("blocks.*.nope",)))
    m = model()
    add_adapters(m, LoraConfig(rank=2, targets=DEFAULT_TARGETS[:1]))
    with pytest.raises(ValueError, match="twice"):
        add_adapters(m, LoraConfig(rank=2, targets=DEFAULT_TARGETS[:1]))


def test_default_targets_skip_the_mlps_a_mixture_of_experts_lacks():
    m = model(moe_experts=2)
    names = add_adapters(m, LoraConfig(rank=2))
    assert names and not any("mlp" in n for n in names) and len(names) == 4 * SMALL["n_layers"]
    with pytest.raises(ValueError, match="'blocks.\\*.mlp.fc1'"):
        add_adapters(model(moe_experts=2), LoraConfig(rank=2, targets=("blocks.*.mlp.fc1",)))
