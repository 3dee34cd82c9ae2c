"""The Triton kernels of `tabfm.parallel.kernels` against torch's ops (the reference), and
their dispatch.

Here (no GPU) the kernels run under triton's interpreter (``TRITON_INTERPRET=1``) on fp32 CPU
tensors, switched on (``TABFM_TRITON=1``) for CPU by the test-only ``TABFM_TRITON_CPU=1``. triton reads
``TRITON_INTERPRET`` once, when it is imported, so `test_kernels_under_interpreter` runs this
file's kernel tests in a subprocess with both variables set (nothing leaks into other test
files); ``TRITON_INTERPRET=1 TABFM_TRITON_CPU=1 TABFM_TRITON=1 pytest tests/test_triton_kernels.py`` runs
them directly. On a CUDA machine the `cuda`-named tests run the compiled kernels on the GPU.

Tolerances (fp32, interpret mode; measured maxima ~1e-6 relative): values and gradients
within rtol 1e-5 / atol 1e-5 of torch (`assert_close`), dweight (a sum over all rows) atol 1e-4.
The whole file skips where triton does not import.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tabfm.model import TabFM, ModelConfig, masked_cell_loss  # noqa: E402
from tabfm.parallel import kernels as triton_kernels  # noqa: E402
from tabfm.model.block import BlockNorm, TableBlock  # noqa: E402
from tabfm.parallel.kernels import dispatch  # noqa: E402
from tests.test_model import SMALL, make_batch  # noqa: E402

KERNEL_MODULES = ("norm", "gelu", "cross_entropy")
CUDA = torch.cuda.is_available()
# triton reads TRITON_INTERPRET when it decorates a kernel, its own library's included, i.e. when
# triton is first imported: a process is either interpreted or not. Under the interpreter (set
# before pytest started) the kernel tests run here; otherwise `test_kernels_under_interpreter`
# runs this file again in a subprocess with TRITON_INTERPRET=1 and the CPU test switch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = dict(rtol=1e-5, atol=1e-5)


def _modules() -> dict:
    return {name: importlib.import_module(f"{triton_kernels.__name__}.{name}") for name in KERNEL_MODULES}


@pytest.fixture
def kernels_cpu(monkeypatch):
    """Kernel modules under the interpreter, and the dispatch switched on for CPU tensors."""
    if not INTERPRET:
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_kernels_under_interpreter")
    monkeypatch.setenv(dispatch.CPU_TEST_SWITCH, "1")
    monkeypatch.setenv(dispatch.ENV_SWITCH, "1")
    dispatch.reset()
    yield _modules()
    dispatch.reset()


@pytest.fixture
def kernels_cuda(monkeypatch):
    if not CUDA or INTERPRET:
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)" if not CUDA else
                    "compiled kernels only without TRITON_INTERPRET")
    monkeypatch.setenv(dispatch.ENV_SWITCH, "1")
    dispatch.reset()
    yield _modules()
    dispatch.reset()


@pytest.fixture
def env_guard():
    dispatch.reset()
    yield
    dispatch.reset()


def test_kernels_under_interpreter():
    """This file's kernel tests, in a subprocess under triton's interpreter (fp32, CPU tensors)."""
    if INTERPRET:
        pytest.skip("already under the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1", dispatch.CPU_TEST_SWITCH: "1", dispatch.ENV_SWITCH: "1"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
                          str(Path(__file__).resolve()), "-k", "not under_interpreter"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, tail
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) >= 50, tail
    assert "needs a CUDA GPU" not in res.stdout or "skipped" in res.stdout, tail


# ---------------------------------------------------------------------------------------- reference
def _ref_add_rms_norm(x, r, w, eps):
    s = x + r if r is not None else x
    return s, F.rms_norm(s, (s.shape[-1],), w, eps)


def _grads(outs, seeds, leaves):
    torch.autograd.backward([o for o in outs if o is not None], [g for o, g in zip(outs, seeds) if o is not None])
    gs = [t.grad.clone() if t.grad is not None else None for t in leaves]
    for t in leaves:
        t.grad = None
    return gs


def _check_norm(norm_mod, shape, residual, eps, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2).to(device).requires_grad_()
    r = torch.randn(shape, generator=g).to(device).requires_grad_() if residual else None
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
    ds, dy = torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)
    leaves = [t for t in (x, r, w) if t is not None]
    if residual:
        s, y = norm_mod.add_rms_norm(x, r, w, eps)
        got = [s, y], _grads([s, y], [ds, dy], leaves)
    else:
        y = norm_mod.rms_norm(x, w, eps)
        got = [x, y], _grads([y], [dy], leaves)
    s_ref, y_ref = _ref_add_rms_norm(x, r, w, eps if eps is not None else torch.finfo(torch.float32).eps)
    want = [s_ref, y_ref], _grads([s_ref, y_ref] if residual else [y_ref], [ds, dy] if residual else [dy], leaves)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(got[1][:-1], want[1][:-1]):  # dx (and dresidual)
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got[1][-1], want[1][-1], rtol=1e-5, atol=1e-4)  # dweight: a sum over rows


# ---------------------------------------------------------------------------------------- RMSNorm (+ residual)
@pytest.mark.parametrize("shape", [(1, 7), (1, 96), (3, 130), (2, 5, 17, 96), (1000, 33), (70, 1)])
@pytest.mark.parametrize("residual", [True, False])
def test_rms_norm_matches_torch(kernels_cpu, shape, residual):
    _check_norm(kernels_cpu["norm"], shape, residual, eps=1e-5)


def test_rms_norm_default_eps_and_zero_rows(kernels_cpu):
    _check_norm(kernels_cpu["norm"], (9, 24), True, eps=None)
    x = torch.zeros(4, 24, requires_grad=True)  # padded cells: all-zero tokens stay finite
    w = torch.ones(24, requires_grad=True)
    s, y = kernels_cpu["norm"].add_rms_norm(x, torch.zeros(4, 24), w, 1e-5)
    (y.sum() + s.sum()).backward()
    assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(x.grad).all()


def test_add_rms_norm_one_output_used(kernels_cpu):
    """Autograd hands None for an unused output; both cases give torch's gradients."""
    k = kernels_cpu["norm"]
    x, r, w = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True), torch.randn(40)
    for pick in (0, 1):
        out = k.add_rms_norm(x, r, w, 1e-5)[pick]
        out.sum().backward()
        got = x.grad.clone(), r.grad.clone()
        x.grad = r.grad = None
        _ref_add_rms_norm(x, r, w, 1e-5)[pick].sum().backward()
        torch.testing.assert_close(got[0], x.grad, **TOL)
        torch.testing.assert_close(got[1], r.grad, **TOL)
        x.grad = r.grad = None


