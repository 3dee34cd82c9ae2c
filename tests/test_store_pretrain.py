"""Pretraining from a table store: tabfm.data.store_episodes (bucketed episode batches, exact resume over
epochs and worker counts, disjoint data-parallel ranks, clear errors) and `tabfm pretrain --data`
(the loss on store tables falls, a killed run resumes to the uninterrupted result, a run is resumed
only on the same store)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris, load_wine

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.data.store import list_store, read_table, write_table
from tabfm.data.store_episodes import StoreEpisodes, encode_store_table, open_store, store_fingerprint
from tabfm.data.table_episodes import IMPUTATION, EpisodeConfig
from tabfm.cli import main
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.train import PretrainConfig
from tabfm.train.pretrain import pretrain
from tabfm.train.trainer import Trainer

KW = dict(cells_per_batch=2048, max_batch=16)  # the smoke preset's (stream "tiny") batch budget


def frames() -> list[tuple[str, pd.DataFrame, str | None, str | None]]:
    """12 small tables: classification, regression, imputation-only, missing targets, strings, dates."""
    iris = load_iris(as_frame=True).frame
    iris["target"] = np.array(["setosa", "versicolor", "virginica"])[iris["target"]]
    wine = load_wine(as_frame=True).frame
    diabetes = load_diabetes(as_frame=True).frame
    cancer = load_breast_cancer(as_frame=True).frame
    rng = np.random.default_rng(0)
    n = 120
    mixed = pd.DataFrame({
        "colour": rng.choice(["red", "green", "blue"], n),
        "when": pd.date_range("2020-01-01", periods=n, freq="D"),
        "size": rng.normal(size=n),
        "flag": rng.random(n) < 0.5,
    })
    mixed["price"] = 3 * mixed["size"] + (mixed["colour"] == "red") + rng.normal(scale=0.1, size=n)
    mixed.loc[rng.random(n) < 0.2, "price"] = np.nan  # missing targets: left out of prediction episodes
    gappy = iris.copy()
    gappy.loc[rng.random(len(gappy)) < 0.3, "target"] = None
    return [
        ("iris", iris, "target", "classification"),
        ("iris-features", iris.drop(columns=["target"]).iloc[:100], None, None),
        ("wine", wine, "target", None),  # task inferred: integer classes
        ("wine-half", wine.iloc[::2].reset_index(drop=True), "target", "classification"),
        ("wine-alcohol", wine.drop(columns=["target"]), "alcohol", "regression"),
        ("diabetes", diabetes, "target", "regression"),
        ("diabetes-150", diabetes.iloc[:150].reset_index(drop=True), "target", "regression"),
        ("diabetes-impute", diabetes.iloc[:80].reset_index(drop=True), "target", "imputation"),
        ("cancer", cancer.iloc[:200].reset_index(drop=True), "target", "classification"),
        ("mixed", mixed, "price", "regression"),
        ("iris-gappy", gappy, "target", None),
        ("one-class", iris.iloc[:40].reset_index(drop=True), "target", "classification"),  # falls back to imputation
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "tables"
    for name, frame, target, task in frames():
        write_table(path, name, frame, target=target, task=task, source="test")
    return path


def source(store, **kw) -> StoreEpisodes:
    return StoreEpisodes(store, EpisodeConfig(max_classes=10), **{**KW, **kw})


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("kind", "cardinality", "row_valid", "col_valid",
                                                                 "context", "query")) \
        and torch.equal(a.x.nan_to_num(-7.5), b.x.nan_to_num(-7.5))


def take(it, n):
    return [next(it) for _ in range(n)]


# ------------------------------------------------------------------ the data source
@pytest.mark.parametrize("features", ["none", "knn-linear"])
def test_batches_are_valid_episodes_of_one_shape_within_budget(store, features):
    """Within the cell budget with the context-feature columns too (a 3-column table with many
    classes shows 3 + 3 per class of them): planned without them, a real run's batch once held
    12x its budget."""
    src = StoreEpisodes(store, EpisodeConfig(max_classes=10, context_features=features), **KW)
    assert len(src.headers) == 12 and src.batches_per_epoch >= 6
    seen, tasks = set(), set()
    widest = 0
    for plan in src.plans(0):
        batch = src.batch(plan).validate()
        b, r, c = batch.shape
        assert (b, r) == (len(plan.indices), plan.rows) and b * r * c <= KW["cells_per_batch"], (plan, batch.shape)
        assert c >= plan.cols if features == "none" else c <= plan.cols  # the class count bounds it from above
        widest = max(widest, c)
        assert batch.query.any() and batch.context.any()
        for j, i in enumerate(plan.indices):
            seen.add(i)
            q = batch.query[j]
            tasks.add("prediction" if bool(q[:, :-1].sum() == 0) and q.any() else "imputation")
    assert seen | set(src.sampler.dropped(0)) == set(range(12))
    assert tasks == {"prediction", "imputation"}
    assert widest > 30 + (6 if features == "knn-linear" else 0)  # cancer's 30 features + target (+ 2 x 3 columns)


def test_store_imputation_episodes_follow_the_mechanisms(store):
    """MAR hides cells by a fully observed driver column, which stays visible; MCAR at half the cells
    leaves no column untouched. `tabfm pretrain --data` takes the stream preset's masks."""
    from tabfm.train.pretrain import store_data

    def untouched_columns(mechanisms):
        cfg = EpisodeConfig(max_classes=10, imputation=1.0, mask_fraction=(0.5, 0.5), mask_mechanisms=mechanisms)
        counts = []
        for plan in StoreEpisodes(store, cfg, **KW).plans(0):
            batch = StoreEpisodes(store, cfg, **KW).batch(plan)
            for j in range(batch.shape[0]):
                x = batch.x[j][batch.row_valid[j]][:, batch.col_valid[j]]
                q = batch.query[j][batch.row_valid[j]][:, batch.col_valid[j]]
                if x.shape[1] > 1 and bool((~x.isnan()).all(dim=0).any()):  # a fully observed column exists
                    counts.append(int((~q.any(dim=0)).sum()))
        return counts

    mar, mcar = untouched_columns((0, 1, 0)), untouched_columns((1, 0, 0))
    assert len(mar) >= 6 and set(mar) == {1}
    assert set(mcar) == {0}
    cfg = PretrainConfig.preset("smoke", data=str(store), stream="pretrain-impute")
    episodes = store_data(cfg, None, 0, 1, 10).episodes
    assert episodes.mask_fraction == (0.05, 0.55) and episodes.mask_mechanisms == pytest.approx((1 / 3,) * 3)


