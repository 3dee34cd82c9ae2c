"""The seeded, bucketed synthetic stream: determinism, resumption, bucketing, episodes, config, CLI."""
from __future__ import annotations

import itertools
import json
from dataclasses import fields

import numpy as np
import pytest
import torch

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.synth.config import PriorConfig
from tabfm.synth.dataset import SynthDataset, SynthLoader
from tabfm.synth.episodes import IMPUTATION, imputation_episode, pack, prediction_episode
from tabfm.synth.stream import BatchInfo, StreamConfig, SynthStream, bucket_at
from tabfm.synth.table import CLASSIFICATION, REGRESSION, SynthTable

TINY = StreamConfig.preset("tiny")


def same(a: TableBatch, b: TableBatch) -> bool:
    """Bitwise equality of two batches, NaN == NaN."""
    for f in fields(TableBatch):
        u, v = getattr(a, f.name), getattr(b, f.name)
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        if u.is_floating_point():
            if not (torch.equal(u.isnan(), v.isnan()) and torch.equal(u.nan_to_num(0.0), v.nan_to_num(0.0))):
                return False
        elif not torch.equal(u, v):
            return False
    return True


def take(it, n):
    return list(itertools.islice(it, n))


# ------------------------------------------------------------------ determinism
def test_same_seed_gives_identical_batches():
    a = take(SynthStream(TINY, seed=7), 4)
    b = take(SynthStream(TINY, seed=7), 4)
    assert all(same(x, y) for x, y in zip(a, b))
    for batch in a:
        batch.validate()
        assert batch.x.dtype == torch.float32


def test_other_seed_or_rank_gives_other_tables():
    base = SynthStream(TINY, seed=7, rank=0, world_size=2).batch_at(0)
    other_rank = SynthStream(TINY, seed=7, rank=1, world_size=2).batch_at(0)
    other_seed = SynthStream(TINY, seed=8, rank=0, world_size=2).batch_at(0)
    assert base.shape == other_rank.shape  # one shape per step on every rank
    assert not torch.equal(base.x.nan_to_num(0.0), other_rank.x.nan_to_num(0.0))
    assert not same(base, other_seed)
    # no two tables of one batch are the same either
    flat = base.x.nan_to_num(-1.0).flatten(1)
    assert len({tuple(row.tolist()) for row in flat}) == len(base)


def test_table_is_reproducible_from_its_index():
    stream = SynthStream(TINY, seed=3, rank=1, world_size=4)
    batch = stream.batch_at(5)
    j = len(batch) - 1
    table, episode = stream.table(5, j)
    b = stream.bucket(5)
    assert same(batch[j], pack([table], [episode], b.rows, b.cols))


def test_rank_tables_do_not_depend_on_num_workers():
    want = [SynthStream(TINY, seed=11, rank=1, world_size=2).batch_at(p) for p in range(5)]
    for workers in (0, 2):
        ds = SynthDataset(TINY, seed=11, rank=1, world_size=2, num_batches=5)
        got = list(SynthLoader(ds, num_workers=workers))
        assert len(got) == 5
        assert all(same(x, y) for x, y in zip(want, got)), f"num_workers={workers} changed the stream"


def test_micro_batches_depend_on_the_global_batch_not_its_split():
    """2 ranks x 2 accumulation micro-batches draw, step by step, what 1 process x 4 draws; with
    workers too, and a loader that stopped mid-step resumes at that step's first micro-batch."""
    one = list(SynthLoader(SynthDataset(TINY, seed=3, micro_batches=4, num_batches=3)))
    assert len(one) == 12
    assert same(one[0], SynthStream(TINY, seed=3, rank=0, world_size=4).batch_at(0))
    for rank in (0, 1):
        loader = SynthLoader(SynthDataset(TINY, seed=3, rank=rank, world_size=2, micro_batches=2, num_batches=3),
                             num_workers=2)
        got = list(loader)
        assert len(got) == 6 and loader.state_dict()["position"] == 3
        for step in range(3):
            for a in range(2):
                assert same(got[2 * step + a], one[4 * step + 2 * a + rank]), (rank, step, a)
    loader = SynthLoader(SynthDataset(TINY, seed=3, micro_batches=4))
    take(iter(loader), 6)  # one and a half steps
    assert loader.state_dict()["position"] == 1
    with pytest.raises(ValueError, match="micro_batches"):
        SynthDataset(TINY, micro_batches=0)


