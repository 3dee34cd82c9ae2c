"""Speak to `tabfm serve` from Python: `TabFMClient`, and remote estimators with the local ones' API.

    from tabfm.client import RemoteTabFMClassifier
    clf = RemoteTabFMClassifier(url="http://127.0.0.1:8000", n_estimators=1)   # was: TabFMClassifier(n_estimators=1)
    clf.fit(X_train, y_train)            # registers the context on the server (POST /v1/contexts)
    clf.predict_proba(X_test)            # sends only the query rows

The remote estimators send tables as Arrow IPC (a DataFrame's dtypes arrive exactly as they are,
so the server's answers equal the local estimator's for the same inputs and random_state), keep
the registered table's bytes, and register it again if the server has evicted it (same table,
same parameters, random_state included: the same answers). `TabFMClient` takes JSON-able tables
(DataFrames, arrays, {column: [cells]}, [{column: cell}]) and returns the server's JSON.

Standard library HTTP (http.client, one kept-alive connection per thread) plus numpy / pandas /
pyarrow, which tabfm depends on anyway: no server package is needed.
"""
from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from typing import Any, Sequence

import numpy as np

from tabfm.serve import wire

DEFAULT_URL = "http://127.0.0.1:8000"
_RETRY = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.BadStatusLine)


class TabFMServerError(RuntimeError):
    """The server refused or failed a request: HTTP `status` and its JSON error body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body
        self.error = body.get("error", "")
        self.message = body.get("message", "")
        super().__init__(f"HTTP {status} {self.error}: {self.message}")


class TabFMRequestError(TabFMServerError, ValueError):
    """A 4xx refusal of the input (what a local estimator raises as ValueError)."""


def _query_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(_query_value(x) for x in v)
    return str(v)


class TabFMClient:
    """The server's endpoints as methods; answers are the JSON bodies (dicts)."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, timeout: float = 300.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout
        self._scheme, self._host, self._port = parsed.scheme, parsed.hostname, parsed.port
        self._base = parsed.path.rstrip("/")
        self._local = threading.local()

    # ---------------------------------------------------------------- transport
    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = self._local.conn = cls(self._host, self._port, timeout=self.timeout)
        return conn

    def request(self, method: str, path: str, body: bytes | None = None, content_type: str = wire.JSON,
                query: dict[str, Any] | None = None, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one request; reconnects once if the server closed a kept-alive connection."""
        if query:
            path += "?" + urllib.parse.urlencode({k: _query_value(v) for k, v in query.items()})
        headers = {"Content-Type": content_type} if body is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if accept:
            headers["Accept"] = accept
        for attempt in (0, 1):
            reused = getattr(self._local, "conn", None) is not None
            conn = self._connection()
            try:
                conn.request(method, self._base + path, body=body, headers=headers)
                res = conn.getresponse()
                data = res.read()
                return res.status, {k.lower(): v for k, v in res.getheaders()}, data
            except Exception as err:  # a failed connection is never reused
                conn.close()
                self._local.conn = None
                if attempt or not reused or not isinstance(err, _RETRY):
                    raise
        raise AssertionError("unreachable")

    def call(self, method: str, path: str, payload: Any = None, **kw: Any) -> Any:
        """The JSON answer of a request with a JSON `payload` (or bytes in kw['body']); raises TabFMServerError."""
        body = kw.pop("body", None)
        if payload is not None:
            body = json.dumps(payload).encode()
        status, headers, data = self.request(method, path, body, **kw)
        if status >= 400:
            try:
                err = json.loads(data)
            except ValueError:
                err = {"error": "http_error", "message": data.decode("utf-8", "replace")[:500]}
            cls = TabFMRequestError if 400 <= status < 500 and status not in (401, 404) else TabFMServerError
            raise cls(status, err if isinstance(err, dict) else {"message": str(err)})
        if headers.get("content-type", "").startswith(wire.JSON):
            return json.loads(data)
        return data

    # ---------------------------------------------------------------- operations
    def health(self) -> dict[str, Any]:
        return self.call("GET", "/healthz")

    def ready(self) -> dict[str, Any]:
        return self.call("GET", "/readyz")

    def info(self) -> dict[str, Any]:
        return self.call("GET", "/v1/info")

    def metrics(self) -> str:
        return self.call("GET", "/metrics").decode()

    # ---------------------------------------------------------------- predictions (JSON)
    @staticmethod
    def _table(table: Any) -> dict[str, list]:
        return table if isinstance(table, dict) else wire.frame_to_columns(wire.as_frame(table))

    def _payload(self, query: Any, context: Any, target: str | None, context_id: str | None,
                 params: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {**extra}
        if query is not None:
            out["query"] = self._table(query)
        if context is not None:
            out["context"] = self._table(context)
        if target is not None:
            out["target"] = target
        if context_id is not None:
            out["context_id"] = context_id
        if params:
            out["params"] = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
        return out

    def classify(self, query: Any, context: Any = None, target: str | None = None, context_id: str | None = None,
                 params: dict[str, Any] | None = None, return_proba: bool = True) -> dict[str, Any]:
        """POST /v1/classify: labels (and probabilities) of `query`, given `context` + `target` or `context_id`."""
        return self.call("POST", "/v1/classify", self._payload(query, context, target, context_id, params,
                                                                return_proba=return_proba))

    def regress(self, query: Any, context: Any = None, target: str | None = None, context_id: str | None = None,
                params: dict[str, Any] | None = None, quantiles: Sequence[float] = ()) -> dict[str, Any]:
        """POST /v1/regress: predictive means (and `quantiles`) of `query`."""
        return self.call("POST", "/v1/regress", self._payload(query, context, None if context is None else target,
                                                               context_id, params, quantiles=list(quantiles)))

    def impute(self, query: Any, context: Any = None, context_id: str | None = None,
               params: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /v1/impute: `query` with its missing cells filled (its own context when none is given)."""
        return self.call("POST", "/v1/impute", self._payload(query, context, None, context_id, params))

    def anomaly_score(self, query: Any = None, context: Any = None, context_id: str | None = None,
                      params: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /v1/anomaly-score: scores (higher = more normal) of `query` (default: the context rows)."""
        return self.call("POST", "/v1/anomaly-score", self._payload(query, context, None, context_id, params))

    # ---------------------------------------------------------------- registered contexts
    def register(self, task: str, context: Any, target: str | None = None, params: dict[str, Any] | None = None,
                 arrow: bool = False) -> dict[str, Any]:
        """POST /v1/contexts: register `context` once for `task`; the answer's context_id serves later calls.
        arrow=True sends the table as Arrow IPC (dtypes exact, compact) with the rest in the query string."""
        if not arrow:
            payload = {"task": task, "context": self._table(context), **({"target": target} if target else {})}
            if params:
                payload["params"] = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
            return self.call("POST", "/v1/contexts", payload)
        body = context if isinstance(context, bytes) else wire.frame_to_arrow(wire.as_frame(context))
        query = {"task": task, **({"target": target} if target else {}), **(params or {})}
        return self.call("POST", "/v1/contexts", body=body, content_type=wire.ARROW_STREAM, query=query)

    def predict_arrow(self, endpoint: str, context_id: str, query: Any, accept: str | None = None,
                      **options: Any) -> Any:
        """POST /v1/ENDPOINT with the query rows as an Arrow IPC body (a registered context)."""
        body = query if isinstance(query, bytes) else wire.frame_to_arrow(wire.as_frame(query))
        return self.call("POST", f"/v1/{endpoint}", body=body, content_type=wire.ARROW_STREAM,
                         query={"context_id": context_id, **options}, accept=accept)

    def context(self, context_id: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/contexts/{urllib.parse.quote(context_id)}")

    def contexts(self) -> dict[str, Any]:
        return self.call("GET", "/v1/contexts")

    def delete_context(self, context_id: str) -> None:
        self.call("DELETE", f"/v1/contexts/{urllib.parse.quote(context_id)}")


# ----------------------------------------------------------------------------- remote estimators
class _RemoteEstimator:
    """What the remote estimators share: parameters, registration at fit, query rows as Arrow."""

    _task = ""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, timeout: float = 300.0,
                 **estimator_params: Any) -> None:
        self.url, self.token, self.timeout = url, token, timeout
        self.estimator_params = dict(estimator_params)

    # sklearn-style parameters (BaseEstimator refuses **kwargs, so these are spelled out)
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "timeout": self.timeout, **self.estimator_params}

    def set_params(self, **params: Any) -> "_RemoteEstimator":
        for key, value in params.items():
            if key in ("url", "token", "timeout"):
                setattr(self, key, value)
            else:
                self.estimator_params[key] = value
        self.__dict__.pop("_client", None)
        return self

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.get_params().items() if k != "token"}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_client"}

    @property
    def client(self) -> TabFMClient:
        if "_client" not in self.__dict__:
            self._client = TabFMClient(self.url, self.token, self.timeout)
        return self._client

    def _check_fitted(self) -> None:
        if not hasattr(self, "context_id_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with appropriate "
                                 "arguments before using this estimator.")

    def _register(self, X: Any, y: Any = None) -> "_RemoteEstimator":
        frame = wire.as_frame(X)
        self.n_features_in_ = frame.shape[1]
        named = isinstance(X, type(frame)) and all(isinstance(c, str) and c for c in X.columns)
        if named:
            self.feature_names_in_ = np.asarray(frame.columns, dtype=object)
        elif hasattr(self, "feature_names_in_"):
            del self.feature_names_in_
        self._columns = list(frame.columns)
        target = None
        if y is not None:
            target = "target"
            while target in frame.columns:
                target = "_" + target
            values = y.to_numpy() if hasattr(y, "to_numpy") else np.asarray(y)
            if values.ndim == 2 and values.shape[1] == 1:
                values = values[:, 0]
            if len(values) != len(frame):
                raise ValueError(f"X has {len(frame)} rows but y has {len(values)}; they must match")
            frame = frame.reset_index(drop=True).assign(**{target: values})
        self._target, self._body = target, wire.frame_to_arrow(frame)
        self._context_params = dict(self.estimator_params)
        self._sign_up()
        return self

    def _sign_up(self) -> None:
        info = self.client.register(self._task, self._body, self._target, self._context_params, arrow=True)
        self.context_id_ = info["context_id"]
        self._context_params = {**self._context_params, "random_state": info["params"].get("random_state", 0)}
        self.context_info_ = info
        if info.get("classes") is not None:
            self.classes_ = np.asarray(info["classes"])
        if info.get("offset") is not None:
            self.offset_ = float(info["offset"])

    def _query_frame(self, X: Any) -> Any:
        frame = wire.as_frame(X)
        names = getattr(self, "feature_names_in_", None)
        named = isinstance(X, type(frame)) and all(isinstance(c, str) and c for c in X.columns)
        if names is None or not named:
            if frame.shape[1] != self.n_features_in_:
                raise ValueError(f"X has {frame.shape[1]} features, but {type(self).__name__} is expecting "
                                 f"{self.n_features_in_} features as input")
            frame = frame.set_axis(self._columns, axis=1)
        return frame

    def _ask(self, endpoint: str, X: Any, accept: str | None = None, **options: Any) -> Any:
        """The server's answer for query rows X; registers the context again if the server lost it."""
        self._check_fitted()
        body = wire.frame_to_arrow(self._query_frame(X))
        try:
            return self.client.predict_arrow(endpoint, self.context_id_, body, accept=accept, **options)
        except TabFMServerError as err:
            if err.status != 404 or err.error != "context_not_found":
                raise
        self._sign_up()  # evicted (or another worker): the same table and parameters give the same answers
        return self.client.predict_arrow(endpoint, self.context_id_, body, accept=accept, **options)


class RemoteTabFMClassifier(_RemoteEstimator):
    """TabFMClassifier on a `tabfm serve` server: fit registers the context; same answers."""

    _task = "classification"

    def fit(self, X: Any, y: Any) -> "RemoteTabFMClassifier":
        return self._register(X, y)

    def predict_proba(self, X: Any) -> np.ndarray:
        return np.asarray(self._ask("classify", X, return_proba=True)["probabilities"], dtype=np.float64)

    def predict(self, X: Any) -> np.ndarray:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]

    def score(self, X: Any, y: Any) -> float:
        from sklearn.metrics import accuracy_score

        return float(accuracy_score(y, self.predict(X)))


class RemoteTabFMRegressor(_RemoteEstimator):
    """TabFMRegressor on a `tabfm serve` server: fit registers the context; same answers."""

    _task = "regression"

    def fit(self, X: Any, y: Any) -> "RemoteTabFMRegressor":
        return self._register(X, y)

    def predict(self, X: Any, output: str = "mean") -> np.ndarray:
        if output not in ("mean", "median"):
            raise ValueError(f"output must be one of ('mean', 'median'), got {output!r}")
        if output == "median":
            return self.predict_quantiles(X, [0.5])[:, 0]
        return np.asarray(self._ask("regress", X)["mean"], dtype=np.float64)

    def predict_quantiles(self, X: Any, quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> np.ndarray:
        levels = [float(q) for q in np.asarray(quantiles, dtype=np.float64).reshape(-1)]
        if not levels or any(not 0 < q < 1 for q in levels):
            raise ValueError(f"quantile levels must be a non-empty list of values in (0, 1), got {list(quantiles)}")
        return np.asarray(self._ask("regress", X, quantiles=levels)["quantiles"], dtype=np.float64)

    def score(self, X: Any, y: Any) -> float:
        from sklearn.metrics import r2_score

        return float(r2_score(y, self.predict(X)))


class RemoteTabFMImputer(_RemoteEstimator):
    """TabFMImputer on a `tabfm serve` server: fit registers the rows; transform fills X's missing cells."""

    _task = "imputation"

    def fit(self, X: Any, y: Any = None) -> "RemoteTabFMImputer":
        return self._register(X)

    def transform(self, X: Any) -> Any:
        import pandas as pd

        filled = wire.arrow_to_frame(self._ask("impute", X, accept=wire.ARROW_STREAM))
        if isinstance(X, pd.DataFrame):
            out = filled.set_axis(X.index, axis=0)
            return out[list(X.columns)] if all(c in out.columns for c in X.columns) else out
        arr = np.array(X)
        return filled.to_numpy(dtype=arr.dtype) if arr.dtype.kind in "fiub" else filled.to_numpy()

    def fit_transform(self, X: Any, y: Any = None) -> Any:
        return self.fit(X).transform(X)


class RemoteTabFMAnomalyDetector(_RemoteEstimator):
    """TabFMAnomalyDetector on a `tabfm serve` server: fit registers the rows (and sets offset_)."""

    _task = "anomaly"

    def fit(self, X: Any, y: Any = None) -> "RemoteTabFMAnomalyDetector":
        return self._register(X)

    def score_samples(self, X: Any) -> np.ndarray:
        return np.asarray(self._ask("anomaly-score", X)["scores"], dtype=np.float64)

    def decision_function(self, X: Any) -> np.ndarray:
        return self.score_samples(X) - self.offset_

    def predict(self, X: Any) -> np.ndarray:
        return np.where(self.decision_function(X) < 0, -1, 1)

    def fit_predict(self, X: Any, y: Any = None) -> np.ndarray:
        return self.fit(X).predict(X)


__all__ = ["TabFMClient", "TabFMServerError", "TabFMRequestError", "RemoteTabFMClassifier", "RemoteTabFMRegressor",
           "RemoteTabFMImputer", "RemoteTabFMAnomalyDetector"]
