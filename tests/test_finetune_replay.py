"""`tabfm finetune --replay-data` and `--holdout-tables`, checked against references built here.

Replay: the replayed positions are the documented draw (SeedSequence(seed, spawn_key=(3, p)): u < F,
then v < 1/2 picks the tables when the prior is on too), their batches hold rows (and values) of the
replay tables' training rows only, the same for every rank's position and for a second build, and a
crashed run resumes to the uninterrupted one. Held-out tables: the seeded choice, never a row or a
value of them in any training batch, and their step-0 score equals TabFMClassifier's in context with
the init weights. Refusals name the numbers and files.
"""
import json
import zlib

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.linear_model import Ridge

from tabfm.cli import main
from tabfm.data.batch import NUMERIC
from tabfm.data.neighbors import design
from tabfm.data.store import write_table
from tabfm.data.table_episodes import TableEpisodeSampler, holdout_split
from tabfm.model import ModelConfig
from tabfm.train.finetune import (BestKeeper, FinetuneConfig, FinetuneData, finetune, finetune_data,
                                  load_replay_tables, load_tables)
from tabfm.train.metrics_log import read_metrics
from tabfm.train.pretrain import checkpoint_model_state
from tabfm.train.trainer import Trainer

from tests.test_finetune import random_cf_export, random_export  # noqa: F401  (fixtures)

SMALL = dict(d_model=32, n_layers=2, n_heads=2, context_features="knn-linear")
F32 = np.float32


def rules(n: int, seed: int, target: str = "y") -> pd.DataFrame:
    """A small classification table; its continuous cells are distinct across seeds (to trace them)."""
    rng = np.random.default_rng(seed)
    x0, x1 = rng.normal(size=(2, n))
    color = rng.choice(["red", "blue"], size=n)
    return pd.DataFrame({"x0": x0, "x1": x1, "color": color,
                         target: np.where(x0 + 0.5 * x1 + 0.5 * (color == "red") > 0.2, "yes", "no")})