# ------------------------------------------------------------------ resumption
def test_stream_resumes_exactly():
    full = take(SynthStream(TINY, seed=5), 6)
    s = SynthStream(TINY, seed=5)
    first = take(s, 3)
    state = s.state_dict()
    assert state["position"] == 3
    resumed = SynthStream(TINY, seed=5)
    resumed.load_state_dict(state)
    rest = take(resumed, 3)
    assert all(same(x, y) for x, y in zip(full, first + rest))
    with pytest.raises(ValueError, match="seed"):
        SynthStream(TINY, seed=6).load_state_dict(state)


def test_loader_with_workers_resumes_exactly():
    want = [SynthStream(TINY, seed=9).batch_at(p) for p in range(6)]
    loader = SynthLoader(SynthDataset(TINY, seed=9, num_batches=6), num_workers=2)
    first = take(iter(loader), 2)
    state = loader.state_dict()
    assert state["position"] == 2
    fresh = SynthLoader(SynthDataset(TINY, seed=9, num_batches=6), num_workers=2)
    fresh.load_state_dict(state)
    assert len(fresh) == 4
    rest = list(fresh)
    assert len(rest) == 4
    assert all(same(x, y) for x, y in zip(want, first + rest))
    # the dataset alone resumes from batches consumed
    ds = SynthDataset(TINY, seed=9)
    st = ds.state_dict(consumed=4)
    ds2 = SynthDataset(TINY, seed=9)
    ds2.load_state_dict(st)
    assert same(next(iter(ds2)), want[4])


# ------------------------------------------------------------------- bucketing
@pytest.mark.parametrize("preset", ["tiny", "small", "default", "large", "pretrain-wide", "pretrain-mixed"])
def test_buckets(preset):
    cfg = StreamConfig.preset(preset)
    lo, hi = cfg.row_range
    shapes = set()
    for p in range(300):
        b = bucket_at(cfg, 1, p)
        cells = b.rows * b.cols
        assert b.rows % cfg.row_quantum == 0 and lo <= b.rows <= hi
        assert cfg.min_rows <= b.rows <= cfg.max_rows and cfg.min_cols <= b.cols <= cfg.max_cols
        assert cells <= cfg.max_cells
        assert 1 <= b.batch <= cfg.max_batch
        assert b.cost <= cfg.cells_per_batch
        if b.batch < cfg.max_batch:
            assert b.cost > cfg.cells_per_batch - cells
        shapes.add((b.rows, b.cols))
    assert len(shapes) > 20  # sizes really vary
    assert bucket_at(cfg, 1, 17) == bucket_at(cfg, 1, 17)


def test_pretrain_mixed_draws_categorical_heavy_tables():
    """pretrain-mixed: up to every feature categorical; the default prior stops at half."""
    from tabfm.synth.prior import sample_table

    def shares(preset: str) -> np.ndarray:
        prior, rng = StreamConfig.preset(preset).prior, np.random.default_rng(0)
        tables = [sample_table(prior, rng, 64, 11) for _ in range(150)]
        return np.array([(t.kind[: t.target] == CATEGORICAL).mean() for t in tables])

    wide, mixed = shares("pretrain-wide"), shares("pretrain-mixed")
    assert wide.max() <= 0.5 + 1e-9
    assert (mixed > 0.5).mean() > 0.25 and mixed.max() == 1.0


def test_nano_preset_is_nanotabpfn_sized_classification():
    """nano: 32 tables of 150 rows x (5 features + target) a batch, every episode a classification
    whose query rows are the target cells of the non-context rows (context share 0.1-0.9)."""
    cfg = StreamConfig.preset("nano")
    stream = SynthStream(cfg, seed=3)
    for p in range(3):
        batch, info = stream.episode_at(p)
        assert tuple(batch.x.shape) == (32, 150, 6)
        assert set(info.tasks) == {"classification"} and 2 <= min(info.n_classes) <= max(info.n_classes) <= 10
        context = batch.context.float().mean(1)
        assert ((context >= 0.1 - 1 / 150) & (context <= 0.9 + 1 / 150)).all()
        q = batch.query.sum(2)  # one hidden cell (the target) in every non-context row
        assert torch.equal(q, (~batch.context & batch.row_valid).long())


