"""Booster + SingleProcessPlugin: the training loop against the engine equals plain torch."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from tabfm.parallel import Booster, MixedPrecision, ModelWrapper, Plugin, SingleProcessPlugin


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def make_data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)).sin()
    return x, y


def params_of(model: nn.Module) -> list[torch.Tensor]:
    module = model.unwrap() if isinstance(model, ModelWrapper) else model
    return [p.detach().clone() for p in module.parameters()]


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    # AdamW for exactness; SGD for closeness (Adam turns tiny grad differences into +-lr steps)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def plain_torch_run(steps: int, clip: float | None = 1.0, opt: str = "adamw") -> tuple[list[torch.Tensor], list[float]]:
    model = make_mlp()
    opt = make_optimizer(model, opt)
    x, y = make_data()
    norms = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return params_of(model), norms


def booster_run(steps: int, precision: "str | MixedPrecision" = "fp32", clip: float | None = 1.0,
                inject_inf_at: int | None = None, opt: str = "adamw"):
    booster = Booster(plugin=SingleProcessPlugin(device="cpu"), precision=precision)
    model = make_mlp()
    opt = make_optimizer(model, opt)
    model, opt, criterion, _, _ = booster.boost(model, opt, nn.functional.mse_loss)
    x, y = make_data()
    skipped, norms = [], []
    for step in range(steps):
        loss = criterion(model(x), y)
        booster.backward(loss, opt)
        if step == inject_inf_at:
            next(model.unwrap().parameters()).grad[0, 0] = float("inf")
        if clip is not None:
            norms.append(float(booster.clip_grad_norm_(opt, clip)))
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last_step_skipped)
    return params_of(model), norms, skipped, opt


def test_loss_falls():
    booster = Booster(SingleProcessPlugin("cpu"))
    model = make_mlp()
    model, opt, crit, _, _ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.mse_loss)
    x, y = make_data()
    losses = []
    for _ in range(60):
        loss = crit(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_fp32_booster_equals_plain_torch_bitwise():
    ref_params, ref_norms = plain_torch_run(12)
    params, norms, skipped, _ = booster_run(12, "fp32")
    assert not any(skipped)
    assert norms == ref_norms
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)


def test_bf16_runs_close_to_fp32_and_really_autocasts():
    ref_params, _ = plain_torch_run(12, opt="sgd")
    params, _, skipped, _ = booster_run(12, "bf16", opt="sgd")
    assert not any(skipped)
    for a, b in zip(params, ref_params):
        assert a.dtype == torch.float32  # master weights stay fp32
        torch.testing.assert_close(a, b, atol=5e-3, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(params, ref_params))  # bf16 did change the math

    seen = []
    booster = Booster(SingleProcessPlugin("cpu", precision="bf16"))
    model, *_ = booster.boost(make_mlp())
    model.unwrap()[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(make_data()[0])
    assert seen == [torch.bfloat16] and out.dtype == torch.float32


def test_fp16_matches_fp32_closely():
    ref_params, ref_norms = plain_torch_run(12, opt="sgd")
    params, norms, skipped, opt = booster_run(12, "fp16", opt="sgd")
    assert not any(skipped)
    assert opt.loss_scale == 2.0**16
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-2, atol=1e-3)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_fp16_skips_step_on_injected_inf():
    ref_params, _ = plain_torch_run(5, opt="sgd")
    params, norms, skipped, opt = booster_run(6, "fp16", inject_inf_at=2, opt="sgd")
    assert skipped == [False, False, True, False, False, False]
    assert norms[2] == float("inf")
    assert opt.loss_scale == 2.0**15  # backed off once
    # the skipped step changed nothing: 6 steps with one skipped == 5 clean steps
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_fp16_real_overflow_backs_off_until_finite():
    """An absurd initial scale overflows fp16 activations' grads; the scaler backs off."""
    precision = MixedPrecision("fp16", init_scale=2.0**30, growth_interval=1000)
    _, _, skipped, opt = booster_run(30, precision, clip=None)
    assert skipped[0] and not skipped[-1]
    n_skipped = sum(skipped)
    assert skipped == [True] * n_skipped + [False] * (30 - n_skipped)
    assert 3 < n_skipped < 30 and opt.loss_scale == 2.0 ** (30 - n_skipped)


