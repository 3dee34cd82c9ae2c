"""Depth growth (tabfm.model.growth): a deeper model that starts as the trained shallower one."""
from __future__ import annotations

import json

import pytest
import torch

from tabfm.parallel.export import export_model
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.model.growth import RESIDUAL_OUTPUTS, grow_depth, source_blocks
from tabfm.train import PretrainConfig
from tabfm.train.config import run_model_config
from tabfm.train.pretrain import export_config, pretrain, warm_start
from tests.test_model import SMALL, make_batch

torch.set_num_threads(1)


def trained(n_layers: int = 2) -> TabFM:
    """A small model whose residual outputs are all non-zero (as after training)."""
    torch.manual_seed(0)
    return TabFM(ModelConfig(**{**SMALL, "n_layers": n_layers})).eval()


def test_source_blocks_repeat_each_block_in_place():
    assert source_blocks(2, 4) == [0, 0, 1, 1]
    assert source_blocks(2, 5) == [0, 0, 0, 1, 1]
    assert source_blocks(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="old layers <= new layers"):
        source_blocks(4, 2)


@pytest.mark.parametrize("new_layers", [2, 4, 5])
def test_grown_model_computes_the_same_function(new_layers):
    small = trained(2)
    state = grow_depth(small.state_dict(), 2, new_layers)
    deep = TabFM(ModelConfig(**{**SMALL, "n_layers": new_layers})).eval()
    deep.load_state_dict(state, strict=True)
    batch = make_batch(seed=3)
    with torch.no_grad():
        a, b = small(batch), deep(batch)
    assert torch.equal(a.index, b.index)
    torch.testing.assert_close(b.cat_logits, a.cat_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.num_logits, a.num_logits, rtol=0, atol=1e-5)
    # the repeats really are repeats: same inner weights, zero residual outputs
    if new_layers == 4:
        assert torch.equal(state["blocks.1.mlp.fc1.weight"], small.state_dict()["blocks.0.mlp.fc1.weight"])
        outputs = [k for k in RESIDUAL_OUTPUTS if f"blocks.1.{k}" in state]  # dense: no MoE experts' w2
        assert len(outputs) == 3
        assert all(state[f"blocks.1.{k}"].abs().sum() == 0 for k in outputs)
        assert all(state[f"blocks.2.{k}"].abs().sum() > 0 for k in outputs)


def test_repeated_blocks_learn():
    """The zeroed outputs get gradients, and after they move the inner weights do too."""
    deep = TabFM(ModelConfig(**{**SMALL, "n_layers": 4}))
    deep.load_state_dict(grow_depth(trained(2).state_dict(), 2, 4))
    opt = torch.optim.AdamW(deep.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in deep.state_dict().items()}
    for step in range(2):
        opt.zero_grad()
        batch = make_batch(seed=step)
        masked_cell_loss(deep(batch), batch)[0].backward()
        opt.step()
    after = deep.state_dict()
    for name in (*RESIDUAL_OUTPUTS[:3], "mlp.fc1.weight", "row_attn.qkv.weight"):  # [:3]: dense (no MoE w2)
        assert not torch.equal(after[f"blocks.1.{name}"], before[f"blocks.1.{name}"]), name