def test_pretrain_small_preset_holds_many_small_tables_of_every_task():
    """pretrain-small: tables up to 256 x 12 within 3072 cells, so a 24,576-cell batch holds at
    least 8 of them; every task appears; context shares span nanoTabPFN's 0.1-0.9."""
    cfg = StreamConfig.preset("pretrain-small")
    stream = SynthStream(cfg, seed=5)
    tasks, counts = set(), []
    for p in range(30):
        batch, info = stream.episode_at(p)
        B, R, C = batch.x.shape
        assert 32 <= R <= 256 and 3 <= C <= 12 and R * C <= 3072 and R % 16 == 0
        counts.append(B)
        assert min(cfg.cells_per_batch // (R * C), cfg.max_batch) == B
        tasks |= set(info.tasks)
    assert tasks == {"classification", "regression", "imputation"}
    assert min(counts) >= 8 and max(counts) == 48


def test_batches_have_bucket_shape_on_every_rank():
    streams = [SynthStream(TINY, seed=2, rank=r, world_size=3) for r in range(3)]
    for p in range(4):
        b = bucket_at(TINY, 2, p)
        for s in streams:
            batch = s.batch_at(p)
            assert batch.shape == (b.batch, b.rows, b.cols)
            assert batch.row_valid.all() and batch.col_valid.all()  # one shape per batch: no padding


def test_max_cells_cuts_tall_wide_tables():
    cfg = StreamConfig.preset("tiny", max_rows=256, max_cols=64, max_cells=600, cells_per_batch=1200)
    for p in range(200):
        b = bucket_at(cfg, 0, p)
        assert b.rows * b.cols <= 600


# -------------------------------------------------------------------- episodes
def episodes_of(batch: TableBatch, info: BatchInfo, cfg: StreamConfig):
    """Check the invariants of every table; return the tasks seen."""
    batch.validate()
    valid = batch.row_valid[:, :, None] & batch.col_valid[:, None, :]
    assert not (batch.query & ~valid).any(), "query on padding"
    for i, task in enumerate(info.tasks):
        q, ctx, x = batch.query[i], batch.context[i], batch.x[i]
        n_rows = int(batch.row_valid[i].sum())
        n_cols = int(batch.col_valid[i].sum())
        target = n_cols - 1
        assert not (q & x.isnan()).any(), "query on a missing cell"
        if task in (CLASSIFICATION, REGRESSION):
            assert q.any(0).nonzero().flatten().tolist() == [target], "prediction queries only the target"
            assert torch.equal(q[:, target], batch.row_valid[i] & ~ctx), "prediction queries every non-context row"
            n_ctx = int(ctx.sum())
            lo, hi = cfg.context_fraction
            assert 1 <= n_ctx <= n_rows - 1
            assert lo - 1 / n_rows <= n_ctx / n_rows <= hi + 1 / n_rows
            want = CATEGORICAL if task == CLASSIFICATION else NUMERIC
            assert int(batch.kind[i, target]) == want
            if task == CLASSIFICATION:
                k = int(batch.cardinality[i, target])
                assert 2 <= k <= cfg.prior.max_classes and info.n_classes[i] == k
        else:
            assert task == IMPUTATION
            assert torch.equal(ctx, batch.row_valid[i]), "imputation context is every row"
            observed = int((valid[i] & ~x.isnan()).sum())
            frac = int(q.sum()) / observed
            lo, hi = cfg.mask_fraction
            assert lo - 1 / observed <= frac <= max(hi + 1 / observed, 1 / observed)
    return info.tasks


def test_episode_invariants_and_mix():
    cfg = StreamConfig.preset("tiny", classification=0.5, regression=0.2, imputation=0.3,
                              context_fraction=(0.2, 0.6), mask_fraction=(0.1, 0.2))
    stream = SynthStream(cfg, seed=4)
    tasks = []
    p = 0
    while len(tasks) < 900:
        tasks += episodes_of(*stream.episode_at(p), cfg)
        p += 1
    n = len(tasks)
    for task, want in cfg.mix.items():
        got = tasks.count(task) / n
        assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / n) + 0.01, (task, got, want)


