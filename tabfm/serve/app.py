"""The FastAPI app: `create_app(config)` (one process), `app_from_env()` (uvicorn workers).

Routes parse the body by its content type (JSON: the pydantic request models; CSV, Arrow IPC,
Parquet: one table, the other fields as query parameters), hand a checked request to the
Service, and shape its answer into the response models. Every refusal is the JSON error body of
tabfm.serve.errors; an unexpected failure is a 500 with that body too (traceback in the server
log only).
"""
from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tabfm import __version__

from . import schemas as S
from . import tables, wire
from .config import ServeConfig
from .errors import ApiError, error_body, invalid
from .middleware import Gate
from .service import Service

log = logging.getLogger("tabfm.serve")
PAGE = Path(__file__).with_name("page.html")
LIST_FIELDS = ("quantiles", "n_neighbors")  # query parameters that take comma-separated lists
ERRORS = {code: {"model": S.ErrorResponse, "description": why} for code, why in (
    (400, "unreadable body"), (401, "missing or wrong bearer token"), (404, "unknown context id"),
    (413, "over a limit (body bytes, rows, columns, categories, classes)"), (415, "unsupported content type"),
    (422, "invalid request or table (names the field, column, row)"), (503, "not ready or overloaded"))}
ADAPTERS = {name: TypeAdapter(model) for name, model in S.REQUEST_MODELS.items()}
DESCRIPTION = """In-context predictions from the tabfm table model: classify, regress, impute and score
anomalies, with the context rows in the request or registered once (POST /v1/contexts).
JSON bodies hold tables in records or columns orientation; a CSV, Arrow IPC or Parquet body holds
one table (the query rows, or the context at registration) and the other fields go in the query
string. See docs/serving.md."""


