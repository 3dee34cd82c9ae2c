"""Mixture-of-experts MLPs (tabfm/model/moe.py, issue #23): routing, capacity and the auxiliary
losses against per-token loops and hand computations; the MoE TabFM end to end (loss, gradients,
export, the pretrain command); dense models exactly as before."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.model.block import MLP
from tabfm.model.moe import MoEMLP

from .test_model import SMALL, make_batch

torch.set_num_threads(1)

MOE = dict(SMALL, moe_experts=4, moe_top_k=2)


def gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def loop_reference(moe: MoEMLP, x: torch.Tensor, mask: torch.Tensor | None, capacity: int
                   ) -> tuple[torch.Tensor, int]:
    """The documented MoE, one token and one assignment at a time, in float64: (output, dropped)."""
    d, e, k = x.shape[-1], moe.n_experts, moe.top_k
    flat = x.reshape(-1, d).double()
    real = list(range(flat.shape[0])) if mask is None else mask.reshape(-1).nonzero().flatten().tolist()
    router, w1, w2 = (t.detach().double() for t in (moe.router.weight, moe.experts.w1, moe.experts.w2))
    choices = {}
    for t in real:
        p = torch.softmax(router @ flat[t], 0).tolist()
        top = sorted(range(e), key=lambda j: -p[j])[:k]
        total = sum(p[j] for j in top) if k > 1 else 1.0
        choices[t] = [(j, p[j] / total) for j in top]
    out = torch.zeros_like(flat)
    used, dropped = [0] * e, 0
    for rank in range(k):  # every token's first choice in token order, then every second choice
        for t in real:
            j, gate = choices[t][rank]
            if used[j] < capacity:
                used[j] += 1
                out[t] += gate * (w2[j] @ gelu_tanh(w1[j] @ flat[t]))
            else:
                dropped += 1
    return out.view(x.shape), dropped


def make_moe(e: int, k: int, factor: float, d: int = 8, hidden: int = 16, seed: int = 0) -> MoEMLP:
    torch.manual_seed(seed)
    return MoEMLP(d, hidden, e, k, factor)


# ------------------------------------------------------------------ routing and capacity
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("masked", [False, True])
def test_routing_matches_a_per_token_loop(k, factor, masked):
    moe = make_moe(4, k, factor).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=g)
    mask = (torch.rand(2, 3, 5, generator=g) < 0.7) if masked else None
    n = 30 if mask is None else int(mask.sum())
    capacity = math.ceil(factor * n * k / 4)
    out = moe(x, mask)
    ref, dropped = loop_reference(moe, x, mask, capacity)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    s = moe.stats
    assert (s.dropped, s.assignments, s.tokens) == (dropped, n * k, n)
    if factor == 0.5:  # 4 experts x ceil(n k / 8) slots < n k assignments
        assert dropped > 0
    if factor == 4.0:
        assert dropped == 0
    if mask is not None:
        assert (out[~mask] == 0).all()


@pytest.mark.parametrize("k", [1, 2])
def test_eval_mode_drops_nothing(k):
    """In eval mode every assignment is kept, whatever the capacity factor: a token's output is its own."""
    moe = make_moe(4, k, 0.25).eval()
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(2))
    out = moe(x)
    ref, dropped = loop_reference(moe, x, None, capacity=40)
    assert dropped == 0 and moe.stats.dropped == 0
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(moe(x[7:9]), out[7:9], atol=1e-6, rtol=0)  # alone = in the crowd


