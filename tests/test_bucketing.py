"""tabfm.data.bucketing: one shape per batch, every table once per epoch across ranks, balanced rank
cost per step, determinism per (seed, epoch), exact resume (sampler and DataLoader wrapper,
across epochs and worker counts), clear errors."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from tabfm.data import encode_frame
from tabfm.data.batch import TableBatch
from tabfm.data.bucketing import (
    BatchPlan,
    BucketedTableLoader,
    BucketedTableSampler,
    apply_plan,
    encoded_cols,
    step_balance,
)


def wide_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Store-like sizes: log-uniform rows 5..5000, columns 2..300."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(5), np.log(5000), n)).astype(int)
    cols = np.exp(rng.uniform(np.log(2), np.log(300), n)).astype(int)
    return list(zip(rows.tolist(), cols.tolist()))


def mid_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Log-uniform rows 5..400, columns 2..20: about 5 tables per batch, most batches hold several."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(5), np.log(400), n)).astype(int)
    cols = np.exp(rng.uniform(np.log(2), np.log(20), n)).astype(int)
    return list(zip(rows.tolist(), cols.tolist()))


SIZES = mid_sizes(1500)
KW = dict(cells_per_batch=2**13, max_batch=16)


def all_ranks(sizes, world_size, epoch=0, **kw):
    samplers = [BucketedTableSampler(sizes, world_size=world_size, rank=r, **{**KW, **kw}) for r in range(world_size)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("rows", ["pad", "subsample"])
def test_one_shape_per_batch_within_budget_and_bucket(rows):
    s = BucketedTableSampler(SIZES, rows=rows, growth=1.25, **KW)
    plans = list(s)
    assert plans and all(isinstance(p, BatchPlan) for p in plans)
    for p in plans:
        b, r, c = p.shape
        assert 1 <= b <= KW["max_batch"] and p.cost == b * r * c <= KW["cells_per_batch"]
        assert c == max(n_cols for _, n_cols in p.sizes)
        if rows == "pad":
            assert r == max(p.keep)
        else:
            assert all(k == r for k in p.keep)
        kept = [min(n, KW["cells_per_batch"] // m) for n, m in p.sizes]
        assert all(k <= kk for k, kk in zip(p.keep, kept))
        # one bucket: rows and columns within the growth factor
        assert max(kept) < 1.25 * min(kept) + 1e-9 and max(m for _, m in p.sizes) < 1.25 * min(m for _, m in p.sizes) + 1e-9
    if rows == "pad":
        # padding is bounded by the bucket width: real cells > cost / g^2
        assert all(p.cells > p.cost / 1.25**2 for p in plans)


# ------------------------------------------------------------------ coverage
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_every_table_once_per_epoch_across_ranks(world_size):
    samplers, per_rank = all_ranks(SIZES, world_size, epoch=2)
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0].plans(2))  # same steps on every rank
    assert samplers[0].epoch == 3 and samplers[0].position == 0  # moved on to the next epoch
    seen = Counter(i for plans in per_rank for p in plans for i in p.indices)
    dropped = samplers[0].dropped(2)
    assert all(v == 1 for v in seen.values())  # disjoint ranks, no repeats
    assert set(seen).isdisjoint(dropped) and sorted(set(seen) | set(dropped)) == list(range(len(SIZES)))
    # only the remainder is dropped: fewer than world_size batches, the cheapest of the epoch
    assert len(dropped) <= (world_size - 1) * KW["max_batch"]
    if world_size == 1:
        assert dropped == []
    assert np.mean([len(p.indices) > 1 for plans in per_rank for p in plans]) > 0.5  # real batching, not singletons
    # every rank's plans are rank-tagged, step-ordered, and agree with the shared plan
    for r, plans in enumerate(per_rank):
        assert [p.step for p in plans] == list(range(len(plans))) and {p.rank for p in plans} == {r}
        assert plans == [step[r] for step in samplers[0].steps(2)]


def test_remainder_dropped_or_padded():
    """9 equal tables, 2 per batch: 5 batches for 4 ranks. drop_last drops the cheapest (the single);
    drop_last=False repeats it on the 3 other ranks of the last step."""
    s = BucketedTableSampler([(10, 3)] * 9, world_size=4, max_batch=2, seed=1)
    assert len(s) == 1 and len(s.dropped()) == 1 and s.repeated() == []
    kept = [i for p in s.steps()[0] for i in p.indices]
    assert sorted(kept + s.dropped()) == list(range(9))
    s = BucketedTableSampler([(10, 3)] * 9, world_size=4, max_batch=2, seed=1, drop_last=False)
    assert len(s) == 2 and s.dropped() == [] and len(s.repeated()) == 3 and len(set(s.repeated())) == 1
    seen = Counter(i for step in s.steps() for p in step for i in p.indices)
    assert set(seen) == set(range(9)) and seen[s.repeated()[0]] == 4
    assert all(len({p.cost for p in step}) == 1 for step in s.steps())


# ------------------------------------------------------------------ balance
def naive_costs(sizes, world_size, per_batch, budget, seed=0):
    """Shuffled tables, rank r takes every world_size-th, chunks of per_batch padded to the largest."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(sizes))
    n = len(order) // (world_size * per_batch) * world_size * per_batch
    costs = []
    for step in range(n // (world_size * per_batch)):
        row = []
        for r in range(world_size):
            ix = order[r::world_size][step * per_batch:(step + 1) * per_batch]
            rr = max(min(sizes[i][0], budget // sizes[i][1]) for i in ix)
            row.append(len(ix) * rr * max(sizes[i][1] for i in ix))
        costs.append(row)
    return np.array(costs)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_rank_cost_spread_is_bounded(world_size):
    """Wide sizes (rows 5..5000, cols 2..300, 3000 tables): per-step max/mean rank cost <= 1.15 on every
    step above 1 % of the budget, max - mean <= 3 % of the budget on every step, efficiency >= 0.98."""
    budget = 2**18
    sizes = wide_sizes(3000, seed=1)
    s = BucketedTableSampler(sizes, cells_per_batch=budget, max_batch=64, world_size=world_size, seed=3)
    for epoch in (0, 1):
        costs = np.array([[p.cost for p in step] for step in s.steps(epoch)])
        mean, top = costs.mean(1), costs.max(1)
        big = mean >= 0.01 * budget
        assert big.sum() > len(costs) / 2
        assert (top[big] / mean[big]).max() <= 1.15
        assert ((top - mean) / budget).max() <= 0.03
        stats = step_balance(costs)
        assert stats["efficiency"] >= 0.98 and stats["steps"] == len(s.steps(epoch)) and stats["ranks"] == world_size
    naive = step_balance(naive_costs(sizes, world_size, 1, budget))
    assert naive["efficiency"] < 0.6 and naive["max_over_mean_mean"] > 1.5


# ------------------------------------------------------------------ determinism
def test_deterministic_per_seed_and_epoch():
    a = BucketedTableSampler(SIZES, world_size=2, rank=1, seed=5, **KW)
    b = BucketedTableSampler(SIZES, world_size=2, rank=1, seed=5, **KW)
    assert a.plans(0) == b.plans(0) and a.plans(3) == b.plans(3)
    assert [p.indices for p in a.plans(0)] != [p.indices for p in a.plans(1)]
    c = BucketedTableSampler(SIZES, world_size=2, rank=1, seed=6, **KW)
    assert [p.indices for p in a.plans(0)] != [p.indices for p in c.plans(0)]
    # row subsets of an oversize table: a function of (seed, epoch, table), new each epoch
    big = [(5000, 40)] + [(10, 4)] * 5
    s = BucketedTableSampler(big, cells_per_batch=8000, max_batch=4)
    take = {e: next(p for p in s.plans(e) if 0 in p.indices) for e in (0, 1)}
    r0 = take[0].row_indices(take[0].indices.index(0))
    r1 = take[1].row_indices(take[1].indices.index(0))
    assert len(r0) == len(r1) == 200 and np.all(np.diff(r0) > 0) and r0.max() < 5000
    assert not np.array_equal(r0, r1)
    again = BucketedTableSampler(big, cells_per_batch=8000, max_batch=4)
    assert np.array_equal(r0, next(p for p in again.plans(0) if 0 in p.indices).row_indices(take[0].indices.index(0)))


# ------------------------------------------------------------------ resume
def run_epochs(sampler, epochs):
    out = []
    for e in range(sampler.epoch, epochs):
        sampler.set_epoch(e)
        out.extend(sampler)
    return out


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 2)])
def test_resume_equals_uninterrupted(world_size, rank):
    make = lambda: BucketedTableSampler(SIZES, world_size=world_size, rank=rank, seed=1, **KW)  # noqa: E731
    full = run_epochs(make(), 3)
    n0 = len(make().plans(0))
    for k in (1, n0 - 1, n0, n0 + 2):  # mid-epoch, last batch, exactly at the boundary, into epoch 1
        first = make()
        got = []
        for e in range(3):
            first.set_epoch(e)
            got.extend(itertools.islice(first, k - len(got)))
            if len(got) == k:
                break
        state = first.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert got + run_epochs(resumed, 3) == full, k
    # a loop that never calls set_epoch moves on to the next epoch by itself
    s = make()
    assert list(s) + list(s) + list(s) == full and s.state_dict()["epoch"] == 3


