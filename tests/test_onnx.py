"""The ONNX export (tabfm.model.onnx_export, `tabfm export --onnx`) and the estimators' backend="onnx":
the graph equals `model(batch)` in onnxruntime within ATOL / RTOL on tables of several shapes (1 and 3
tables, 5 and 40 rows, 2 and 12 columns, categorical columns, missing cells, padding), and the
estimators give the torch backend's answers. One small model is exported once for the whole file."""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from tabfm import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor, cli  # noqa: E402
from tabfm.commands import export as export_command  # noqa: E402
from tabfm.data.batch import TableBatch  # noqa: E402
from tabfm.model import ModelConfig, TabFM  # noqa: E402
from tabfm.model import onnx_export as ox  # noqa: E402
from tabfm.model.encoder import _value_bits  # noqa: E402

SMALL = dict(n_layers=1, d_model=32, n_heads=2)
FIELDS = ("cat_logits", "num_logits", "mean", "std")


def small_model(seed: int = 0, **overrides) -> TabFM:
    torch.manual_seed(seed)
    model = TabFM(ModelConfig.preset("tiny", **{**SMALL, **overrides})).eval()
    if model.config.context_refs:  # trained-like reference projections (they start at zero)
        for name, p in model.encoder.named_parameters():
            if name.startswith("ref_"):
                torch.nn.init.normal_(p, std=0.3)
    return model


def random_queries(batch: TableBatch, share: float, seed: int) -> TableBatch:
    """The batch with query cells anywhere (as the imputer asks), context rows included."""
    g = torch.Generator().manual_seed(seed)
    cells = batch.row_valid[:, :, None] & batch.col_valid[:, None, :]
    query = (torch.rand(batch.x.shape, generator=g) < share) & cells & ~torch.isnan(batch.x)
    return TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid,
                      col_valid=batch.col_valid, context=batch.context, query=query | batch.query,
                      feature_ref=batch.feature_ref)


def shuffled(batch: TableBatch, seed: int) -> TableBatch:
    """The batch with its rows in a random order (context rows no longer first)."""
    order = torch.randperm(batch.x.shape[1], generator=torch.Generator().manual_seed(seed))
    return TableBatch(x=batch.x[:, order], kind=batch.kind, cardinality=batch.cardinality,
                      row_valid=batch.row_valid[:, order], col_valid=batch.col_valid, context=batch.context[:, order],
                      query=batch.query[:, order], feature_ref=batch.feature_ref)


def all_context(batch: TableBatch, seed: int) -> TableBatch:
    """Every row context, hidden cells anywhere (the imputer's question): no row is only a query row."""
    full = TableBatch(x=batch.x.nan_to_num(0.5), kind=batch.kind, cardinality=batch.cardinality,
                      row_valid=batch.row_valid, col_valid=batch.col_valid, context=batch.row_valid.clone(),
                      query=torch.zeros_like(batch.query), feature_ref=batch.feature_ref)
    full.x[:] = torch.where(full.kind[:, None, :] == 2, full.x.floor().clamp(min=0), full.x)
    return random_queries(full, 0.2, seed)


def max_violation(ref, got) -> tuple[float, dict[str, float]]:
    """max |got - ref| / (ATOL + RTOL |ref|) over the outputs (equal infinities count 0), and max |diff| each."""
    worst, diffs = 0.0, {}
    for name in FIELDS:
        a, b = getattr(ref, name).double(), getattr(got, name).double()
        assert a.shape == b.shape, name
        same_inf = torch.isinf(a) & (a == b)
        d = torch.where(same_inf, 0.0, (a - b).abs()).nan_to_num(float("inf"))
        diffs[name] = float(d.max()) if d.numel() else 0.0
        if d.numel():
            worst = max(worst, float((d / (ox.ATOL + ox.RTOL * torch.where(same_inf, 0.0, a.abs()))).max()))
    return worst, diffs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model, path of its .onnx, the export's own check): exported once (the slow part of this file)."""
    torch.set_num_threads(1)
    model = small_model()
    path = tmp_path_factory.mktemp("onnx") / "small.onnx"
    data, check = ox.export_onnx(model, path, check=True)
    assert path.read_bytes() == data
    return model, path, check


@pytest.fixture(scope="module")
def session(exported):
    return ox.OnnxModel(exported[1], threads=1)