def test_mix_with_zero_weights():
    cfg = StreamConfig.preset("tiny", classification=0.0, regression=0.0, imputation=1.0)
    _, info = SynthStream(cfg, seed=1).episode_at(0)
    assert set(info.tasks) == {IMPUTATION}
    cfg = StreamConfig.preset("tiny", classification=2 / 3, regression=0.0, imputation=0.0)  # normalised
    tasks = sum((SynthStream(cfg, seed=1).episode_at(p)[1].tasks for p in range(3)), ())
    assert set(tasks) == {CLASSIFICATION}


def _table(X, kind, card, task=REGRESSION):
    X = np.asarray(X, dtype=np.float32)
    return SynthTable(X=X, kind=np.asarray(kind, np.int8), cardinality=np.asarray(card, np.int64),
                      target=X.shape[1] - 1, task=task)


def test_episodes_on_a_padded_batch():
    rng = np.random.default_rng(0)
    small = _table(rng.standard_normal((5, 3)), [1, 1, 1], [0, 0, 0])
    X = rng.standard_normal((8, 4))
    X[:, 0] = np.nan  # a column with nothing observed is never queried
    X[2, 1] = np.nan
    big = _table(X, [1, 1, 1, 1], [0, 0, 0, 0])
    e_small = prediction_episode(small, rng, (0.5, 0.5))
    e_big = imputation_episode(big, rng, (1.0, 1.0))
    batch = pack([small, big], [e_small, e_big], rows=8, cols=4).validate()
    assert batch.shape == (2, 8, 4)
    assert batch.row_valid[0].tolist() == [True] * 5 + [False] * 3
    assert batch.col_valid[0].tolist() == [True] * 3 + [False]
    assert not batch.query[0, 5:].any() and not batch.query[0, :, 3].any()
    assert int(batch.query[0].sum()) == 5 - int(batch.context[0].sum())
    # mask fraction 1: every observed cell, no NaN cell
    assert torch.equal(batch.query[1], ~batch.x[1].isnan())
    assert bool(batch.context[1].all())


def _numeric(n_rows=200, n_cols=4, seed=0, nan_col=None):
    X = np.random.default_rng(seed).standard_normal((n_rows, n_cols))
    if nan_col is not None:
        X[::7, nan_col] = np.nan
    return _table(X, [1] * n_cols, [0] * n_cols)


def test_mcar_default_draws_as_before_mechanisms_existed():
    """The default (MCAR only) mask is the plain uniform draw, number for number."""
    table = _numeric(nan_col=2)
    got = imputation_episode(table, np.random.default_rng(3), (0.1, 0.4)).query
    rng = np.random.default_rng(3)  # the pre-mechanism recipe by hand
    observed = np.flatnonzero(~np.isnan(table.X).ravel())
    k = int(round(rng.uniform(0.1, 0.4) * observed.size))
    want = np.zeros(table.X.size, dtype=bool)
    want[rng.choice(observed, size=k, replace=False)] = True
    assert np.array_equal(got, want.reshape(table.X.shape))


def test_mar_never_hides_its_driver_and_hides_by_it():
    """MAR: one fully observed column drives which rows lose cells; that column stays visible."""
    table = _numeric(n_rows=400, n_cols=5, nan_col=0)  # column 0 has NaNs: never a driver
    shifts = []
    for seed in range(20):
        q = imputation_episode(table, np.random.default_rng(seed), (0.3, 0.3), (0.0, 1.0, 0.0)).query
        hidden_cols = q.any(axis=0)
        assert hidden_cols[0] and hidden_cols.sum() == 4  # exactly one column (the driver) is untouched
        driver = int(np.flatnonzero(~hidden_cols)[0])
        assert driver != 0
        z = table.X[:, driver]
        hidden_rows = q.sum(axis=1) > 0
        shifts.append(abs(z[hidden_rows].mean() - z[~hidden_rows].mean()))
        hideable = np.count_nonzero(~np.isnan(np.delete(table.X, driver, axis=1)))
        assert int(q.sum()) == int(round(0.3 * hideable))
    assert np.mean(shifts) > 0.5  # the driver's value, not chance, picks the rows


