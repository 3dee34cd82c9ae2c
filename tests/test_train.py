"""Pretraining: the loss falls, a crashed run resumes to the uninterrupted result, CLI and config errors."""
import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tabfm.synth.stream import StreamConfig
from tabfm.cli import main
from tabfm.model import ModelConfig, TabFM
from tabfm.train import PretrainConfig, build_optimizer, warmup_cosine
from tabfm.train.evaluate import synthetic_eval
from tabfm.train.pretrain import pretrain
from tabfm.train.trainer import Trainer


def smoke(**kw) -> PretrainConfig:
    return PretrainConfig.preset("smoke", **kw)


def params(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "export" / "model.safetensors"))


def test_warmup_cosine_by_hand():
    f = warmup_cosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert f(0) == pytest.approx(0.25) and f(3) == pytest.approx(1.0)
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_short_pretraining_lowers_held_out_loss(tmp_path):
    # measured held-out loss 2.009 -> 1.517 after 20 steps (60 steps: 1.479): 20 show the fall as well
    cfg = smoke(steps=20, lr=3e-3, warmup_steps=5, eval_every=20, ckpt_every=20)
    torch.manual_seed(cfg.seed)
    initial = TabFM(ModelConfig.preset(cfg.model))  # the same initialisation pretrain() starts from
    held_out = synthetic_eval(StreamConfig.preset(cfg.stream), cfg.seed, n_batches=6)
    before = held_out(initial.eval())["loss"]
    result = pretrain(cfg, tmp_path, progress=False)
    trained = TabFM(ModelConfig.preset(cfg.model))
    trained.load_state_dict(params(tmp_path))
    after = held_out(trained.eval())["loss"]
    assert result.step == 20 and result.stopped == "steps"
    assert after < before - 0.1, (before, after)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "eval"}
    assert all(math.isfinite(r["loss"]) for r in records if r["kind"] == "train")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_crashed_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, optimizer):
    cfg = smoke(steps=4, ckpt_every=2, eval_every=100, eval_batches=0, optimizer=optimizer)
    pretrain(cfg, tmp_path / "straight", progress=False)

    save = Trainer.save

    def crash_after_first_checkpoint(self):
        path = save(self)
        if self.step == 2:
            raise KeyboardInterrupt("simulated kill right after the step-2 checkpoint")
        return path

    monkeypatch.setattr(Trainer, "save", crash_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(Trainer, "save", save)
    result = pretrain(cfg, tmp_path / "resumed", progress=False)
    assert result.step == 4
    a, b = params(tmp_path / "straight"), params(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_refuses_a_different_run(tmp_path):
    pretrain(smoke(steps=2, eval_batches=0), tmp_path, progress=False)
    with pytest.raises(ValueError, match="seed=0, this one has seed=1"):
        pretrain(smoke(steps=2, eval_batches=0, seed=1), tmp_path, progress=False)


def test_init_warm_starts_from_an_export_and_refuses_another_model(tmp_path):
    first = pretrain(smoke(steps=3, eval_batches=0), tmp_path / "a", progress=False)
    # zero steps of training after the warm start: the weights must be exactly the init's
    cfg = smoke(steps=1, eval_batches=0, lr=1e-12, warmup_steps=0, init=str(first.export))
    pretrain(cfg, tmp_path / "b", progress=False)
    a, b = params(tmp_path / "a"), params(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    fresh = params_of(TabFM(ModelConfig.preset("tiny")))
    assert any(not torch.allclose(a[k], fresh[k]) for k in a)  # the init really differs from a fresh model
    with pytest.raises(ValueError, match="model config differs"):
        pretrain(smoke(steps=1, eval_batches=0, model="small", init=str(first.export)), tmp_path / "c", progress=False)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_muon_optimizer_steps_all_parameters():
    model = TabFM(ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2))
    opt = build_optimizer(model, "muon", lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(4, 10))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert opt.param_groups[0]["lr"] != opt.param_groups[0]["initial_lr"]  # the scheduler drives every group
    assert len({g["lr"] / g["initial_lr"] for g in opt.param_groups}) == 1


class _Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(3, 2)
        self.ref_proj = torch.nn.Linear(3, 2)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_lr_scale_steps_matching_parameters_at_the_factor_times_the_rate(name):
    """Adam's first step moves every weight by lr (m / sqrt(v) = sign(grad), no decay on biases):
    the parameters a fragment names move by factor x lr, the others by lr, and the schedule keeps
    the ratio."""
    torch.manual_seed(0)
    model = _Named()
    opt = build_optimizer(model, name, lr=1e-3, weight_decay=0.0, lr_scale={"ref_": 10})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(0, 10))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    step = {n: (before[n] - p.detach()).abs() for n, p in model.named_parameters()}
    assert torch.allclose(step["base.weight"], torch.full((2, 3), 1e-3), rtol=1e-4)
    assert torch.allclose(step["ref_proj.weight"], torch.full((2, 3), 1e-2), rtol=1e-4)
    assert torch.allclose(step["ref_proj.bias"], torch.full((2,), 1e-2), rtol=1e-4)
    ratio = sorted(g["lr"] / opt.param_groups[0]["lr"] for g in opt.param_groups)
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="'refs_' is in no trainable parameter"):
        build_optimizer(model, name, lr_scale={"refs_": 10})
    with pytest.raises(ValueError, match=r"lr_scale\['ref_'\] = 0"):
        build_optimizer(model, name, lr_scale={"ref_": 0})