# ----------------------------------------------------------------------------- pieces in torch
def test_float32_bits_is_the_encoders_bit_pattern():
    """The bitcast-free bit patterns equal encoder._value_bits on every kind of float32."""
    fi = torch.finfo(torch.float32)
    pows = torch.tensor([2.0**k for k in range(-149, 128)])
    special = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), fi.max, -fi.max,
                            fi.tiny, -fi.tiny, 1e-45, -1e-45, 3 * 2**-140, 1.0, -1.5, 0.1, 1e30])
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31 - 1, (50_000,), generator=g).to(torch.int32).view(torch.float32)
    x = torch.cat([special, pows, -pows, torch.nextafter(pows, torch.tensor(0.0)), torch.nextafter(pows, torch.tensor(9.0)),
                   torch.randn(20_000, generator=g) * torch.exp(torch.randn(20_000, generator=g) * 15), random_bits])
    assert torch.equal(ox.float32_bits(x.float()), _value_bits(x.float()))


@pytest.mark.parametrize("overrides", [{}, {"n_thinking_rows": 2}, {"code_ids": "per_column", "n_layers": 2},
                                       {"context_features": "knn-linear", "context_refs": True}],
                         ids=["shipped-like", "thinking-rows", "per-column-codes", "context-refs"])
def test_graph_module_equals_the_model_in_torch(overrides):
    """ExportableTabFM (no keys-first reorder, no nonzero, fixed code width, arithmetic bit patterns)
    computes model(batch)'s numbers for the query cells, before any export."""
    model = small_model(1, **overrides)
    graph = ox.ExportableTabFM(model).eval()
    cfg = model.config
    for i, (b, r, c, missing) in enumerate([(1, 5, 2, 0.0), (3, 40, 12, 0.25), (2, 17, 5, 0.1), (2, 9, 4, 0.0)]):
        batch = ox._example(cfg, b, r, c, seed=i, missing=missing)
        if i == 2:
            batch = shuffled(random_queries(batch, 0.2, seed=i), seed=i)
        if i == 3:
            batch = all_context(batch, seed=i)
        for id_seed in (0, 7):
            feeds = ox.graph_inputs(batch, id_seed)
            with torch.inference_mode():
                ref = model(batch, id_seed=id_seed)
                got = graph(*(torch.from_numpy(np.array(feeds[n])) for n in ox.graph_input_names(cfg)))
            for name, tensor in zip(FIELDS, got):
                a, t = getattr(ref, name), tensor
                finite = torch.isfinite(a)
                assert torch.equal(finite, torch.isfinite(t)), name
                torch.testing.assert_close(t[finite], a[finite], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the exported graph
def test_export_checks_itself_and_carries_its_config(exported, session):
    model, path, check = exported
    assert check.ok and check.worst_ratio < 0.1, check
    assert {(1, 5, 2), (3, 40, 12)} <= set(check.shapes)
    assert session.config == model.config and session.max_codes == ox.DEFAULT_MAX_CODES
    assert export_command.DEFAULT_MAX_CODES == ox.DEFAULT_MAX_CODES  # the command line's torch-free copy
    inputs = session.session.get_inputs()
    assert [i.name for i in inputs] == list(ox.INPUTS)
    dims = {i.name: i.shape for i in inputs}
    assert all(isinstance(d, str) for d in (*dims["x"], *dims["keys"], dims["index"][0]))  # dynamic, all of them


SHAPES = [(1, 5, 2), (1, 40, 12), (3, 5, 12), (3, 40, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("missing", [0.0, 0.3], ids=["complete", "missing"])
def test_onnxruntime_equals_torch(exported, session, shape, missing):
    """The one file answers every shape (tables, rows, columns, query cells dynamic) as torch does."""
    model = exported[0]
    b, r, c = shape
    batch = ox._example(model.config, b, r, c, seed=10 * b + r + c, missing=missing)
    if missing:  # query cells anywhere as well, the imputer's and anomaly detector's questions, rows in any order
        batch = shuffled(random_queries(batch, 0.15, seed=r), seed=c)
    for id_seed in (0, 2**31 - 5):
        with torch.inference_mode():
            ref = model(batch, id_seed=id_seed)
        got = session(batch, id_seed=id_seed)
        assert torch.equal(got.index, ref.index) and torch.equal(got.kind, ref.kind)
        assert torch.equal(got.cardinality, ref.cardinality)
        worst, diffs = max_violation(ref, got)
        assert worst <= 1.0, diffs


def test_onnxruntime_equals_torch_when_every_row_is_context(exported, session):
    """All rows key rows (nothing after them in the row attention's split), and a table without any."""
    model = exported[0]
    batch = all_context(ox._example(model.config, 3, 12, 5, seed=5), seed=5)
    none = TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid,
                      col_valid=batch.col_valid, context=batch.context.clone(), query=batch.query)
    none.context[1] = False  # table 1 has no context rows: one arbitrary key, as in torch
    for case in (batch, none):
        with torch.inference_mode():
            ref = model(case, id_seed=3)
        worst, diffs = max_violation(ref, session(case, id_seed=3))
        assert worst <= 1.0, diffs
    nothing = TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid,
                         col_valid=batch.col_valid, context=batch.context, query=torch.zeros_like(batch.query))
    out = session(nothing)  # no query cell: empty answers (the graph is not run)
    assert len(out) == 0 and out.num_logits.shape == (0, model.config.n_bins)


def test_onnx_graph_refusals(exported, session, tmp_path):
    model = exported[0]
    batch = ox._example(model.config, 1, 6, 3, seed=0)
    wide = TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality.clone(), row_valid=batch.row_valid,
                      col_valid=batch.col_valid, context=batch.context, query=batch.query)
    wide.cardinality[0, 1] = ox.DEFAULT_MAX_CODES + 1
    with pytest.raises(ValueError, match="max_codes"):
        session(wide)
    import onnx

    other = tmp_path / "other.onnx"
    proto = onnx.load(exported[1])
    del proto.metadata_props[:]
    onnx.save(proto, other)
    with pytest.raises(ValueError, match="tabfm export --onnx"):
        ox.OnnxModel(other)
    with pytest.raises(FileNotFoundError):
        ox.OnnxModel(tmp_path / "nowhere.onnx")


