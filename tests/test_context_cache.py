"""Cached-context inference: `TabFM.encode_context` + `forward_queries` (and `ContextPredictor`
built on them) must equal one plain `forward` over context + query rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tabfm.data.batch import TableBatch
from tabfm.inference import ContextPredictor, forward_eval, predict_rows, query_batch
from tabfm.model.predict import cell_nll

from .test_model import make_batch, model

torch.set_num_threads(1)


def split(batch: TableBatch) -> tuple[TableBatch, TableBatch, TableBatch]:
    """(full batch with queries only in non-context rows, its context rows, its query rows);
    the tables keep their own rows, padded to a common count."""
    query = batch.query & ~batch.context[:, :, None]
    full = TableBatch(batch.x, batch.kind, batch.cardinality, batch.row_valid, batch.col_valid, batch.context, query)

    def rows(keep: torch.Tensor, context: bool) -> TableBatch:
        n = int(keep.sum(1).max())
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :n]
        valid = keep.gather(1, order)
        idx = order[:, :, None].expand(-1, -1, batch.x.shape[2])
        return TableBatch(batch.x.gather(1, idx), batch.kind, batch.cardinality, valid, batch.col_valid,
                          valid & context, query.gather(1, idx) & valid[:, :, None] & (not context))

    return full, rows(batch.context & batch.row_valid, True), rows(~batch.context & batch.row_valid, False)


@pytest.mark.parametrize("thinking", [0, 2])
@pytest.mark.parametrize("pad", [(0, 0), (3, 2)])
@pytest.mark.parametrize("cells_per_token", [1, 4])
def test_cached_context_equals_full_forward(thinking, pad, cells_per_token):
    m = model(n_thinking_rows=thinking, cells_per_token=cells_per_token)
    full, ctx, qry = split(make_batch(b=2, r=16, c=6, n_ctx=10, pad_rows=pad[0], pad_cols=pad[1]))
    with torch.inference_mode():
        ref = m(full, id_seed=5)
        out = m.forward_queries(qry, m.encode_context(ctx, id_seed=5))
    assert len(ref) == len(out) > 0
    # the same cells in the same order (row numbers differ: the query batch holds query rows alone)
    (b1, r1, c1), (b2, r2, c2) = ref.index.unbind(1), out.index.unbind(1)
    assert torch.equal(b1, b2) and torch.equal(c1, c2)
    assert torch.equal(full.x[b1, r1, c1].nan_to_num(-99.0), qry.x[b2, r2, c2].nan_to_num(-99.0))
    assert torch.equal(ref.kind, out.kind) and torch.allclose(ref.std, out.std)
    finite = torch.isfinite(ref.cat_logits)
    assert torch.equal(finite, torch.isfinite(out.cat_logits))
    assert (ref.cat_logits[finite] - out.cat_logits[finite]).abs().max() < 1e-5
    assert (ref.num_logits - out.num_logits).abs().max() < 1e-5


def test_context_predictor_equals_one_pass_in_any_chunking():
    m = model(n_thinking_rows=2)
    rng = np.random.default_rng(0)
    ctx = rng.normal(size=(40, 5)).astype(np.float32)
    ctx[:, 4] = rng.integers(0, 3, 40)
    ctx[rng.random(ctx.shape) < 0.1] = np.nan
    qx = rng.normal(size=(23, 5)).astype(np.float32)
    qx[:, 4] = rng.integers(0, 3, 23)
    mask = rng.random(qx.shape) < 0.4
    mask[3] = False  # a row without query cells is skipped
    kind, card = np.array([1, 1, 1, 1, 2], np.int8), np.array([0, 0, 0, 0, 3])
    batch = query_batch(ctx, qx, mask, kind, card)
    ref = cell_nll(forward_eval(m, batch, id_seed=3), batch.x[batch.query]).numpy()
    predictor = ContextPredictor(m, ctx, kind, card, id_seed=3)
    for chunk in (1, 4, 100):
        np.testing.assert_allclose(predictor.predict(qx, mask, cell_nll, chunk_size=chunk), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(predict_rows(m, ctx, qx, mask, kind, card, cell_nll, chunk_size=5, id_seed=3), ref,
                               atol=1e-5, rtol=1e-5)
    assert predict_rows(m, ctx, qx, np.zeros_like(mask), kind, card, cell_nll).shape == (0,)


def test_cached_inference_refuses_misuse():
    m = model()
    full, ctx, qry = split(make_batch())
    with pytest.raises(ValueError, match="context rows only"):
        m.encode_context(full)
    cache = m.encode_context(ctx)
    with pytest.raises(ValueError, match="non-context rows only"):
        m.forward_queries(ctx, cache)
    with pytest.raises(ValueError, match="tables x"):
        m.forward_queries(split(make_batch(c=4))[2], cache)
    with pytest.raises(RuntimeError, match="eval"):
        m.train().encode_context(ctx)