def test_add_rms_norm_mixed_dtypes(kernels_cpu):
    """An fp32 residual stream plus an fp16 update (an autocast sublayer's output): the sum is
    fp32 as torch's promotion makes it, each input gets its gradient in its own dtype."""
    x = torch.randn(5, 48, requires_grad=True)
    r = torch.randn(5, 48).half().requires_grad_()
    w = torch.randn(48)
    s, y = kernels_cpu["norm"].add_rms_norm(x, r, w, 1e-5)
    assert s.dtype == y.dtype == torch.float32
    (s.sum() + y.sum()).backward()
    assert x.grad.dtype == torch.float32 and r.grad.dtype == torch.float16
    s_ref, y_ref = _ref_add_rms_norm(x.detach(), r.detach(), w, 1e-5)
    torch.testing.assert_close(s, s_ref, **TOL)
    torch.testing.assert_close(y, y_ref, **TOL)


def test_add_rms_norm_refuses_shape_mismatch(kernels_cpu):
    with pytest.raises(ValueError, match="differ in shape"):
        kernels_cpu["norm"].add_rms_norm(torch.randn(2, 8), torch.randn(1, 8), torch.ones(8), 1e-5)


# ---------------------------------------------------------------------------------------- bias + GELU
def _check_gelu(gelu_mod, shape, bias, approximate, scale=3.0, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(shape, generator=g) * scale).to(device).requires_grad_()
    b = torch.randn(shape[-1], generator=g).to(device).requires_grad_() if bias else None
    dy = torch.randn(shape, generator=g).to(device)
    leaves = [t for t in (h, b) if t is not None]
    y = gelu_mod.bias_gelu(h, b, approximate)
    got = _grads([y], [dy], leaves)
    y_ref = F.gelu(h + b if bias else h, approximate=approximate)
    want = _grads([y_ref], [dy], leaves)
    torch.testing.assert_close(y, y_ref, **TOL)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-4 if a.numel() == shape[-1] else 1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 1000), (2, 9, 192), (4097,)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_bias_gelu_matches_torch(kernels_cpu, shape, approximate, bias):
    _check_gelu(kernels_cpu["gelu"], shape, bias, approximate)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_saturates(kernels_cpu, approximate):
    """Large |x| (tanh's exp far out of range): exact 0 / x, finite gradients, as torch."""
    _check_gelu(kernels_cpu["gelu"], (5, 64), True, approximate, scale=40.0)


def test_bias_gelu_refuses_bad_arguments(kernels_cpu):
    with pytest.raises(ValueError, match="approximate"):
        kernels_cpu["gelu"].bias_gelu(torch.randn(2, 4), None, "fast")
    with pytest.raises(ValueError, match="bias must have shape"):
        kernels_cpu["gelu"].bias_gelu(torch.randn(2, 4), torch.randn(3), "tanh")