def test_no_sync_accumulation_equals_big_batch():
    x, y = make_data(64)
    results = []
    for micro in (1, 4):
        booster = Booster(SingleProcessPlugin("cpu"))
        model = make_mlp()
        model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            chunks = list(zip(x.chunk(micro), y.chunk(micro)))
            for i, (xb, yb) in enumerate(chunks):
                ctx = booster.no_sync(model, opt) if i < len(chunks) - 1 else contextlib.nullcontext()
                with ctx:
                    booster.backward(nn.functional.mse_loss(model(xb), yb) / micro, opt)
            opt.step()
            opt.zero_grad()
        results.append(params_of(model))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type):
    x, y = make_data()
    ref = make_mlp()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)

    booster = Booster(SingleProcessPlugin("cpu"))
    model = make_mlp()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    booster.backward(nn.functional.mse_loss(model(x), y), opt)
    norm = booster.clip_grad_norm_(opt, 0.05, norm_type=norm_type)
    assert torch.equal(norm, ref_norm)
    assert ref_norm > 0.05  # clipping actually happened
    for p, q in zip(model.unwrap().parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_boost_contract():
    module = make_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    booster = Booster()
    model, wopt, crit, loader, sched = booster.boost(module, opt)
    assert model.unwrap() is module and wopt.unwrap() is opt and wopt.param_groups is opt.param_groups
    assert crit is None and loader is None and sched is None
    with pytest.raises(ValueError, match="already boosted"):
        booster.boost(model)
    assert isinstance(booster.plugin, Plugin) and booster.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_precision_given_twice_conflict_and_invalid():
    with pytest.raises(ValueError, match="precision given twice"):
        Booster(SingleProcessPlugin("cpu", precision="bf16"), precision="fp16")
    assert Booster(SingleProcessPlugin("cpu", precision="bf16"), precision="bf16").precision.dtype == "bf16"
    with pytest.raises(ValueError, match="not one of"):
        Booster(precision="fp8")


class Blocks(nn.Module):
    """Two blocks and a ParallelPlan naming them: what the block options act on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def parallel_plan(self):
        from tabfm.parallel import ParallelPlan

        return ParallelPlan(blocks=["blocks.0", "blocks.1"])


def test_block_options_reach_the_blocks_through_boost():
    """Booster(activation_checkpointing=True): the plugin recomputes every planned block in
    backward (its forward runs twice) with the same gradients; a model without a plan is refused."""
    x = torch.randn(3, 4)
    grads = []
    for ac in (False, True):
        module, calls = Blocks(), []
        module.blocks[1].register_forward_pre_hook(lambda m, a: calls.append(1))
        model, *_ = Booster(SingleProcessPlugin("cpu"), activation_checkpointing=ac).boost(module)
        model(x).square().sum().backward()
        assert len(calls) == (2 if ac else 1)
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="declares no parallel_plan"):
        Booster(SingleProcessPlugin("cpu"), compile=True).boost(make_mlp())


def test_gemini_refuses_the_block_options():
    from tabfm.parallel import GeminiPlugin

    with pytest.raises(ValueError, match="GeminiPlugin .* recomputed in backward"):
        Booster(GeminiPlugin(device="cpu"), activation_checkpointing=True)


def test_execute_pipeline_not_supported():
    booster = Booster(SingleProcessPlugin("cpu"))
    with pytest.raises(TypeError, match="does not run pipeline parallelism"):
        booster.execute_pipeline(iter([]), None, None)


def test_prepare_dataloader_seeded_and_complete():
    data = torch.utils.data.TensorDataset(torch.arange(20.0))
    booster = Booster(SingleProcessPlugin("cpu"))

    def order(seed, epoch):
        loader = booster.prepare_dataloader(data, batch_size=6, shuffle=True, seed=seed)
        loader.sampler.set_epoch(epoch)
        return torch.cat([b[0] for b in loader]).tolist()

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(3, 1) and order(3, 0) != order(4, 0)
    assert sorted(order(3, 0)) == list(range(20))


def test_fp16_scaler_state_in_optimizer_state_dict():
    *_, opt = booster_run(2, "fp16", inject_inf_at=0)
    state = opt.state_dict()
    assert state["loss_scaler"] == {"scale": 2.0**15, "good_steps": 1}
    *_, fresh = booster_run(0, "fp16")
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.loss_scale == 2.0**15 and fresh.scaler.good_steps == 1