def test_cli_lr_scale_is_recorded_and_a_resume_with_another_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["pretrain", "--preset", "smoke", "--steps", "2", "--eval-every", "2", "--out", str(out), "--quiet"]
    assert main(base + ["--lr-scale", "encoder.=3", "--lr-scale", "blocks.0.=0.5"]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["lr_scale"] == {"encoder.": 3.0, "blocks.0.": 0.5}
    assert main(base + ["--steps", "3"]) == 2  # resuming without the factors: other optimizer groups
    assert "lr_scale" in capsys.readouterr().err
    assert main(base + ["--lr-scale", "encoder.:3"]) == 2
    assert "FRAGMENT=FACTOR" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("steps", 0), ("optimizer", "sgd"), ("precision", "fp8"), ("clip", 0.0), ("min_lr_ratio", 2.0),
                                          ("lr_scale", {"encoder.": -1.0})])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"PretrainConfig.{field}"):
        smoke(**{field: value})


def test_cli_pretrain_writes_an_export(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pretrain", "--preset", "smoke", "--steps", "3", "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["format"] == "tabfm.model" and config["model"] == ModelConfig.preset("tiny").to_dict()
    assert "export" in capsys.readouterr().out
    assert main(["pretrain", "--preset", "smoke", "--steps", "0", "--out", str(out), "--quiet"]) == 2


def test_cli_pretrain_packs_cells_into_tokens_and_exports_a_loadable_model(tmp_path):
    """--cells-per-token 3: the export says so, estimators load it, and resuming with another value
    is refused (the weights would not fit)."""
    from sklearn.datasets import load_iris

    from tabfm.estimators import TabFMClassifier

    out = tmp_path / "run"
    assert main(["pretrain", "--preset", "smoke", "--steps", "2", "--cells-per-token", "3", "--out", str(out),
                 "--quiet", "--no-sklearn-eval"]) == 0
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["model"] == ModelConfig.preset("tiny", cells_per_token=3).to_dict()
    X, y = load_iris(return_X_y=True)
    proba = TabFMClassifier(model=str(out / "export"), n_estimators=1).fit(X[::2], y[::2]).predict_proba(X[1::2])
    assert proba.shape == (75, 3) and np.allclose(proba.sum(1), 1)
    with pytest.raises(ValueError, match="cells_per_token=3, this one has cells_per_token=1"):
        pretrain(smoke(steps=3, eval_batches=0), out, progress=False)


def test_muon_adamw_equals_torch_muon_plus_adamw():
    """MuonAdamW with bf16 Newton-Schulz steps exactly as torch.optim.Muon (hidden matrices) +
    AdamW (the rest) stepped in turn; its state dict has torch's layout."""
    import copy

    from tabfm.train.optim import _groups

    torch.manual_seed(0)
    ours = TabFM(ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2))
    ref = copy.deepcopy(ours)
    opt = build_optimizer(ours, "muon", lr=1e-3, muon_lr=0.02)
    for group in opt.param_groups:
        group["ns_dtype"] = "bfloat16"
    named = list(ref.named_parameters())
    hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
    rest = [(n, p) for n, p in named if all(p is not h for h in hidden)]
    torch_opts = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                  torch.optim.AdamW(_groups(rest, 0.01), lr=1e-3, betas=(0.9, 0.95))]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours.parameters(), ref.parameters()):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        for o in torch_opts:
            o.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups"} and any(g["muon"] for g in state["param_groups"])


def test_the_log_shows_the_share_of_time_spent_waiting_for_data(tmp_path, monkeypatch, capsys):
    """`data N%` in the log (and `data_wait` in metrics.jsonl): the share of the window's wall time
    spent waiting for the next batch. A loader that sleeps before each batch shows as waiting;
    the same run without the sleep waits less."""
    import time

    from tabfm.synth.dataset import SynthLoader
    import tabfm.train.pretrain as pretrain_module

    class SlowLoader(SynthLoader):
        def __iter__(self):
            for batch in super().__iter__():
                time.sleep(1.0)  # longer than a smoke step, even on a loaded machine
                yield batch

    def waits(out, loader) -> list[float]:
        monkeypatch.setattr(pretrain_module, "SynthLoader", loader)
        pretrain(smoke(steps=4, log_every=2, eval_batches=0, ckpt_every=100), out, progress=False)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["data_wait"] for r in records if r["kind"] == "train"]

    slow, plain = waits(tmp_path / "slow", SlowLoader), waits(tmp_path / "plain", SynthLoader)
    assert len(slow) == len(plain) == 2 and all(0.0 <= w <= 1.0 for w in slow + plain)
    assert min(slow) > 0.3 and min(slow) > max(plain), (slow, plain)
    main(["pretrain", "--preset", "smoke", "--steps", "2", "--log-every", "1", "--no-progress",
          "--out", str(tmp_path / "cli")])
    assert re.search(r"step 2/2 .* data \d+%", capsys.readouterr().out)