def test_capacity_drops_later_tokens_first():
    """By hand: 4 tokens that all prefer expert 0, capacity ceil(1.0 * 4 * 1 / 2) = 2: tokens 0 and 1
    keep their expert, tokens 2 and 3 are dropped (output 0: the residual carries them)."""
    moe = make_moe(2, 1, 1.0, d=2, hidden=4)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    x = torch.tensor([[3.0, 0.0], [2.0, 1.0], [4.0, -1.0], [1.0, 0.5]])
    out = moe.train()(x)
    assert moe.capacity(4) == 2 and moe.stats.dropped == 2
    assert (out[2:] == 0).all() and (out[:2] != 0).all()
    p0 = torch.softmax(x[0], 0)[0]
    expected = p0 * (moe.experts.w2[0] @ gelu_tanh(moe.experts.w1[0] @ x[0]))  # k = 1: gate = the router probability
    torch.testing.assert_close(out[0], expected.detach(), atol=1e-6, rtol=0)


def test_capacity_rounding():
    assert make_moe(1, 1, 1.1).capacity(10) == 11  # not 12 (1.1 * 10 = 11.000000000000002)
    assert make_moe(4, 2, 1.25).capacity(10) == 7  # ceil(6.25)
    assert make_moe(4, 1, 1.25).capacity(0) == 0


def test_one_expert_is_the_dense_mlp():
    """E = 1, k = 1: the gate is softmax over one expert = 1, so the MoE is the dense MLP."""
    torch.manual_seed(0)
    dense, moe = MLP(8, 16), MoEMLP(8, 16, 1, 1, 1.0).train()
    with torch.no_grad():
        moe.experts.w1.copy_(dense.fc1.weight[None])
        moe.experts.w2.copy_(dense.fc2.weight[None])
    x = torch.randn(3, 7, 8)
    torch.testing.assert_close(moe(x), dense(x), atol=1e-6, rtol=0)
    assert moe.stats.dropped == 0


# ------------------------------------------------------------------ auxiliary losses
def test_aux_and_z_loss_by_hand():
    """E = 2, k = 1, router = identity, so the logits are the tokens themselves."""
    moe = make_moe(2, 1, 1.0, d=2, hidden=4)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
    tokens = [(2.0, 0.0), (0.0, 1.0), (1.0, 0.5)]
    moe(torch.tensor(tokens))
    probs = [[math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))] for a, b in tokens]
    f = [2 / 3, 1 / 3]  # tokens 0 and 2 choose expert 0, token 1 expert 1
    P = [sum(p[e] for p in probs) / 3 for e in range(2)]
    aux = 2 * (f[0] * P[0] + f[1] * P[1])
    z = sum(math.log(math.exp(a) + math.exp(b)) ** 2 for a, b in tokens) / 3
    assert moe.stats.aux.item() == pytest.approx(aux, rel=1e-6)
    assert moe.stats.z.item() == pytest.approx(z, rel=1e-6)


def test_uniform_router_has_unit_balance_loss():
    moe = make_moe(4, 2, 1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(16, 8))  # every probability 1/4; top-2 of ties picks the same two experts
    assert moe.stats.aux.item() == pytest.approx(4 * (0.5 * 0.25 + 0.5 * 0.25))
    assert moe.stats.z.item() == pytest.approx(math.log(4) ** 2)


def test_padding_is_not_counted():
    moe = make_moe(4, 2, 1.0)
    x = torch.randn(10, 8)
    mask = torch.tensor([True] * 6 + [False] * 4)
    out = moe(x, mask)
    aux, z = moe.stats.aux, moe.stats.z
    moe(x[:6])
    assert moe.stats.tokens == 6 and moe.stats.assignments == 12
    torch.testing.assert_close(aux, moe.stats.aux)
    torch.testing.assert_close(z, moe.stats.z)
    assert (out[6:] == 0).all()
    empty = moe(x, torch.zeros(10, dtype=torch.bool))  # nothing to route: zeros, finite losses
    assert (empty == 0).all() and moe.stats.tokens == 0 and moe.stats.aux.item() == 0 == moe.stats.z.item()


