"""The fused bf16 CPU kernels against torch's fp32 ops (the reference): attention against
SDPA, RMSNorm against nn.RMSNorm; their routing, fallbacks and build errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tabfm.model import ModelConfig, TabFM, attention
from tabfm.model.block import BlockNorm
from tabfm.model.cpu_kernels import attention as cpu_attention
from tabfm.model.cpu_kernels import build
from tabfm.model.cpu_kernels import gelu as cpu_gelu
from tabfm.model.cpu_kernels import rms_norm as cpu_rms_norm

needs_kernel = pytest.mark.skipif(not build.available(), reason=f"CPU kernels unavailable: {build.reason()}")


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
@pytest.mark.parametrize("keys", [16, attention.CPU_BF16_EXPLICIT_MAX_KEYS + 5])
def test_attend_routes_bf16_to_the_kernel(keys):
    q, k, v, mask, _ = _inputs(2, 2, 10, keys, 32, masked=True)
    assert torch.equal(attention.attend(q, k, v, mask, 0.0), cpu_attention.fused_attention(q, k, v, mask))
    # fp32 keeps SDPA; dropout and a per-query mask are not the kernel's
    q32 = q.float()
    assert torch.equal(attention.attend(q32, k.float(), v.float(), mask, 0.0),
                       F.scaled_dot_product_attention(q32, k.float(), v.float(), attn_mask=mask))
    assert not cpu_attention.supports(q, k, mask, 0.1)
    assert not cpu_attention.supports(q, k, mask.expand(2, 1, 10, keys), 0.0)


def test_switched_off_kernel_warns_and_falls_back_to_sdpa(monkeypatch):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    assert not build.available() and "TABFM_CPU_KERNELS=0" in build.reason()
    q, k, v, mask, _ = _inputs(2, 2, 10, attention.CPU_BF16_EXPLICIT_MAX_KEYS + 1, 32, masked=True)
    with pytest.warns(RuntimeWarning, match="fused CPU bf16 kernels unavailable"):
        out = attention.attend(q, k, v, mask, 0.0)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()
    assert torch.equal(out, ref)
    short = attention.attend(q, k[:, :, :16], v[:, :, :16], mask[..., :16], 0.0)  # explicit formula
    ref = F.scaled_dot_product_attention(q.float(), k[:, :, :16].float(), v[:, :, :16].float(), attn_mask=mask[..., :16])
    assert (short.float() - ref).abs().max() < 0.05


def test_a_failed_build_names_the_compiler_error(monkeypatch, tmp_path):
    if not build._cpu_has_bf16():
        pytest.skip("this CPU has no AVX512-BF16: the build is never tried")
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("TABFM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    assert not build.available()
    assert "failed to build the CPU kernels" in build.reason()
    assert not list(tmp_path.iterdir())  # nothing half-written left in the cache


@needs_kernel
@pytest.mark.parametrize("d", [40, 96, 130])
def test_rms_norm_matches_torch(d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(7, 33, d, generator=g) * 3 + 0.5).requires_grad_()
    w = (1 + 0.3 * torch.randn(d, generator=g)).requires_grad_()
    dy = torch.randn(7, 33, d, generator=g).bfloat16()
    ref = F.rms_norm(x, (d,), w, 1e-5)
    ref.backward(dy.float())
    dx_ref, dw_ref = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_rms_norm.supports(x, w)
        y = cpu_rms_norm.rms_norm_bf16(x, w, 1e-5)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert (y.float() - ref).abs().max() <= 0.004 * ref.abs().max()  # bf16 rounding of the output only
    assert _rel(x.grad, dx_ref) < 1e-5 and _rel(w.grad, dw_ref) < 1e-5


@needs_kernel
def test_rms_norm_threads_sum_the_weight_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(301, 96, generator=g).requires_grad_()
    w = torch.randn(96, generator=g).requires_grad_()
    dy = torch.randn(301, 96, generator=g).bfloat16()
    grads = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x.grad = w.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                cpu_rms_norm.rms_norm_bf16(x, w, 1e-5).backward(dy)
            grads.append((x.grad.clone(), w.grad.clone()))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.allclose(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_gelu_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(5000, generator=g) * 3, torch.tensor([0.0, -20.0, 20.0, 1e-3])]).bfloat16()
    x = x[-4998:].reshape(3, 1666, 1)  # not a multiple of 16; the extremes included
    dy = torch.randn(x.shape, generator=g).bfloat16()
    xr = x.float().requires_grad_()
    ref = F.gelu(xr, approximate="tanh")
    ref.backward(dy.float())
    xb = x.clone().requires_grad_()
    out = cpu_gelu.gelu_tanh_bf16(xb)
    out.backward(dy)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out.float() - ref).abs().max() <= 0.008 * ref.abs().max()  # bf16 output rounding
    assert _rel(xb.grad, xr.grad) < 0.005
    assert torch.equal(cpu_gelu.gelu_tanh_bf16(torch.tensor([0.0, -30.0]).bfloat16()), torch.tensor([0.0, -0.0]).bfloat16())


def test_block_norm_is_rms_norm_outside_cpu_bf16_autocast():
    torch.manual_seed(0)
    norm, ref = BlockNorm(24, eps=1e-5), torch.nn.RMSNorm(24, eps=1e-5)
    ref.load_state_dict(norm.state_dict())  # same parameters, same names
    x = torch.randn(5, 24)
    assert torch.equal(norm(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == (torch.bfloat16 if build.available() else torch.float32)
    assert (out.float() - ref(x)).abs().max() < 0.02


def test_an_unwritable_cache_is_reported_not_raised(monkeypatch, tmp_path):
    if not build._cpu_has_bf16():
        pytest.skip("this CPU has no AVX512-BF16: the build is never tried")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("TABFM_KERNEL_CACHE", str(blocker / "kernels"))  # a directory under a file
    assert not build.available()
    assert "could not build or load" in build.reason()


@needs_kernel
def test_bf16_train_step_matches_torch_ops(monkeypatch):
    """A whole model's bf16 loss and gradients: the kernels (both attentions, the row attention
    over > 128 key rows of two tables with different key counts; the blocks' norms; GELU) vs
    torch's ops (fp32 SDPA for the rows, the explicit formula for the columns, nn.RMSNorm,
    F.gelu)."""
    from tests.test_model import make_batch

    batch = make_batch(b=2, r=200, c=5, n_ctx=150, seed=3)
    batch.context[1, 140:150] = False  # a key mask: the second table has fewer key rows
    torch.manual_seed(0)
    model = TabFM(ModelConfig.preset("tiny")).train()
    calls = []
    real = cpu_attention.fused_attention
    monkeypatch.setattr(cpu_attention, "fused_attention", lambda *a: calls.append(1) or real(*a))
    loss_fused, grads_fused = _toy_step(model, batch)
    assert len(calls) == 2 * model.config.n_layers  # both attentions of every block ran the kernel
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    monkeypatch.setattr(cpu_rms_norm, "supports", lambda *a: False)
    monkeypatch.setattr(cpu_gelu, "supports", lambda *a: False)
    loss_ref, grads_ref = _toy_step(model, batch)
    assert len(calls) == 2 * model.config.n_layers
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