def test_encoding_store_tables(store):
    headers = {h.name: h for h in list_store(store)}
    iris = encode_store_table(headers["iris"], read_table(headers["iris"]))
    assert iris.task == "classification" and iris.n_cols == 5 and iris.cardinality[-1] == 3
    assert iris.kind[-1] == CATEGORICAL
    wine = encode_store_table(headers["wine"], read_table(headers["wine"]))
    assert wine.task == "classification" and wine.cardinality[-1] == 3  # inferred from integer classes
    mixed = encode_store_table(headers["mixed"], read_table(headers["mixed"]))
    frame = read_table(headers["mixed"])
    assert mixed.task == "regression" and mixed.kind[-1] == NUMERIC
    assert np.array_equal(mixed.rows, np.flatnonzero(frame["price"].notna()))  # rows without a target left out
    assert mixed.n_cols > 5  # the date expands into parts
    for name in ("iris-features", "diabetes-impute", "one-class"):
        t = encode_store_table(headers[name], read_table(headers[name]))
        assert t.task == IMPUTATION and t.n_cols == headers[name].n_cols and t.n_rows == headers[name].n_rows


def test_resume_sees_exactly_the_uninterrupted_batches_across_epochs_and_workers(store):
    src = source(store)
    n_epoch = src.batches_per_epoch
    straight = take(iter(source(store)), 2 * n_epoch + 3)  # into the third epoch
    for cut, workers in ((3, 0), (n_epoch, 2), (n_epoch + 2, 0)):
        first = source(store, num_workers=workers)
        it = iter(first)
        head = take(it, cut)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
        resumed = source(store, num_workers=2 - workers)
        resumed.load_state_dict(state)
        tail = take(iter(resumed), len(straight) - cut)
        got = head + tail
        assert all(same(a, b) for a, b in zip(straight, got)), (cut, workers)
    assert resumed.epoch == 2


