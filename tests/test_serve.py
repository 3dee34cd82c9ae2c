"""`tabfm serve` in process (FastAPI's TestClient): answers equal the in-process estimators', merged
batches equal requests alone, registered contexts (LRU, 404s), bad input as 4xx JSON naming the
field / column / row / limit, the bearer token, /metrics, OpenAPI, Arrow / Parquet / CSV bodies.

The shipped tabfm-tiny weights on 40-row tables with n_estimators=1 keep every call well under a second.
"""
from __future__ import annotations

import inspect
import io
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # starlette's note on httpx
    from fastapi.testclient import TestClient

from tabfm import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
from tabfm.serve import wire
from tabfm.serve.app import create_app
from tabfm.serve.batching import Batcher, lane_of
from tabfm.serve.config import PRECISIONS, ServeConfig
from tabfm.serve.estimators import ServedClassifier
from tabfm.serve.metrics import Metrics
from tabfm.serve.schemas import PARAMS
from tabfm.weights import DEFAULT_MODELS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ONE = {"n_estimators": 1}
FEATURES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    n = 60
    df = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.choice(["x", "y", "z"], n)})
    df["label"] = np.where(df.a + df.b > 0, "hi", "lo")
    df["kind"] = np.where(df.a > 0.5, "p", np.where(df.a < -0.5, "n", "z"))  # three classes
    df["value"] = 2 * df.a - df.b + 0.1 * rng.normal(size=n)
    return df


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ServeConfig(max_wait_ms=150)), raise_server_exceptions=False) as c:
        yield c


def cols(frame: pd.DataFrame) -> dict:
    return wire.frame_to_columns(frame)


def records(frame: pd.DataFrame) -> list[dict]:
    c = cols(frame)
    return [{k: c[k][i] for k in c} for i in range(len(frame))]


def ok(response) -> dict:
    assert response.status_code in (200, 201), response.text
    return response.json()