def amounts(n: int, seed: int) -> pd.DataFrame:
    """A regression table with another target column than the fine-tuning tables'."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"u": rng.normal(size=n), "v": rng.normal(size=n)})
    frame["amount"] = 2 * frame["u"] - frame["v"] + 0.1 * rng.normal(size=n)
    return frame


@pytest.fixture(scope="module")
def init(random_cf_export) -> str:
    """A small random-init export with context features (tabfm-tiny-cf's input contract)."""
    return random_cf_export


@pytest.fixture(scope="module")
def plain_init(random_export) -> str:
    """As `init`, without context features: several times cheaper episodes, for the three-run resume test."""
    return random_export


@pytest.fixture
def replay_store(tmp_path):
    """An earlier table store: a regression table (target 'amount') and a classification table (target
    'label'), the targets its headers name, neither the fine-tuning target 'y'."""
    store = tmp_path / "old"
    write_table(store, "old_amounts", amounts(90, 7), target="amount", task="regression")
    write_table(store, "old_labels", rules(80, 8, target="label"), target="label", task="classification")
    return store


def smoke(init: str, **kw) -> FinetuneConfig:
    # significance 0: runs of a few steps test the mechanics of training and export, and rarely move
    # the held-out loss by two standard errors (the paired test has tests of its own)
    return FinetuneConfig.preset("smoke", init=init, target="y", threads=1, **{"significance": 0.0, **kw})


def reference_source(seed: int, position: int, share: float, prior: bool) -> str:
    """The documented replay draw, recomputed: u < share replays; with the prior on too, v < 1/2 picks the tables."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(3, position)))
    if not rng.random() < share:
        return "data"
    return "prior" if prior and not rng.random() < 0.5 else "replay"


def training_rows(frame: pd.DataFrame, target: str, name: str, classification: bool) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of a table, as holdout_split cuts them for a table of this name."""
    strata = np.unique(frame[target], return_inverse=True)[1] if classification else None
    return holdout_split(len(frame), 0.2, 0, strata, stream=zlib.crc32(name.encode()))


def run_cli(args, capsys) -> tuple[int, str, str]:
    code = main(["finetune", *args, "--quiet", "--threads", "1"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ----------------------------------------------------------------------------- replay


def test_replay_batches_are_the_replay_tables_training_rows_at_the_seeded_positions(tmp_path, init, replay_store):
    data_csv = tmp_path / "rules.csv"
    rules(120, 0).to_csv(data_csv, index=False)
    cfg = smoke(init, data=str(data_csv), replay=0.3, replay_data=str(replay_store))
    assert cfg.replay_prior() is None  # --replay-data turns the prior off by default
    model_cfg = ModelConfig.preset("tiny", **SMALL)
    tables, replay = load_tables(cfg.data, cfg), load_replay_tables(cfg)
    assert [(t.name, t.target, t.task) for t in replay] == [("old_amounts", "amount", "regression"),
                                                            ("old_labels", "label", "classification")]
    data = finetune_data(cfg, tables, replay, BestKeeper(0, 0.0), model_cfg)
    again = finetune_data(cfg, tables, replay, BestKeeper(0, 0.0), model_cfg)
    rank1 = finetune_data(cfg, tables, replay, BestKeeper(0, 0.0), model_cfg, rank=1, world_size=2)
    # the replay episodes are posed as the fine-tuning ones: the same settings, the model's context features
    assert data.replay_tables.cfg == data.sampler.cfg and data.sampler.cfg.context_features == "knn-linear"

    frames = {"old_amounts": amounts(90, 7), "old_labels": rules(80, 8, target="label")}
    splits = {"old_amounts": training_rows(frames["old_amounts"], "amount", "old_amounts", False),
              "old_labels": training_rows(frames["old_labels"], "label", "old_labels", True)}
    data_values = rules(120, 0)[["x0", "x1"]].to_numpy(F32).ravel()
    n, sources, tasks, rank_rows_differ, posed = 40, [], {}, 0, set()
    for p in range(n):
        batch, source, info = data.episode_at(p)
        sources.append(source)
        if p < 12:
            b2, s2, _ = again.episode_at(p)
            assert s2 == source and torch.equal(batch.x.nan_to_num(-9), b2.x.nan_to_num(-9))  # seeded: the same batches
        b1, s1, i1 = rank1.episode_at(p)
        assert s1 == source and b1.x.shape == batch.x.shape  # every rank replays at p, at one cost
        values = batch.x[batch.row_valid].numpy().ravel()
        if source == "data":
            assert info.table == "rules"
            continue
        frame = frames[info.table]
        train, held = splits[info.table]
        cont = ["u", "v", "amount"] if info.table == "old_amounts" else ["x0", "x1"]
        assert not np.isin(data_values, values).any()  # nothing of the fine-tuning table
        assert not np.isin(frame[cont].iloc[held].to_numpy(F32).ravel(), values).any()  # nor replay-held-out rows
        for j, rows in enumerate(info.rows):
            assert len(rows) == batch.x.shape[1] <= len(train) and set(rows) <= set(train)  # its training rows
            shown = batch.x[j].numpy().ravel()
            assert np.isin(frame[cont[:2]].iloc[rows].to_numpy(F32).ravel(), shown).all()  # exactly those rows
            if info.tasks[j] == "regression":  # its own target, not --target's: the ridge residual or the target
                x, ctx = batch.x[j].numpy().astype(np.float64), batch.context[j].numpy()  # (the regressor's mixed members)
                amount, target = frame["amount"].iloc[rows].to_numpy(np.float64), int(batch.col_valid[j].sum()) - 1
                a, b = design(x[ctx, :2], x[~ctx, :2], np.array([NUMERIC, NUMERIC]), np.array([0, 0]))
                want = amount[~ctx] - Ridge(alpha=1.0).fit(a, amount[ctx]).predict(b)
                residual = np.allclose(x[~ctx, target], want, rtol=1e-4, atol=1e-4)
                assert residual or np.allclose(x[~ctx, target], amount[~ctx], rtol=1e-4, atol=1e-4)
                posed.add(residual)
            tasks.setdefault(info.table, set()).add(info.tasks[j])
        rank_rows_differ += any(not np.array_equal(a, b) for a, b in zip(info.rows, i1.rows))
    want = [reference_source(0, p, 0.3, prior=False) for p in range(n)]
    assert sources == want and 0.15 < sources.count("replay") / n < 0.5
    assert "regression" in tasks["old_amounts"] <= {"regression", "imputation"} and "classification" in tasks["old_labels"]
    assert rank_rows_differ  # ranks draw other episodes at the same positions
    assert posed == {True, False}  # regression episodes posed both ways

    # both: a preset with --replay-data splits the replayed positions, by the second draw of the position
    from tabfm.synth.stream import StreamConfig, SynthStream

    both = finetune_data(cfg.replace(replay_stream="tiny"), tables, replay, BestKeeper(0, 0.0), model_cfg)
    mixed = [both.source_at(p) for p in range(n)]
    assert mixed == [reference_source(0, p, 0.3, prior=True) for p in range(n)] and {"prior", "replay"} <= set(mixed)
    assert [s == "data" for s in mixed] == [s == "data" for s in sources]
    p = mixed.index("prior")
    prior = SynthStream(StreamConfig.preset("tiny", context_features="knn-linear"), seed=0)
    assert torch.equal(both.batch_at(p).x.nan_to_num(-9), prior.batch_at(p).x.nan_to_num(-9))


def test_a_crashed_replay_run_resumes_to_the_uninterrupted_one(tmp_path, plain_init, replay_store, monkeypatch):
    """The end-to-end run: it draws the replay tables at the seeded positions; a run killed after its
    step-3 checkpoint resumes drawing the very batches the uninterrupted run drew, to the same weights;
    resuming with other replay tables is refused."""
    frame = rules(100, 1)
    cfg = smoke(plain_init, steps=4, eval_every=2, ckpt_every=2, patience=0, lr=1e-3, replay=0.5,
                replay_data=str(replay_store))
    drawn: dict[str, list] = {}
    episode_at, current = FinetuneData.episode_at, ["straight"]

    def spy(self, position):
        batch, source, info = episode_at(self, position)
        drawn.setdefault(current[0], []).append((position, source, info and info.table, batch.x.nan_to_num(-9)))
        return batch, source, info

    monkeypatch.setattr(FinetuneData, "episode_at", spy)
    straight = finetune(cfg, tmp_path / "straight", data=frame, progress=False)

    save = Trainer.save

    def crash_after_first_checkpoint(self):
        path = save(self)
        if self.step == 2:
            raise KeyboardInterrupt("simulated kill right after the step-2 checkpoint")
        return path

    current[0] = "crashed"
    monkeypatch.setattr(Trainer, "save", crash_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        finetune(cfg, tmp_path / "resumed", data=frame, progress=False)
    monkeypatch.setattr(Trainer, "save", save)
    current[0] = "resumed"
    resumed = finetune(cfg, tmp_path / "resumed", data=frame, progress=False)

    s = drawn["straight"]
    assert [d[0] for d in s] == list(range(4)) and [d[0] for d in drawn["resumed"]] == [2, 3]
    assert [d[1] for d in s] == [reference_source(0, p, 0.5, prior=False) for p in range(4)]
    assert {d[2] for d in s if d[1] == "replay"} <= {"old_amounts", "old_labels"} and any(d[1] == "replay" for d in s)
    assert {d[2] for d in s if d[1] == "data"} == {"frame0"}
    assert len(drawn["crashed"]) == 2
    for a, b in zip(s, drawn["crashed"] + drawn["resumed"], strict=True):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3])
    assert resumed.best == straight.best and resumed.best_step == straight.best_step
    a = checkpoint_model_state(tmp_path / "straight" / "checkpoints" / "step_000004")
    b = checkpoint_model_state(tmp_path / "resumed" / "checkpoints" / "step_000004")
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "straight" / "finetune_summary.json").read_text())
    assert summary["replay"]["stream"] is None and [t["name"] for t in summary["replay"]["tables"]] == [
        "old_amounts", "old_labels"] and summary["replay"]["tables"][0]["rows"] == 72  # its training rows
    write_table(replay_store, "old_amounts", amounts(90, 9), target="amount", task="regression")  # other content
    with pytest.raises(ValueError, match=r"other replay tables' content \(--replay-data\)"):
        finetune(cfg, tmp_path / "resumed", data=frame, progress=False)