def test_two_ranks_get_disjoint_tables(store):
    ranks = [source(store, world_size=2, rank=r) for r in (0, 1)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch
    for epoch in (0, 1):
        p0, p1 = ranks[0].plans(epoch), ranks[1].plans(epoch)
        t0 = {i for p in p0 for i in p.indices}
        t1 = {i for p in p1 for i in p.indices}
        assert t0 and t1 and not t0 & t1
        assert t0 | t1 | set(ranks[0].sampler.dropped(epoch)) == set(range(12))
    b0, b1 = next(iter(ranks[0])), next(iter(ranks[1]))
    assert not same(b0, b1) if b0.shape == b1.shape else True
    with pytest.raises(ValueError, match="same number of data-parallel ranks"):
        source(store).load_state_dict(ranks[0].state_dict())


def test_bad_store_paths_are_clear_errors(tmp_path, store):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nowhere'}: no such table store"):
        open_store(tmp_path / "nowhere")
    (tmp_path / "file.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a table store, it is a file"):
        open_store(tmp_path / "file.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'}: empty table store"):
        StoreEpisodes(tmp_path / "empty")
    plain = tmp_path / "plain"
    plain.mkdir()
    pd.DataFrame({"a": [1.0, 2.0]}).to_parquet(plain / "t.parquet")
    with pytest.raises(ValueError, match="without a tabfm header"):
        open_store(plain)
    with pytest.raises(ValueError, match="another store"):
        other = source(store)
        state = other.state_dict()
        state["store"] = "0" * 16
        source(store).load_state_dict(state)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'}: empty table store"):
        pretrain(PretrainConfig.preset("smoke", data=str(tmp_path / "empty")), out, progress=False)
    assert not out.exists()  # nothing written for a bad store
    assert main(["pretrain", "--preset", "smoke", "--data", str(tmp_path / "nowhere"), "--out", str(out),
                 "--quiet"]) == 2


# ------------------------------------------------------------------ pretraining
def smoke(store, **kw) -> PretrainConfig:
    return PretrainConfig.preset("smoke", data=str(store), eval_batches=0, **kw)


def params(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "export" / "model.safetensors"))


def store_loss(model: TabFM, store) -> float:
    """Mean loss over one epoch of episodes posed with another seed (the same tables, other episodes)."""
    src = source(store, seed=123)
    model.eval()
    with torch.no_grad():
        losses = [float(masked_cell_loss(model(src.batch(p)), src.batch(p))[0]) for p in src.plans(0)]
    return float(np.mean(losses))


def test_pretraining_on_a_store_lowers_the_loss_on_its_tables(tmp_path, store):
    cfg = smoke(store, steps=30, lr=3e-3, warmup_steps=3, ckpt_every=30, eval_every=30)
    torch.manual_seed(cfg.seed)
    before = store_loss(TabFM(ModelConfig.preset(cfg.model)), store)  # the initialisation pretrain() starts from
    result = pretrain(cfg, tmp_path, progress=False)
    trained = TabFM(ModelConfig.preset(cfg.model))
    trained.load_state_dict(params(tmp_path))
    after = store_loss(trained, store)
    assert result.step == 30 and result.stopped == "steps"
    assert after < before - 0.2, (before, after)
    saved = json.loads((tmp_path / "train_config.json").read_text())
    assert saved["data"] == str(store)
    assert saved["data_store"] == {"path": str(store.resolve()), "fingerprint": store_fingerprint(list_store(store)),
                                   "tables": 12}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records if r["kind"] == "train")


