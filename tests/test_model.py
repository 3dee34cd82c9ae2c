"""Tests of the table transformer (tabfm/model): invariances, masking, loss, heads, plan, config."""
from __future__ import annotations

import fnmatch
import math

import pytest
import torch

from tabfm.data.batch import TableBatch
from tabfm.parallel.plan import ParallelPlan
from tabfm.model import BarDistribution, ModelConfig, ModelOutput, TabFM, masked_cell_loss
from tabfm.model import predict as P
from tabfm.model.attention import RowAttention, RowKeys
from tabfm.model.encoder import ContextStatistics, hash_normal, squash

torch.set_num_threads(1)  # small tensors; avoids thread contention on shared 2-core machines

SMALL = dict(d_model=32, n_layers=2, n_heads=4, id_dim=16, n_bins=32, n_thinking_rows=2)


def make_batch(b=2, r=14, c=5, n_ctx=9, seed=0, pad_rows=0, pad_cols=0) -> TableBatch:
    """Random mixed-type tables; context = first n_ctx rows; queries = last column of the
    other rows plus ~15% random cells (some in context rows, as in imputation)."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.where(torch.rand(b, c, generator=g) < 0.4, 2, 1).to(torch.int8)
    kind[:, 0], kind[:, 1] = 1, 2
    card = torch.where(kind == 2, torch.randint(2, 6, (b, c), generator=g), 0)
    x = torch.randn(b, r, c, generator=g) * 3 + 1
    x = torch.where(kind[:, None, :] == 2, (torch.rand(b, r, c, generator=g) * card[:, None, :]).floor(), x)
    x[torch.rand(b, r, c, generator=g) < 0.1] = float("nan")
    row_valid = torch.ones(b, r, dtype=torch.bool)
    col_valid = torch.ones(b, c, dtype=torch.bool)
    if pad_rows:
        row_valid[-1, r - pad_rows :] = False
    if pad_cols:
        col_valid[-1, c - pad_cols :] = False
        kind[-1, c - pad_cols :] = 0
        card[-1, c - pad_cols :] = 0
    context = torch.zeros(b, r, dtype=torch.bool)
    context[:, :n_ctx] = True
    context &= row_valid
    query = torch.zeros(b, r, c, dtype=torch.bool)
    query[:, n_ctx:, 0] = True
    query |= torch.rand(b, r, c, generator=g) < 0.15
    query &= row_valid[:, :, None] & col_valid[:, None, :]
    return TableBatch(x, kind, card.long(), row_valid, col_valid, context, query).validate()


def clone(batch: TableBatch) -> TableBatch:
    return TableBatch(**{k: v.clone() for k, v in vars(batch).items()})


def model(seed: int = 0, **overrides) -> TabFM:
    torch.manual_seed(seed)
    return TabFM(ModelConfig(**{**SMALL, **overrides})).eval()


def by_cell(out: ModelOutput) -> dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]:
    return {tuple(i.tolist()): (out.cat_logits[n], out.num_logits[n]) for n, i in enumerate(out.index)}


def assert_same_cells(a: ModelOutput, b: ModelOutput, cells=None, atol=0.0) -> None:
    da, db = by_cell(a), by_cell(b)
    for cell in cells if cells is not None else da:
        for x, y in zip(da[cell], db[cell]):
            torch.testing.assert_close(x, y, atol=atol, rtol=0.0, msg=f"cell {cell}")


def max_diff(a: ModelOutput, b: ModelOutput) -> float:
    da, db = by_cell(a), by_cell(b)
    return max(float((x - y).detach().nan_to_num(0, 0, 0).abs().max()) for cell in da for x, y in zip(da[cell], db[cell]))


@pytest.fixture(params=[1, 3], ids=["cell-tokens", "3-cells-per-token"])
def G(request) -> int:
    """ModelConfig.cells_per_token: every invariance must hold with cells packed into tokens too."""
    return request.param


# ------------------------------------------------------------------------- masking
@torch.no_grad()
def test_query_values_never_reach_the_forward_pass(G):
    m, batch = model(cells_per_token=G), make_batch()
    out = m(batch)
    other = clone(batch)
    other.x[batch.query] = torch.randn(int(batch.query.sum())) * 100  # hidden values changed
    assert_same_cells(out, m(other))
    # sanity: changing one visible context cell does change predictions
    visible = clone(batch)
    visible.x[0, 0, 0] = 1e3
    assert max_diff(out, m(visible)) > 1e-3


def test_query_values_never_reach_the_forward_pass_in_train_mode(G):
    m, batch = model(cells_per_token=G).train(), make_batch()
    torch.manual_seed(5)
    out = m(batch)
    other = clone(batch)
    other.x[batch.query] = 1e6
    torch.manual_seed(5)
    assert_same_cells(out, m(other))


def test_non_context_rows_do_not_influence_other_rows(G):
    m, batch = model(cells_per_token=G), make_batch()
    out = m(batch)
    row = 11  # a non-context row (context = rows 0..8)
    other = clone(batch)
    other.x[:, row, 1:] = torch.where(other.kind[:, 1:] == 2, 0.0, 77.0)  # all its visible cells
    out2 = m(other)
    cells = [c for c in by_cell(out) if c[1] != row]
    assert_same_cells(out, out2, cells)
    own = [c for c in by_cell(out) if c[1] == row]
    assert own and max(float((by_cell(out)[c][1] - by_cell(out2)[c][1]).detach().abs().max()) for c in own) > 1e-4


def test_padding_changes_nothing(G):
    m = model(cells_per_token=G)
    full = make_batch(b=2, r=14, c=5)
    # table 1 of `padded` = table 1 of `full` restricted to 7 rows x 3 columns, then padded with garbage
    r_keep, c_keep = 7, 4  # fewer context rows than table 0 (9): key masks differ per table; 4 columns: a
    # token of 3 cells then holds valid and padding cells
    padded = clone(full)
    padded.row_valid[1, r_keep:] = False
    padded.context[1, r_keep:] = False
    padded.col_valid[1, c_keep:] = False
    padded.kind[1, c_keep:] = 0
    padded.cardinality[1, c_keep:] = 0
    padded.query[1, r_keep:] = False
    padded.query[1, :, c_keep:] = False
    padded.x[1, r_keep:] = 1e30
    padded.x[1, :, c_keep:] = float("nan")
    padded.validate()
    ref = TableBatch.from_table(
        full.x[1, :r_keep, :c_keep], full.kind[1, :c_keep], full.cardinality[1, :c_keep],
        full.context[1, :r_keep], full.query[1, :r_keep, :c_keep],
    )
    out, out_ref = m(padded), m(ref)
    got = {(r, c): v for (b, r, c), v in by_cell(out).items() if b == 1}
    want = {(r, c): v for (_, r, c), v in by_cell(out_ref).items()}
    assert got.keys() == want.keys() and got
    for cell in want:
        for x, y in zip(got[cell], want[cell]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    # different garbage in the padding: bitwise the same predictions
    padded2 = clone(padded)
    padded2.x[1, r_keep:] = -3.0
    padded2.x[1, :, c_keep:] = 0.0
    assert_same_cells(out, m(padded2))


def test_fully_padded_table_is_harmless(G):
    batch = make_batch(b=2)
    batch.row_valid[1] = False
    batch.context[1] = False
    batch.query[1] = False
    batch.col_valid[1] = False
    batch.kind[1] = 0
    batch.cardinality[1] = 0
    batch.validate()
    m = model(cells_per_token=G).train()
    out = m(batch)
    loss, _ = masked_cell_loss(out, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


# -------------------------------------------------------------------- invariances
@pytest.mark.parametrize("id_seed", [0, 12345])
def test_column_permutation_invariance(id_seed, G):
    m, batch = model(cells_per_token=G), make_batch(c=6)
    out = m(batch, id_seed=id_seed)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    permuted = TableBatch(
        x=batch.x[:, :, perm], kind=batch.kind[:, perm], cardinality=batch.cardinality[:, perm],
        row_valid=batch.row_valid, col_valid=batch.col_valid[:, perm], context=batch.context,
        query=batch.query[:, :, perm],
    )
    out_p = by_cell(m(permuted, id_seed=id_seed))
    for (b, r, c), (cat, num) in by_cell(out).items():
        new_c = int((perm == c).nonzero())
        cat_p, num_p = out_p[(b, r, new_c)]
        torch.testing.assert_close(cat, cat_p, atol=1e-5, rtol=0)
        torch.testing.assert_close(num, num_p, atol=1e-5, rtol=0)


def with_refs(batch: TableBatch) -> TableBatch:
    """Column 0 (numeric) as a context feature estimating class 1 of column 1 (categorical), column 2
    (when numeric) its value-free second estimator of class 0."""
    ref = torch.full_like(batch.feature_ref, -1)
    ref[:, 0] = torch.tensor([1, 1, 0])
    numeric2 = batch.kind[:, 2] == 1
    ref[numeric2, 2] = torch.tensor([1, 0, 2])
    out = TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid,
                     col_valid=batch.col_valid, context=batch.context, query=batch.query, feature_ref=ref)
    return out.validate()


def refs_model(seed: int = 0) -> TabFM:
    """A context_refs model whose reference projections are trained-like (they start at zero)."""
    m = model(seed, context_features="knn-linear", context_refs=True)
    for name, p in m.encoder.named_parameters():
        if name.startswith("ref_"):
            torch.nn.init.normal_(p, std=0.3)
    return m


def test_context_refs_change_answers_and_keep_column_order_invariance():
    """What a feature column estimates reaches the model (other answers than without references), and
    permuting the columns (references renumbered) permutes the answers."""
    m, batch = refs_model(), with_refs(make_batch(c=6))
    plain = make_batch(c=6)
    out = m(batch)
    assert max_diff(out, m(plain)) > 1e-3
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    inv = torch.argsort(perm)
    ref = batch.feature_ref[:, perm].clone()
    ref[..., 0] = torch.where(ref[..., 0] >= 0, inv[ref[..., 0].clamp(min=0)], -1)
    permuted = TableBatch(
        x=batch.x[:, :, perm], kind=batch.kind[:, perm], cardinality=batch.cardinality[:, perm],
        row_valid=batch.row_valid, col_valid=batch.col_valid[:, perm], context=batch.context,
        query=batch.query[:, :, perm], feature_ref=ref,
    ).validate()
    out_p = by_cell(m(permuted))
    for (b, r, c), (cat, num) in by_cell(out).items():
        cat_p, num_p = out_p[(b, r, int(inv[c]))]
        torch.testing.assert_close(cat, cat_p, atol=1e-5, rtol=0)
        torch.testing.assert_close(num, num_p, atol=1e-5, rtol=0)


def test_context_refs_need_context_features():
    with pytest.raises(ValueError, match="context_refs"):
        ModelConfig(**SMALL, context_refs=True)


def test_id_seed_draws_other_column_identities():
    """Ensemble members salt the eval-mode identities: same model, other (deterministic) answers."""
    m, batch = model(), make_batch(c=6)
    a, b, again = m(batch, id_seed=1), m(batch, id_seed=2), m(batch, id_seed=1)
    assert max_diff(a, b) > 1e-4
    assert max_diff(a, again) == 0.0


def test_row_order_equivariance_and_interleaved_context(G):
    """Context rows need not come first; permuting rows permutes predictions."""
    m, batch = model(cells_per_token=G), make_batch()
    out = m(batch)
    perm = torch.randperm(batch.shape[1], generator=torch.Generator().manual_seed(3))
    permuted = TableBatch(
        x=batch.x[:, perm], kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid[:, perm],
        col_valid=batch.col_valid, context=batch.context[:, perm], query=batch.query[:, perm],
    )
    out_p = by_cell(m(permuted))
    for (b, r, c), (cat, num) in by_cell(out).items():
        new_r = int((perm == r).nonzero())
        torch.testing.assert_close(cat, out_p[(b, new_r, c)][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(num, out_p[(b, new_r, c)][1], atol=1e-5, rtol=0)


def test_query_row_independence(G):
    m, batch = model(cells_per_token=G), make_batch()
    out = m(batch)
    keep = [r for r in range(batch.shape[1]) if r != 12]  # drop query row 12 (non-context)
    dropped = TableBatch(
        x=batch.x[:, keep], kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid[:, keep],
        col_valid=batch.col_valid, context=batch.context[:, keep], query=batch.query[:, keep],
    )
    out_d = by_cell(m(dropped))
    for (b, r, c), (cat, num) in by_cell(out).items():
        if r == 12:
            continue
        new_r = r - (r > 12)
        torch.testing.assert_close(cat, out_d[(b, new_r, c)][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(num, out_d[(b, new_r, c)][1], atol=1e-5, rtol=0)


# -------------------------------------------------------------------- determinism
def test_determinism(G):
    m, batch = model(cells_per_token=G), make_batch()
    a, b = m(batch), m(batch)
    assert torch.equal(a.num_logits, b.num_logits) and torch.equal(a.cat_logits, b.cat_logits)
    m.train()
    torch.manual_seed(1)
    a = m(batch)
    torch.manual_seed(1)
    b = m(batch)
    assert torch.equal(a.num_logits, b.num_logits)
    torch.manual_seed(2)
    c = m(batch)  # fresh random column identities in training
    assert not torch.allclose(a.num_logits, c.num_logits)


# ---------------------------------------------------------------- loss & training
def test_loss_is_finite_and_overfits_one_batch(G):
    torch.manual_seed(0)
    m = TabFM(ModelConfig(**SMALL, cells_per_token=G)).train()
    batch = make_batch(b=2, r=24, c=4, n_ctx=16, seed=1)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, metrics = masked_cell_loss(m(batch), batch)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert set(metrics) >= {"loss", "cat_nll", "num_nll", "cat_acc", "cells"}
    assert metrics["cells"] == metrics["cat_cells"] + metrics["num_cells"] > 0
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("only", ["numeric", "categorical", "no queries of a kind"])
@pytest.mark.parametrize("thinking", [0, 2])
def test_every_parameter_gets_a_gradient_whatever_the_batch_holds(only, thinking):
    """Data-parallel reduction expects every parameter in every step's graph: the model must
    reach each one with a (possibly zero) gradient on all-numeric and all-categorical batches,
    and when no query cell is of one kind, without zero-weight terms of its own."""
    torch.manual_seed(0)
    m = TabFM(ModelConfig(**{**SMALL, "n_thinking_rows": thinking})).train()
    batch = make_batch(b=2, r=16, c=4, n_ctx=10, seed=3)
    if only == "numeric":
        batch.kind[:] = 1
        batch.cardinality[:] = 0
        batch.x[torch.isnan(batch.x)] = 0.5
    elif only == "categorical":
        batch.kind[:] = 2
        batch.cardinality[:] = 3
        batch.x = torch.randint(0, 3, batch.x.shape).float()
    else:  # queries only in categorical columns: the numeric head scores nothing
        batch.query &= (batch.kind == 2)[:, None, :]
    loss, metrics = masked_cell_loss(m(batch.validate()), batch)
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    assert torch.isfinite(loss)
    if only == "numeric":
        assert metrics["cat_cells"] == 0 and metrics["num_cells"] > 0
    else:
        assert metrics["num_cells"] == 0 and metrics["cat_cells"] > 0


@torch.no_grad()
def test_loss_matches_hand_computation():
    m, batch = model(), make_batch()
    out = m(batch)
    loss, metrics = masked_cell_loss(out, batch)
    total, n = 0.0, 0
    for i, (b, r, c) in enumerate(out.index.tolist()):
        v = float(batch.x[b, r, c])
        if math.isnan(v):
            continue
        if int(batch.kind[b, c]) == 2:
            total += -float(torch.log_softmax(out.cat_logits[i], -1)[int(v)])
        else:
            z = (v - float(out.mean[i])) / float(out.std[i])
            total += float(out.bar.nll(out.num_logits[i : i + 1], torch.tensor([z]))[0])
        n += 1
    assert metrics["cells"] == n
    assert loss.item() == pytest.approx(total / n, rel=1e-4)


def test_high_cardinality_columns_are_not_scored():
    batch = make_batch()
    batch.cardinality[0, 1] = 50  # column 1 is categorical; its head only covers 10 codes
    out = model()(batch)
    _, metrics = masked_cell_loss(out, batch)
    scored = [(b, c) for b, _, c in out.index.tolist() if not (b == 0 and c == 1)]
    known = [i for i, (b, r, c) in enumerate(out.index.tolist()) if (b, c) != (0, 1) and not math.isnan(float(batch.x[b, r, c]))]
    assert metrics["cells"] == len(known) and scored


def test_bf16_autocast_close_to_fp32():
    m, batch = model(), make_batch()
    ref = m(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(batch)
    assert out.num_logits.dtype == torch.float32
    assert torch.isfinite(out.num_logits).all()
    assert max_diff(ref, out) < 0.1
    ref_p = torch.softmax(ref.num_logits, -1)
    torch.testing.assert_close(torch.softmax(out.num_logits, -1), ref_p, atol=0.02, rtol=0)
    m.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = masked_cell_loss(m(batch), batch)
    loss.backward()
    assert torch.isfinite(loss)


def test_activation_checkpointing_same_gradients_and_names():
    """The engine's activation checkpointing (parallel.checkpoint_blocks) changes no gradient and no
    parameter name, and recomputes each block in backward (its forward runs twice)."""
    from tabfm.parallel import checkpoint_blocks

    batch = make_batch()
    grads, calls = [], []
    for ckpt in (False, True):
        m = model(seed=3).train()
        if ckpt:
            assert checkpoint_blocks(m, m.parallel_plan()) == [f"blocks.{i}" for i in range(len(m.blocks))]
            m.blocks[0].register_forward_pre_hook(lambda mod, args: calls.append(1))
        torch.manual_seed(7)
        loss, _ = masked_cell_loss(m(batch), batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        if ckpt:
            assert list(m.state_dict()) == list(model(seed=3).state_dict())
    assert len(calls) == 2  # the forward, then the recomputation in backward
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_configs_of_older_exports_still_load():
    """`activation_checkpointing` left ModelConfig for the engine; exports that carry it still load."""
    data = ModelConfig(**SMALL).to_dict()
    assert ModelConfig.from_dict({**data, "activation_checkpointing": False}) == ModelConfig(**SMALL)
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({**data, "activation_checkpointng": False})


# ------------------------------------------------------------------ parallel plan
def test_parallel_plan_names_resolve():
    m = model(n_layers=3)
    plan = m.parallel_plan()
    assert isinstance(plan, ParallelPlan)
    assert plan.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    for name in plan.blocks:
        m.get_submodule(name)
    names = [n for n, _ in m.named_modules()]
    for pattern, style in plan.tp_plan.items():
        hits = fnmatch.filter(names, pattern)
        assert len(hits) == 3, pattern
        assert all(isinstance(m.get_submodule(h), torch.nn.Linear) for h in hits)
    assert {s for s in plan.tp_plan.values()} == {"colwise", "rowwise"}
    assert all(isinstance(m.get_submodule(n), RowKeys) for n in plan.row_attention) and len(plan.row_attention) == 3
    assert all(isinstance(m.get_submodule(n.rsplit(".", 1)[0]), RowAttention) for n in plan.row_attention)
    assert all(isinstance(m.get_submodule(n), ContextStatistics) for n in plan.row_statistics)
    assert plan.num_heads == 4


def test_attention_infers_local_heads_from_sharded_qkv():
    """A column-wise shard of the head-major fused qkv holds whole heads (tensor parallel)."""
    from tabfm.model.attention import ColumnAttention

    torch.manual_seed(0)
    full = ColumnAttention(16, 4)
    x = torch.randn(2, 3, 5, 16)
    want = full(x, None)
    got = torch.zeros_like(want)
    for rank in range(2):  # emulate 2-way TP: rows of qkv / columns of out per rank, sum partial outputs
        part = ColumnAttention(16, 4)
        part.qkv = torch.nn.Linear(16, 24, bias=False)
        part.out = torch.nn.Linear(8, 16, bias=False)
        part.qkv.weight.data = full.qkv.weight.data[rank * 24 : (rank + 1) * 24]
        part.out.weight.data = full.out.weight.data[:, rank * 8 : (rank + 1) * 8]
        got += part(x, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- config
def test_config_validation_and_roundtrip():
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="dropout"):
        ModelConfig(dropout=1.5)
    with pytest.raises(ValueError, match="n_bins"):
        ModelConfig(n_bins=2)
    with pytest.raises(ValueError, match="max_categories"):
        ModelConfig(max_categories=1)
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({"d_model": 64, "d_modle": 3})
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("huge")
    cfg = ModelConfig.preset("small", dropout=0.1)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg and cfg.d_model == 128


def test_presets_sizes():
    counts = {name: TabFM(ModelConfig.preset(name)).num_parameters() for name in ("tiny", "small", "base")}
    assert 0.3e6 <= counts["tiny"] <= 1e6
    assert counts["tiny"] < counts["small"] < counts["base"]
    assert ModelConfig.preset("base").d_model == 192 and ModelConfig.preset("base").n_layers == 12


# ----------------------------------------------------------------- bar & predict
def hand_bar() -> tuple[BarDistribution, torch.Tensor]:
    bar = BarDistribution(torch.tensor([-1.0, 0.0, 1.0]), tail_scale=1.0)  # 4 bins: tail, [-1,0], [0,1], tail
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64))
    return bar, logits


def test_bar_distribution_by_hand():
    bar, logits = hand_bar()
    t = math.sqrt(2 / math.pi)  # mean of a unit half-normal
    mean = 0.1 * (-1 - t) + 0.2 * (-0.5) + 0.3 * 0.5 + 0.4 * (1 + t)
    assert bar.mean(logits).item() == pytest.approx(mean, abs=1e-9)
    h = math.sqrt(2) * 0.4769362762044699  # sqrt(2) * erfinv(0.5): median of a unit half-normal
    q = bar.quantile(logits, [0.05, 0.2, 0.5, 0.8])[0].tolist()
    assert q == pytest.approx([-1 - h, -0.5, 2 / 3, 1 + h], abs=1e-6)
    nll = bar.nll(logits.expand(3, 4), torch.tensor([0.25, -0.5, 2.0])).tolist()
    tail = -math.log(0.4 * t * math.exp(-0.5))  # p_last * half-normal density at distance 1
    assert nll == pytest.approx([-math.log(0.3), -math.log(0.2), tail], abs=1e-9)
    # the density integrates to one
    z = torch.linspace(-12, 12, 200001)
    dens = torch.exp(-bar.nll(logits.expand(len(z), 4), z))
    assert float(torch.trapezoid(dens, z)) == pytest.approx(1.0, abs=1e-3)


def test_predict_helpers_map_back_to_original_scale():
    bar, logits = hand_bar()
    out = ModelOutput(
        index=torch.tensor([[0, 0, 0], [0, 1, 1]]),
        cat_logits=torch.tensor([[0.0] * 3, [0.0, math.log(3.0), float("-inf")]]),
        num_logits=logits.expand(2, 4),
        mean=torch.tensor([10.0, 0.0], dtype=torch.float64),
        std=torch.tensor([2.0, 1.0], dtype=torch.float64),
        kind=torch.tensor([1, 2], dtype=torch.int8),
        cardinality=torch.tensor([0, 2]),
        bar=bar,
    )
    assert P.numeric_median(out)[0].item() == pytest.approx(10 + 2 * 2 / 3)
    assert P.numeric_mean(out)[0].item() == pytest.approx(10 + 2 * bar.mean(logits).item())
    assert P.numeric_quantiles(out, [0.2, 0.5])[0].tolist() == pytest.approx([9.0, 10 + 4 / 3])
    assert P.numeric_nll(out, torch.tensor([10.5, 0.0]))[0].item() == pytest.approx(-math.log(0.3) + math.log(2))
    assert math.isnan(P.numeric_mean(out)[1].item())
    probs = P.class_probabilities(out)
    assert probs[1].tolist() == pytest.approx([0.25, 0.75, 0.0])
    assert torch.isnan(probs[0]).all()
    nll = P.cell_nll(out, torch.tensor([10.5, 1.0]))
    assert nll.tolist() == pytest.approx([-math.log(0.3) + math.log(2), -math.log(0.75)])
    assert P.point_prediction(out)[1].item() == 1.0


def test_model_predictions_are_proper_distributions():
    m, batch = model(), make_batch()
    out = m(batch)
    probs = P.class_probabilities(out)
    cat = out.kind == 2
    torch.testing.assert_close(probs[cat].sum(-1), torch.ones(int(cat.sum())))
    beyond = torch.arange(probs.shape[1])[None, :] >= out.cardinality[:, None]
    assert (probs[cat][beyond[cat]] == 0).all()
    q = P.numeric_quantiles(out, [0.1, 0.5, 0.9])[out.kind == 1]
    assert (q[:, 0] <= q[:, 1]).all() and (q[:, 1] <= q[:, 2]).all()


def test_hash_normal_is_standard_normal_and_deterministic():
    seeds = torch.arange(200, dtype=torch.int64)[:, None]
    z = hash_normal(seeds, torch.arange(100))
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
    assert torch.equal(z, hash_normal(seeds, torch.arange(100)))
    corr = torch.corrcoef(z[:20])
    assert float((corr - torch.eye(20)).abs().max()) < 0.5


def test_every_parameter_gets_a_gradient(G):
    """Data-parallel wrappers expect a gradient for every parameter, even when a batch has no
    categorical cells or the model no thinking rows."""
    for thinking in (0, 2):
        batch = make_batch()
        batch.kind[:] = 1
        batch.cardinality[:] = 0
        batch.x = torch.randn_like(batch.x)
        m = model(n_thinking_rows=thinking, cells_per_token=G).train()
        loss, _ = masked_cell_loss(m(batch.validate()), batch)
        loss.backward()
        assert [n for n, p in m.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("keys", [5, 200])  # explicit bf16 path / fp32-upcast SDPA path on CPU
def test_attend_bf16_paths_match_sdpa(keys):
    from tabfm.model.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g) for n in (7, keys, keys))
    mask = torch.rand(3, 1, 1, keys, generator=g) > 0.3
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def test_context_estimates_reach_the_cell_they_estimate_by_hand():
    """encoder.estimates: a class share adds value x W[estimator] @ (class identity) to the target
    cell of its row; a numeric estimate its value standardised on the target column's context,
    times the estimator's vector; nothing anywhere else."""
    m = refs_model(2)
    enc = m.encoder
    batch = with_refs(make_batch(b=1, c=6, seed=3))
    ref = batch.feature_ref.clone()
    numeric = [j for j in range(3, 6) if int(batch.kind[0, j]) == 1 and j != 0]
    if numeric:  # a numeric column estimating column 0 (numeric) with estimator 1
        ref[0, numeric[0]] = torch.tensor([0, -1, 1])
    batch.feature_ref = ref
    batch.validate()
    x = batch.visible_x()
    facts = enc.columns(batch, x=x)
    got = enc.estimates(enc.refs(batch.feature_ref, facts.code_vectors), x, facts.mean, facts.std)
    want = torch.zeros_like(got)
    for j in range(6):
        col, code, est = ref[0, j].tolist()
        if col < 0:
            continue
        v = torch.nan_to_num(x[0, :, j], nan=0.0)
        if code >= 0:
            vec = enc.ref_value_class[est] @ facts.code_vectors[0, col, code]
        else:
            v = squash((v.double() - facts.mean[0, col]) / facts.std[0, col]).float()
            vec = enc.ref_value_num[est]
        want[0, :, col] += v[:, None] * vec[None, :]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[0, :, [c for c in range(6) if c not in ref[0, :, 0].tolist()]].abs().max() == 0
