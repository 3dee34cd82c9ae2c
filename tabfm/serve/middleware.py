"""What every HTTP request passes through, as one pure ASGI middleware (no body re-streaming
surprises of BaseHTTPMiddleware):

1. metrics: requests by endpoint (the route template, so ids do not explode the label set),
   method and status; latency; requests in flight;
2. access: with a token, every path but OPEN_PATHS needs `Authorization: Bearer TOKEN` (compared
   in constant time); a missing or wrong one is 401 and counted (tabfm_unauthorized_total);
3. body size: a Content-Length over --max-body-bytes is refused (413) before anything is read,
   and a body without one is read up to the limit (413 beyond it), then handed on.
"""
from __future__ import annotations

import hmac
import json
import time
from typing import Any, Awaitable, Callable

from .errors import error_body
from .metrics import Metrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# open without a token: liveness, and the page (static HTML holding no data; it asks for the token)
OPEN_PATHS = ("/healthz", "/", "/favicon.ico")


async def _answer(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class Gate:
    """ASGI middleware: metrics, bearer token, body size (see the module doc)."""

    def __init__(self, app: Any, metrics: Metrics, token: str | None, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body_bytes
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self._handle(scope, receive, sending)
        finally:
            self.metrics.in_flight.inc(-1)
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.inc(endpoint=endpoint, method=scope["method"], status=str(status[0]))
            self.metrics.latency.observe(time.perf_counter() - start, endpoint=endpoint)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.token is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            self.metrics.unauthorized.inc()
            await _answer(send, 401, error_body("unauthorized", "missing or wrong bearer token: send the header "
                                                "`Authorization: Bearer TOKEN` (tabfm serve --token)",
                                                field="authorization"), {"WWW-Authenticate": "Bearer"})
            return
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                await _answer(send, 400, error_body("bad_request", "Content-Length is not a number",
                                                    field="content-length"))
                return
            if n > self.max_body:
                await self._too_large(send, n)
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):  # no length given (chunked): read it here, bounded
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body:
                    await self._too_large(send, size, at_least=True)
                    return
                if not message.get("more_body", False):
                    break
            body, sent = b"".join(chunks), [False]

            async def replay() -> dict[str, Any]:
                if not sent[0]:
                    sent[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        scheme, _, given = headers.get("authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)

    async def _too_large(self, send: Send, n: int, at_least: bool = False) -> None:
        self.metrics.rejected.inc(reason="body_too_large")
        more = "more than " if at_least else ""
        await _answer(send, 413, error_body("body_too_large", f"the request body has {more}{n} bytes, over this "
                                            f"server's limit of {self.max_body} (tabfm serve --max-body-bytes); "
                                            "register large contexts once, or send Arrow IPC / Parquet",
                                            field="body", limit=self.max_body))