def test_killed_store_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, store):
    # 14 steps cross an epoch boundary (the store packs into fewer batches per epoch)
    cfg = smoke(store, steps=14, ckpt_every=7, eval_every=100)
    assert source(store).batches_per_epoch < 14
    pretrain(cfg, tmp_path / "straight", progress=False)
    save = Trainer.save

    def crash_after_first_checkpoint(self):
        path = save(self)
        if self.step == 7:
            raise KeyboardInterrupt("simulated kill right after the step-7 checkpoint")
        return path

    monkeypatch.setattr(Trainer, "save", crash_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(Trainer, "save", save)
    result = pretrain(cfg, tmp_path / "resumed", progress=False)
    assert result.step == 14
    a, b = params(tmp_path / "straight"), params(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_store_or_the_stream(tmp_path, store):
    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    out = tmp_path / "run"
    pretrain(smoke(mine, steps=1), out, progress=False)
    with pytest.raises(ValueError, match="trained on table store .* this one trains on"):
        pretrain(smoke(store, steps=2), out, progress=False)  # same tables, another path
    with pytest.raises(ValueError, match="this one trains on the synthetic stream"):
        pretrain(PretrainConfig.preset("smoke", steps=2, eval_batches=0), out, progress=False)
    with pytest.raises(ValueError, match="data_cells_per_batch"):
        pretrain(smoke(mine, steps=2, data_cells_per_batch=4096), out, progress=False)
    write_table(mine, "extra", pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": [0.5, 0.1, 0.2]}))
    with pytest.raises(ValueError, match="tables were added, removed or replaced"):
        pretrain(smoke(mine, steps=2), out, progress=False)
    synthetic = tmp_path / "synthetic"
    pretrain(PretrainConfig.preset("smoke", steps=1, eval_batches=0), synthetic, progress=False)
    with pytest.raises(ValueError, match="holds a run trained on the synthetic stream"):
        pretrain(smoke(store, steps=2), synthetic, progress=False)


def test_config_checks_the_data_fields():
    with pytest.raises(ValueError, match="PretrainConfig.data "):
        PretrainConfig.preset("smoke", data="")
    with pytest.raises(ValueError, match="PretrainConfig.data_max_batch"):
        PretrainConfig.preset("smoke", data_max_batch=0)
    with pytest.raises(ValueError, match="PretrainConfig.data_share"):
        PretrainConfig.preset("smoke", data_share=0.5)  # a share needs a store
    with pytest.raises(ValueError, match="PretrainConfig.data_share"):
        PretrainConfig.preset("smoke", data="x", data_share=1.5)


# ------------------------------------------------------------------ store + synthetic mixture
class Counter:
    """A resumable stream of (name, i) items: what MixedBatches needs of a loader."""

    def __init__(self, name):
        self.name, self.i = name, 0

    def __iter__(self):
        while True:
            self.i += 1
            yield self.name, self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def test_mixture_draws_the_share_from_the_store_and_resumes_exactly():
    from tabfm.train.mixed_data import MixedBatches

    mix = MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=4)
    first = take(iter(mix), 2000)
    share = np.mean([name == "store" for name, _ in first])
    assert abs(share - 0.3) < 0.03, share
    # each stream is consumed in order, none skipped: the i-th store batch is the store's i-th item
    for name in ("synth", "store"):
        got = [i for n, i in first if n == name]
        assert got == list(range(len(got)))
    assert [n for n, _ in first] == [n for n, _ in take(iter(MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=4)), 2000)]
    assert [n for n, _ in first[:50]] != [n for n, _ in take(iter(MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=5)), 50)]

    straight = MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=4)
    it = iter(straight)
    take(it, 37)
    state = json.loads(json.dumps(straight.state_dict()))  # what a checkpoint stores
    resumed = MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=4)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 100) == take(it, 100)
    with pytest.raises(ValueError, match="data share 0.3"):
        MixedBatches(Counter("synth"), Counter("store"), 0.5, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not a mixture"):
        MixedBatches(Counter("synth"), Counter("store"), 0.3, seed=4).load_state_dict({"seed": 0, "position": 3})


def test_mixed_run_through_the_command_resumes_to_the_uninterrupted_result(tmp_path, store):
    """`tabfm pretrain --data STORE --data-share 0.5`: store and synthetic batches both train, a run
    stopped at step 4 and resumed to 8 ends where an uninterrupted 8-step run does."""
    flags = ["pretrain", "--preset", "smoke", "--data", str(store), "--data-share", "0.5", "--eval-batches", "0",
             "--no-sklearn-eval", "--ckpt-every", "4", "--quiet"]
    assert main(flags + ["--steps", "8", "--out", str(tmp_path / "straight")]) == 0
    assert main(flags + ["--steps", "8", "--max-minutes", "1e-9", "--out", str(tmp_path / "resumed")]) == 0
    assert main(flags + ["--steps", "8", "--out", str(tmp_path / "resumed")]) == 0
    a, b = params(tmp_path / "straight"), params(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = json.loads((tmp_path / "straight" / "train_config.json").read_text())
    assert saved["data_share"] == 0.5
    extra = json.loads((tmp_path / "straight" / "checkpoints" / "step_000008" / "extra.json").read_text())
    data = extra["state"]["trainer"]["data"]  # both streams trained: their positions add up to the 8 batches
    assert data["mix"]["position"] == 8 and data["synthetic"]["position"] >= 1 and data["store"]["sampler"]["position"] >= 1
    assert data["synthetic"]["position"] + data["store"]["sampler"]["position"] == 8
    with pytest.raises(ValueError, match="data_share"):
        pretrain(smoke(store, steps=9, data_share=0.25, ckpt_every=4), tmp_path / "straight", progress=False)