@pytest.mark.parametrize("k", [1, 2])
def test_gradients_reach_router_and_experts(k):
    moe = make_moe(4, k, 1.0).train()
    x = torch.randn(24, 8, requires_grad=True)
    moe(x).pow(2).sum().backward()  # the task loss alone: the router learns through the gates
    assert moe.router.weight.grad.abs().sum() > 0
    used = set(moe.router(x).topk(k, -1).indices.flatten().tolist())
    for e in range(4):
        assert (moe.experts.w1.grad[e].abs().sum() > 0) == (e in used)
        assert (moe.experts.w2.grad[e].abs().sum() > 0) == (e in used)
    assert x.grad.abs().sum() > 0
    moe.zero_grad()
    moe(x)
    (moe.stats.aux + moe.stats.z).backward()  # the auxiliary losses reach the router
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w1.grad is None  # set_to_none, untouched


# ------------------------------------------------------------------ the model
def moe_model(seed: int = 0, **overrides) -> TabFM:
    torch.manual_seed(seed)
    return TabFM(ModelConfig(**{**MOE, **overrides}))


def test_config_fields_and_validation():
    cfg = ModelConfig(**MOE)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert [cfg.moe_layer(i) for i in range(2)] == [True, True]
    assert [ModelConfig(**{**MOE, "moe_every": 2}).moe_layer(i) for i in range(2)] == [False, True]
    assert not any(ModelConfig(**SMALL).moe_layer(i) for i in range(2))
    for name in ("tiny", "small", "base"):
        assert ModelConfig.preset(name).moe_experts == 0
    bad = [dict(moe_top_k=5), dict(moe_experts=-1), dict(moe_top_k=0), dict(moe_every=0), dict(moe_every=3),
           dict(moe_capacity_factor=0.0), dict(moe_aux_weight=-1.0), dict(moe_z_weight=float("nan")),
           dict(moe_experts=0, moe_top_k=2)]
    for override in bad:
        field = next(iter(override)) if len(override) == 1 else "moe_top_k"
        with pytest.raises(ValueError, match=f"ModelConfig.{field} "):
            ModelConfig(**{**MOE, **override})


def test_moe_blocks_plan_and_state_dict():
    m = moe_model(moe_every=2)
    assert isinstance(m.blocks[0].mlp, MLP) and isinstance(m.blocks[1].mlp, MoEMLP)
    keys = [k for k in m.state_dict() if k.startswith("blocks.1.mlp")]
    assert keys == ["blocks.1.mlp.router.weight", "blocks.1.mlp.experts.w1", "blocks.1.mlp.experts.w2"]
    assert m.blocks[1].mlp.experts.w1.shape == (4, 64, 32) and m.blocks[1].mlp.experts.w2.shape == (4, 32, 64)
    from tabfm.parallel.tensor_parallel import resolve_tp_plan

    for model_ in (m, moe_model()):  # the dense MLPs' patterns only where dense MLPs exist
        plan = model_.parallel_plan()
        assert plan.pipeline is None  # the stages would not carry the routing losses
        styles = resolve_tp_plan(model_, plan.tp_plan)
        assert not any(".mlp." in n for n in styles if n.startswith("blocks.1."))
    assert "blocks.0.mlp.fc1" in resolve_tp_plan(m, m.parallel_plan().tp_plan)


