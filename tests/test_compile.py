"""`tabfm pretrain --compile`: every block compiled in place, the model otherwise the same.

The unit test uses dynamo's "eager" backend (the graphs captured and run by torch's own ops,
so outputs equal the uncompiled model's exactly, in seconds); the end-to-end test runs the
real command with inductor, against the same run uncompiled.
"""
from __future__ import annotations

import json

import pytest
import torch

from tabfm import cli
from tabfm.model import ModelConfig, TabFM
from tabfm.parallel import ParallelPlan, compile_blocks
from tabfm.synth import StreamConfig
from tabfm.synth.dataset import SynthDataset


def test_compile_blocks_keeps_the_model_and_its_answers():
    torch.manual_seed(0)
    model = TabFM(ModelConfig.preset("tiny", n_layers=2, d_model=32, n_heads=2))
    batch = next(iter(SynthDataset(StreamConfig.preset("tiny"), seed=0)))
    keys = list(model.state_dict())
    model.eval()
    with torch.no_grad():
        before = model(batch).cat_logits
    assert compile_blocks(model, model.parallel_plan(), backend="eager") == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == keys  # checkpoints and exports name the same tensors
    assert all(model.get_submodule(f"blocks.{i}")._compiled_call_impl is not None for i in range(2))
    with torch.no_grad():
        after = model(batch).cat_logits
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="names no blocks"):
        compile_blocks(model, ParallelPlan())


@pytest.mark.parametrize("flags, reason", [
    (["--plugin", "gemini"], "--compile is not offered with --plugin gemini"),
    (["--plugin", "hybrid", "--tp", "2"], "--compile with --tp 2: inductor fails"),
    (["--plugin", "hybrid", "--pp", "2", "--microbatches", "2"], "--compile with --pp"),
    (["--plugin", "hybrid", "--ep", "2", "--moe-experts", "4"], "--compile with --ep 2"),
])
def test_compile_is_refused_where_it_cannot_run(capsys, flags, reason):
    assert cli.main(["pretrain", "--preset", "smoke", "--compile", *flags, "--out", "unused"]) == 2
    assert reason in capsys.readouterr().err


@pytest.mark.slow
def test_pretrain_compile_trains_like_the_eager_run(tmp_path):
    flags = ["pretrain", "--preset", "smoke", "--steps", "3", "--eval-batches", "0", "--no-sklearn-eval",
             "--threads", "1", "--log-every", "1"]
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        assert cli.main([*flags, "--out", str(tmp_path / name), *extra]) == 0
    losses = {name: [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                     if r["kind"] == "train"] for name in ("eager", "compiled")}
    assert len(losses["eager"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)
    assert (tmp_path / "compiled" / "export" / "model.safetensors").exists()