# ----------------------------------------------------------------------------- held-out tables


def test_held_out_tables_are_never_trained_and_scored_as_the_estimators_score(tmp_path, init, replay_store,
                                                                             monkeypatch, capsys):
    """`tabfm finetune --holdout-tables 1` (with replay too) on a directory of three tables."""
    from sklearn.metrics import log_loss
    from tabfm import TabFMClassifier

    tables = tmp_path / "tables"
    tables.mkdir()
    frames = {name: rules(100, seed) for name, seed in (("alpha", 11), ("beta", 12), ("gamma", 13))}
    for name, frame in frames.items():
        frame.to_csv(tables / f"{name}.csv", index=False)
    # the documented choice, recomputed: a permutation seeded by (seed, 4) over the sorted names
    held = sorted(frames)[np.random.default_rng(np.random.SeedSequence(0, spawn_key=(4,))).permutation(3)[0]]
    seen = []
    episode_at = TableEpisodeSampler.episode_at

    def spy(self, position):  # every training batch, of the fine-tuning tables and of the replay tables
        batch, info = episode_at(self, position)
        seen.append((info.table, batch.x[batch.row_valid].numpy().ravel()))
        return batch, info

    monkeypatch.setattr(TableEpisodeSampler, "episode_at", spy)
    out = tmp_path / "run"
    args = ["--data", str(tables), "--target", "y", "--out", str(out), "--preset", "smoke", "--init", init,
            "--steps", "4", "--eval-every", "2", "--patience", "0", "--lr", "3e-3", "--holdout-tables", "1",
            "--replay", "0.2", "--replay-data", str(replay_store)]
    code, printed, _ = run_cli(args, capsys)
    assert code == 0 and "held-out tables (never trained)" in printed and f"{held}/logloss" in printed

    drawn = [t for t, _ in seen]  # position 1 replays (u = 0.117 < 0.2), positions 0, 2, 3 train
    assert len(drawn) == 4 and drawn[1] in ("old_amounts", "old_labels") and held not in drawn
    assert set(drawn[:1] + drawn[2:]) <= set(frames) - {held}
    everything = frames[held][["x0", "x1"]].to_numpy(F32).ravel()  # context and held-out rows alike
    assert not any(np.isin(everything, values).any() for _, values in seen)

    summary = json.loads((out / "finetune_summary.json").read_text())
    unseen = summary["holdout_tables"]
    assert [t["name"] for t in unseen["tables"]] == [held] and unseen["best"]["step"] == summary["best_step"]
    assert sorted(t["name"] for t in summary["tables"]) == sorted(set(frames) - {held})
    assert not any(k.startswith(held + "/") for k in summary["before"])  # not in the training tables' score
    # the hand reference: the init in context on the held-out table's own held-out rows
    frame = frames[held]
    train_i, hold_i = training_rows(frame, "y", held, True)
    params = json.loads((out / "export" / "config.json").read_text())["finetune"]["estimator_params"]
    assert params == {"n_estimators": 1, "random_state": 0, "max_context_rows": 2048}
    clf = TabFMClassifier(model=init, **params).fit(frame.drop(columns="y").iloc[train_i], frame["y"].iloc[train_i])
    proba = clf.predict_proba(frame.drop(columns="y").iloc[hold_i])
    want = log_loss(frame["y"].iloc[hold_i], np.clip(proba, 1e-15, 1), labels=clf.classes_)
    assert unseen["before"][f"{held}/logloss"] == pytest.approx(want, abs=1e-6)
    assert unseen["before"]["score"] == pytest.approx(want, abs=1e-6)
    rows = json.loads((out / "holdout_rows.json").read_text())[held]
    assert rows["held_out_table"] and rows["rows"] == hold_i.tolist() and rows["context_rows"] == train_i.tolist()

    evals = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"}
    assert sorted(evals) == [0, 2, 4] and all(f"holdout_tables/{held}/logloss" in r for r in evals.values())
    best = evals[summary["best_step"]]
    assert all(best[f"holdout_tables/{k}"] == pytest.approx(v) for k, v in unseen["best"].items() if k != "step")
    assert evals[0][f"holdout_tables/{held}/logloss"] == pytest.approx(want, abs=1e-6)

    # resuming with another count (or none) is refused: the held-out tables stay those of the run
    code, _, err = run_cli([*args[:-6], "--holdout-tables", "0", *args[-4:]], capsys)  # same replay settings
    assert code == 2 and "holdout_tables=1" in err and "holdout_tables=0" in err