def test_mnar_hidden_values_lean_with_the_slope():
    """MNAR (self-masking): hidden cells' own values sit away from the mean; MCAR's do not."""
    table = _numeric(n_rows=400, n_cols=3)
    x = table.X
    mnar = [abs(x[imputation_episode(table, np.random.default_rng(s), (0.2, 0.2), (0.0, 0.0, 1.0)).query].mean())
            for s in range(20)]
    mcar = [abs(x[imputation_episode(table, np.random.default_rng(s), (0.2, 0.2)).query].mean()) for s in range(20)]
    assert np.mean(mnar) > 0.5 > 0.2 > np.mean(mcar)


def test_mask_mechanisms_reach_the_stream_and_are_normalised():
    cfg = StreamConfig.preset("pretrain-impute")
    assert cfg.mask_mechanisms == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert StreamConfig.preset("tiny", mask_mechanisms=(0, 2, 2)).mask_mechanisms == (0.0, 0.5, 0.5)
    cfg = StreamConfig.preset("tiny", classification=0.0, regression=0.0, imputation=1.0, mask_mechanisms=(0, 0, 1))
    batch, _ = SynthStream(cfg, seed=2).episode_at(0)
    assert bool(batch.query.any())


def test_pretrain_missing_empties_feature_cells_of_prediction_episodes():
    """pretrain-missing: prediction episodes' features are missing about 4x as often as pretrain-nominal's
    (60 % of tables at 5-60 % against 30 % at 1-30 %: expected shares ~0.195 and ~0.047), the target never."""
    def feature_missing_share(name: str) -> float:
        stream = SynthStream(StreamConfig.preset(name, classification=1.0, regression=0.0, imputation=0.0,
                                                 max_rows=128, max_cols=12, max_cells=1536, cells_per_batch=4096), seed=5)
        missing = cells = 0
        for pos in range(12):
            for j in range(4):
                table, episode = stream.table(pos, j)
                features = np.arange(table.shape[1]) != table.target
                assert not np.isnan(table.X[:, table.target]).any()
                missing += int(np.isnan(table.X[:, features]).sum())
                cells += int(table.X[:, features].size)
        return missing / cells
    nominal, heavy = feature_missing_share("pretrain-nominal"), feature_missing_share("pretrain-missing")
    assert 0.12 < heavy < 0.3 and nominal < 0.09 and heavy > 2.5 * nominal


def test_residual_targets_are_what_a_context_fitted_ridge_misses():
    """residual_targets=1: a regression episode's target is y minus sklearn's Ridge(alpha=1) on the
    features' design, fitted on the context rows (out of fold for them, 5 folds from the episode's own
    generator); every other cell, and every classification table of the stream, is as without."""
    from sklearn.linear_model import Ridge
    from tabfm.data.neighbors import design
    from tabfm.synth.stream import table_rng

    kw = dict(classification=0.5, regression=0.5, imputation=0.0, max_rows=96, max_cols=6, max_cells=576, cells_per_batch=2048)
    plain = SynthStream(StreamConfig.preset("tiny", **kw), seed=4)
    resid = SynthStream(StreamConfig.preset("tiny", **kw, residual_targets=1.0), seed=4)
    n_reg = 0
    for pos, j in itertools.product(range(3), range(4)):
        (t0, e0), (t1, e1) = plain.table(pos, j), resid.table(pos, j)
        np.testing.assert_array_equal(e0.context, e1.context)
        feats = np.arange(t0.shape[1]) != t0.target
        np.testing.assert_array_equal(np.nan_to_num(t0.X[:, feats], nan=-7), np.nan_to_num(t1.X[:, feats], nan=-7))
        if t0.task != "regression":
            np.testing.assert_array_equal(np.nan_to_num(t0.X, nan=-7), np.nan_to_num(t1.X, nan=-7))
            continue
        n_reg += 1
        ctx, y = e0.context, t0.X[:, t0.target].astype(np.float64)
        a, b = design(t0.X[ctx][:, feats], t0.X[~ctx][:, feats], t0.kind[feats], t0.cardinality[feats])
        want_q = y[~ctx] - Ridge(alpha=1.0).fit(a, y[ctx]).predict(b)
        np.testing.assert_allclose(t1.X[~ctx, t0.target], want_q, rtol=1e-4, atol=1e-4)
        rng = table_rng(4, pos, 0, j, 4)
        rng.random()  # the draw that chose a residual target
        folds = rng.permutation(int(ctx.sum())) % min(5, int(ctx.sum()))
        want_c = np.empty(int(ctx.sum()))
        for f in np.unique(folds):
            held = folds == f
            want_c[held] = y[ctx][held] - Ridge(alpha=1.0).fit(a[~held], y[ctx][~held]).predict(a[held])
        np.testing.assert_allclose(t1.X[ctx, t0.target], want_c, rtol=1e-4, atol=1e-4)
    assert n_reg >= 3