def test_moe_model_loss_adds_the_weighted_aux_terms():
    m = moe_model(moe_capacity_factor=1.0, n_layers=3, moe_every=1).train()
    batch = make_batch(pad_rows=2, pad_cols=1)
    seen = []
    for block in m.blocks:
        block.mlp.register_forward_hook(lambda mod, args, out: seen.append(mod.stats))
    out = m(batch)
    loss, metrics = masked_cell_loss(out, batch)
    loss.backward()
    assert len(seen) == 3 and all(b.mlp.stats is None for b in m.blocks)  # taken into the output
    aux = sum(s.aux.item() for s in seen) / 3
    z = sum(s.z.item() for s in seen) / 3
    dropped = sum(s.dropped for s in seen) / sum(s.assignments for s in seen)
    moe, out.moe = out.moe, None
    nll, dense_metrics = masked_cell_loss(out, batch)
    assert loss.item() == pytest.approx(nll.item() + 0.01 * aux + 0.001 * z, rel=1e-6)
    assert metrics["loss"] == pytest.approx(loss.item())
    assert metrics["moe_aux"] == pytest.approx(aux, rel=1e-6) and metrics["moe_z"] == pytest.approx(z, rel=1e-6)
    assert metrics["moe_dropped"] == pytest.approx(dropped) and 0 < dropped < 1
    assert set(metrics) == set(dense_metrics) | {"moe_aux", "moe_z", "moe_dropped"}
    assert moe.tokens == 3 * 2 * (2 + 14) * 5  # every token of every block, padding included
    for name, p in m.named_parameters():
        assert p.grad is not None, name
    for block in m.blocks:
        assert block.mlp.router.weight.grad.abs().sum() > 0
        assert block.mlp.experts.w1.grad.abs().sum() > 0


def test_moe_model_with_one_expert_equals_the_dense_model():
    """The TabFM plumbing: E = 1 MoE blocks holding the dense MLPs' weights compute the dense model."""
    torch.manual_seed(0)
    dense = TabFM(ModelConfig(**SMALL)).eval()
    moe = TabFM(ModelConfig(**SMALL, moe_experts=1)).eval()
    state = dict(dense.state_dict())
    for i in range(2):
        state[f"blocks.{i}.mlp.experts.w1"] = state.pop(f"blocks.{i}.mlp.fc1.weight")[None]
        state[f"blocks.{i}.mlp.experts.w2"] = state.pop(f"blocks.{i}.mlp.fc2.weight")[None]
        state[f"blocks.{i}.mlp.router.weight"] = moe.state_dict()[f"blocks.{i}.mlp.router.weight"]
    moe.load_state_dict(state)
    batch = make_batch(pad_rows=2, pad_cols=1)
    a, b = dense(batch), moe(batch)
    torch.testing.assert_close(b.num_logits, a.num_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.cat_logits, a.cat_logits, atol=1e-5, rtol=0)
    assert b.moe.aux.item() == pytest.approx(1.0) and b.moe.dropped == 0  # one expert: f = P = 1


def test_moe_model_cached_context_equals_full_forward():
    """Eval mode drops nothing, so the cached-context path equals one forward for MoE models too."""
    from .test_context_cache import split

    m = moe_model(moe_capacity_factor=0.5).eval()
    full, ctx, qry = split(make_batch(b=2, r=16, c=6, n_ctx=10, pad_rows=3, pad_cols=2))
    with torch.no_grad():
        ref = m(full)
        cached = m.forward_queries(qry, m.encode_context(ctx))
    assert ref.moe.dropped == 0 and len(ref) == len(cached) > 0
    assert torch.equal(ref.index[:, 0], cached.index[:, 0]) and torch.equal(ref.index[:, 2], cached.index[:, 2])
    assert (ref.num_logits - cached.num_logits).abs().max() < 1e-5
    finite = torch.isfinite(ref.cat_logits)
    assert (ref.cat_logits[finite] - cached.cat_logits[finite]).abs().max() < 1e-5