def test_refusals_name_the_numbers_and_files(tmp_path, init, replay_store, capsys):
    tables = tmp_path / "tables"
    tables.mkdir()
    for name, seed in (("alpha", 11), ("beta", 12), ("gamma", 13)):
        rules(60, seed).to_csv(tables / f"{name}.csv", index=False)
    out = str(tmp_path / "run")
    base = ["--target", "y", "--out", out, "--preset", "smoke", "--init", init]

    code, _, err = run_cli(["--data", str(tables), *base, "--holdout-tables", "3"], capsys)
    assert code == 2 and "--holdout-tables 3 leaves no table to train on" in err and "holds 3 tables" in err
    assert "at most 2" in err
    one = tables / "alpha.csv"
    code, _, err = run_cli(["--data", str(one), *base, "--holdout-tables", "1"], capsys)
    assert code == 2 and "is a single table (alpha)" in err and "alpha.csv" in err
    code, _, err = run_cli(["--data", str(tables), *base, "--holdout-tables", "-1"], capsys)
    assert code == 2 and "FinetuneConfig.holdout_tables" in err

    code, _, err = run_cli(["--data", str(one), *base, "--replay-data", str(replay_store)], capsys)
    assert code == 2 and "needs replay > 0" in err
    code, _, err = run_cli(["--data", str(one), *base, "--replay", "0.2", "--replay-stream", "none"], capsys)
    assert code == 2 and "nothing to replay" in err

    # a replay table with a --data table's content: its held-out rows would be trained on
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "again.csv").write_bytes((tables / "beta.csv").read_bytes())
    code, _, err = run_cli(["--data", str(tables), *base, "--replay", "0.2", "--replay-data", str(copy)], capsys)
    assert code == 2 and "again.csv holds the same table as --data's" in err and "beta.csv" in err
    # a plain table without a target header and without the --target column
    bare = tmp_path / "bare.csv"
    amounts(40, 3).to_csv(bare, index=False)
    code, _, err = run_cli(["--data", str(one), *base, "--replay", "0.2", "--replay-data", str(replay_store),
                            "--replay-data", str(bare)], capsys)
    assert code == 2 and "bare.csv: no target column" in err and "no --target column 'y'" in err
    assert not (tmp_path / "run").exists()  # nothing was written for any of them
