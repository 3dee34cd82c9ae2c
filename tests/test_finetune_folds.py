"""K-fold cross-fitted fine-tuning (`tabfm finetune --folds K`): the split, the pooled choice, the average."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tabfm.cli import main
from tabfm.data.table_episodes import fold_split
from tabfm.model import ModelConfig, TabFM
from tabfm.parallel.export import export_model
from tabfm.train.finetune import FinetuneConfig, average_exports, finetune, paired_z, pool_folds
from tabfm.train.pretrain import export_config
from tests.test_finetune import SMALL, random_export, smoke, structured_table, table_csv  # noqa: F401 (fixtures)


def test_fold_split_partitions_the_rows_class_by_class():
    y = np.repeat([0, 1, 2, 3], [40, 13, 2, 1])  # a class of 2 rows and one of a single row
    folds = [fold_split(len(y), 5, k, seed=3, strata=y, stream=7) for k in range(5)]
    held = np.concatenate([h for _, h in folds])
    assert sorted(held) == sorted(np.flatnonzero(y != 3))  # every row once, but the single-row class: never held out
    for train, hold in folds:
        assert np.intersect1d(train, hold).size == 0 and len(train) + len(hold) == len(y)
        assert set(y[hold]) <= set(y[train])  # every held-out class was seen in training
        assert sum(y[hold] == 0) == 8 and sum(y[hold] == 1) in (2, 3)  # about 1/5 of each class
    assert [f[1].tolist() for f in folds] == [fold_split(len(y), 5, k, 3, y, 7)[1].tolist() for k in range(5)]
    assert fold_split(len(y), 5, 0, 4, y, 7)[1].tolist() != folds[0][1].tolist()  # the seed moves the split
    plain = np.concatenate([fold_split(23, 4, k, 0)[1] for k in range(4)])
    assert sorted(plain) == list(range(23))
    with pytest.raises(ValueError, match="too few"):
        fold_split(3, 4, 0, 0)
    with pytest.raises(ValueError, match="fold 4 of 4"):
        fold_split(10, 4, 4, 0)


def test_pooled_choice_tests_all_rows_where_each_fold_alone_cannot():
    rng = np.random.default_rng(0)
    start = [rng.gamma(2.0, 0.2, 60) for _ in range(3)]
    gain = [s - 0.02 + rng.normal(0, 0.08, 60) for s in start]  # a small gain, noisy per row
    worse = [s + 0.05 for s in start]
    histories = [{0: {"t": s}, 10: {"t": g}, 20: {"t": w}, 30: {"t": g}} for s, g, w in zip(start, gain, worse)]
    histories[0][40] = {"t": gain[0]}  # a step only one fold reached is not pooled
    each = [paired_z({"t": s}, {"t": g}) for s, g in zip(start, gain)]
    pooled = paired_z({"t": np.concatenate(start)}, {"t": np.concatenate(gain)})
    assert max(each) < 2 < pooled  # the hand computation: no fold passes alone, all rows together do
    choice = pool_folds(histories, {"t": "classification"}, significance=2.0, min_delta=1e-4)
    steps = {row["step"]: row for row in choice["steps"]}
    assert list(steps) == [0, 10, 20, 30] and choice["best_step"] == 10  # 30 ties 10: not lower by min_delta
    assert steps[10]["z_vs_start"] == pytest.approx(pooled) and steps[10]["rows"] == 180
    assert steps[10]["t/logloss"] == pytest.approx(np.concatenate(gain).mean()) == steps[10]["score"]
    assert steps[20]["z_vs_start"] < 0
    assert pool_folds(histories, {"t": "classification"}, significance=8.0, min_delta=1e-4)["best_step"] == 0
    reg = pool_folds(histories, {"t": "regression"}, significance=0.0, min_delta=0.0)
    assert reg["steps"][1]["t/nrmse"] == pytest.approx(np.sqrt(np.concatenate(gain).mean()))


def test_average_exports_is_the_elementwise_mean(tmp_path):
    cfg = ModelConfig.preset("tiny", **SMALL)
    paths, states = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        model = TabFM(cfg)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        paths.append(export_model(model, tmp_path / f"m{seed}", export_config(cfg, {})))
    state, config = average_exports(paths)
    for k, v in state.items():
        assert v.dtype == states[0][k].dtype
        assert torch.allclose(v, (states[0][k] + states[1][k] + states[2][k]) / 3, atol=1e-7), k
    assert config["model"] == cfg.to_dict()
    other = ModelConfig.preset("tiny", **{**SMALL, "n_layers": 1})
    export_model(TabFM(other), tmp_path / "small", export_config(other, {}))
    with pytest.raises(ValueError, match="do not match"):
        average_exports([paths[0], tmp_path / "small"])


def test_config_names_bad_fold_settings():
    with pytest.raises(ValueError, match="folds"):
        FinetuneConfig(folds=0)
    with pytest.raises(ValueError, match="fold"):
        FinetuneConfig(fold=0)  # a fold of a one-run fine-tuning
    with pytest.raises(ValueError, match="holdout_tables"):
        FinetuneConfig(folds=3, holdout_tables=1)


def test_cli_kfold_run_exports_the_average_at_the_pooled_step_and_resumes(tmp_path, table_csv, random_export,
                                                                         capsys):
    out = tmp_path / "run"
    args = ["finetune", "--data", table_csv, "--target", "y", "--out", str(out), "--preset", "smoke", "--init",
            random_export, "--steps", "4", "--eval-every", "2", "--folds", "3", "--quiet", "--threads", "1"]
    assert main(args + ["--significance", "0"]) == 0
    text = capsys.readouterr().out
    assert "3 folds" in text and "pooled over the folds" in text
    summary = json.loads((out / "finetune_summary.json").read_text())
    assert summary["folds"] == 3 and [r["step"] for r in summary["fold_runs"]] == [4, 4, 4]
    n = len(structured_table())
    held = [json.loads((out / f"fold-{k}" / "holdout_rows.json").read_text())["rules"]["rows"] for k in range(3)]
    assert sorted(sum(held, [])) == list(range(n))  # the folds' held-out rows: every row once
    assert all(row["rows"] == n for row in summary["pooled"]) and [r["step"] for r in summary["pooled"]] == [0, 2, 4]
    best = summary["best_step"]
    scores = {r["step"]: r["score"] for r in summary["pooled"]}
    assert best == min(scores, key=lambda s: (scores[s], s))  # significance 0: the lowest pooled score
    exported = load_file(str(out / "export" / "model.safetensors"))
    snapshots = [load_file(str(out / f"fold-{k}" / "steps" / f"step_{best}" / "model.safetensors")) for k in range(3)]
    for key, value in exported.items():
        assert torch.allclose(value, sum(s[key] for s in snapshots) / 3, atol=1e-6), key
    init = load_file(str(Path(random_export) / "model.safetensors"))
    assert all(torch.equal(snapshots[0][k], init[k]) for k in init) == (best == 0)
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["finetune"]["folds"] == 3 and config["finetune"]["step"] == best

    stamps = [(out / f"fold-{k}" / "metrics.jsonl").read_text() for k in range(3)]
    assert main(args + ["--significance", "50"]) == 0  # rerun: no training, the choice made again
    assert "best step 0" in capsys.readouterr().out
    assert [(out / f"fold-{k}" / "metrics.jsonl").read_text() for k in range(3)] == stamps  # the folds kept
    other = tmp_path / "other.csv"
    structured_table(seed=1).to_csv(other, index=False)
    args[args.index(table_csv)] = str(other)
    assert main(args) == 2  # finished folds of other data are not reused
    assert "fold-0 holds a fine-tuning run with the tables' content" in capsys.readouterr().err
    assert main(args + ["--restart"]) == 0  # starting over: every fold trained again on the new data
    assert "removed" in capsys.readouterr().out
    held = [json.loads((out / f"fold-{k}" / "holdout_rows.json").read_text())["other"]["rows"] for k in range(3)]
    assert sorted(sum(held, [])) == list(range(n))
    assert [len(open(out / f"fold-{k}" / "holdout_losses.jsonl").readlines()) for k in range(3)] == [3, 3, 3]
    again = load_file(str(out / "export" / "model.safetensors"))
    assert all(torch.equal(again[k], init[k]) for k in init)  # nothing passes 50 SE: the starting weights


def test_a_killed_kfold_run_resumes_in_its_fold(tmp_path, table_csv, random_export):
    import shutil

    cfg = smoke(random_export, data=table_csv, steps=4, eval_every=2, ckpt_every=2, folds=2)
    whole = finetune(cfg, tmp_path / "whole", progress=False)
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    killed = tmp_path / "cut" / "fold-1"  # as a kill after step 4's evaluation, before its checkpoint, leaves it
    shutil.rmtree(killed / "checkpoints" / "step_000004")
    (killed / "finetune_summary.json").unlink()
    (tmp_path / "cut" / "finetune_summary.json").unlink()
    resumed = finetune(cfg, tmp_path / "cut", progress=False)
    lines = [json.loads(x)["step"] for x in (killed / "holdout_losses.jsonl").read_text().splitlines()]
    assert lines == [0, 2, 4, 4]  # step 4 evaluated again on resume; its last line counts
    assert resumed.summary["pooled"] == whole.summary["pooled"] and resumed.best_step == whole.best_step
    a, b = (load_file(str(p / "export" / "model.safetensors")) for p in (tmp_path / "whole", tmp_path / "cut"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
