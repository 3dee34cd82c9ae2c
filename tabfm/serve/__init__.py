"""`tabfm serve`: the prediction server (FastAPI + uvicorn) over the in-context estimators.

Modules, one job each:
- config     ServeConfig: the server's settings and limits (standard library only, so the command
             line's --help and the client need neither FastAPI nor torch)
- wire       how tables travel: content types, DataFrame <-> JSON columns / Arrow IPC (client and server)
- schemas    the pydantic models of every request and response (the OpenAPI schema at /docs)
- tables     request tables -> DataFrames, checked against the limits (errors name field, column, row)
- errors     ApiError and the JSON error body every 4xx/5xx carries
- estimators the estimators the server runs: the in-process ones, keeping each member's encoded context
- tasks      one model call per batch: fit a context, classify / regress / impute / score, split answers
- contexts   registered contexts: content ids, an LRU under a byte cap, a spool shared by workers
- batching   size-classed lanes: a queue and a worker thread each, merging what can share a call
- metrics    Prometheus text exposition (counters, gauges, histograms)
- service    the state of one server process; a checked request -> a queued model call
- middleware bearer-token check, body-size limit, request metrics (pure ASGI)
- app        create_app(config): the routes, error handlers, OpenAPI; page.html is the page at GET /

Importing this package imports nothing heavy; `tabfm.serve.app` needs the `serve` extra
(`pip install "tabfm[serve]"`).
"""