def test_warm_start_grows_an_export_and_refuses_a_shallower_run(tmp_path):
    small = trained(2)
    export_model(small, tmp_path / "two", {"model": small.config.to_dict()})
    deep = TabFM(ModelConfig(**{**SMALL, "n_layers": 3})).eval()
    warm_start(deep, str(tmp_path / "two"))
    batch = make_batch(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(deep(batch).cat_logits, small(batch).cat_logits, rtol=0, atol=1e-5)
    shallow = TabFM(ModelConfig(**{**SMALL, "n_layers": 1}))
    with pytest.raises(ValueError, match="only a deeper run"):
        warm_start(shallow, str(tmp_path / "two"))
    wider = TabFM(ModelConfig(**{**SMALL, "n_layers": 3, "d_model": 64}))
    with pytest.raises(ValueError, match="d_model"):
        warm_start(wider, str(tmp_path / "two"))


def test_pretrain_n_layers_runs_a_deeper_model_and_resumes_only_with_it(tmp_path):
    first = pretrain(PretrainConfig.preset("smoke", steps=2, eval_batches=0, eval_sklearn=False), tmp_path / "a",
                     progress=False)
    cfg = PretrainConfig.preset("smoke", steps=2, eval_batches=0, eval_sklearn=False, n_layers=6,
                                init=str(first.export))
    pretrain(cfg, tmp_path / "b", progress=False)
    header = json.loads((tmp_path / "b" / "export" / "config.json").read_text())
    assert header["model"]["n_layers"] == 6 and header["train"]["n_layers"] == 6
    with pytest.raises(ValueError, match="n_layers"):
        pretrain(cfg.replace(n_layers=8, steps=3), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="n_layers"):
        PretrainConfig(n_layers=0)


def test_run_model_config_reads_old_and_new_train_configs():
    assert run_model_config({"model": "tiny"}) == ModelConfig.preset("tiny")
    assert run_model_config({"model": "tiny", "n_layers": 6, "cells_per_token": 2}).n_layers == 6
    assert run_model_config(PretrainConfig(n_layers=5)).n_layers == 5
    assert export_config(run_model_config(PretrainConfig(n_layers=5)), PretrainConfig(n_layers=5))["model"]["n_layers"] == 5


def test_warm_start_packs_cells_of_a_g1_export(tmp_path):
    """A G = 3 run starts from G = 1 weights: everything but the grouper is copied, and where each
    token holds one cell (one-column tables) it computes exactly the G = 1 function."""
    small = trained(2)
    export_model(small, tmp_path / "g1", {"model": small.config.to_dict()})
    grouped = TabFM(ModelConfig(**{**SMALL, "cells_per_token": 3})).eval()
    warm_start(grouped, str(tmp_path / "g1"))
    theirs = small.state_dict()
    for name, value in grouped.state_dict().items():
        if not name.startswith("grouper."):
            assert torch.equal(value, theirs[name]), name
    one_column = make_batch(seed=6)  # column 0 (numeric) alone; the others are padding
    one_column.col_valid[:, 1:] = False
    one_column.kind[:, 1:] = 0
    one_column.cardinality[:, 1:] = 0
    one_column.query &= one_column.col_valid[:, None, :]
    one_column.validate()
    with torch.no_grad():
        a, b = small(one_column), grouped(one_column)
    assert torch.equal(a.index, b.index)
    torch.testing.assert_close(b.num_logits, a.num_logits, rtol=0, atol=1e-5)
    wide = make_batch(c=5, seed=6)  # tokens of 3 cells: a different function, but a finite one
    with torch.no_grad():
        assert torch.isfinite(grouped(wide).num_logits).all()
    export_model(grouped, tmp_path / "g3", {"model": grouped.config.to_dict()})
    with pytest.raises(ValueError, match="cells_per_token"):  # G = 3 -> 1 is not a growth
        warm_start(TabFM(ModelConfig(**SMALL)), str(tmp_path / "g3"))


def test_warm_start_adds_context_refs_that_start_as_a_no_op(tmp_path):
    """A context_refs run from weights without them: every weight copied, the reference projections
    zero, so it computes exactly the init's function on a batch whose columns carry references."""
    from tests.test_model import with_refs

    base = TabFM(ModelConfig(**SMALL, context_features="knn-linear")).eval()
    export_model(base, tmp_path / "base", {"model": base.config.to_dict()})
    refs = TabFM(ModelConfig(**SMALL, context_features="knn-linear", context_refs=True)).eval()
    torch.nn.init.normal_(refs.encoder.ref_code.weight)  # whatever it held, the warm start zeroes it
    warm_start(refs, str(tmp_path / "base"))
    assert all(float(p.abs().max()) == 0.0 for n, p in refs.encoder.named_parameters() if n.startswith("ref_"))
    batch = with_refs(make_batch(c=6, seed=4))
    with torch.no_grad():
        a, b = base(batch), refs(batch)
    assert torch.equal(a.num_logits, b.num_logits) and torch.equal(a.cat_logits, b.cat_logits)
    export_model(refs, tmp_path / "refs", {"model": refs.config.to_dict()})
    with pytest.raises(ValueError, match="context_refs"):  # dropping them is not a growth
        warm_start(TabFM(ModelConfig(**SMALL, context_features="knn-linear")), str(tmp_path / "refs"))