# ---------------------------------------------------------------------------------------- target log-prob
@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (37, 10), (300, 128), (5, 3), (64, 129)])
def test_target_log_prob_matches_torch(kernels_cpu, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    z = torch.randn(n, k, generator=g) * 3
    card = torch.randint(1, k + 1, (n,), generator=g)  # codes >= cardinality are -inf (CategoricalHead)
    z = z.masked_fill(torch.arange(k)[None, :] >= card[:, None], float("-inf")).requires_grad_()
    t = (torch.rand(n, generator=g) * card).long()
    dout = torch.randn(n, generator=g)
    lp = kernels_cpu["cross_entropy"].target_log_prob(z, t)
    (got,) = _grads([lp], [dout], [z])
    ref = F.log_softmax(z, -1).gather(-1, t[:, None])[:, 0]
    (want,) = _grads([ref], [dout], [z])
    torch.testing.assert_close(lp, ref, **TOL)
    torch.testing.assert_close(got, want, **TOL)
    assert (got[torch.isinf(z)] == 0).all()  # masked codes: no gradient
    # = -F.cross_entropy per row
    torch.testing.assert_close(-lp, F.cross_entropy(z.detach(), t, reduction="none"), **TOL)


def test_target_log_prob_refuses_bad_shapes(kernels_cpu):
    with pytest.raises(ValueError, match="logits"):
        kernels_cpu["cross_entropy"].target_log_prob(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))


# ---------------------------------------------------------------------------------------- in the model
def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    loss, _ = masked_cell_loss(out, batch)
    loss.backward()
    return out, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_model_with_kernels_matches_torch_path(kernels_cpu):
    """A whole train step with the Triton path (fused add + norm, GELU) equals the torch path."""
    torch.manual_seed(0)
    model = TabFM(ModelConfig(**SMALL)).train()
    batch = make_batch(pad_rows=3, pad_cols=1)
    assert triton_kernels.use(batch.x)
    calls = []
    orig = kernels_cpu["norm"]._AddRMSNorm.apply
    kernels_cpu["norm"]._AddRMSNorm.apply = lambda *a: calls.append(1) or orig(*a)
    try:
        torch.manual_seed(1)
        out_k, loss_k, grads_k = _step(model, batch)
    finally:
        kernels_cpu["norm"]._AddRMSNorm.apply = orig
    assert len(calls) == 3 * SMALL["n_layers"]  # norm_col plain, norm_row / norm_mlp fused, per block
    os.environ[dispatch.ENV_SWITCH] = "0"
    dispatch.reset()
    try:
        assert not triton_kernels.use(batch.x)
        torch.manual_seed(1)
        out_t, loss_t, grads_t = _step(model, batch)
    finally:
        os.environ[dispatch.ENV_SWITCH] = "1"
        dispatch.reset()
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k.num_logits, out_t.num_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_k.cat_logits, out_t.cat_logits, rtol=1e-4, atol=1e-4)
    assert grads_k.keys() == grads_t.keys()
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-4, atol=1e-5, msg=name)


def test_hooked_norms_keep_the_residual_add_outside(kernels_cpu):
    """An engine's pre-hook on a norm (Gemini casts inputs there) must not see the residual
    stream: the block then adds outside the norm, as on the torch path."""
    block = TableBlock(ModelConfig(**SMALL))
    seen = []
    block.norm_row.register_forward_pre_hook(lambda m, args: seen.append(len(args)))
    x = torch.randn(2, 6, 4, SMALL["d_model"])
    block(x, None, 6, None)
    assert seen == [1]


# ---------------------------------------------------------------------------------------- dispatch
def test_dispatch_picks_torch_on_cpu_by_default(env_guard, monkeypatch):
    monkeypatch.delenv(dispatch.CPU_TEST_SWITCH, raising=False)
    monkeypatch.delenv(dispatch.ENV_SWITCH, raising=False)
    dispatch.reset()
    try:
        assert not triton_kernels.use(torch.randn(3, 4))
        assert not triton_kernels.use(torch.randn(3, 4), None, torch.nn.Parameter(torch.ones(4)))
    finally:
        dispatch.reset()