def test_missing_onnxruntime_is_a_clear_error(exported, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    with pytest.raises(ox.OnnxUnavailableError, match=r'pip install "tabfm\[onnx\]"'):
        ox.OnnxModel(exported[1])
    est = onnx_backend(TabFMClassifier(model=exported[1], n_estimators=1)).fit(np.eye(4), [0, 1, 0, 1])
    with pytest.raises(ImportError, match="onnxruntime"):
        est.predict(np.eye(4))


def test_a_module_is_exported_once_per_weights_version(exported, monkeypatch):
    model = small_model(3)
    calls = []
    data = exported[1].read_bytes()

    def fake_export(m, path=None, max_codes=ox.DEFAULT_MAX_CODES, check=True):
        calls.append(m)
        return data, None

    monkeypatch.setattr(ox, "export_onnx", fake_export)
    first = ox.onnx_model_of(model, threads=1)
    assert ox.onnx_model_of(model, threads=1) is first and len(calls) == 1
    with torch.no_grad():
        next(model.parameters()).add_(0.0)  # an in-place update: new weights version
    assert ox.onnx_model_of(model, threads=1) is not first and len(calls) == 2
    path = exported[1]  # a file: one session per file version and thread count
    assert ox.onnx_model_of(path, threads=1) is ox.onnx_model_of(str(path), threads=1)
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        ox.onnx_model_of(path.with_name("nowhere.onnx"))


# ----------------------------------------------------------------------------- estimators
def onnx_backend(est):
    """`est` with backend="onnx" (a parameter of every estimator; set directly where an estimator's
    own __init__ does not list it yet)."""
    if "backend" in est.get_params():
        return est.set_params(backend="onnx")
    est.backend = "onnx"
    return est


def table(n: int = 70, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n) * 3,
                          "c": pd.Categorical(rng.choice(["u", "v", "w"], size=n)), "d": rng.exponential(size=n)})
    y_class = (frame["a"] + (frame["c"] == "u") > 0.3).astype(int).to_numpy()
    y_reg = (2 * frame["a"] - frame["b"] + rng.normal(size=n) * 0.1).to_numpy()
    return frame, y_class, y_reg


COMMON = dict(n_estimators=2, chunk_size=16, random_state=0)


def test_estimators_with_the_onnx_backend_answer_as_torch(exported):
    model, path, _ = exported
    X, y_class, y_reg = table()
    Xtr, Xte = X.iloc[:50], X.iloc[50:]
    torch_clf = TabFMClassifier(model=model, **COMMON).fit(Xtr, y_class[:50])
    onnx_clf = onnx_backend(TabFMClassifier(model=path, **COMMON)).fit(Xtr, y_class[:50])
    np.testing.assert_allclose(onnx_clf.predict_proba(Xte), torch_clf.predict_proba(Xte), atol=1e-4)
    reg_kw = dict(COMMON, n_neighbors=5)
    torch_reg = TabFMRegressor(model=model, **reg_kw).fit(Xtr, y_reg[:50])
    onnx_reg = onnx_backend(TabFMRegressor(model=path, **reg_kw)).fit(Xtr, y_reg[:50])
    scale = float(np.std(y_reg))
    np.testing.assert_allclose(onnx_reg.predict(Xte), torch_reg.predict(Xte), atol=1e-3 * scale)

    holes = X.mask(np.random.default_rng(1).random(X.shape) < 0.15)
    torch_imp = TabFMImputer(model=model, **COMMON).fit(holes)
    onnx_imp = onnx_backend(TabFMImputer(model=path, **COMMON)).fit(holes)
    a, b = torch_imp.transform(holes.iloc[:20]), onnx_imp.transform(holes.iloc[:20])
    pd.testing.assert_frame_equal(a.select_dtypes("number"), b.select_dtypes("number"), atol=1e-3, check_exact=False)
    assert a.select_dtypes(exclude="number").equals(b.select_dtypes(exclude="number"))

    det_kw = dict(COMMON, n_estimators=1, n_folds=2, max_offset_rows=16)
    X_num = X[["a", "b", "d"]]
    torch_det = TabFMAnomalyDetector(model=model, **det_kw).fit(X_num.iloc[:30])
    onnx_det = onnx_backend(TabFMAnomalyDetector(model=path, **det_kw)).fit(X_num.iloc[:30])
    np.testing.assert_allclose(onnx_det.score_samples(X_num.iloc[30:40]), torch_det.score_samples(X_num.iloc[30:40]),
                               rtol=1e-4, atol=1e-3)


