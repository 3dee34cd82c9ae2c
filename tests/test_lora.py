"""Low-rank adapters (tabfm.model.lora): identity at the start, only adapters train, the merged
state dict computes what the adapted model computes (plain and cached-context passes), and
tensor parallelism (tp=2) computes the outputs, adapter gradients and steps of one process."""
from __future__ import annotations

import pytest
import torch

from tabfm.model import TabFM, masked_cell_loss
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


def adapted_model(rank: int = 2) -> TabFM:
    """The SMALL model with adapters whose B is nonzero (as after some training: B A is not zero)."""
    m = model()
    add_adapters(m, LoraConfig(rank=rank, alpha=3.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def adapter_step(m, booster=None) -> dict:
    """Outputs, loss, adapter gradients and adapters after one AdamW step on one batch (whole tensors)."""
    from tabfm.parallel import Booster, SingleProcessPlugin

    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    booster = booster or Booster(SingleProcessPlugin())
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    wrapped, opt, crit, _, _ = booster.boost(m, opt, masked_cell_loss)
    batch = make_batch(b=2, r=16, c=6, n_ctx=10)
    out = wrapped(batch, id_seed=3)
    loss, _ = crit(out, batch)
    booster.backward(loss, opt)
    res = {"outputs": outputs_of(out), "loss": float(loss.detach()),
           "grads": {n: full(p.grad) for n, p in m.named_parameters() if p.requires_grad},
           "placements": {n: str(getattr(p.grad, "placements", None)) for n, p in m.named_parameters()
                          if p.requires_grad},
           "param_placements": {n: str(getattr(p, "placements", None)) for n, p in m.named_parameters()
                                if p.requires_grad}}
    booster.clip_grad_norm_(opt, 1.0)
    opt.step()
    res["stepped"] = {n: full(p) for n, p in m.named_parameters() if p.requires_grad}
    return res


def outputs_of(out) -> torch.Tensor:
    return torch.cat([out.num_logits.flatten(), out.cat_logits.nan_to_num(0.0, 0.0, 0.0).flatten()]).detach()


def _tp_adapter_step(rank: int, world: int) -> dict:
    from tabfm.parallel import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=world)
    m = adapted_model()
    res = adapter_step(m, Booster(plugin))
    res["styles"] = dict(plugin.tp_styles)
    return res


@pytest.mark.slow
def test_tensor_parallel_adapters_compute_and_train_as_one_process():
    """tp=2 (hybrid plugin, gloo): colwise (qkv, fc1) and rowwise (out, fc2) layers with adapters give one
    process's outputs, loss, adapter gradients (the replicated factor's all-reduced, not left partial) and
    AdamW step; the adapters keep their names, so checkpoints and merges see the usual state dict."""
    from tests.dist_utils import run_distributed

    ref = adapter_step(adapted_model())
    got = run_distributed(_tp_adapter_step, world_size=2, timeout_s=300)
    styles = got[0]["styles"]
    assert set(styles.values()) == {"colwise", "rowwise"}
    assert set(got[0]["grads"]) == set(ref["grads"]) and ref["grads"]
    for r in got:
        assert torch.allclose(r["outputs"], ref["outputs"], atol=1e-5, rtol=1e-4)
        assert abs(r["loss"] - ref["loss"]) < 1e-5
        for n, g in ref["grads"].items():
            assert g.abs().max() > 0, n  # B != 0: A gets a gradient too
            assert torch.allclose(r["grads"][n], g, atol=1e-6, rtol=1e-4), n
            assert torch.allclose(r["stepped"][n], ref["stepped"][n], atol=1e-6, rtol=1e-4), n
    for n, placement in got[0]["param_placements"].items():
        layer = n.split(".parametrizations.")[0]
        sharded = "lora_b" if styles[layer] == "colwise" else "lora_a"
        want = f"(Shard(dim={0 if sharded == 'lora_b' else 1}),)" if n.endswith(sharded) else "(Replicate(),)"
        assert placement == want and got[0]["placements"][n] == want, (n, placement, got[0]["placements"][n])


def test_tensor_parallel_layout_checks_name_what_cannot_be_split():
    """The engine's checks before any collective: adapters declare their split (B's rows beside a colwise
    weight, A's columns beside a rowwise one; the rank is never split, so r need not divide by tp); a
    parametrization without a declaration, or with one that does not divide, is refused by name."""
    from torch import nn
    from torch.nn.utils import parametrize

    from tabfm.parallel.tensor_parallel import check_tp_layout, parametrization_shard_dims

    m = model()
    add_adapters(m, LoraConfig(rank=3))  # 3 does not divide by tp = 2: fine, the rank dim stays whole
    styles = check_tp_layout(m, m.parallel_plan(), 2)
    assert parametrization_shard_dims(m.get_submodule("blocks.0.mlp.fc1"), "fc1", styles["blocks.0.mlp.fc1"], 2) == [
        {"lora_b": 0, "lora_a": None}]
    assert parametrization_shard_dims(m.get_submodule("blocks.0.mlp.fc2"), "fc2", styles["blocks.0.mlp.fc2"], 2) == [
        {"lora_a": 1, "lora_b": None}]

    class Scale(nn.Module):  # a parametrization that does not say how to split its parameter
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(()))

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * self.s

    m = model()
    parametrize.register_parametrization(m.get_submodule("blocks.1.row_attn.out"), "weight", Scale())
    with pytest.raises(TypeError, match=r"blocks\.1\.row_attn\.out\.parametrizations\.weight\.0 \(Scale\) declares no "
                                        r"tp_shard_dims"):
        check_tp_layout(m, m.parallel_plan(), 2)

    class Odd(Scale):  # declares a split that 2 ranks cannot make
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def tp_shard_dims(self, style: str) -> dict:
            return {"s": 0}

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * self.s.sum()

    m = model()
    parametrize.register_parametrization(m.get_submodule("blocks.0.col_attn.qkv"), "weight", Odd())
    with pytest.raises(ValueError, match=r"\(Odd\)\.s has 3 entries on dim 0, not divisible by tp=2"):
        check_tp_layout(m, m.parallel_plan(), 2)
