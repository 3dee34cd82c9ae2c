"""Context features: the extra columns of the episode contract, against hand computations, and the
same inputs from the synthetic stream, the in-training evaluation and the estimators."""
import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge

from tabfm.data.batch import CATEGORICAL, NUMERIC
from tabfm.data.context_features import ContextFeatureSpec, context_features, feature_targets, ridge_scores
from tabfm.data.neighbors import design
from tabfm.synth.stream import _FEATURES, StreamConfig, SynthStream, table_rng
from tabfm.inference import append_context_features
from tabfm.model.config import CONTEXT_FEATURES


def test_names_agree_between_model_config_and_spec():
    assert CONTEXT_FEATURES == ContextFeatureSpec.NAMES
    assert ContextFeatureSpec.named("none") is None
    with pytest.raises(ValueError, match="unknown context features 'knn5'"):
        ContextFeatureSpec.named("knn5")


def test_feature_targets_by_hand():
    np.testing.assert_array_equal(feature_targets(np.array([0, 2, 1, 2]), 3),
                                  [[0, 0], [0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(feature_targets(np.array([1.5, -2.0]), None), [[1.5], [-2.0]])
    with pytest.raises(ValueError, match="n_classes >= 2"):
        feature_targets(np.array([0, 0]), 1)


def test_neighbour_columns_leave_one_out_by_hand():
    """One numeric feature: neighbours by |x - x'|, so the k = 1 and k = 2 means can be read off."""
    x_ctx = np.array([[0.0], [1.0], [3.0], [10.0], [11.0]], dtype=np.float32)
    y_ctx = np.array([0, 0, 1, 1, 1])
    x_q = np.array([[0.4], [10.6]], dtype=np.float32)
    spec = ContextFeatureSpec(neighbors=(1, 2), linear=False)
    c, q = context_features(x_ctx, x_q, np.array([NUMERIC]), np.array([0]), y_ctx, 2, spec, np.random.default_rng(0))
    # context rows leave themselves out: nearest of 0 is 1 (y 0), of 1 is 0 (y 0), of 3 is 1 (y 0), ...
    np.testing.assert_allclose(c[:, 0], [0, 0, 0, 1, 1])
    np.testing.assert_allclose(c[:, 1], [0.5, 0.5, 0, 1, 1])  # 0 -> {1, 3}; 1 -> {0, 3}; 3 -> {1, 0}
    np.testing.assert_allclose(q, [[0, 0], [1, 1]])


def test_neighbourhoods_take_at_most_half_the_other_rows():
    """k = 4 of 5 context rows would average every other row: leave-one-out, a row's mean then falls as
    its own target rises (here 1 -> 0.75, 0 -> 1.0). Capped at (5 - 1) // 2 = 2, the k = 4 column is
    the k = 2 one read off above, and follows the target."""
    x_ctx = np.array([[0.0], [1.0], [3.0], [10.0], [11.0]], dtype=np.float32)
    y_ctx = np.array([0, 0, 1, 1, 1])
    x_q = np.array([[0.4], [10.6]], dtype=np.float32)
    spec = ContextFeatureSpec(neighbors=(4,), linear=False)
    c, q = context_features(x_ctx, x_q, np.array([NUMERIC]), np.array([0]), y_ctx, 2, spec, np.random.default_rng(0))
    np.testing.assert_allclose(c[:, 0], [0.5, 0.5, 0, 1, 1])
    np.testing.assert_allclose(q[:, 0], [0, 1])


def test_a_small_context_is_not_answered_upside_down():
    """Eight rows, y = 3x: with every other row as a neighbour the shipped regressor answered the two
    ends the wrong way round; now each end gets its own side (tabfm-tiny-cf)."""
    from tabfm.estimators import TabFMRegressor

    for n in (6, 8, 20):
        rng = np.random.default_rng(n)
        x = np.repeat([0.0, 1.0], n // 2) + rng.normal(size=n) * 0.1
        pred = TabFMRegressor(model="tabfm-tiny-cf").fit(x[:, None], 3 * x).predict(np.array([[0.0], [1.0]]))
        assert pred[0] < 1.0 < 2.0 < pred[1], (n, pred)


def test_width_does_not_depend_on_the_rows():
    """Fewer context rows than the largest k: the sizes coincide but every size keeps its columns."""
    rng = np.random.default_rng(1)
    spec = ContextFeatureSpec.named("knn-linear")
    for n_ctx in (1, 2, 3, 40):
        c, q = context_features(rng.normal(size=(n_ctx, 3)), rng.normal(size=(5, 3)), np.full(3, NUMERIC),
                                np.zeros(3, int), rng.integers(0, 4, n_ctx), 4, spec, rng)
        assert c.shape == (n_ctx, spec.width(3)) and q.shape == (5, 9)
        assert np.isfinite(c).all() and np.isfinite(q).all()


def test_ridge_scores_match_sklearn_out_of_fold():
    rng = np.random.default_rng(2)
    ctx = rng.normal(size=(30, 4)).astype(np.float32)
    ctx[:, 3] = rng.integers(0, 3, 30)
    ctx[rng.random(30) < 0.1, 0] = np.nan
    query = rng.normal(size=(6, 4)).astype(np.float32)
    query[:, 3] = rng.integers(0, 3, 6)
    kind, card = np.array([NUMERIC] * 3 + [CATEGORICAL]), np.array([0, 0, 0, 3])
    y = ctx[:, 1] * 2 - np.nan_to_num(ctx[:, 0]) + rng.normal(size=30) * 0.1
    a, b = design(ctx, query, kind, card)
    folds = np.arange(30) % 5
    got_c, got_q = ridge_scores(a, b, y[:, None].astype(np.float64), folds)
    want_c = np.zeros(30)
    for f in range(5):
        held = folds == f
        want_c[held] = Ridge(alpha=1.0).fit(a[~held], y[~held]).predict(a[held])
    np.testing.assert_allclose(got_c[:, 0], want_c, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got_q[:, 0], Ridge(alpha=1.0).fit(a, y).predict(b), rtol=1e-6, atol=1e-8)


def test_stream_episodes_carry_the_shared_columns():
    """A prediction table of the stream = its own columns + context_features(...) of its features,
    with the stream's feature seed; imputation tables are unchanged; batches stay in budget."""
    cfg = StreamConfig.preset("tiny", context_features="knn-linear")
    plain = SynthStream(StreamConfig.preset("tiny"), seed=3)
    stream = SynthStream(cfg, seed=3)
    spec = ContextFeatureSpec.named("knn-linear")
    seen = set()
    for position in range(6):
        batch, info = stream.episode_at(position)
        batch.validate()
        assert batch.x.numel() <= cfg.cells_per_batch or batch.x.shape[0] == 1
        for j, task in enumerate(info.tasks):
            seen.add(task)
            table, episode = plain.table(position, j)
            r, c = table.shape
            x = batch.x[j].numpy()
            np.testing.assert_array_equal(np.nan_to_num(x[:r, :c], nan=-9), np.nan_to_num(table.X, nan=-9))
            if task == "imputation":
                assert not batch.col_valid[j, c:].any()
                continue
            feats = [k for k in range(c) if k != table.target]
            n_classes = int(table.cardinality[table.target]) if task == "classification" else None
            ctx = episode.context
            extra_c, extra_q = context_features(table.X[ctx][:, feats], table.X[~ctx][:, feats], table.kind[feats],
                                                table.cardinality[feats], table.X[ctx, table.target], n_classes,
                                                spec, table_rng(3, position, 0, j, _FEATURES))
            width = extra_c.shape[1]
            np.testing.assert_array_equal(x[:r][ctx, c:c + width], extra_c)
            np.testing.assert_array_equal(x[:r][~ctx, c:c + width], extra_q)
            assert (batch.kind[j, c:c + width] == NUMERIC).all() and not batch.query[j, :, c:].any()
            # what each column estimates: nothing for the table's own, the target's classes 1..n-1 (or
            # its value) per estimator for the extra ones, in their order
            ref = batch.feature_ref[j].numpy()
            assert (ref[:c] == -1).all() and (ref[c + width:] == -1).all()
            codes = list(range(1, n_classes)) if n_classes else [-1]
            want = [[table.target, k, e] for e in range(3) for k in codes]
            np.testing.assert_array_equal(ref[c:c + width], want)
    assert {"classification", "regression"} <= seen


def test_stream_without_features_is_unchanged_and_bad_names_are_refused():
    a = SynthStream(StreamConfig.preset("tiny"), seed=5).batch_at(2)
    b = SynthStream(StreamConfig.preset("tiny", context_features="none"), seed=5).batch_at(2)
    assert torch.equal(torch.nan_to_num(a.x, nan=-1), torch.nan_to_num(b.x, nan=-1))
    with pytest.raises(ValueError, match="StreamConfig.context_features"):
        StreamConfig.preset("tiny", context_features="knn5")


def test_estimator_shows_a_contract_model_exactly_its_columns(monkeypatch):
    """A model whose config names context features gets, from TabFMClassifier, its member's columns +
    append_context_features(...) + the target, and no legacy neighbour or linear column."""
    from tabfm import TabFMClassifier
    from tabfm.model import ModelConfig, TabFM

    torch.manual_seed(0)
    model = TabFM(ModelConfig.preset("tiny", n_layers=1, context_features="knn-linear"))
    rng = np.random.default_rng(4)
    X = rng.normal(size=(40, 3))
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5)
    clf = TabFMClassifier(model=model, n_estimators=1, multiclass="native", random_state=0,
                          categorical="identity").fit(X, y)
    calls = []
    real = TabFMClassifier._predict

    def spy(self, rt, context_x, query_x, query_mask, kind, cardinality, fn, feature_ref=None):
        calls.append((rt.id_seed, context_x.copy(), query_x.copy(), kind.copy(), feature_ref))
        return real(self, rt, context_x, query_x, query_mask, kind, cardinality, fn, feature_ref)

    monkeypatch.setattr(TabFMClassifier, "_predict", spy)
    proba = clf.predict_proba(X[:7])
    assert proba.shape == (7, 3) and np.allclose(proba.sum(1), 1)
    (seed, ctx_x, query_x, kind, refs), = calls
    member = clf._members(cover_all=False, n_classes=3)[0]
    view = clf._supervised_view(member, X[:7].astype(np.float32), classes=True, rt=clf._runtime().for_member(member))
    y_member = member.class_perm[clf.y_[view.rows]]
    want_c, want_q, want_kind, _, want_refs = append_context_features(
        view.ctx, view.query, view.kind, view.card, y_member, 3, "knn-linear", np.random.default_rng([seed, 1]),
        design=(view.source_kind, view.source_card))
    np.testing.assert_array_equal(ctx_x[:, :-1], want_c)
    np.testing.assert_array_equal(query_x[:, :-1], want_q)
    assert ctx_x.shape[1] == 3 + 2 * 3 + 1  # 3 features, (2 neighbour sizes + ridge) x 2 class indicators, target
    np.testing.assert_array_equal(kind[:-1], want_kind)
    # what each column estimates: nothing for the 3 features and the target; the target (column 9),
    # classes 1, 2 per estimator (k = 5, k = 20, ridge) for the 6 context features
    np.testing.assert_array_equal(refs, want_refs)
    np.testing.assert_array_equal(refs, [[-1, -1, -1]] * 3 + [[9, 1, 0], [9, 2, 0], [9, 1, 1], [9, 2, 1], [9, 1, 2],
                                                                [9, 2, 2], [-1, -1, -1]])


def test_warm_start_teaches_an_init_new_columns_and_resume_keeps_them(tmp_path):
    """--init from weights without context features is allowed; resuming with other ones is refused."""
    from tabfm.train.config import PretrainConfig, run_model_config
    from tabfm.train.pretrain import _check_same_run, warm_start
    from tabfm.model import TabFM

    cfg = PretrainConfig.preset("tiny", context_features="knn-linear")
    model_cfg = run_model_config(cfg)
    assert model_cfg.context_features == "knn-linear"
    warm_start(TabFM(model_cfg), "tabfm-tiny")  # no error: the contract is not architecture
    import json
    (tmp_path / "train_config.json").write_text(json.dumps({**cfg.to_dict(), "context_features": "none"}))
    with pytest.raises(ValueError, match="context_features='none'"):
        _check_same_run(tmp_path, cfg)


def test_fine_tuning_episodes_carry_the_shared_columns_before_the_target():
    """pose_episode with the model's context features: the episode's features + context_features(...) of
    them (measured on the codes as encoded, the rng's next draws), then the target; imputation
    episodes of the same batch are padded to the width."""
    from tabfm.data.table_episodes import EpisodeConfig, EpisodeTable, TableEpisodeSampler, pose_episode

    rng = np.random.default_rng(0)
    n = 60
    x = np.column_stack([rng.normal(size=n), rng.integers(0, 4, n), rng.integers(0, 3, n)]).astype(np.float32)
    table = EpisodeTable("t", x, np.array([NUMERIC, CATEGORICAL, CATEGORICAL], np.int8), np.array([0, 4, 3]),
                         "classification", np.arange(n))
    cfg = EpisodeConfig(min_rows=8, max_rows=40, imputation=0.0, context_features="knn-linear", categorical="identity")
    plain = EpisodeConfig(min_rows=8, max_rows=40, imputation=0.0, categorical="identity")
    take = np.arange(40)
    got = pose_episode(table, take, 3, "classification", cfg, np.random.default_rng(7))
    base = pose_episode(table, take, 3, "classification", plain, np.random.default_rng(7))
    assert got.shape == (1, 40, 3 + 2 * 3)
    ctx = base.context[0].numpy()
    bx = base.x[0].numpy()
    replay = np.random.default_rng(7)
    pose_episode(table, take, 3, "classification", plain, replay)  # the same draws up to the features
    want_c, want_q = context_features(bx[ctx, :2], bx[~ctx, :2], np.array([NUMERIC, CATEGORICAL]), np.array([0, 4]),
                                      bx[ctx, 2], 3, ContextFeatureSpec.named("knn-linear"), replay)
    gx = got.x[0].numpy()
    np.testing.assert_array_equal(np.nan_to_num(gx[:, :2], nan=-9), np.nan_to_num(bx[:, :2], nan=-9))
    np.testing.assert_array_equal(gx[ctx, 2:8], want_c)
    np.testing.assert_array_equal(gx[~ctx, 2:8], want_q)
    np.testing.assert_array_equal(gx[:, 8], bx[:, 2])
    assert got.query[0, :, -1].equal(~base.context[0]) and not got.query[0, :, :-1].any()
    np.testing.assert_array_equal(got.feature_ref[0].numpy(), [[-1, -1, -1]] * 2 + [[8, k, e] for e in range(3)
                                                                                    for k in (1, 2)] + [[-1, -1, -1]])
    mixed = TableEpisodeSampler([table], cfg.replace(imputation=0.5), seed=1)
    for p in range(8):
        mixed.batch_at(p).validate()


def test_store_regression_episodes_with_residual_targets():
    """EpisodeConfig.residual_targets=1: a regression episode's query targets are y minus sklearn's
    Ridge(alpha=1) fitted on the context rows (the features' design); its context features then
    describe the residual; fine-tuning's episodes always ask for it (as the regressor does)."""
    from sklearn.linear_model import Ridge
    from tabfm.data.neighbors import design
    from tabfm.data.table_episodes import EpisodeConfig, EpisodeTable, pose_episode
    from tabfm.train.finetune import FinetuneConfig

    rng = np.random.default_rng(3)
    n = 60
    x = np.column_stack([rng.normal(size=n), rng.integers(0, 4, n), rng.normal(size=n)]).astype(np.float32)
    x[:, 2] = 2 * x[:, 0] + 0.5 * x[:, 1] + 0.1 * rng.normal(size=n)
    kind, card = np.array([NUMERIC, CATEGORICAL, NUMERIC], np.int8), np.array([0, 4, 0])
    table = EpisodeTable("t", x, kind, card, "regression", np.arange(n))
    take = np.arange(48)
    plain = EpisodeConfig(min_rows=8, max_rows=48, imputation=0.0, categorical="identity")
    base = pose_episode(table, take, 3, "regression", plain, np.random.default_rng(5))
    got = pose_episode(table, take, 3, "regression", plain.replace(residual_targets=1.0), np.random.default_rng(5))
    bx, gx, ctx = base.x[0].numpy().astype(np.float64), got.x[0].numpy(), base.context[0].numpy()
    np.testing.assert_array_equal(gx[:, :2], bx[:, :2])
    a, b = design(bx[ctx, :2], bx[~ctx, :2], kind[:2], card[:2])
    want = bx[~ctx, 2] - Ridge(alpha=1.0).fit(a, bx[ctx, 2]).predict(b)
    np.testing.assert_allclose(gx[~ctx, 2], want, rtol=1e-4, atol=1e-4)
    assert np.abs(gx[ctx, 2]).mean() < 0.5 * np.abs(bx[ctx, 2] - bx[ctx, 2].mean()).mean()  # out-of-fold: small
    with pytest.raises(ValueError, match="residual_targets"):
        EpisodeConfig(residual_targets=2.0)
    assert FinetuneConfig().episode_config(10).residual_targets == 0.5  # as TabFMRegressor's mixed members ask


def test_pretrain_from_an_init_keeps_its_context_features(tmp_path, capsys):
    """`tabfm pretrain --init tabfm-tiny-cf` without --context-features trains with the init's knn-linear
    columns (recorded in the run's config and its export), and says so; --context-features none drops them."""
    import json
    from tabfm.cli import main

    argv = ["pretrain", "--preset", "smoke", "--init", "tabfm-tiny-cf", "--steps", "2", "--eval-batches", "0", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "keep")]) == 0
    assert json.loads((tmp_path / "keep" / "train_config.json").read_text())["context_features"] == "knn-linear"
    export = json.loads((tmp_path / "keep" / "export" / "config.json").read_text())
    assert export["model"]["context_features"] == "knn-linear"
    assert main([*argv, "--out", str(tmp_path / "drop"), "--context-features", "none"]) == 0
    assert json.loads((tmp_path / "drop" / "train_config.json").read_text())["context_features"] == "none"
    # the shipped init refers its feature columns to what they estimate: without the columns, no references
    dropped = json.loads((tmp_path / "drop" / "export" / "config.json").read_text())["model"]
    assert dropped["context_features"] == "none" and not dropped.get("context_refs", False)


def test_pretrain_context_refs_from_an_init_and_the_estimators_read_them(tmp_path, capsys):
    """`tabfm pretrain --init tabfm-tiny-cf --context-refs` records context_refs in its run and export,
    a warm start from that export keeps them, and TabFMClassifier answers with the exported model."""
    import json
    from tabfm import TabFMClassifier
    from tabfm.cli import main

    argv = ["pretrain", "--preset", "smoke", "--steps", "2", "--eval-batches", "0", "--quiet"]
    assert main([*argv, "--init", "tabfm-tiny-cf", "--context-refs", "--out", str(tmp_path / "refs")]) == 0
    assert json.loads((tmp_path / "refs" / "train_config.json").read_text())["context_refs"] is True
    export = tmp_path / "refs" / "export"
    assert json.loads((export / "config.json").read_text())["model"]["context_refs"] is True
    assert main([*argv, "--init", str(export), "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "train_config.json").read_text())["context_refs"] is True
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4))
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0)
    proba = TabFMClassifier(model=str(export), n_estimators=2, multiclass="native", random_state=0).fit(X, y).predict_proba(X[:9])
    assert proba.shape == (9, 3) and np.allclose(proba.sum(1), 1)
    assert main([*argv, "--context-refs", "--context-features", "none", "--out", str(tmp_path / "none")]) != 0
    assert "context_refs = True: needs context features" in capsys.readouterr().err