def test_state_is_the_same_on_every_rank_and_checked():
    a = BucketedTableSampler(SIZES, world_size=2, rank=0, **KW)
    b = BucketedTableSampler(SIZES, world_size=2, rank=1, **KW)
    list(itertools.islice(a, 3))
    b.load_state_dict(a.state_dict())  # rank 0's state serves rank 1
    assert next(iter(b)) == b.plans()[3]
    with pytest.raises(ValueError, match="world_size=2, this sampler has world_size=4"):
        BucketedTableSampler(SIZES, world_size=4, **KW).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="other table sizes or sampler settings"):
        BucketedTableSampler(SIZES[:-1] + [(7, 7)], world_size=2, **KW).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="seed=0, this sampler has seed=1"):
        BucketedTableSampler(SIZES, world_size=2, seed=1, **KW).load_state_dict(a.state_dict())


# ------------------------------------------------------------------ applying plans and the loader
def make_frames(n=24, seed=0):
    """Small mixed tables (rows 30..60, 2-3 numeric + 1 categorical column) and one oversize table."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        r, c = (400, 4) if i == 5 else (int(rng.integers(30, 61)), int(rng.integers(3, 5)))
        df = pd.DataFrame({f"f{j}": rng.normal(size=r) for j in range(c - 1)})
        df.iloc[rng.integers(0, r), 0] = np.nan
        df["cat"] = rng.choice(["a", "b", "c"], size=r)
        frames.append(df)
    return frames


LOADER_KW = dict(cells_per_batch=1000, max_batch=8)
FRAMES = make_frames()
ENCODED = [encode_frame(f)[0] for f in FRAMES]


def load_encoded(i: int):
    return ENCODED[i]


def test_apply_plan_builds_one_valid_tablebatch():
    sizes = [e.shape for e in ENCODED]
    s = BucketedTableSampler(sizes, rows="subsample", seed=2, **LOADER_KW)
    plans = s.plans()
    assert any(len(p.indices) > 1 for p in plans)
    assert any(p.row_indices(j) is not None for p in plans for j in range(len(p.indices)))
    assert any(p.indices == (5,) and p.keep == (250,) for p in plans)  # 400 x 4 cells > 1000: 250 rows
    for p in plans:
        batch = apply_plan(p, [ENCODED[i] for i in p.indices]).validate()
        assert batch.shape == p.shape and batch.num_cells == p.cells
        for j, i in enumerate(p.indices):
            take = p.row_indices(j)
            src = ENCODED[i].x if take is None else ENCODED[i].x[torch.from_numpy(take)]
            k, w = src.shape
            assert torch.equal(torch.nan_to_num(batch.x[j, :k, :w], 7.0), torch.nan_to_num(src, 7.0))
            assert not batch.row_valid[j, k:].any() and not batch.col_valid[j, w:].any()
    # one-table TableBatches keep their episode (query cells) through row selection
    t = ENCODED[0].to_batch(query=torch.zeros(ENCODED[0].shape, dtype=torch.bool).index_fill_(0, torch.tensor([1]), True))
    plan = BatchPlan(epoch=0, step=0, rank=0, indices=(0,), sizes=(ENCODED[0].shape,), keep=(ENCODED[0].shape[0],),
                     rows=ENCODED[0].shape[0] + 3, cols=ENCODED[0].shape[1] + 1, seed=0)
    out = apply_plan(plan, [t]).validate()
    assert out.shape == (1, plan.rows, plan.cols) and out.query[0, 1].sum() == ENCODED[0].shape[1]
    with pytest.raises(ValueError, match="table 0 has shape .* plan was made for 99 rows"):
        apply_plan(BatchPlan(0, 0, 0, (0,), ((99, 3),), (99,), 99, 3, 0), [ENCODED[0]])


def test_apply_plan_widens_to_encoded_columns():
    df = pd.DataFrame({"t": pd.date_range("2020-01-01", periods=6, freq="h"), "v": np.arange(6.0)})
    enc = encode_frame(df)[0]
    assert encoded_cols(["datetime", "numeric"]) == 7 >= enc.shape[1] > 2
    plan = BatchPlan(0, 0, 0, (0,), ((6, 2),), (6,), 6, 2, 0)  # planned in source columns
    assert apply_plan(plan, [enc]).validate().shape == (1, 6, enc.shape[1])


def batches_equal(a: TableBatch, b: TableBatch) -> bool:
    return all(torch.equal(torch.nan_to_num(getattr(a, f), 7.0) if f == "x" else getattr(a, f),
                           torch.nan_to_num(getattr(b, f), 7.0) if f == "x" else getattr(b, f))
               for f in ("x", "kind", "cardinality", "row_valid", "col_valid", "context", "query"))


def test_loader_same_batches_any_workers_and_resumes_across_worker_counts():
    sizes = [e.shape for e in ENCODED]
    make = lambda: BucketedTableSampler(sizes, world_size=2, rank=1, seed=4, **LOADER_KW)  # noqa: E731
    ref_sampler = make()
    expected = [apply_plan(p, [ENCODED[i] for i in p.indices]) for e in (0, 1) for p in ref_sampler.plans(e)]
    n0 = len(ref_sampler.plans(0))
    assert n0 >= 3 and any(len(p.indices) > 1 for p in ref_sampler.plans(0))
    # uninterrupted, 2 workers, two epochs
    loader = BucketedTableLoader(make(), load_encoded, num_workers=2)
    got = [b for e in (0, 1) if loader.set_epoch(e) is None for b in loader]
    assert len(got) == len(expected) and all(batches_equal(x, y) for x, y in zip(got, expected))
    # stop after k with 2 workers (they ran ahead), resume with 0 workers, and the other way
    for k, before, after in ((2, 2, 0), (n0, 0, 2)):
        first = BucketedTableLoader(make(), load_encoded, num_workers=before, return_plans=True)
        head = [b for _, b in itertools.islice(first, k)]
        state = first.state_dict()
        again = BucketedTableLoader(make(), load_encoded, num_workers=after)
        again.load_state_dict(state)
        rest = []
        for e in range(again.sampler.epoch, 2):
            again.set_epoch(e)
            rest.extend(again)
        assert len(head) + len(rest) == len(expected)
        assert all(batches_equal(x, y) for x, y in zip(head + rest, expected)), k


def test_store_headers_as_input(tmp_path):
    store = pytest.importorskip("tabfm.data.store")
    for i, f in enumerate(FRAMES[:6]):
        store.write_table(tmp_path, f"t{i}", f)
    headers = store.list_store(tmp_path)
    s = BucketedTableSampler(headers, **LOADER_KW)
    p = s.plans()[0]
    batch = apply_plan(p, [encode_frame(store.read_table(headers[i]))[0] for i in p.indices]).validate()
    assert batch.shape == p.shape


# ------------------------------------------------------------------ errors
def test_oversize_tables_subsampled_or_refused():
    sizes = [(10, 5), (4000, 300), (20, 5), (8, 6)]
    s = BucketedTableSampler(sizes, cells_per_batch=30000, max_batch=8)
    p = next(p for p in s.plans() if 1 in p.indices)
    assert p.keep == (100,) and p.cost <= 30000 and len(p.row_indices(0)) == 100
    too_big = r"table 1 \(4000 rows x 300 cols = 1200000 cells\) exceeds cells_per_batch=30000.*keep 100 random rows"
    with pytest.raises(ValueError, match=too_big):
        BucketedTableSampler(sizes, cells_per_batch=30000, oversize="error")
    too_wide = r"table 1 \(4000 rows x 300 cols\) has too many columns for cells_per_batch=500.*>= 600"
    with pytest.raises(ValueError, match=too_wide):
        BucketedTableSampler(sizes, cells_per_batch=500)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tables=[]), "at least one table"),
    (dict(tables=[(3, 0)]), r"table 0: n_cols must be an integer >= 1, got 0"),
    (dict(tables=[(3, 2), (2.5, 2)]), r"table 1: n_rows must be an integer >= 1, got 2.5"),
    (dict(tables=[(3, 2, 1)]), r"table 0: expected \(n_rows, n_cols\)"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=2, rank=2), "rank must be < world_size=2"),
    (dict(growth=1.0), "growth must be a finite number > 1"),
    (dict(rows="crop"), "rows must be one of"),
    (dict(oversize="drop"), "oversize must be one of"),
    (dict(cells_per_batch=0), "cells_per_batch must be an integer >= 1"),
    (dict(tables=[(5, 5)] * 3, world_size=4), "pack into 1 batches, fewer than world_size=4"),
])
def test_bad_arguments(kwargs, match):
    kw = {"tables": [(10, 3)] * 4, **KW, **kwargs}
    with pytest.raises(ValueError, match=match):
        BucketedTableSampler(**kw)


def test_bad_epoch_and_state():
    s = BucketedTableSampler(SIZES, **KW)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        s.set_epoch(-1)
    state = {**s.state_dict(), "position": len(s) + 1}
    with pytest.raises(ValueError, match="past the"):
        s.load_state_dict(state)
    with pytest.raises(ValueError, match="do not pass batch_size"):
        BucketedTableLoader(s, load_encoded, batch_size=4)


# ------------------------------------------------------------------ benchmark smoke run
def test_loader_benchmark_quick(tmp_path, load_benchmark):
    import json

    bench = load_benchmark("loader")
    out = tmp_path / "loader.json"
    assert bench.main(["--quick", "--tables", "6", "--sim-tables", "400", "--workers", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    by = {(r["ranks"], r["method"]): r for r in res["straggler"]["results"]}
    for w in (2, 4, 8):
        assert by[(w, "bucketed")]["efficiency"] > by[(w, "naive B=1")]["efficiency"]
    if res["throughput"] is not None:
        assert res["throughput"]["results"][0]["batches"] >= 1