def test_onnx_backend_row_answers_are_their_own(exported):
    """Every pass has the same shape, so a row's answer does not depend on the rows predicted with it."""
    X, y_class, _ = table()
    clf = onnx_backend(TabFMClassifier(model=exported[1], **COMMON)).fit(X.iloc[:50], y_class[:50])
    assert np.array_equal(clf.predict_proba(X.iloc[50:51]), clf.predict_proba(X.iloc[50:60])[:1])


def test_backend_is_chosen_once_with_clear_errors(exported):
    X, y, _ = table(20)
    bad = TabFMClassifier(model=exported[0], n_estimators=1)
    bad.backend = "tensorrt"
    with pytest.raises(ValueError, match="backend must be one of"):
        bad.fit(X, y)
    for params, match in [(dict(device="cuda"), "onnxruntime's CPU"), (dict(precision="bf16"), "fp32")]:
        est = onnx_backend(TabFMClassifier(model=exported[1], n_estimators=1, **params)).fit(X, y)
        with pytest.raises(ValueError, match=match):
            est.predict(X)
    with pytest.raises(ValueError, match="backend='onnx'"):  # an ONNX file never runs as torch
        TabFMClassifier(model=exported[1], n_estimators=1).fit(X, y).predict(X)
    assert TabFMClassifier().backend == "torch" and TabFMImputer().backend == "torch"


# ----------------------------------------------------------------------------- command line
def test_export_command_writes_the_checked_graph(exported, tmp_path, monkeypatch, capsys):
    data = exported[1].read_bytes()
    seen = {}

    def fake_export(model, path=None, max_codes=ox.DEFAULT_MAX_CODES, check=True):
        seen.update(model=model, max_codes=max_codes, check=check)
        open(path, "wb").write(data)
        return data, ox.CheckResult(max_abs={f: 1e-7 for f in FIELDS}, worst_ratio=1e-3, shapes=[(1, 5, 2)])

    monkeypatch.setattr(ox, "export_onnx", fake_export)
    out = tmp_path / "m.onnx"
    assert cli.main(["export", "--onnx", str(out), "--model", "tabfm-tiny", "--max-codes", "64"]) == 0
    assert out.read_bytes() == data and seen["max_codes"] == 64 and seen["check"] is True
    assert isinstance(seen["model"], TabFM) and seen["model"].config.d_model == 96  # the shipped tabfm-tiny
    line = capsys.readouterr().out
    assert "-> " + str(out) in line and "max |diff|" in line and "1x5x2" in line
    for argv in (["export"], ["export", "ckpt"], ["export", "--model", "tabfm-tiny"],
                 ["export", "c", "o", "--onnx", "x.onnx", "--model", "tabfm-tiny"], ["export", "--onnx", "x.onnx",
                                                                                     "--max-codes", "0"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith("tabfm export: error: ")


def test_a_model_with_context_refs_exports_its_reference_input():
    """A context_refs model's graph takes TableBatch.feature_ref as one more input and answers as torch
    on batches whose columns estimate the target (export's own check), and the references matter."""
    model = small_model(3, context_features="knn-linear", context_refs=True)
    data, result = ox.export_onnx(model)
    assert result.ok
    graph = ox.OnnxModel(data)
    assert graph.inputs == ox.INPUTS + (ox.REF_INPUT,)
    batch = ox._example(model.config, 2, 30, 7, seed=9, missing=0.1)
    assert (batch.feature_ref[..., 0] >= 0).any()
    plain = TableBatch(x=batch.x, kind=batch.kind, cardinality=batch.cardinality, row_valid=batch.row_valid,
                       col_valid=batch.col_valid, context=batch.context, query=batch.query)
    with torch.inference_mode():
        ref, ref_plain = model(batch), model(plain)
    got, got_plain = graph(batch), graph(plain)
    for a, b in ((ref, got), (ref_plain, got_plain)):
        torch.testing.assert_close(b.num_logits, a.num_logits, atol=1e-4, rtol=1e-4)
    assert (ref.num_logits - ref_plain.num_logits).abs().max() > 1e-3