# ----------------------------------------------------------------------------- equal to the estimators
def test_classify_equals_the_estimator_records_and_columns(client, table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    local = TabFMClassifier(n_estimators=1).fit(ctx[FEATURES], ctx.label)
    for orient in (records, cols):
        out = ok(client.post("/v1/classify", json={"context": orient(ctx[FEATURES + ["label"]]), "target": "label",
                                                    "query": orient(q[FEATURES]), "params": ONE}))
        assert out["classes"] == list(local.classes_)
        np.testing.assert_array_equal(np.array(out["probabilities"]), local.predict_proba(q[FEATURES]))
        assert out["predictions"] == list(local.predict(q[FEATURES]))
        assert out["n_rows"] == len(q) and out["context_id"] is None and out["model"] == DEFAULT_MODELS["classification"]
    three = {"n_estimators": 1, "linear_features": False, "n_neighbors": [5]}  # three classes, "auto" strategy
    local = TabFMClassifier(n_estimators=1, linear_features=False, n_neighbors=5).fit(ctx[FEATURES], ctx.kind)
    out = ok(client.post("/v1/classify", json={"context": cols(ctx[FEATURES + ["kind"]]), "target": "kind",
                                                "query": cols(q[FEATURES]), "params": three}))
    assert out["classes"] == ["n", "p", "z"]
    np.testing.assert_array_equal(np.array(out["probabilities"]), local.predict_proba(q[FEATURES]))


def test_regress_equals_the_estimator(client, table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    local = TabFMRegressor(n_estimators=1, random_state=3).fit(ctx[FEATURES], ctx.value)
    out = ok(client.post("/v1/regress", json={"context": cols(ctx[FEATURES + ["value"]]), "target": "value",
                                               "query": cols(q[FEATURES + ["value"]]),  # the target column is ignored
                                               "params": {**ONE, "random_state": 3}, "quantiles": [0.1, 0.5, 0.9]}))
    np.testing.assert_array_equal(out["mean"], local.predict(q[FEATURES]))
    np.testing.assert_array_equal(np.array(out["quantiles"]), local.predict_quantiles(q[FEATURES], [0.1, 0.5, 0.9]))
    assert out["quantile_levels"] == [0.1, 0.5, 0.9]


def test_impute_and_anomaly_equal_the_estimators(client, table):
    holes = table[FEATURES].copy()
    holes.loc[::5, "a"] = np.nan
    holes.loc[::7, "c"] = None
    out = ok(client.post("/v1/impute", json={"query": cols(holes), "params": ONE}))  # its own context
    local = TabFMImputer(n_estimators=1).fit_transform(holes)
    pd.testing.assert_frame_equal(pd.DataFrame(out["table"]), local)
    assert out["n_filled"] == int(holes.isna().sum().sum())
    for params in ({**ONE, "strategy": "joint"}, {**ONE, "n_rounds": 2}):  # the other strategy, a second round
        out = ok(client.post("/v1/impute", json={"query": cols(holes), "params": params}))
        pd.testing.assert_frame_equal(pd.DataFrame(out["table"]), TabFMImputer(**params).fit_transform(holes))
    # a registered context: the per-column estimators (and their encodings) are kept, answers unchanged
    info = ok(client.post("/v1/contexts", json={"task": "imputation", "context": cols(holes.iloc[:40]),
                                                "params": {**ONE, "n_rounds": 2}}))
    local = TabFMImputer(n_estimators=1, n_rounds=2).fit(holes.iloc[:40])
    for _ in range(2):
        out = ok(client.post("/v1/impute", json={"context_id": info["context_id"], "query": cols(holes.iloc[40:])}))
        pd.testing.assert_frame_equal(pd.DataFrame(out["table"]).set_axis(holes.index[40:]),
                                      local.transform(holes.iloc[40:]))

    ctx, q = table.iloc[:40][FEATURES], table.iloc[40:][FEATURES]
    det = TabFMAnomalyDetector(n_estimators=1, contamination=0.2).fit(ctx)
    params = {**ONE, "contamination": 0.2}
    out = ok(client.post("/v1/anomaly-score", json={"context": cols(ctx), "query": cols(q), "params": params}))
    np.testing.assert_array_equal(out["scores"], det.score_samples(q))
    np.testing.assert_array_equal(out["decision"], det.decision_function(q))
    assert out["labels"] == list(det.predict(q)) and out["offset"] == det.offset_
    own = ok(client.post("/v1/anomaly-score", json={"context": cols(ctx), "params": params}))  # the context scores itself
    np.testing.assert_array_equal(own["scores"], det.score_samples(ctx))
    alone = TabFMAnomalyDetector(n_estimators=1, columns_per_copy=1).fit(ctx)  # more copies: other scores
    out = ok(client.post("/v1/anomaly-score", json={"context": cols(ctx), "query": cols(q),
                                                    "params": {**ONE, "columns_per_copy": 1}}))
    np.testing.assert_array_equal(out["scores"], alone.score_samples(q))
    assert not np.allclose(out["scores"], det.score_samples(q))


def test_request_params_default_to_the_estimators_own_defaults():
    """A parameter a request leaves out must mean what the in-process estimator's default means."""
    served_by_server = {"model", "device", "precision", "progress", "backend"}  # the server's own choices
    for task, estimator in [("classification", TabFMClassifier), ("regression", TabFMRegressor),
                            ("imputation", TabFMImputer), ("anomaly", TabFMAnomalyDetector)]:
        schema = PARAMS[task]().model_dump()
        signature = {k: p.default for k, p in inspect.signature(estimator.__init__).parameters.items() if k != "self"}
        assert set(signature) - set(schema) <= served_by_server, (task, set(signature) - set(schema))
        for name, value in schema.items():
            default = signature[name]
            assert (list(default) if isinstance(default, tuple) else default) == value, (task, name, value, default)


def test_served_estimators_keep_encodings_and_answer_the_same(table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    kept = ServedClassifier(n_estimators=2, linear_features=False).fit(ctx[FEATURES], ctx.label)
    local = TabFMClassifier(n_estimators=2, linear_features=False).fit(ctx[FEATURES], ctx.label)
    first = kept.predict_proba(q[FEATURES])
    assert kept.encoded_bytes() > 0  # one encoding per member and one-vs-rest task
    n = len(kept._encoded())
    np.testing.assert_array_equal(kept.predict_proba(q[FEATURES][:5]), first[:5])  # reused, not re-encoded
    assert len(kept._encoded()) == n
    np.testing.assert_array_equal(first, local.predict_proba(q[FEATURES]))
    kept.drop_encoded()
    assert kept.encoded_bytes() == 0
    np.testing.assert_array_equal(kept.predict_proba(q[FEATURES]), first)


# ----------------------------------------------------------------------------- batching
def test_concurrent_requests_merge_and_equal_requests_alone(client, table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    info = ok(client.post("/v1/contexts", json={"task": "classification", "context": cols(ctx[FEATURES + ["label"]]),
                                                 "target": "label", "params": ONE}))
    local = TabFMClassifier(n_estimators=1).fit(ctx[FEATURES], ctx.label)
    service = client.app.state.service
    before = service.metrics.batch_requests.count()
    parts = [q.iloc[i:i + 4][FEATURES] for i in range(0, len(q), 4)]
    with ThreadPoolExecutor(len(parts)) as pool:
        answers = list(pool.map(lambda part: client.post("/v1/classify", json={
            "context_id": info["context_id"], "query": cols(part)}), parts))
    calls = service.metrics.batch_requests.count() - before
    assert calls < len(parts), "concurrent requests of one context should share model calls"
    for part, answer in zip(parts, answers):
        np.testing.assert_array_equal(np.array(ok(answer)["probabilities"]), local.predict_proba(part))


def test_a_request_never_waits_behind_a_far_larger_one():
    """Lanes by size: a small job runs while a large one holds its own lane's thread."""
    assert [lane_of(c) for c in (0, 1 << 13, 1 << 16, 1 << 19, 1 << 30)] == [0, 1, 2, 3, 4]
    release, ran = threading.Event(), []

    def runner(payloads):
        if payloads[0] == "large":
            release.wait(10)
        ran.append(payloads)
        return payloads

    batcher = Batcher(runner, Metrics(), max_wait_ms=0, max_batch_cells=100, max_queue=10)
    batcher.start()
    try:
        large = batcher.submit("g", cost=1 << 30, cells=10, payload="large")
        small = batcher.submit("g", cost=10, cells=10, payload="small")
        assert small.result(timeout=5) == "small" and not large.done()
        release.set()
        assert large.result(timeout=5) == "large"
    finally:
        release.set()
        batcher.close(5)


def test_batches_respect_groups_the_cell_cap_and_cancelled_jobs():
    gate, batches = threading.Event(), []

    def runner(payloads):
        gate.wait(10)
        batches.append(list(payloads))
        return payloads

    batcher = Batcher(runner, Metrics(), max_wait_ms=50, max_batch_cells=25, max_queue=10)
    batcher.start()
    try:
        futures = [batcher.submit("busy", 1, 1, "first")]
        time.sleep(0.1)  # the lane is now inside runner(["first"])
        futures += [batcher.submit(g, 1, 10, f"{g}{i}") for i, g in enumerate("aaab")]
        cancelled = batcher.submit("a", 1, 1, "gone")
        assert cancelled.cancel()
        gate.set()
        for f in futures:
            f.result(timeout=5)
    finally:
        gate.set()
        batcher.close(5)
    assert batches == [["first"], ["a0", "a1"], ["a2"], ["b3"]]  # 2 x 10 cells <= 25 < 3 x 10; groups apart


# ----------------------------------------------------------------------------- registered contexts
def test_register_query_list_delete(client, table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    body = {"task": "regression", "context": cols(ctx[FEATURES + ["value"]]), "target": "value", "params": ONE}
    first = client.post("/v1/contexts", json=body)
    assert first.status_code == 201
    info = first.json()
    again = client.post("/v1/contexts", json=body)
    assert again.status_code == 200 and again.json()["existed"] and again.json()["context_id"] == info["context_id"]
    assert info["columns"] == FEATURES and info["n_rows"] == 40 and info["target"] == "value"
    cid = info["context_id"]
    by_id = ok(client.post("/v1/regress", json={"context_id": cid, "query": cols(q[FEATURES]), "quantiles": [0.5]}))
    inline = ok(client.post("/v1/regress", json={**{k: body[k] for k in ("context", "target", "params")},
                                                  "query": cols(q[FEATURES]), "quantiles": [0.5]}))
    assert by_id["mean"] == inline["mean"] and by_id["quantiles"] == inline["quantiles"] and by_id["context_id"] == cid
    held = ok(client.get(f"/v1/contexts/{cid}"))
    assert held["requests"] == 1 and held["bytes"] > 0
    assert cid in [c["context_id"] for c in ok(client.get("/v1/contexts"))["contexts"]]
    wrong = client.post("/v1/classify", json={"context_id": cid, "query": cols(q[FEATURES])})
    assert wrong.status_code == 422 and wrong.json()["error"] == "wrong_task"
    assert client.delete(f"/v1/contexts/{cid}").status_code == 204
    gone = client.post("/v1/regress", json={"context_id": cid, "query": cols(q[FEATURES])})
    assert gone.status_code == 404 and gone.json()["error"] == "context_not_found" and "deleted" in gone.json()["message"]
    assert client.get("/v1/contexts/nonsense").status_code == 404


def test_lru_eviction_under_the_cap_answers_404_saying_so(table):
    with TestClient(create_app(ServeConfig(context_cache_mib=0.4)), raise_server_exceptions=False) as c:
        ids = []
        for seed in (1, 2):
            ids.append(ok(c.post("/v1/contexts", json={"task": "imputation", "context": cols(table[FEATURES]),
                                                        "params": {**ONE, "random_state": seed}}))["context_id"])
            holes = table[FEATURES].iloc[:5].copy()
            holes.loc[:, "a"] = np.nan
            ok(c.post("/v1/impute", json={"context_id": ids[-1], "query": cols(holes)}))  # encodings: ~0.3 MiB
        first = c.post("/v1/impute", json={"context_id": ids[0], "query": cols(table[FEATURES].iloc[:2])})
        assert first.status_code == 404 and "evicted" in first.json()["message"]
        assert "--context-cache-mib 0.4" in first.json()["message"]
        service = c.app.state.service
        assert service.metrics.evictions.value() >= 1 and service.store.total() <= 0.4 * (1 << 20)
        ok(c.post("/v1/impute", json={"context_id": ids[1], "query": cols(table[FEATURES].iloc[:2])}))


def test_arrow_parquet_and_csv_bodies(client, table):
    ctx, q = table.iloc[:40], table.iloc[40:]
    fast = {**ONE, "linear_features": False}
    json_info = ok(client.post("/v1/contexts", json={"task": "classification", "target": "label",
                                                      "context": cols(ctx[FEATURES + ["label"]]), "params": fast}))
    want = ok(client.post("/v1/classify", json={"context_id": json_info["context_id"], "query": cols(q[FEATURES])}))
    parquet = io.BytesIO()
    ctx[FEATURES + ["label"]].to_parquet(parquet, index=False)
    bodies = {wire.ARROW_STREAM: wire.frame_to_arrow(ctx[FEATURES + ["label"]]), wire.PARQUET: parquet.getvalue(),
              wire.CSV: ctx[FEATURES + ["label"]].to_csv(index=False).encode()}
    for media, body in bodies.items():
        info = ok(client.post("/v1/contexts?task=classification&target=label&n_estimators=1&linear_features=false",
                              content=body,
                              headers={"content-type": media}))
        got = ok(client.post(f"/v1/classify?context_id={info['context_id']}", content=wire.frame_to_arrow(q[FEATURES]),
                             headers={"content-type": wire.ARROW_STREAM}))
        assert got["probabilities"] == want["probabilities"], media
    broken = client.post("/v1/contexts?task=classification&target=label", content=b"not arrow",
                         headers={"content-type": wire.ARROW_STREAM})
    assert broken.status_code == 400 and broken.json()["error"] == "unreadable_body"
    holes = q[FEATURES].copy()
    holes.loc[holes.index[::3], "b"] = np.nan
    filled = ok(client.post("/v1/impute?n_estimators=1", content=wire.frame_to_arrow(holes),  # its own context
                            headers={"content-type": wire.ARROW_STREAM}))
    local = TabFMImputer(n_estimators=1).fit_transform(holes).reset_index(drop=True)
    pd.testing.assert_frame_equal(pd.DataFrame(filled["table"]), local)
    scores = client.post("/v1/anomaly-score?n_estimators=1", content=wire.frame_to_arrow(holes),
                         headers={"content-type": wire.ARROW_STREAM})
    assert scores.status_code == 422 and "context_id" in scores.json()["message"]  # query rows need a context


# ----------------------------------------------------------------------------- bad input
LIMITS = ServeConfig(max_rows=50, max_columns=5, max_classes=3, max_categories=30, max_body_bytes=60_000,
                     max_estimators=2)


@pytest.fixture(scope="module")
def strict():
    with TestClient(create_app(LIMITS), raise_server_exceptions=False) as c:
        yield c


def _bad_cases(table: pd.DataFrame) -> list[tuple[str, dict | bytes, int, str, dict]]:
    ctx, q = table.iloc[:40], table.iloc[40:50]
    good = {"context": cols(ctx[FEATURES + ["label"]]), "target": "label", "query": cols(q[FEATURES]), "params": ONE}
    wide = pd.DataFrame({f"f{i}": [0.0, 1.0] for i in range(6)})
    ragged = records(q[FEATURES])
    del ragged[3]["b"]
    text_in_numbers = cols(q[FEATURES])
    text_in_numbers["a"][2] = "seven"
    many = pd.DataFrame({"a": np.arange(40.0), "t": np.arange(40) % 5})
    cats = pd.DataFrame({"a": np.arange(40.0), "c": [f"v{i}" for i in range(40)], "t": np.arange(40) % 2})
    missing_target = cols(ctx[FEATURES + ["label"]])
    missing_target["label"][7] = None
    return [
        ("/v1/classify", {**good, "target": "nope"}, 422, "unknown_column", {"field": "target", "column": "nope"}),
        ("/v1/classify", {**good, "context": {k: [] for k in good["context"]}}, 422, "empty_table", {"field": "context"}),
        ("/v1/classify", {**good, "context": []}, 422, "empty_table", {"field": "context"}),
        ("/v1/classify", {**good, "query": ragged}, 422, "ragged_table", {"field": "query", "row": 3, "column": "b"}),
        ("/v1/classify", {**good, "query": text_in_numbers}, 422, "not_numeric", {"column": "a", "row": 2}),
        ("/v1/regress", {**good}, 422, "not_numeric", {"field": "context", "column": "label", "row": 0}),
        ("/v1/classify", {**good, "query": cols(q[["a", "b"]])}, 422, "column_mismatch", {"column": "c"}),
        ("/v1/classify", {**good, "context": missing_target}, 422, "missing_target", {"column": "label", "row": 7}),
        ("/v1/classify", {**good, "context": cols(table[FEATURES + ["label"]])}, 413, "too_many_rows",
         {"field": "context", "limit": 50}),
        ("/v1/classify", {**good, "context": cols(wide), "target": "f0"}, 413, "too_many_columns", {"limit": 5}),
        ("/v1/classify", {**good, "context": cols(many), "target": "t", "query": cols(many[["a"]])}, 413,
         "too_many_classes", {"column": "t", "limit": 3}),
        ("/v1/classify", {**good, "context": cols(cats), "target": "t", "query": cols(cats[["a", "c"]])}, 413,
         "too_many_categories", {"column": "c", "limit": 30}),
        ("/v1/classify", {**good, "params": {"n_estimators": 3}}, 422, "too_many_estimators",
         {"field": "params.n_estimators", "limit": 2}),
        ("/v1/classify", {**good, "params": {"n_trees": 3}}, 422, "invalid_request", {"field": "params.n_trees"}),
        ("/v1/anomaly-score", {"context": good["context"], "params": {"columns_per_copy": 1.5}}, 422, "invalid_request",
         {"field": "params.columns_per_copy"}),
        ("/v1/classify", {**good, "query": {"a": [1.0, {"x": 1}]}}, 422, "invalid_request",
         {"column": "a", "row": 1}),
        ("/v1/classify", {k: v for k, v in good.items() if k != "target"}, 422, "invalid_request", {}),
        ("/v1/regress", {**good, "target": "a", "quantiles": [1.5]}, 422, "invalid_request", {"field": "quantiles.0"}),
        ("/v1/classify", {"context_id": "ctx_" + "0" * 32, "query": good["query"]}, 404, "context_not_found",
         {"field": "context_id"}),
        ("/v1/classify", b'{"context": [', 400, "invalid_json", {"field": "body"}),
        ("/v1/classify", {**good, "context": cols(pd.concat([ctx] * 40)[FEATURES + ["label"]].iloc[:45])
                          | {"pad": ["x" * 2000] * 45}}, 413, "body_too_large", {"limit": 60_000}),
    ]


def test_bad_input_is_a_4xx_naming_the_problem(strict, table):
    for path, body, status, error, where in _bad_cases(table):
        if isinstance(body, bytes):
            r = strict.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = strict.post(path, json=body)
        assert r.status_code == status, (error, r.status_code, r.text)
        got = r.json()
        assert got["error"] == error and got["message"] and "Traceback" not in r.text, (error, got)
        for key, value in where.items():
            assert got[key] == value, (error, key, got)
    other = strict.post("/v1/classify", content=b"a,b\n1,2\n", headers={"content-type": "application/xml"})
    assert other.status_code == 415 and other.json()["error"] == "unsupported_media_type"
    assert strict.get("/v1/nothing").json()["error"] == "not_found"
    # a chunked body without Content-Length is bounded as well
    chunks = (b"x" * 10_000 for _ in range(10))
    assert strict.post("/v1/classify", content=chunks, headers={"content-type": "application/json"}).status_code == 413


def test_an_estimator_refusal_is_a_422_not_a_500(client, table):
    ctx = table.iloc[:40]
    one_row = client.post("/v1/anomaly-score", json={"context": cols(ctx[FEATURES].iloc[:1]), "params": ONE})
    assert one_row.status_code == 422 and one_row.json()["error"] == "estimator_refused"
    assert "at least 2 rows" in one_row.json()["message"]


# ----------------------------------------------------------------------------- access, metrics, docs, page
def test_token_guards_everything_but_healthz_and_the_page(table):
    with TestClient(create_app(ServeConfig(token="s3cret")), raise_server_exceptions=False) as c:
        assert c.get("/healthz").status_code == 200 and c.get("/").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            for path in ("/readyz", "/metrics", "/v1/info", "/openapi.json", "/v1/contexts"):
                r = c.get(path, headers=headers)
                assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, headers)
        r = c.post("/v1/classify", json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get("/readyz", headers=auth).status_code == 200
        text = c.get("/metrics", headers=auth).text
        assert "tabfm_unauthorized_total 16" in text


def test_metrics_exposition(client, table):
    ok(client.post("/v1/classify", json={"context": cols(table.iloc[:40][FEATURES + ["label"]]), "target": "label",
                                          "query": cols(table.iloc[40:44][FEATURES]), "params": ONE}))
    client.post("/v1/classify", json={"query": {}})
    text = client.get("/metrics").text
    assert text.endswith("\n")
    for line in ('tabfm_requests_total{endpoint="/v1/classify",method="POST",status="200"}',
                 'tabfm_requests_total{endpoint="/v1/classify",method="POST",status="422"}',
                 'tabfm_request_duration_seconds_bucket{endpoint="/v1/classify",le="+Inf"}',
                 "tabfm_batch_requests_count", "tabfm_batch_rows_bucket", 'tabfm_queue_depth{lane="0"} 0',
                 "tabfm_context_cache_bytes", "tabfm_context_cache_limit_bytes 536870912", "tabfm_unauthorized_total 0",
                 'tabfm_model_seconds_count{task="classify"}', "# TYPE tabfm_request_duration_seconds histogram"):
        assert line in text, line
    for name in ("tabfm_requests_total", "tabfm_queue_depth"):
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text


def test_health_ready_info_openapi_page(client):
    assert ok(client.get("/healthz")) == {"status": "ok"}
    assert ok(client.get("/readyz"))["status"] == "ready"
    info = ok(client.get("/v1/info"))
    assert info["models"] == DEFAULT_MODELS and info["limits"]["max_rows"] == 10_000
    assert ok(client.get("/readyz"))["models"] == DEFAULT_MODELS
    spec = ok(client.get("/openapi.json"))
    for path in ("/v1/classify", "/v1/regress", "/v1/impute", "/v1/anomaly-score", "/v1/contexts", "/metrics"):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/classify"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"] == "#/components/schemas/ClassifyRequest"
    assert wire.ARROW_STREAM in body and wire.PARQUET in body
    schemas = spec["components"]["schemas"]
    assert {"ClassifyRequest", "ClassifierParams", "RegisterRequest", "ErrorResponse", "ClassifyResponse"} <= set(schemas)
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html") and 'id="file"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # self-contained: no external assets


def test_config_names_match_the_estimators():
    from tabfm.estimators.base import PRECISIONS as ESTIMATOR_PRECISIONS

    assert PRECISIONS == ESTIMATOR_PRECISIONS
    config = ServeConfig(token="t", max_rows=7)
    assert ServeConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="--max-rows"):
        ServeConfig(max_rows=0)
    # each task answers with its own default weights unless --model names one for all
    assert ServeConfig().models() == DEFAULT_MODELS
    assert ServeConfig(model="tabfm-tiny").models() == dict.fromkeys(DEFAULT_MODELS, "tabfm-tiny")
    assert ServeConfig(model="x").model_for("anomaly") == "x"


def test_one_shot_requests_with_the_same_context_share_a_fit(client, table):
    """Identical one-shot contexts arriving together are fitted once and answered in one call."""
    ctx, q = table.iloc[:40], table.iloc[40:]
    body = {"context": cols(ctx[FEATURES + ["value"]]), "target": "value", "params": ONE}
    local = TabFMRegressor(n_estimators=1).fit(ctx[FEATURES], ctx.value)
    parts = [q.iloc[i:i + 5][FEATURES] for i in range(0, 20, 5)]
    with ThreadPoolExecutor(len(parts)) as pool:
        answers = list(pool.map(lambda p: client.post("/v1/regress", json={**body, "query": cols(p)}), parts))
    for part, answer in zip(parts, answers):
        np.testing.assert_array_equal(ok(answer)["mean"], local.predict(part))



def test_workers_share_registered_contexts_through_the_spool(table, tmp_path, monkeypatch):
    """--workers N: each worker is its own process with its own store; a registration spooled by one
    is answered by another (fitted again from the table as it arrived), and a deletion reaches all."""
    ctx, q = table.iloc[:40], table.iloc[40:]
    config = ServeConfig(context_dir=str(tmp_path / "spool"))
    monkeypatch.setenv("TABFM_SERVE_CONFIG", config.to_json())
    from tabfm.serve.app import app_from_env

    with TestClient(app_from_env(), raise_server_exceptions=False) as one, \
            TestClient(app_from_env(), raise_server_exceptions=False) as two:
        for media, body in ((None, None), (wire.ARROW_STREAM, wire.frame_to_arrow(ctx[FEATURES + ["label"]]))):
            if media is None:
                info = ok(one.post("/v1/contexts", json={"task": "classification", "target": "label", "params": ONE,
                                                          "context": cols(ctx[FEATURES + ["label"]])}))
            else:
                info = ok(one.post("/v1/contexts?task=classification&target=label&n_estimators=1", content=body,
                                   headers={"content-type": media}))
            cid = info["context_id"]
            assert two.app.state.service.store.peek(cid) is None
            a = ok(one.post("/v1/classify", json={"context_id": cid, "query": cols(q[FEATURES])}))
            b = ok(two.post("/v1/classify", json={"context_id": cid, "query": cols(q[FEATURES])}))
            assert a["probabilities"] == b["probabilities"]
        assert two.delete(f"/v1/contexts/{cid}").status_code == 204
        assert one.post("/v1/classify", json={"context_id": cid, "query": cols(q[FEATURES])}).status_code == 404