def _body_spec(model: str, table: str) -> dict[str, Any]:
    """openapi_extra: the JSON request model, or one table as a CSV / Arrow / Parquet body."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "description": f"JSON ({model}), or the {table} table alone as "
                            "CSV / Arrow IPC / Parquet with the other fields as query parameters",
                            "content": {wire.JSON: {"schema": {"$ref": f"#/components/schemas/{model}"}},
                                        **{m: binary for m in (wire.CSV, wire.ARROW_STREAM, wire.ARROW_FILE,
                                                               wire.PARQUET)}}}}


def _clean_loc(loc: tuple) -> tuple[str, str | None, int | None]:
    """(field path, column, row) of a pydantic error location inside a request table."""
    parts = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool",
                                                                              "function-after", "none")))]
    column = row = None
    for i, p in enumerate(loc):
        if isinstance(p, str) and p.startswith("list[dict"):  # records: row, then column
            row, column = _at(loc, i + 1, int), _at(loc, i + 2, str)
        elif isinstance(p, str) and p.startswith("dict[str"):  # columns: column, then row
            column, row = _at(loc, i + 1, str), _at(loc, i + 2, int)
    return ".".join(str(p) for p in parts), column, row


def _at(loc: tuple, i: int, kind: type) -> Any:
    return loc[i] if i < len(loc) and isinstance(loc[i], kind) else None


def validation_error(err: ValidationError | RequestValidationError) -> ApiError:
    """A pydantic error as the error body: 400 for JSON that does not parse, else 422 naming the field."""
    errors = err.errors() if isinstance(err, RequestValidationError) else \
        err.errors(include_url=False, include_input=False, include_context=False)
    if errors and errors[0]["type"] == "json_invalid":
        return ApiError(400, "invalid_json", f"the body is not valid JSON: {errors[0]['msg']}", field="body")
    first = max(errors, key=lambda e: len(e["loc"]))  # the most specific (deepest) of a union's errors
    field, column, row = _clean_loc(tuple(first["loc"]))
    where = "".join(f" {k} {v!r}" for k, v in (("column", column), ("row", row)) if v is not None)
    details = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "type": e["type"]} for e in errors[:20]]
    return ApiError(422, "invalid_request", f"{field or 'body'}{where}: {first['msg']}", field=field or None,
                    column=column, row=row, details=details)


def _query_fields(request: Request, top: set[str]) -> dict[str, Any]:
    """Query parameters as request fields: `top` ones as they are, the rest into `params`."""
    fields: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for key in request.query_params:
        values = request.query_params.getlist(key)
        value: Any = values[-1]
        if key in LIST_FIELDS:
            value = [v for item in values for v in item.split(",") if v.strip()]
        elif value.lower() in ("null", "none"):
            value = None
        (fields if key in top else params)[key] = value
    if params:
        fields["params"] = params
    return fields


def create_app(config: ServeConfig | None = None) -> FastAPI:
    """The ASGI app of one server process (the weights load at startup)."""
    config = config or ServeConfig()
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            await run_in_threadpool(service.stop)  # uvicorn has let in-flight requests finish

    app = FastAPI(title="tabfm", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.service = service

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        if err.status != 401:
            service.metrics.rejected.inc(reason=err.error)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        message = f"no route {request.method} {request.url.path} (see /docs)" if err.status_code in (404, 405) \
            else str(err.detail)
        return JSONResponse(error_body(code, message), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("tabfm serve: internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", f"internal error ({type(err).__name__}); the server log has "
                                       "the details"), status_code=500)

    # ------------------------------------------------------------------ bodies
    def json_tables(req: Any) -> tuple[dict[str, Any], bytes]:
        """The request's JSON tables as DataFrames, and the canonical JSON of its context (its identity)."""
        frames = {}
        for field in ("context", "query"):
            value = getattr(req, field, None)
            if value is not None:
                frames[field] = tables.json_table(value, field, config)
        return frames, json.dumps(getattr(req, "context", None) or getattr(req, "query", None)).encode()

    async def read(request: Request, name: str, table: str) -> tuple[Any, dict[str, Any], str, bytes]:
        """(request model, its tables as DataFrames, media type, bytes that identify its context)."""
        media = wire.media_type(request.headers.get("content-type"))
        body = await request.body()
        adapter = ADAPTERS[name]
        if media in ("", wire.JSON) or media.endswith("+json"):
            if not body.strip():
                raise ApiError(400, "empty_body", f"the request body is empty: send a JSON {name} (see /docs)",
                               field="body")
            try:
                req = await run_in_threadpool(adapter.validate_json, body)
            except ValidationError as err:
                raise validation_error(err) from None
            frames, identity = await run_in_threadpool(json_tables, req)
            return req, frames, wire.JSON, identity
        if media in wire.TABLE_TYPES:
            top = set(S.RegisterClassification.model_fields) if name == "RegisterRequest" else \
                set(S.REQUEST_MODELS[name].model_fields)
            fields = {**_query_fields(request, top), table: {}}
            try:
                req = adapter.validate_python(fields)
            except ValidationError as err:
                raise validation_error(err) from None
            frame = await run_in_threadpool(tables.body_table, body, media, table, config)
            return req, {table: frame}, media, body
        raise ApiError(415, "unsupported_media_type", f"content type {media!r} is not one of {wire.JSON}, "
                       f"{', '.join(wire.TABLE_TYPES)}", field="content-type")

    def answer_meta(ctx: Any, out: dict[str, Any], n_rows: int) -> dict[str, Any]:
        used = out["context"]
        found = ([] if ctx.registered else list(used.fit_warnings)) + list(out["warnings"])
        return {"model": config.model_for(ctx.task), "context_id": ctx.id if ctx.registered else None,
                "n_rows": n_rows, "warnings": found}

    def context_of(req: Any, frames: dict[str, Any], op: str, identity: bytes) -> Any:
        if req.context_id is not None:
            return service.registered(req.context_id, op)
        task = {"classify": "classification", "regress": "regression", "impute": "imputation", "anomaly": "anomaly"}[op]
        return service.new_context(task, frames["context"], getattr(req, "target", None), req.params, identity)

    # ------------------------------------------------------------------ predictions
    @app.post("/v1/classify", response_model=S.ClassifyResponse, responses=ERRORS, tags=["predict"],
              openapi_extra=_body_spec("ClassifyRequest", "query"), summary="class labels and probabilities")
    async def classify(request: Request) -> S.ClassifyResponse:
        req, frames, _, identity = await read(request, "ClassifyRequest", "query")
        ctx = context_of(req, frames, "classify", identity)
        out = await service.run("classify", ctx, frames["query"], (req.return_proba,))
        proba = out["probabilities"]
        return S.ClassifyResponse(**answer_meta(ctx, out, len(frames["query"])), predictions=out["predictions"],
                                  classes=out["context"].classes,
                                  probabilities=proba.tolist() if proba is not None else None)

    @app.post("/v1/regress", response_model=S.RegressResponse, responses=ERRORS, tags=["predict"],
              openapi_extra=_body_spec("RegressRequest", "query"), summary="predictive mean and quantiles")
    async def regress(request: Request) -> S.RegressResponse:
        req, frames, _, identity = await read(request, "RegressRequest", "query")
        ctx = context_of(req, frames, "regress", identity)
        levels = tuple(float(q) for q in req.quantiles)
        out = await service.run("regress", ctx, frames["query"], (levels,))
        q = out["quantiles"]
        return S.RegressResponse(**answer_meta(ctx, out, len(frames["query"])), mean=out["mean"].tolist(),
                                 quantile_levels=list(levels), quantiles=q.tolist() if q is not None else None)

    @app.post("/v1/impute", response_model=S.ImputeResponse, responses=ERRORS, tags=["predict"],
              openapi_extra=_body_spec("ImputeRequest", "query"),
              summary="fill missing cells (Accept: application/vnd.apache.arrow.stream for an Arrow answer)")
    async def impute(request: Request) -> Any:
        req, frames, _, identity = await read(request, "ImputeRequest", "query")
        if req.context_id is None and req.context is None:  # the rows are their own context
            frames["context"] = frames["query"]
        ctx = context_of(req, frames, "impute", identity)
        out = await service.run("impute", ctx, frames["query"])
        n_filled = int(out["n_filled"].sum())
        meta = answer_meta(ctx, out, len(frames["query"]))
        if wire.media_type(request.headers.get("accept")) == wire.ARROW_STREAM:
            body = await run_in_threadpool(wire.frame_to_arrow, out["table"])
            return Response(body, media_type=wire.ARROW_STREAM, headers={
                "x-tabfm-filled": str(n_filled), "x-tabfm-warnings": json.dumps(meta["warnings"])})
        return S.ImputeResponse(**meta, table=wire.frame_to_columns(out["table"]), n_filled=n_filled)

    @app.post("/v1/anomaly-score", response_model=S.AnomalyResponse, responses=ERRORS, tags=["predict"],
              openapi_extra=_body_spec("AnomalyRequest", "query"), summary="anomaly scores (higher = more normal)")
    async def anomaly_score(request: Request) -> S.AnomalyResponse:
        req, frames, _, identity = await read(request, "AnomalyRequest", "query")
        if "query" not in frames:  # the context rows score themselves (each without itself: folds)
            if req.context_id is not None:
                raise invalid("`query` is required with `context_id`", field="query")
            frames["query"] = frames["context"]
        ctx = context_of(req, frames, "anomaly", identity)
        out = await service.run("anomaly", ctx, frames["query"])
        return S.AnomalyResponse(**answer_meta(ctx, out, len(frames["query"])), scores=out["scores"].tolist(),
                                 decision=out["decision"].tolist(), labels=out["labels"].tolist(),
                                 offset=out["context"].offset)

    # ------------------------------------------------------------------ registered contexts
    def info(ctx: Any, existed: bool = False) -> S.ContextInfo:
        return S.ContextInfo(context_id=ctx.id, task=ctx.task, target=ctx.target, columns=ctx.columns,
                             n_rows=ctx.n_rows, classes=ctx.classes, offset=ctx.offset, params=ctx.params,
                             bytes=ctx.nbytes, created=ctx.created, last_used=ctx.last_used, requests=ctx.requests,
                             existed=existed, warnings=ctx.fit_warnings)

    @app.post("/v1/contexts", response_model=S.ContextInfo, status_code=201, responses=ERRORS, tags=["contexts"],
              openapi_extra=_body_spec("RegisterRequest", "context"), summary="register a context once")
    async def register(request: Request) -> JSONResponse:
        req, frames, media, identity = await read(request, "RegisterRequest", "context")
        ctx, existed = await service.register(req.task, frames["context"], req.target, req.params, media, identity)
        return JSONResponse(info(ctx, existed).model_dump(mode="json"), status_code=200 if existed else 201)

    @app.get("/v1/contexts", response_model=S.ContextList, responses=ERRORS, tags=["contexts"])
    async def list_contexts() -> S.ContextList:
        held = service.store.list()
        return S.ContextList(contexts=[info(c) for c in held], bytes=service.store.total(),
                             limit_bytes=config.context_cache_bytes)

    @app.get("/v1/contexts/{context_id}", response_model=S.ContextInfo, responses=ERRORS, tags=["contexts"])
    async def get_context(context_id: str) -> S.ContextInfo:
        return info(service.store.get(context_id, service._reload))

    @app.delete("/v1/contexts/{context_id}", status_code=204, responses=ERRORS, tags=["contexts"])
    async def delete_context(context_id: str) -> Response:
        service.store.delete(context_id)
        return Response(status_code=204)

    # ------------------------------------------------------------------ operations
    @app.get("/healthz", response_model=S.Health, tags=["operations"], summary="liveness (no token needed)")
    async def healthz() -> S.Health:
        return S.Health(status="ok")

    @app.get("/readyz", response_model=S.Ready, responses=ERRORS, tags=["operations"],
             summary="ready to answer: weights loaded, lanes running")
    async def readyz() -> Any:
        if not service.ready:
            return JSONResponse(error_body("not_ready", "the server is starting or stopping"), status_code=503)
        return S.Ready(status="ready", models=config.models(), lanes=len(service.batcher.lanes),
                       queued=service.batcher.queued())

    @app.get("/metrics", response_class=PlainTextResponse, tags=["operations"], summary="Prometheus text exposition")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/info", response_model=S.Info, responses=ERRORS, tags=["operations"],
             summary="the model, device and limits")
    async def server_info() -> S.Info:
        return S.Info(models=config.models(), version=__version__, device=service.device, batching=config.batching,
                      limits=config.limits(), tasks=list(S.TASKS))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request models the routes parse themselves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, adapter in ADAPTERS.items():
                js = adapter.json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[name] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(Gate, metrics=service.metrics, token=config.token, max_body_bytes=config.max_body_bytes)
    return app


def app_from_env() -> FastAPI:
    """The app of a uvicorn worker process (tabfm serve --workers N): config from TABFM_SERVE_CONFIG."""
    return create_app(ServeConfig.from_env())