def test_dispatch_needs_interpret_mode_for_cpu(env_guard, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SWITCH, "1")
    monkeypatch.setenv(dispatch.CPU_TEST_SWITCH, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch.reset()
    try:
        assert not triton_kernels.use(torch.randn(3, 4))
    finally:
        dispatch.reset()


@pytest.mark.parametrize("switch", [None, "0", "yes"])
def test_kernels_are_opt_in(env_guard, monkeypatch, switch):
    """Only TABFM_TRITON=1 turns them on (they lost to torch's ops on an H200), even where every
    other condition holds."""
    if switch is None:
        monkeypatch.delenv(dispatch.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(dispatch.ENV_SWITCH, switch)
    monkeypatch.setenv(dispatch.CPU_TEST_SWITCH, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.reset()
    try:
        assert not dispatch.enabled() and dispatch.reason().startswith("TABFM_TRITON is not 1")
        assert not triton_kernels.use(torch.randn(3, 4))
        with warnings.catch_warnings(record=True) as caught:  # not asked for: nothing to warn about
            warnings.simplefilter("always")
            assert not dispatch._on_cuda()
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    finally:
        dispatch.reset()


def test_dispatch_refuses_dtensors_and_mixed_devices(kernels_cpu):
    class Sub(torch.Tensor):
        pass

    assert triton_kernels.use(torch.randn(2))
    assert not triton_kernels.use(torch.randn(2).as_subclass(Sub))
    assert not triton_kernels.use(torch.randn(2), torch.empty(2, device="meta"))
    assert not triton_kernels.use(None)


def test_missing_triton_on_cuda_warns_once(env_guard, monkeypatch):
    """Asked for where triton does not import, CUDA tensors take torch's ops, said once."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setenv(dispatch.ENV_SWITCH, "1")
    dispatch.reset()
    try:
        assert not dispatch.enabled() and "triton does not import" in dispatch.reason()
        # no CUDA tensor here: the CUDA branch of `use` directly
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not dispatch._on_cuda()
            assert not dispatch._on_cuda()
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "Triton kernels unavailable" in msgs[0] and "torch's ops" in msgs[0]
    finally:
        dispatch.reset()


def test_torch_path_is_unchanged_on_cpu(env_guard, monkeypatch):
    """Dispatch off (CPU default): a block computes exactly the pre-kernel formula, and the
    norm's residual form is exactly (x + r, norm(x + r))."""
    monkeypatch.delenv(dispatch.CPU_TEST_SWITCH, raising=False)
    dispatch.reset()
    torch.manual_seed(0)
    block = TableBlock(ModelConfig(**SMALL)).eval()
    x = torch.randn(2, 7, 5, SMALL["d_model"])
    kv_mask = torch.ones(2, 4, dtype=torch.bool)
    kv_mask[1, 3] = False
    out = block(x, None, 4, kv_mask)
    y = x + block.drop(block.col_attn(block.norm_col(x), None))
    y = y + block.drop(block.row_attn(block.norm_row(y), 4, kv_mask, None))
    y = y + block.drop(block.mlp.fc2(F.gelu(block.mlp.fc1(block.norm_mlp(y)), approximate="tanh")))
    assert torch.equal(out, y)
    norm = BlockNorm(SMALL["d_model"], eps=1e-5)
    r = torch.randn_like(x)
    s, n = norm(x, r)
    assert torch.equal(s, x + r) and torch.equal(n, torch.nn.RMSNorm.forward(norm, x + r))
    dispatch.reset()


# ---------------------------------------------------------------------------------------- CUDA (skipped here)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_torch(kernels_cuda, dtype):
    """The compiled kernels on the GPU: fp32 as above; bf16 storage within bf16 rounding."""
    if dtype == torch.float32:
        _check_norm(kernels_cuda["norm"], (4099, 192), True, 1e-5, device="cuda")
        _check_norm(kernels_cuda["norm"], (1, 130), False, None, device="cuda")
        _check_gelu(kernels_cuda["gelu"], (1025, 384), True, "tanh", device="cuda")
        _check_gelu(kernels_cuda["gelu"], (3, 7), False, "none", device="cuda")
        return
    x = torch.randn(2048, 128, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(128, device="cuda", dtype=dtype)
    s, y = kernels_cuda["norm"].add_rms_norm(x, r, w, 1e-5)
    s_ref, y_ref = _ref_add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
    torch.testing.assert_close(s.float(), s_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    h = torch.randn(2048, 256, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels_cuda["gelu"].bias_gelu(h).float(), F.gelu(h.float(), approximate="tanh"),
                               rtol=1e-2, atol=1e-2)


def test_cuda_model_uses_kernels_and_matches(kernels_cuda):
    torch.manual_seed(0)
    model = TabFM(ModelConfig(**SMALL)).cuda().train()
    batch = make_batch(pad_rows=3, pad_cols=1).to("cuda")
    assert triton_kernels.use(batch.x)
    torch.manual_seed(1)
    _, loss_k, grads_k = _step(model, batch)
    os.environ[dispatch.ENV_SWITCH] = "0"
    dispatch.reset()
    try:
        torch.manual_seed(1)
        _, loss_t, grads_t = _step(model, batch)
    finally:
        os.environ[dispatch.ENV_SWITCH] = "1"
        dispatch.reset()
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-4, atol=1e-4)
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-3, atol=1e-4, msg=name)
