"""`tabfm serve` as a user runs it: one real server process on a free loopback port (with --token),
polled on /readyz, spoken to by tabfm.client (remote estimators = local estimators, to the last
bit), a slow client that does not stall others, the page at / driven in headless Chromium
(skipped without Chromium or Playwright), and last a graceful shutdown with a request in flight.
(Workers sharing registered contexts through the spool: tests/test_serve.py, in process.)"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tabfm import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor
from tabfm.client import (RemoteTabFMAnomalyDetector, RemoteTabFMClassifier, RemoteTabFMImputer, RemoteTabFMRegressor,
                          TabFMClient, TabFMRequestError, TabFMServerError)

TOKEN = "e2e-token"
FAST = {"n_estimators": 1}
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, res.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@contextlib.contextmanager
def serve(tmp_path: Path, *flags: str, token: str | None = None):
    """`tabfm serve` on a free port until the block ends (SIGTERM, then its exit code is checked)."""
    port = free_port()
    log = open(tmp_path / f"serve-{port}.log", "w+")
    argv = [sys.executable, "-m", "tabfm", "serve", "--port", str(port), "--threads", "1", "--max-wait-ms", "20",
            *(["--token", token] if token else []), *flags]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"tabfm serve exited {proc.returncode}:\n{(tmp_path / log.name).read_text()}"
            try:
                if get(url + "/readyz", token)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "tabfm serve did not get ready in 90 s"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve"), token=TOKEN) as (url, proc):
        yield url, proc
    assert proc.returncode == 0, proc.returncode


@pytest.fixture(scope="module")
def server(server_process):
    return server_process[0]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    n = 60
    X = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.choice(["u", "v"], n)})
    y = np.where(X.a - X.b > 0, "yes", "no")
    v = X.a * 3 + rng.normal(size=n) * 0.2
    return X, y, v


def test_remote_estimators_answer_as_the_local_ones(server, data):
    X, y, v = data
    Xc, Xq = X.iloc[:40], X.iloc[40:]
    clf = RemoteTabFMClassifier(url=server, token=TOKEN, **FAST).fit(Xc, y[:40])
    local = TabFMClassifier(**FAST).fit(Xc, y[:40])
    np.testing.assert_array_equal(clf.predict_proba(Xq), local.predict_proba(Xq))
    np.testing.assert_array_equal(clf.predict(Xq), local.predict(Xq))
    assert list(clf.classes_) == list(local.classes_) and clf.score(Xq, y[40:]) == local.score(Xq, y[40:])

    arr = X[["a", "b"]].to_numpy()  # arrays: columns x0, x1 on both sides
    reg = RemoteTabFMRegressor(url=server, token=TOKEN, random_state=5, **FAST).fit(arr[:40], v[:40])
    lreg = TabFMRegressor(random_state=5, **FAST).fit(arr[:40], v[:40])
    np.testing.assert_array_equal(reg.predict(arr[40:]), lreg.predict(arr[40:]))
    np.testing.assert_array_equal(reg.predict(arr[40:], output="median"), lreg.predict(arr[40:], output="median"))
    np.testing.assert_array_equal(reg.predict_quantiles(arr[40:], [0.2, 0.8]), lreg.predict_quantiles(arr[40:], [0.2, 0.8]))

    holes = X.copy()
    holes.loc[::4, "a"] = np.nan
    holes.loc[1::5, "c"] = None
    imp = RemoteTabFMImputer(url=server, token=TOKEN, **FAST)
    pd.testing.assert_frame_equal(imp.fit_transform(holes), TabFMImputer(**FAST).fit_transform(holes))

    det = RemoteTabFMAnomalyDetector(url=server, token=TOKEN, contamination=0.2, **FAST).fit(Xc)
    ldet = TabFMAnomalyDetector(contamination=0.2, **FAST).fit(Xc)
    assert det.offset_ == ldet.offset_
    np.testing.assert_array_equal(det.score_samples(Xq), ldet.score_samples(Xq))
    np.testing.assert_array_equal(det.predict(Xq), ldet.predict(Xq))


def test_remote_estimator_registers_again_when_the_server_lost_its_context(server, data):
    X, y, _ = data
    clf = RemoteTabFMClassifier(url=server, token=TOKEN, random_state=None, **FAST).fit(X.iloc[:40], y[:40])
    before = clf.predict_proba(X.iloc[40:])
    clf.client.delete_context(clf.context_id_)
    np.testing.assert_array_equal(clf.predict_proba(X.iloc[40:]), before)  # same table, same drawn seed


def test_client_errors(server, data):
    X, y, _ = data
    with pytest.raises(TabFMServerError) as err:
        TabFMClient(server).ready()
    assert err.value.status == 401 and err.value.error == "unauthorized"
    client = TabFMClient(server, token=TOKEN)
    clf = RemoteTabFMClassifier(url=server, token=TOKEN, **FAST).fit(X.iloc[:40], y[:40])
    with pytest.raises(ValueError, match="missing \\['c'\\]"):  # TabFMRequestError is a ValueError
        clf.predict(X.iloc[40:, :2])
    with pytest.raises(TabFMRequestError, match="unknown_column"):
        client.classify(X.iloc[40:], context=X.iloc[:40].assign(y=y[:40]), target="nope")
    out = client.classify(X.iloc[40:], context=X.iloc[:40].assign(y=y[:40]), target="y", params=FAST)
    assert out["predictions"] == list(TabFMClassifier(**FAST).fit(X.iloc[:40], y[:40]).predict(X.iloc[40:]))
    assert "tabfm_unauthorized_total 1" in client.metrics()


def test_a_slow_client_does_not_stall_the_others(server, data):
    X, y, _ = data
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:  # headers and a tenth of its body, then silence
        slow.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"query\":")
        start = time.monotonic()
        out = TabFMClient(server, token=TOKEN).classify(X.iloc[40:45], context=X.iloc[:40].assign(y=y[:40]),
                                                        target="y", params=FAST)
        assert len(out["predictions"]) == 5 and time.monotonic() - start < 30


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_the_page_predicts_an_uploaded_csv_in_chromium(server, data, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    X, y, v = data
    csv = tmp_path / "table.csv"
    X.assign(label=y, value=v).to_csv(csv, index=False)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.fill("#token", TOKEN)
            page.set_input_files("#file", str(csv))
            page.select_option("#target", "label")
            page.select_option("#task", "classification")
            page.click("#predict")
            page.wait_for_selector("#predictions tbody tr", timeout=60_000)
            assert page.locator("#predictions tbody tr").count() == 12  # the held-out 20 % of 60 rows
            assert page.locator("#predictions thead th").all_inner_texts()[-2:] == ["P(no)", "P(yes)"]
            assert page.locator("#plot").count() == 1 and page.locator("#plot rect").count() >= 4
            assert page.inner_text("#error") == ""

            page.select_option("#target", "value")
            page.select_option("#task", "regression")
            page.click("#predict")
            page.wait_for_selector("#plot circle", timeout=60_000)  # predicted vs actual
            assert page.locator("#plot circle").count() == 12
        finally:
            browser.close()


def test_graceful_shutdown_finishes_the_request_in_flight(server_process):
    """Last in this file: it stops the module's server (SIGTERM) while a request is in flight."""
    url, proc = server_process
    rng = np.random.default_rng(2)
    ctx = pd.DataFrame(rng.normal(size=(600, 8)), columns=[f"f{i}" for i in range(8)])
    labels = np.where(ctx.f0 > 0, "a", "b")
    client, answer = TabFMClient(url, token=TOKEN), {}

    def slow() -> None:
        answer["out"] = client.classify(ctx.iloc[100:], context=ctx.iloc[:100].assign(y=labels[:100]), target="y",
                                        params={"n_estimators": 4})

    worker = threading.Thread(target=slow)
    worker.start()
    deadline = time.monotonic() + 30
    while "tabfm_requests_in_flight 2" not in get(url + "/metrics", TOKEN)[1]:  # this scrape + the slow request
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert proc.wait(60) == 0  # stopped as asked, after answering
    assert len(answer["out"]["predictions"]) == 500
    with pytest.raises(OSError):
        get(url + "/healthz")  # and then it is gone