# ------------------------------------------------------------------ bad config
@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("min_rows", dict(min_rows=-4)),
        ("max_rows", dict(max_rows=-1)),
        ("min_rows", dict(min_rows=100, max_rows=50)),
        ("min_cols", dict(min_cols=9, max_cols=4)),
        ("min_cols", dict(min_cols=1)),
        ("max_cells", dict(max_cells=0)),
        ("max_cells", dict(max_cells=10)),
        ("row_quantum", dict(row_quantum=0)),
        ("row_quantum", dict(min_rows=10, max_rows=12, row_quantum=8)),
        ("cells_per_batch", dict(cells_per_batch=100)),
        ("max_batch", dict(max_batch=0)),
        ("classification", dict(classification=1.5)),
        ("regression", dict(regression=-0.1)),
        ("mix", dict(classification=0.0, regression=0.0, imputation=0.0)),
        ("context_fraction", dict(context_fraction=(0.8, 0.2))),
        ("mask_fraction", dict(mask_fraction=(0.1, 1.5))),
        ("mask_mechanisms", dict(mask_mechanisms=(1.0, 0.0))),
        ("residual_targets", dict(residual_targets=1.5)),
        ("mask_mechanisms", dict(mask_mechanisms=(1.0, -1.0, 0.5))),
        ("mask_mechanisms", dict(mask_mechanisms=(0, 0, 0))),
    ],
)
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        StreamConfig.preset("tiny", **kwargs)


def test_bad_prior_or_stream_arguments():
    with pytest.raises(ValueError, match="max_classes"):
        StreamConfig(prior=PriorConfig(max_classes=1))
    with pytest.raises(ValueError, match="p_classification"):
        StreamConfig(prior=PriorConfig(p_classification=1.5))
    with pytest.raises(ValueError, match="preset"):
        StreamConfig.preset("huge")
    with pytest.raises(ValueError, match="seed"):
        SynthStream(TINY, seed=-1)
    with pytest.raises(ValueError, match="rank"):
        SynthStream(TINY, rank=2, world_size=2)
    with pytest.raises(ValueError, match="mode"):
        SynthDataset(TINY, mode="tensors")


# ------------------------------------------------------------------------- CLI
def test_cli_synth_summary(capsys, tmp_path):
    from tabfm.cli import main

    out = tmp_path / "summary.json"
    assert main(["synth", "--batches", "3", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("tables/s", "cells/s", "episode mix", "classification", "imputation", "missing rate", "categorical"):
        assert word in text
    d = json.loads(out.read_text())
    want = [SynthStream(StreamConfig(), seed=0).batch_at(p) for p in range(3)]
    assert d["batches"] == 3
    assert d["tables"] == sum(len(b) for b in want)
    assert d["cells"] == sum(b.num_cells for b in want)
    assert sum(v["tables"] for v in d["tasks"].values()) == d["tables"]


def test_cli_small_raw_and_errors(capsys):
    from tabfm.cli import main

    assert main(["synth", "--preset", "tiny", "--batches", "2", "--raw", "--no-progress"]) == 0
    assert "dtype" in capsys.readouterr().out
    assert main(["synth", "--preset", "tiny", "--rows", "10:40", "--cols", "3:5", "--batches", "2", "--no-progress"]) == 0
    assert main(["synth", "--rows", "50:10", "--no-progress"]) == 2
    assert "min_rows" in capsys.readouterr().err
