"""TableBatch: validation names the problem, collation and moves keep values."""
import math
import re

import pytest
import torch

from tabfm.data.batch import CATEGORICAL, NUMERIC, PAD, TableBatch


def make_batch(b: int = 2, r: int = 5, c: int = 3) -> TableBatch:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, r, c, generator=g)
    x[:, :, 2] = torch.randint(0, 4, (b, r), generator=g).float()
    kind = torch.tensor([NUMERIC, NUMERIC, CATEGORICAL], dtype=torch.int8).repeat(b, 1)
    card = torch.tensor([0, 0, 4]).repeat(b, 1)
    context = torch.zeros(b, r, dtype=torch.bool)
    context[:, :3] = True
    query = torch.zeros(b, r, c, dtype=torch.bool)
    query[:, 3:, 2] = True
    return TableBatch(x, kind, card, torch.ones(b, r, dtype=torch.bool), torch.ones(b, c, dtype=torch.bool), context, query)


def test_valid_batch_passes_and_counts_cells():
    batch = make_batch().validate()
    assert batch.shape == (2, 5, 3)
    assert batch.num_cells == 30
    batch.row_valid[1, 4] = False
    batch.context[1, 4] = False
    batch.query[1, 4] = False
    assert batch.validate().num_cells == 27


def test_visible_x_hides_query_cells_only():
    batch = make_batch()
    vis = batch.visible_x()
    assert torch.isnan(vis[:, 3:, 2]).all()
    assert torch.equal(vis[:, :3], batch.x[:, :3])
    assert not torch.isnan(batch.x).any()  # true values stay in x


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: setattr(b, "kind", b.kind.long()), "kind has dtype"),
        (lambda b: setattr(b, "x", b.x[:, :4]), "row_valid has shape (2, 5), expected (2, 4)"),
        (lambda b: b.kind.__setitem__((0, 1), 7), "kind[0, 1] = 7"),
        (lambda b: b.x.__setitem__((1, 2, 2), 4.0), "table 1 row 2 column 2: categorical code 4.0"),
        (lambda b: b.x.__setitem__((0, 0, 2), 1.5), "categorical code 1.5"),
        (lambda b: b.cardinality.__setitem__((0, 0), 3), "not categorical but has cardinality 3"),
        (lambda b: b.cardinality.__setitem__((0, 2), 0), "cardinality 0"),
        (lambda b: b.context.fill_(False), "has rows but no context rows"),
        (lambda b: b.row_valid.__setitem__((0, 4), False), "query cell but is padding"),
        (lambda b: b.col_valid.__setitem__((1, 0), False), "table 1 column 0: col_valid=False but kind=1"),
    ],
)
def test_validation_names_the_problem(mutate, message):
    batch = make_batch()
    mutate(batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.validate()


def test_missing_categorical_cell_is_allowed():
    batch = make_batch()
    batch.x[0, 1, 2] = math.nan
    batch.validate()


def test_collate_and_index_round_trip():
    a, b = make_batch(1), make_batch(2)
    both = TableBatch.collate([a, b])
    assert both.shape == (3, 5, 3)
    assert torch.equal(both[0].x, a.x)
    assert torch.equal(both[1:].query, b.query)
    with pytest.raises(ValueError, match="one shape"):
        TableBatch.collate([make_batch(1, r=5), make_batch(1, r=6)])


def test_from_table_and_to():
    x = torch.tensor([[1.0, 0.0], [2.0, 1.0], [math.nan, 1.0]])
    batch = TableBatch.from_table(x, [NUMERIC, CATEGORICAL], [0, 2])
    assert batch.shape == (1, 3, 2)
    assert batch.context.all() and not batch.query.any()
    moved = batch.to("cpu")
    assert torch.equal(torch.nan_to_num(moved.x), torch.nan_to_num(batch.x))
    assert int(moved.kind[0, 1]) == CATEGORICAL and PAD == 0


def test_slice_rows_keeps_columns():
    batch = make_batch()
    part = batch.slice_rows(1, 4)
    assert part.shape == (2, 3, 3)
    assert torch.equal(part.x, batch.x[:, 1:4])
    assert torch.equal(part.kind, batch.kind)


def refs_batch() -> TableBatch:
    """make_batch with column 0 a context feature estimating class 3 of column 2 (ridge slot 2)."""
    batch = make_batch()
    batch.feature_ref[:, 0] = torch.tensor([2, 3, 2])
    return batch.validate()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.feature_ref.__setitem__((0, 2), torch.tensor([2, 1, 0])), "must mark a numeric column"),
        (lambda b: b.feature_ref.__setitem__((0, 0, 1), 4), "class code below its cardinality"),
        (lambda b: b.feature_ref.__setitem__((0, 1), torch.tensor([1, -1, 0])), "estimating another real column"),
        (lambda b: b.feature_ref.__setitem__((1, 1), torch.tensor([-1, 2, 0])), "neither all -1"),
        (lambda b: b.feature_ref.__setitem__((1, 1), torch.tensor([7, 2, 0])), "names column 7, but the table has 3"),
        (lambda b: setattr(b, "feature_ref", b.feature_ref[:, :2]), "feature_ref has shape (2, 2, 3)"),
    ],
)
def test_feature_ref_validation_names_the_problem(mutate, message):
    batch = refs_batch()
    mutate(batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.validate()


def test_feature_ref_defaults_and_travels():
    """Left out, every column is a table's own (-1); padding columns, collation and indexing keep it."""
    plain = make_batch()
    assert plain.feature_ref.shape == (2, 3, 3) and bool((plain.feature_ref == -1).all())
    batch = refs_batch()
    wide = batch.pad_columns(5).validate()
    assert torch.equal(wide.feature_ref[:, :3], batch.feature_ref) and bool((wide.feature_ref[:, 3:] == -1).all())
    both = TableBatch.collate([batch, plain])
    assert torch.equal(both[0].feature_ref, batch.feature_ref[:1]) and torch.equal(both[2:].feature_ref, plain.feature_ref)
    assert torch.equal(batch.slice_rows(1, 3).feature_ref, batch.feature_ref)