def test_activation_checkpointing_keeps_moe_gradients():
    from tabfm.parallel import checkpoint_blocks

    batch = make_batch()
    grads = []
    for ckpt in (False, True):
        m = moe_model(seed=3, moe_capacity_factor=1.0).train()
        if ckpt:
            checkpoint_blocks(m, m.parallel_plan())
        torch.manual_seed(7)
        loss, _ = masked_cell_loss(m(batch), batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_export_and_load_round_trip(tmp_path):
    from tabfm.parallel.export import export_model
    from tabfm.parallel import load_exported
    from tabfm.weights import EXPORT_FORMAT, EXPORT_VERSION, build_model

    m = moe_model(moe_every=2).eval()
    config = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": m.config.to_dict()}
    state, header = load_exported(export_model(m, tmp_path / "export", config))
    loaded = build_model(state, header)
    assert loaded.config == m.config and isinstance(loaded.blocks[1].mlp, MoEMLP)
    batch = make_batch()
    with torch.no_grad():
        a, b = m(batch), loaded(batch)
    assert torch.equal(a.num_logits, b.num_logits) and torch.equal(a.cat_logits, b.cat_logits)


def test_onnx_export_refuses_moe_models():
    from tabfm.model.onnx_export import ExportableTabFM

    with pytest.raises(ValueError, match="mixture-of-experts"):
        ExportableTabFM(moe_model().eval())


# ------------------------------------------------------------------ dense models: as before
DENSE_KEYS = ["encoder.value", "encoder.thinking", "encoder.code.weight", "encoder.column.weight",
              "encoder.state.weight"] + [
    f"blocks.{i}.{name}" for i in range(2) for name in (
        "norm_col.weight", "col_attn.qkv.weight", "col_attn.out.weight", "norm_row.weight", "row_attn.qkv.weight",
        "row_attn.out.weight", "norm_mlp.weight", "mlp.fc1.weight", "mlp.fc2.weight")] + [
    "norm.weight", "num_head.fc1.weight", "num_head.fc1.bias", "num_head.fc2.weight", "num_head.fc2.bias",
    "cat_head.query.weight", "cat_head.query.bias", "cat_head.key.weight"]


def test_dense_model_is_unchanged():
    """A dense config builds the model it built before MoE existed: the same state dict names, and
    (fixed seeds) the same loss and predictions as the code before this change computed (recorded
    values: train-mode loss, eval-mode numeric logits)."""
    torch.manual_seed(0)
    m = TabFM(ModelConfig(**SMALL))
    assert list(m.state_dict()) == DENSE_KEYS
    assert all(isinstance(b.mlp, MLP) for b in m.blocks)
    batch = make_batch(pad_rows=2, pad_cols=1)
    torch.manual_seed(1)
    out = m.train()(batch)
    loss, metrics = masked_cell_loss(out, batch)
    assert out.moe is None
    assert set(metrics) == {"loss", "cat_nll", "num_nll", "cat_acc", "cells", "cat_cells", "num_cells"}
    assert loss.item() == pytest.approx(1.672637939453125, rel=1e-6)
    with torch.no_grad():
        num = m.eval()(batch).num_logits.double()
    assert num.shape == (26, 32)
    assert num.sum().item() == pytest.approx(12.260690866038203, rel=1e-5)
    assert num.abs().sum().item() == pytest.approx(134.85923557542264, rel=1e-6)
    assert m.parallel_plan().pipeline is not None


# ------------------------------------------------------------------ the pretrain command
def test_pretrain_config_plumbing():
    from tabfm.train.config import PretrainConfig, run_model_config

    cfg = run_model_config(PretrainConfig(moe_experts=4, moe_top_k=2))
    assert (cfg.moe_experts, cfg.moe_top_k) == (4, 2)
    assert run_model_config({"model": "tiny"}).moe_experts == 0  # older train_config.json
    with pytest.raises(ValueError, match="PretrainConfig.moe_top_k"):
        PretrainConfig(moe_top_k=2)
    with pytest.raises(ValueError, match="PretrainConfig.moe_experts"):
        PretrainConfig(moe_experts=-1)


def test_pretrain_command_smoke(tmp_path):
    import json

    from tabfm import cli

    out = tmp_path / "run"
    argv = ["pretrain", "--preset", "smoke", "--moe-experts", "4", "--moe-top-k", "2", "--steps", "2",
            "--eval-batches", "0", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    header = json.loads((out / "export" / "config.json").read_text())
    assert (header["model"]["moe_experts"], header["model"]["moe_top_k"]) == (4, 2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("moe_aux" in json.dumps(r) for r in records)
