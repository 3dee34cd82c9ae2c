"""The fused bf16 CPU attention kernel against fp32 SDPA (the reference), and its routing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tabfm.model import ModelConfig, TabFM, attention, cpu_attention

needs_kernel = pytest.mark.skipif(not cpu_attention.available(),
                                  reason=f"fused CPU attention unavailable: {cpu_attention.unavailable_reason()}")


def _inputs(n, h, l, s, d, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, m, d, generator=g).bfloat16() for m in (l, s, s))
    mask = None
    if masked:
        mask = torch.rand(n, 1, 1, s, generator=g) > 0.4
        mask[:, :, :, 0] = True
    do = torch.randn(n, h, l, d, generator=g).bfloat16()
    return q, k, v, mask, do


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _reference(q, k, v, mask, do):
    """fp32 SDPA on the same (bf16-exact) values."""
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    out.backward(do.float())
    return out, q32.grad, k32.grad, v32.grad


def _fused(q, k, v, mask, do):
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    out = cpu_attention.fused_attention(qb, kb, vb, mask)
    out.backward(do)
    return out, qb.grad, kb.grad, vb.grad


@needs_kernel
@pytest.mark.parametrize("shape", [(2, 3, 16, 16, 32), (3, 2, 17, 13, 24), (2, 2, 272, 208, 32),
                                   (1, 1, 5, 3, 2), (2, 2, 33, 100, 64), (2, 2, 40, 50, 48)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_fp32_sdpa(shape, masked):
    args = _inputs(*shape, masked)
    ref, fused = _reference(*args), _fused(*args)
    assert fused[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in fused[1:])
    # bf16 outputs: the rounding of the result alone is ~0.3 % relative
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, ref):
        assert _rel(a, b) < (0.006 if shape[2] > 8 else 0.02), name


@needs_kernel
def test_masked_keys_get_no_weight_and_no_gradient():
    q, k, v, mask, do = _inputs(2, 2, 20, 40, 32, masked=True)
    kb, vb = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = cpu_attention.fused_attention(q, kb, vb, mask)
    out.backward(do)
    hidden = ~mask[:, 0, 0, :]  # (N, S)
    assert hidden.any()
    assert kb.grad.permute(0, 2, 1, 3)[hidden].abs().max() == 0
    assert vb.grad.permute(0, 2, 1, 3)[hidden].abs().max() == 0
    # changing a hidden key's value changes nothing
    v2 = v.clone()
    v2.permute(0, 2, 1, 3)[hidden] = 100.0
    assert torch.equal(cpu_attention.fused_attention(q, k, v2, mask), out.detach())


@needs_kernel
def test_a_query_without_visible_keys_gets_zeros():
    q, k, v, _, do = _inputs(2, 2, 8, 12, 16, masked=False)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1] = False
    qb = q.clone().requires_grad_()
    out = cpu_attention.fused_attention(qb, k, v, mask)
    out.backward(do)
    assert out[1].abs().max() == 0 and qb.grad[1].abs().max() == 0
    assert torch.isfinite(out).all() and out[0].abs().max() > 0


@needs_kernel
def test_threads_split_the_slices_without_changing_results():
    args = _inputs(3, 4, 40, 150, 32, masked=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fused(*args)
        torch.set_num_threads(2)
        two = _fused(*args)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@needs_kernel
def test_attend_routes_long_bf16_key_sets_to_the_kernel():
    long_s = attention.CPU_BF16_EXPLICIT_MAX_KEYS + 5
    q, k, v, mask, _ = _inputs(2, 2, 10, long_s, 32, masked=True)
    assert torch.equal(attention.attend(q, k, v, mask, 0.0), cpu_attention.fused_attention(q, k, v, mask))
    # fp32 and short key sets keep their paths
    q32 = q.float()
    assert torch.equal(attention.attend(q32, k.float(), v.float(), mask, 0.0),
                       F.scaled_dot_product_attention(q32, k.float(), v.float(), attn_mask=mask))


def test_switched_off_kernel_warns_and_falls_back_to_sdpa(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "0")
    assert not cpu_attention.available() and "TABFM_CPU_ATTENTION=0" in cpu_attention.unavailable_reason()
    q, k, v, mask, _ = _inputs(2, 2, 10, attention.CPU_BF16_EXPLICIT_MAX_KEYS + 1, 32, masked=True)
    with pytest.warns(RuntimeWarning, match="fused CPU bf16 attention unavailable"):
        out = attention.attend(q, k, v, mask, 0.0)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()
    assert torch.equal(out, ref)


def test_a_failed_build_names_the_compiler_error(monkeypatch, tmp_path):
    if not cpu_attention._cpu_has_bf16():
        pytest.skip("this CPU has no AVX512-BF16: the build is never tried")
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setenv("TABFM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    assert not cpu_attention.available()
    assert "failed to build cpu_attention.cpp" in cpu_attention.unavailable_reason()
    assert not list(tmp_path.iterdir())  # nothing half-written left in the cache


@needs_kernel
def test_bf16_train_step_matches_the_sdpa_path(monkeypatch):
    """A whole model's bf16 loss and gradients: the kernel for the row attention (> 128 key
    rows, two tables with different key counts) vs the fp32 SDPA path."""
    from tests.test_model import make_batch

    batch = make_batch(b=2, r=200, c=5, n_ctx=150, seed=3)
    batch.context[1, 140:150] = False  # a key mask: the second table has fewer key rows
    torch.manual_seed(0)
    model = TabFM(ModelConfig.preset("tiny")).train()
    calls = []
    real = cpu_attention.fused_attention
    monkeypatch.setattr(cpu_attention, "fused_attention", lambda *a: calls.append(1) or real(*a))
    loss_fused, grads_fused = _toy_step(model, batch)
    assert len(calls) == model.config.n_layers  # every block's row attention ran the kernel
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    loss_ref, grads_ref = _toy_step(model, batch)
    assert len(calls) == model.config.n_layers
    assert abs(loss_fused - loss_ref) < 0.01 * abs(loss_ref)
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(grads_fused, grads_ref) if b.norm() > 0]
    assert max(rel) < 0.03 and sum(rel) / len(rel) < 0.01  # measured 0.009 / 0.004


def _toy_step(model, batch):
    from tabfm.model.loss import masked_cell_loss

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # train mode draws column identities
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = masked_cell_loss(model(batch), batch)
    loss.backward()
    return float(loss), [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
