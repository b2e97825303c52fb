"""The FastAPI application: query endpoints, collect jobs, metrics and the dashboard.

``create_api(backend)`` builds the app over a :class:`~sparseety.api.backend.Backend`; the
server module runs it (beside the sink loop, or alone). Routes mirror the query library so the
CLI can use them remotely (:class:`~sparseety.api.client.RemoteQueries`). ``docs/api.md`` is the
reference; OpenAPI docs are at ``/docs``.

Errors are JSON ``{"error": <code>, "message": <text>}``: 400 ``bad_parameter``, 401
``unauthorized``, 403 ``forbidden``, 404 ``not_found``, 409 ``ambiguous`` (an id that names several
requests; the body adds ``candidates``), 503 ``store_unavailable``.
"""

from __future__ import annotations

import html
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparseety import __version__
from sparseety.api import params
from sparseety.api.auth import SESSION_COOKIE, AuthError, Principal, Sessions
from sparseety.api.backend import JOB_KINDS, Backend, ClientGone
from sparseety.api.clickhouse_http import router as clickhouse_router
from sparseety.api.collect import (
    COLLECT_KINDS,
    AnalyzeSpec,
    CollectSpecError,
    IngestSpec,
    ReplaySpec,
    VllmLogSpec,
)
from sparseety.api.dashboard import collect as collect_dashboard
from sparseety.api.dashboard import plotly_js_path, render_html
from sparseety.api.encode import jsonable
from sparseety.api.endpoints import Endpoint, lookups, routes
from sparseety.api.guard import BodyLimit
from sparseety.api.jobs import JobCancelled
from sparseety.api.queries import ApiQueries, timeline_counts
from sparseety.errors import (
    AmbiguousIdError,
    ConfigError,
    MigrationError,
    PluginLoadError,
    QueryLimitError,
    ReplayError,
    StoreError,
    TooManyQueriesError,
)
from sparseety.producers.logs.errors import TraceError
from sparseety.queries.export import MEDIA_TYPES, check_format
from sparseety.queries.registry import Param, QueryError, Scope
from sparseety.queries.sql import run_sql
from sparseety.sinks.clickhouse.migrate import status_rows
from sparseety.sinks.clickhouse.prices import (
    checked_price,
    delete_prices,
    list_prices,
    set_prices,
    unseen_models,
)

log = logging.getLogger("sparseety.api")
T = TypeVar("T")

_bearer = HTTPBearer(auto_error=False, description="A token from api.tokens, or the admin token.")


class NotFound(Exception):
    """Answered with 404 (unknown, or not visible to the caller: the two look the same)."""


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


def backend_of(request: Request) -> Backend:
    return request.app.state.backend  # type: ignore[no-any-return]


def _session(request: Request) -> Principal | None:
    """The principal of the request's browser session: reads (GET, HEAD) only, so a cookie never
    authorizes a change (a form another site posts gets nothing from it)."""
    if request.method not in ("GET", "HEAD"):
        return None
    sessions: Sessions = request.app.state.sessions
    return sessions.get(request.cookies.get(SESSION_COOKIE))


