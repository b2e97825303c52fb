"""The embedded store on ClickHouse's own HTTP interface: a read-only subset (issue 21).

ClickHouse's clients (clickhouse-connect, Grafana's ClickHouse data source, ``curl``) talk to a
server over HTTP: the query in the body or ``?query=``, its ``{name:Type}`` parameters as
``param_<name>``, the output format as the query's trailing ``FORMAT <name>`` (TabSeparated when
it names none), credentials as Basic auth, ``X-ClickHouse-User``/``X-ClickHouse-Key`` or
``?user=&password=``. The API serves that at ``/clickhouse`` (``/clickhouse/ping`` answers
``Ok.``), so those clients work against the embedded default (one process owns the chDB path)
as they do against a server: ``clickhouse_connect.get_client(host=..., port=<api port>,
password=<token>, proxy_path="/clickhouse")``.

The subset: one SELECT at a time, parsed and checked as ``sparseety sql`` checks it
(:mod:`sparseety.queries.sql`: the store's tables and views and ClickHouse's metadata
tables only, no table function, no ``file()``, no ``SETTINGS`` or ``INTO OUTFILE``), under the
admin limits (``api.limits.admin``), by an all-tenant token (the password; the user name is not
checked). Settings sent by the client (``?date_time_input_format=...``) are not applied: the
store sets its own. A tenant-scoped token is refused (its clients read system tables, which its
scope hides): it uses ``sparseety sql`` / ``POST /api/v1/sql``. No inserts, sessions or
compression. Errors are ClickHouse's shape: ``Code: <n>. DB::Exception: <message>`` with the
``X-ClickHouse-Exception-Code`` header.
"""

from __future__ import annotations

import base64
import re
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sparseety.api.auth import AuthError, Principal
from sparseety.errors import QueryError, QueryLimitError, SqlRefusedError, TooManyQueriesError
from sparseety.queries.sql import run_sql_raw

PATH = "/clickhouse"
#: ClickHouse's error codes for the answers this subset gives.
READONLY, UNKNOWN_FORMAT, AUTH_FAILED, ACCESS_DENIED, SYNTAX = 164, 73, 516, 497, 62
TOO_MANY, LIMIT = 202, 159
_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)
_WRITE = re.compile(
    r"^\s*(INSERT|CREATE|ALTER|DROP|TRUNCATE|RENAME|SET|USE|OPTIMIZE|KILL|SYSTEM|GRANT)\b", re.I
)


def _error(code: int, message: str, status: int = 500) -> PlainTextResponse:
    return PlainTextResponse(
        f"Code: {code}. DB::Exception: {message}. (SPARSEETY)\n",
        status_code=status,
        headers={"X-ClickHouse-Exception-Code": str(code)},
    )


def credentials(request: Request) -> str:
    """The token a ClickHouse client sent as its password ('' when none)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value).decode().partition(":")[2]
        except Exception:
            return ""
    if scheme.lower() == "bearer":
        return value.strip()
    return request.headers.get("x-clickhouse-key") or request.query_params.get("password", "")


class ParamText:
    """A ``param_<name>`` value exactly as the client sent it: already in the text form the
    server parses (``a\\'b``, ``['x', 'y']``). The store's client formats a value it binds
    (escapes a ``str``, renders a list) and falls back to ``str()`` for a type it does not know,
    so wrapping the text passes it through unchanged, as a ClickHouse server would read it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def split_format(sql: str) -> tuple[str, str]:
    """``(query without its FORMAT clause, format)``: TabSeparated when it names none."""
    m = _FORMAT.search(sql)
    if m is None:
        return sql, "TabSeparated"
    return sql[: m.start()], m.group(1)


def router(backend_of: Any) -> APIRouter:
    """The ``/clickhouse`` routes (``backend_of(request)``: the app's Backend)."""
    api = APIRouter(tags=["clickhouse"], include_in_schema=False)

    @api.get(PATH + "/ping")
    async def ping() -> PlainTextResponse:
        return PlainTextResponse("Ok.\n")

    @api.api_route(PATH, methods=["GET", "POST"])
    @api.api_route(PATH + "/", methods=["GET", "POST"])
    async def query(request: Request) -> Response:
        back = backend_of(request)
        token = credentials(request)
        try:
            who: Principal = back.tokens.authenticate(f"Bearer {token}" if token else None)
        except AuthError as exc:
            return _error(AUTH_FAILED, f"authentication failed: {exc} (the password is an API token)", 401)
        if not who.admin:
            return _error(
                ACCESS_DENIED,
                "the ClickHouse interface is for all-tenant tokens; a tenant's token runs its SQL "
                "with sparseety sql or POST /api/v1/sql",
                403,
            )
        body = (await request.body()).decode("utf-8", "replace")
        sql = " ".join(p for p in (request.query_params.get("query", ""), body) if p.strip())
        if not sql.strip():
            return _error(SYNTAX, "empty query", 400)
        cap = back.limits.max_sql_bytes
        if len(sql.encode()) > cap:
            return _error(SYNTAX, f"the query is over {cap} bytes (api.limits.max_sql_bytes)", 413)
        if _WRITE.match(sql):
            return _error(READONLY, "the embedded store's ClickHouse interface is read-only", 403)
        sql, fmt = split_format(sql)
        params = {k[6:]: ParamText(v) for k, v in request.query_params.items() if k.startswith("param_")}
        limits = back.limits_for(who).sql_settings()
        access = who.access
        try:
            data = await back.read(
                who,
                "clickhouse_http",
                lambda q: run_sql_raw(q.store, sql, fmt, params, access=access, limits=limits),
                disconnected=request.is_disconnected,
            )
        except TooManyQueriesError as exc:
            return _error(TOO_MANY, str(exc), 429)
        except QueryLimitError as exc:
            return _error(LIMIT, str(exc), 400)
        except SqlRefusedError as exc:
            return _error(ACCESS_DENIED, str(exc), 403)
        except QueryError as exc:
            text = str(exc)
            if "readonly" in text.lower():
                return _error(READONLY, text, 403)
            return _error(UNKNOWN_FORMAT if "unknown format" in text.lower() else SYNTAX, text, 400)
        query_id = request.query_params.get("query_id") or str(uuid.uuid4())
        return Response(
            content=data,
            media_type="text/plain; charset=UTF-8" if fmt.startswith(("Tab", "CSV", "JSON")) else None,
            headers={
                "X-ClickHouse-Format": fmt,
                "X-ClickHouse-Query-Id": query_id,
                "X-ClickHouse-Timezone": "UTC",
                "X-ClickHouse-Summary": '{"read_rows":"0","read_bytes":"0","written_rows":"0",'
                '"written_bytes":"0","total_rows_to_read":"0","result_rows":"0","result_bytes":"0"}',
            },
        )

    return api