def principal(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The caller, from its bearer token, else its browser session (401 when tokens are
    configured and it has neither)."""
    header = request.headers.get("authorization")
    tokens = backend_of(request).tokens
    who = (None if header or tokens.open else _session(request)) or tokens.authenticate(header)
    request.state.principal = who
    return who


Caller = Annotated[Principal, Depends(principal)]


def browser_principal(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal | None:
    """As :func:`principal`, but None (not 401) for a browser page load without credentials, so
    the page can send it to the login form."""
    header = request.headers.get("authorization")
    if not header and "text/html" in request.headers.get("accept", ""):
        try:
            return principal(request, _)
        except AuthError:
            return None
    return principal(request, _)


Browser = Annotated[Principal | None, Depends(browser_principal)]


def _login_html(message: str, status: int = 200) -> HTMLResponse:
    from importlib import resources
    from string import Template

    page = resources.files("sparseety.api").joinpath("static", "login.html").read_text(encoding="utf-8")
    body = Template(page).substitute(message=html.escape(message))
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})


async def _login(request: Request) -> Response:
    """A token (form field ``token``, or JSON ``{"token": ...}``) -> a session cookie; a form is
    sent on to the dashboard, JSON answered ``{"ok": true}``."""
    from urllib.parse import parse_qs

    raw = await request.body()
    is_json = request.headers.get("content-type", "").startswith("application/json")
    token = ""
    if is_json:
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        token = str(body.get("token", "")) if isinstance(body, dict) else ""
    else:
        token = (parse_qs(raw.decode(errors="replace")).get("token") or [""])[0]
    tokens = backend_of(request).tokens
    try:
        who = tokens.authenticate(f"Bearer {token.strip()}") if not tokens.open else None
    except AuthError:
        if is_json:
            return _error(401, "unauthorized", "unknown token")
        return _login_html("That token is not known here.", status=401)
    if who is None:  # an open API needs no login
        return RedirectResponse("/dashboard", status_code=303)
    sessions: Sessions = request.app.state.sessions
    sid = sessions.create(who)
    response: Response = (
        JSONResponse({"ok": True}) if is_json else RedirectResponse("/dashboard", status_code=303)
    )
    response.set_cookie(
        SESSION_COOKIE,
        sid,
        max_age=int(sessions.ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


Back = Annotated[Backend, Depends(backend_of)]


@dataclass(frozen=True)
class Call:
    """One API request's caller, backend and connection: its reads run under the caller's
    limits and stop when the client goes away (:meth:`Backend.read`)."""

    who: Principal
    back: Backend
    request: Request

    async def read(self, name: str, fn: Callable[[ApiQueries], T]) -> T:
        return await self.back.read(self.who, name, fn, disconnected=self.request.is_disconnected)


def _call(request: Request, who: Caller, back: Back) -> Call:
    return Call(who, back, request)


Called = Annotated[Call, Depends(_call)]


class ScopeParams(BaseModel):
    """Time range and tenant filters every query takes: the query-parameter model every route's
    own model extends (FastAPI reads a route's query string into one model)."""

    since: str | None = Field(
        None, description="Finished at or after: ISO-8601 time, now, or a duration ago (2h)."
    )
    until: str | None = Field(None, description="Finished before: ISO-8601 time or a duration ago.")
    since_ns: int | None = Field(None, description="Finished at or after, wall-clock ns.")
    until_ns: int | None = Field(None, description="Finished before, wall-clock ns.")
    tenant: list[str] = Field([], description="Only these tenants (repeatable).")

    def scope(self, who: Principal, now_ns: int) -> Scope:
        return params.scope(
            who.visible(self.tenant),
            since=self.since,
            until=self.until,
            since_ns=self.since_ns,
            until_ns=self.until_ns,
            now_ns=now_ns,
        )

    def describe(self, scope: Scope) -> dict[str, Any]:
        return {"since_ns": scope.since_ns, "until_ns": scope.until_ns, "tenants": scope.tenants}


class BatchParams(ScopeParams):
    request_id: list[str] = Field(
        [],
        description=f"These requests in full (as /requests/UID answers each), in this order, "
        f"in one query; at most {params.MAX_DASHBOARD_REQUESTS}.",
    )


class DashboardParams(ScopeParams):
    request_id: list[str] = Field([], description="Requests whose timelines to draw.")
    inline: bool = Field(False, description="Embed plotly.js (a self-contained file).")


Scoped = Annotated[ScopeParams, Query()]


def _group_by_field() -> Any:
    return Field([], description="Dimensions: tenant, model, engine, lora (repeatable or comma-separated).")


def _bucket_field() -> Any:
    return Field(None, description="Time buckets by finish time, e.g. 15m, 1h, 1d.")


def _rows(query: str, scope: Scope, rows: list[dict[str, Any]], **extra: Any) -> JSONResponse:
    body = {
        "query": query,
        **extra,
        "scope": {"since_ns": scope.since_ns, "until_ns": scope.until_ns, "tenants": scope.tenants},
        "rows": rows,
    }
    return JSONResponse(jsonable(body))


def _format_field() -> Any:
    return Field(
        None,
        description="parquet or csv: the rows as a file, streamed (ClickHouse's own FORMAT for SQL queries).",
    )


#: Bytes per chunk of a streamed export.
CHUNK = 1 << 16


async def _file(call: Call, spec: Endpoint, fmt: str, **kwargs: Any) -> Response:
    """A registry query's rows as a Parquet or CSV attachment, sent in chunks."""
    check_format(fmt)
    data = await call.read(spec.label, lambda q: q.export(spec.query, fmt, **kwargs))
    if data is None:
        raise NotFound(f"{spec.not_found} {kwargs.get('key')!r}")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]

    return StreamingResponse(
        chunks(),
        media_type=MEDIA_TYPES[fmt],
        headers={"Content-Disposition": f'attachment; filename="{spec.name}.{fmt}"'},
    )


def _param_field(p: Param, default: Any) -> tuple[Any, Any]:
    """A registry param as a field of a route's query model (its wire name is the field's)."""
    kind = p.type if default is not None else p.type | None
    return kind, Field(default, description=p.doc, ge=p.ge, le=p.le)


def _with_query(handler: Any, model: type[BaseModel], **annotations: Any) -> Any:
    # FastAPI reads the query model from the handler's annotation; the model is built from the
    # registry at run time, so the annotation is set here (this module has no name for it that
    # FastAPI could resolve).
    handler.__annotations__.update(q=Annotated[model, Query()], **annotations)
    return handler


def _registry_route(specs: list[Endpoint]) -> Any:
    """The handler of one registry route: scope, grouping and params from one query-parameter
    model, :class:`ScopeParams` extended by the declaration's.

    ``specs[0]`` is the route's plain query; a later one runs instead when its ``selected_by``
    param is non-zero (``/duplication?top=N``).
    """
    plain, variants = specs[0], specs[1:]
    params_of = [p for s in specs for p in s.params]
    switches = {s.selected_by: s for s in variants if s.selected_by}
    fields: dict[str, Any] = {}
    if plain.query.group_by is not None:
        fields["group_by"] = (list[str], _group_by_field())
    for p in params_of:
        fields[p.wire] = _param_field(p, 0 if p.name in switches else p.default)
    if plain.query.bucket:
        fields["bucket"] = (str | None, _bucket_field())
    fields["format"] = (str | None, _format_field())
    model = create_model(f"{plain.route.title()}Parameters", __base__=ScopeParams, **fields)

    async def handler(call: Called, q: Any) -> Response:
        scope = q.scope(call.who, call.back.clock())
        given = q.model_dump()
        for name, spec in switches.items():
            (switch,) = (p for p in spec.params if p.name == name)
            if given[switch.wire]:
                return await _answer(call, spec, scope, given)
        return await _answer(call, plain, scope, given)

    handler.__doc__ = plain.query.doc.split("\n\n")[0]
    handler.__name__ = plain.route
    return _with_query(handler, model)


async def _answer(call: Call, spec: Endpoint, scope: Scope, given: dict[str, Any]) -> Response:
    """Run one registry query with the route's parameters; the body echoes what it used (or, with
    ``format``, the rows as a Parquet or CSV file)."""
    query = spec.query
    arguments = {p.name: p.check(given[p.wire]) for p in query.params}
    extra: dict[str, Any] = {p.wire: arguments[p.name] for p in query.params}
    by = bucket = None
    if query.group_by is not None:
        by = params.group_by(given["group_by"], query.group_by)
        extra["group_by"] = list(by)
    if query.bucket:
        bucket = given["bucket"]
        extra["bucket"] = bucket
    if given.get("format"):
        by_ = None if by is None else list(by)
        return await _file(
            call, spec, given["format"], by=by_, bucket=params.bucket(bucket), scope=scope, **arguments
        )
    rows = await call.read(
        spec.label, lambda q: q.ask(query, by=by, bucket=params.bucket(bucket), scope=scope, **arguments)
    )
    return _rows(spec.label, scope, rows, **extra)


#: What a lookup's id may be.
KEY_DOC = (
    "The request: its uid (engine_id/request_id), the engine's id, or the id the client got "
    "(chatcmpl-..., cmpl-...); an id that names several requests answers 409 with them."
)


def _lookup_route(spec: Endpoint) -> Any:
    """The handler of one lookup: the id from the path (or the query string), 404 when absent."""
    query = spec.query
    assert query.key is not None
    key_name = query.key
    fields: dict[str, Any] = {p.wire: _param_field(p, p.default) for p in query.params}
    if not spec.key_in_path:
        fields[key_name] = (str, Field(description=KEY_DOC))
    fields["format"] = (str | None, _format_field())
    model = create_model(f"{spec.name.title().replace('_', '')}Parameters", __base__=ScopeParams, **fields)

    async def answer(key: str, call: Call, q: ScopeParams, given: dict[str, Any]) -> Response:
        scope = q.scope(call.who, call.back.clock())
        arguments = {p.name: p.check(given[p.wire]) for p in query.params}
        if spec.permission:
            arguments["allowed"] = call.who.allows(spec.permission)
        if given.get("format"):
            return await _file(call, spec, given["format"], key=key, scope=scope, **arguments)
        found = await call.read(spec.label, lambda q: q.fetch(query, key, scope=scope, **arguments))
        if found is None:
            raise NotFound(f"{spec.not_found} {key!r}")
        body = {key_name: key, **found} if spec.echo_key else found
        return JSONResponse(jsonable(body))

    path: dict[str, Any] = {}
    if spec.key_in_path:
        path["key"] = Annotated[str, PathParam(alias=key_name)]

        async def handler(key: str, call: Called, q: Any) -> Response:
            return await answer(key, call, q, q.model_dump())

    else:

        async def handler(call: Called, q: Any) -> Response:  # type: ignore[misc]
            given = q.model_dump()
            return await answer(given.pop(key_name), call, q, given)

    handler.__doc__ = query.doc.split("\n\n")[0]
    handler.__name__ = spec.name
    return _with_query(handler, model, **path)


async def _request(call: Call, request_id: str, scope: Scope) -> dict[str, Any]:
    """One request in ``scope``; another tenant's request is as unknown as a missing one (404)."""
    found = await call.read("request", lambda q: q.request(request_id, scope=scope))
    if found is None:
        raise NotFound(f"no request {request_id!r}")
    return found


class PriceIn(BaseModel):
    """One price (docs/cost-model.md, Prices): USD per 1M tokens, or per GPU-hour."""

    model: str
    token_class: str = Field(
        description="input, cached_input, output, gpu_hour, kv (USD per GiB-hour of KV cache held), "
        "reasoning_output, or one of issue 36's classes (docs/cost-model.md, 'The bill of 2026')"
    )
    usd: str = Field(description="Decimal text, at most six decimals (never a float).")
    effective_from_ns: int = Field(0, description="Applies from this time on (ns; 0 = always).")
    effective_from: str = Field("", description="The same as ISO-8601 (when effective_from_ns is 0).")
    note: str = ""
    qualifier: str = Field(
        "", description="service_tier_multiplier: the tier; cache_write_ttl_multiplier: the TTL; else empty."
    )


class PricesBody(BaseModel):
    prices: list[PriceIn]


class SqlBody(BaseModel):
    sql: str = Field(description="One SELECT (WITH, UNION allowed); no FORMAT, no ';' inside.")


def _router() -> APIRouter:
    api = APIRouter(prefix="/api/v1")

    # Before the lookups: "requests/batch" is never a request uid (uids are engine_id/request_id).
    @api.get("/requests/batch", tags=["requests"])
    async def requests_batch(call: Called, s: Annotated[BatchParams, Query()]) -> JSONResponse:
        """Several requests in full in one query (the dashboard's batch); unknown or out-of-scope
        ones are left out. At least one ``request_id``."""
        scope = s.scope(call.who, call.back.clock())
        uids = params.request_ids(s.request_id)
        if not uids:
            raise QueryError("give at least one request_id (repeatable)")
        found = await call.read("requests_by_uid", lambda q: q.requests_by_uid(uids, scope=scope))
        return _rows("requests", scope, list(found.values()), request_id=uids)

    @api.get("/requests/{request_id:path}/timeline", tags=["requests"])
    async def timeline(request_id: str, call: Called, s: Scoped) -> JSONResponse:
        """A request's token timeline: counts per status and the run-length segments."""
        found = await _request(call, request_id, s.scope(call.who, call.back.clock()))
        counts = timeline_counts(found["segments"])
        counts["draft_rejected"] = int(found["draft_rejected_tokens"])
        return JSONResponse(
            jsonable(
                {
                    "request_id": request_id,
                    "tenant": found["tenant"],
                    "model": found["model"],
                    "prompt_tokens": found["prompt_tokens"],
                    "output_tokens": found["output_tokens"],
                    "counts": counts,
                    "segments": found["segments"],
                }
            )
        )

    for spec in lookups():
        api.add_api_route(
            spec.api_path.removeprefix("/api/v1"), _lookup_route(spec), methods=["GET"], tags=["requests"]
        )

    for route, specs in routes().items():
        api.add_api_route(f"/{route}", _registry_route(specs), methods=["GET"], tags=["cost"])

    @api.get("/health", tags=["operations"])
    async def health(who: Caller, back: Back, s: Scoped) -> JSONResponse:
        """Freshness and stored-request health in scope; the pipeline's counters for admins."""
        scope = s.scope(who, back.clock())
        body: dict[str, Any] = {"store": await back.health(who, scope)}
        if who.admin:
            body["pipeline"] = back.pipeline()
        return JSONResponse(jsonable(body))

    @api.get("/prices", tags=["admin"])
    async def prices_list(
        who: Caller, back: Back, model: Annotated[str | None, Query(description="Only this model.")] = None
    ) -> JSONResponse:
        """The stored prices (model, token_class, usd, unit, effective_from, note): the price list
        every token reads (as its SQL reads ``prices``); setting them is an admin's."""
        rows = await back.read(who, "prices", lambda q: list_prices(q.store, model))
        return JSONResponse(jsonable({"rows": rows}))

    @api.post("/prices", tags=["admin"])
    async def prices_set(who: Caller, back: Back, body: Annotated[PricesBody, Body()]) -> JSONResponse:
        """Set prices in the running store (replacing any with the same model, class and
        effective time); admin only. Answers how many were set."""
        who.require_admin("prices")
        try:
            entries = [
                checked_price(
                    p.model,
                    p.token_class,
                    p.usd,
                    p.effective_from_ns or p.effective_from,
                    p.note,
                    qualifier=p.qualifier,
                    where=f"prices[{i}]",
                )
                for i, p in enumerate(body.prices)
            ]
        except ConfigError as exc:
            raise QueryError(str(exc)) from None
        n = await back.write("set_prices", set_prices, back.store, entries)
        return JSONResponse({"set": n})

    @api.get("/prices/unseen", tags=["admin"])
    async def prices_unseen(
        who: Caller, back: Back, model: Annotated[list[str], Query(description="Models to look for.")]
    ) -> JSONResponse:
        """Which of these models no stored request has (a price for one of them applies to
        nothing yet: a typo?); admin only."""
        who.require_admin("prices")
        found = await back.read(who, "prices_unseen", lambda q: unseen_models(q.store, model))
        return JSONResponse({"models": found})

    @api.delete("/prices", tags=["admin"])
    async def prices_delete(
        who: Caller,
        back: Back,
        model: Annotated[str, Query(min_length=1, description="The model whose prices to delete.")],
        token_class: Annotated[str | None, Query(description="Only this class.")] = None,
        effective_from_ns: Annotated[
            int | None, Query(description="Only the price from this time (ns).")
        ] = None,
        qualifier: Annotated[
            str | None, Query(description="Only the multiplier of this service tier or cache TTL.")
        ] = None,
    ) -> JSONResponse:
        """Delete stored prices of a model (one class, one effective time); admin only. Answers
        how many were deleted."""
        who.require_admin("prices")
        try:
            n = await back.write(
                "delete_prices", delete_prices, back.store, model, token_class, effective_from_ns, qualifier
            )
        except ConfigError as exc:
            raise QueryError(str(exc)) from None
        return JSONResponse({"deleted": n})

    @api.get("/dead-letters", tags=["operations"])
    async def dead_letters(
        who: Caller,
        back: Back,
        limit: Annotated[int, Query(ge=1, le=10_000, description="At most N.")] = 100,
        component: Annotated[
            str | None, Query(description="Only this component's (ingest: refused lines of ingested files).")
        ] = None,
    ) -> JSONResponse:
        """The newest dead letters of the whole pipeline (when, which component, error type,
        reason, the input's topic/partition/offset; never its bytes); admin only."""
        who.require_admin("dead letters")
        rows = await back.read(
            who, "dead_letters", lambda q: q.dead_letters(limit=limit, component=component)
        )
        return JSONResponse(jsonable({"rows": rows}))

    @api.get("/db/status", tags=["admin"])
    async def db_status(who: Caller, back: Back) -> JSONResponse:
        """The store's migrations: version, name, applied, applied_at, checksum_ok; admin only."""
        who.require_admin("the schema status")
        rows = await back.read(who, "db_status", lambda q: status_rows(q.store))
        return JSONResponse({"rows": rows})

    @api.post("/sql", tags=["admin"])
    async def own_sql(call: Called, body: Annotated[SqlBody, Body()]) -> JSONResponse:
        """One SELECT of your own on the store (docs/clickhouse.md, Your own SQL), parsed and
        checked against the tables your token may read: an all-tenant token reads every row, a
        tenant's token only its tenants' rows; token content needs ``token_ids``. Answers
        ``columns`` and ``rows`` (at most ``api.limits.*.max_result_rows``; add LIMIT for fewer)."""
        cap = call.back.limits.max_sql_bytes
        if len(body.sql.encode()) > cap:
            raise QueryError(f"the SQL is over {cap} bytes (api.limits.max_sql_bytes)")
        limits = call.back.limits_for(call.who).sql_settings()
        access = call.who.access
        columns, rows = await call.read(
            "sql", lambda q: run_sql(q.store, body.sql, access=access, limits=limits)
        )
        return JSONResponse(jsonable({"columns": columns, "rows": [list(r) for r in rows]}))

    @api.post("/collect", status_code=202, tags=["jobs"])
    async def collect(
        who: Caller,
        back: Back,
        spec: Annotated[
            Annotated[ReplaySpec | IngestSpec | AnalyzeSpec, Field(discriminator="kind")] | VllmLogSpec,
            Body(),
        ],
    ) -> JSONResponse:
        """Submit an offline job: replay a topic range into the store, ingest a trace file, analyze
        trace files into reports (``kind``), or parse a vLLM server log (the seed's
        ``trace_source: vllm_log`` body)."""
        who.require_admin("collect jobs")
        return JSONResponse(back.submit(spec), status_code=202)

    @api.get("/jobs", tags=["jobs"])
    async def jobs(who: Caller, back: Back) -> JSONResponse:
        """Remembered jobs, newest first."""
        who.require_admin("jobs")
        return JSONResponse({"jobs": back.jobs.list()})

    @api.get("/jobs/{job_id}", tags=["jobs"])
    async def job(job_id: str, who: Caller, back: Back) -> JSONResponse:
        """A job's state, progress, throughput and result or error."""
        who.require_admin("jobs")
        found = back.jobs.get(job_id)
        if found is None:
            raise NotFound(f"no job {job_id!r}")
        return JSONResponse(found)

    @api.get("/jobs/{job_id}/output", tags=["jobs"])
    async def job_output(job_id: str, who: Caller, back: Back) -> Response:
        """The report file a finished ``vllm_log`` job wrote (its result's ``output``), in its
        ``output_format``."""
        who.require_admin("jobs")
        found = back.jobs.get(job_id)
        if found is None:
            raise NotFound(f"no job {job_id!r}")
        path = (found.get("result") or {}).get("output")
        if not path:
            raise NotFound(f"job {job_id!r} wrote no report (state {found['state']}; only vllm_log jobs do)")
        if not Path(path).is_file():
            raise NotFound(f"job {job_id!r}'s report {path} is gone from the API's machine")
        fmt = str(found["result"].get("output_format", "json"))
        media = {"json": "application/json", **MEDIA_TYPES}.get(fmt, "application/octet-stream")
        return FileResponse(path, media_type=media, filename=Path(path).name)

    return api


def _ops(app: FastAPI) -> None:
    @app.get("/healthz", tags=["operations"])
    async def healthz(back: Back) -> JSONResponse:
        """Liveness: whether the store answers (no authentication; no data)."""
        try:
            await back.ping()
        except StoreError:
            return _error(503, "store_unavailable", "the store does not answer")
        return JSONResponse({"status": "ok", "version": __version__})

    @app.get("/metrics", tags=["operations"])
    async def metrics(who: Caller, back: Back) -> Response:
        """Prometheus metrics (``sparseety:<noun>_<unit>``); needs an all-tenant token."""
        who.require_admin("metrics")
        try:
            await back.health(who, Scope())
        except StoreError:
            log.warning("metrics: the store did not answer the health query")
        try:
            await back.regressions()
        except StoreError:
            log.warning("metrics: the store did not answer the regressions query")
        try:
            await back.bill_2026_totals()
        except StoreError:
            log.warning("metrics: the store did not answer the token-class query")
        back.metrics.set_jobs_active(back.jobs.running(), JOB_KINDS)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(back.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/login", response_class=HTMLResponse, tags=["dashboard"])
    async def login_page(request: Request) -> Response:
        """The browser's sign-in page: a token in a form, or in the ``#token=`` fragment (read by
        the page, never sent in a URL), exchanged for a session cookie."""
        if backend_of(request).tokens.open:
            return RedirectResponse("/dashboard", status_code=303)
        return _login_html("")

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        return await _login(request)

    @app.post("/logout", tags=["dashboard"])
    async def logout(request: Request) -> Response:
        """End the browser's session."""
        sessions: Sessions = request.app.state.sessions
        sessions.drop(request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @app.get("/dashboard", response_class=HTMLResponse, tags=["dashboard"])
    async def dashboard(
        request: Request, who: Browser, back: Back, s: Annotated[DashboardParams, Query()]
    ) -> Response:
        """The dashboard, rendered now for the caller's tenants; a browser without a session is
        sent to ``/login``."""
        if who is None:
            return RedirectResponse("/login", status_code=303)
        scope = s.scope(who, back.clock())
        uids = params.request_ids(s.request_id)
        pipeline = back.pipeline() if who.admin else None
        now = back.clock()
        data = await back.read(
            who,
            "dashboard",
            lambda q: collect_dashboard(q, scope=scope, request_uids=uids, pipeline=pipeline, now_ns=now),
            disconnected=request.is_disconnected,
        )
        return HTMLResponse(render_html(data, plotly_src=None if s.inline else "/dashboard/plotly.min.js"))

    @app.get("/dashboard/plotly.min.js", include_in_schema=False)
    async def plotly_js() -> FileResponse:
        # the charting library itself: public, no data; cached by browsers
        return FileResponse(
            plotly_js_path(), media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"}
        )


def _errors(app: FastAPI) -> None:
    @app.exception_handler(AuthError)
    async def auth_error(_: Request, exc: AuthError) -> JSONResponse:
        if exc.status == 401:
            return _error(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})
        return _error(exc.status, "forbidden", str(exc))

    @app.exception_handler(TooManyQueriesError)
    async def too_many(_: Request, exc: TooManyQueriesError) -> JSONResponse:
        return _error(429, "too_many_queries", str(exc), {"Retry-After": "1"})

    @app.exception_handler(QueryLimitError)
    async def query_limit(_: Request, exc: QueryLimitError) -> JSONResponse:
        return _error(400, "query_limit", str(exc))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the query was stopped

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return _error(404, "not_found", str(exc))

    @app.exception_handler(AmbiguousIdError)
    async def ambiguous(_: Request, exc: AmbiguousIdError) -> JSONResponse:
        body = {"error": "ambiguous", "message": str(exc), "candidates": jsonable(exc.candidates)}
        return JSONResponse(body, status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return _error(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    for cls in (QueryError, CollectSpecError, ReplayError, PluginLoadError, TraceError):

        @app.exception_handler(cls)
        async def bad_parameter(_: Request, exc: Exception) -> JSONResponse:
            return _error(400, "bad_parameter", str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path == "/api/v1/collect":
            return _error(400, "bad_parameter", _collect_problem(exc))
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p not in ("query", "body", "path"))
            problems.append(f"{where or 'request'}: {e.get('msg', 'invalid')}")
        return _error(400, "bad_parameter", "; ".join(problems) or "invalid request")

    @app.exception_handler(MigrationError)
    async def not_migrated(_: Request, exc: MigrationError) -> JSONResponse:
        return _error(503, "store_unavailable", str(exc))

    @app.exception_handler(StoreError)
    async def store_error(request: Request, exc: StoreError) -> JSONResponse:
        # ClickHouse's message may quote SQL; callers get a generic answer, the log the detail
        log.error("store error on %s: %s", request.url.path, exc)
        return _error(503, "store_unavailable", "the store failed to answer; see the API's log")

    @app.exception_handler(JobCancelled)
    async def shutting_down(_: Request, exc: JobCancelled) -> JSONResponse:
        return _error(503, "shutting_down", str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, "internal", f"unexpected {type(exc).__name__}; see the API's log")


def _collect_problem(exc: RequestValidationError) -> str:
    """A collect body that is no spec: its kind named against the allowed ones, or the first
    field problem of the kind it names (not pydantic's text for every member of the union)."""
    body = getattr(exc, "body", None)
    kinds = ", ".join(COLLECT_KINDS)
    if not isinstance(body, dict):
        return f"a collect spec is a JSON object with a kind: {kinds}"
    kind = body.get("kind", "vllm_log" if body.get("trace_source") == "vllm_log" else None)
    if kind not in COLLECT_KINDS:
        return f"unknown collect kind {kind!r}: choose from {kinds} (docs/api.md, Collect jobs)"
    problems = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # the union's members lead the location: keep only the named kind's problems
        member = loc[0] if loc else ""
        if ("VllmLogSpec" in member) != (kind == "vllm_log"):
            continue
        rest = loc[1:] if member.startswith(("tagged-union", "function-", "VllmLogSpec")) else loc
        if rest and rest[0] == kind:
            rest = rest[1:]
        if not rest:
            continue  # the union's own "no such tag": the kind was named above
        problems.append(f"{kind}.{'.'.join(rest)}: {e.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(problems)) or f"{kind}: invalid spec"


class _Metrics:
    """ASGI middleware: each request counted and timed by route, method and status.

    Plain ASGI, not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs the app in
    a task of its own and hides the client's disconnect from ``Request.is_disconnected``, which the
    reads poll to stop a query nobody waits for (:meth:`Backend.read`)."""

    def __init__(self, app: Any, backend: Backend) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sent(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            label = getattr(scope.get("route"), "path", "unmatched")
            m = self.backend.metrics
            m.requests.labels(label, scope["method"], str(status)).inc()
            m.request_seconds.labels(label).observe(time.perf_counter() - started)


def create_api(backend: Backend) -> FastAPI:
    """The API over ``backend`` (OpenAPI docs at ``/docs``)."""
    app = FastAPI(
        title="SparSEEty API",
        version=__version__,
        description=(
            "Token-level accounting of LLM serving: per-request token statistics and timelines, cost "
            "attribution (actual, amortized, list, gpu), savings, waste, experts, duplication, usage, "
            "offline collect jobs, Prometheus metrics and the dashboard. Bearer tokens are scoped to "
            "tenants; another tenant's request answers 404."
        ),
    )
    app.state.backend = backend
    app.state.sessions = Sessions()
    app.include_router(_router())
    app.include_router(clickhouse_router(backend_of))
    _ops(app)
    _errors(app)
    app.add_middleware(_Metrics, backend=backend)
    app.add_middleware(BodyLimit, max_bytes=backend.limits.max_body_bytes)  # outermost: before auth
    return app
