"""The query library's shared vocabulary: which requests a query sees (:class:`Scope`), how it
groups (:data:`DIMENSIONS`, :func:`group`), what a reader may see of other tenants' requests
(:func:`hidden_source`, :func:`segments_sql`), and what one query is (:class:`QuerySpec`,
:class:`Param`).

It sits below every query module: :mod:`.registry` and the modules it composes (what-if,
outliers, regressions, routing, sessions, tokens, listing, export, ids) import these names from
here, never from :mod:`.registry`, so the library has no import loop (issue 34).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sparseety.errors import QueryError
from sparseety.times import parse_bucket, to_ns

#: Grouping dimensions a caller may ask for, and the column (or expression) behind each.
DIMENSIONS: dict[str, str] = {
    "tenant": "tenant",
    "model": "model",
    "engine": "engine_name",
    "adapter": "ifNull(lora_name, '')",  # the LoRA adapter ('' = the base model)
    "lora": "ifNull(lora_name, '')",  # the same, by its older name
    # issue 36: what the client asked for, and the request's part in P/D disaggregation (columns of
    # requests_v and request_costs_v; sparseety/billing.py)
    "service_tier": "service_tier",
    "priority": "priority",
    "pd_role": "pd_role",
}


class Queryable(Protocol):
    """What the query library needs from a store."""

    database: str

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]: ...


class QueryRunner(Protocol):
    """What a lookup needs of :class:`~.registry.Queries`: its database and its store."""

    db: str
    store: Queryable


@dataclass(frozen=True)
class Scope:
    """Which requests a query sees.

    Attributes:
        since_ns: Finished at or after (wall-clock ns); None = no lower bound.
        until_ns: Finished before; None = no upper bound.
        tenants: Tenants the caller may see; None = all (an empty tuple sees nothing).
    """

    since_ns: int | None = None
    until_ns: int | None = None
    tenants: tuple[str, ...] | None = None

    @classmethod
    def of(
        cls,
        since: datetime | int | None = None,
        until: datetime | int | None = None,
        tenants: Sequence[str] | None = None,
    ) -> Scope:
        """A scope from datetimes (naive = UTC) or ns, and a tenant list."""
        return cls(
            None if since is None else to_ns(since),
            None if until is None else to_ns(until),
            None if tenants is None else tuple(tenants),
        )

    def where(self, alias: str = "", time_column: str = "finished_ts_ns") -> tuple[str, dict[str, Any]]:
        """SQL conditions (``AND``-joined, ``1`` when none) and their parameters."""
        p = f"{alias}." if alias else ""
        conds: list[str] = []
        params: dict[str, Any] = {}
        if self.since_ns is not None:
            conds.append(f"{p}{time_column} >= {{since_ns:Int64}}")
            params["since_ns"] = self.since_ns
        if self.until_ns is not None:
            conds.append(f"{p}{time_column} < {{until_ns:Int64}}")
            params["until_ns"] = self.until_ns
        if self.tenants is not None:
            conds.append(f"has({{tenants:Array(String)}}, {p}tenant)")
            params["tenants"] = list(self.tenants)
        return (" AND ".join(conds) or "1"), params


def _dims(by: Sequence[str], alias: str = "") -> list[tuple[str, str]]:
    out = []
    for d in by:
        if d not in DIMENSIONS:
            raise QueryError(f"cannot group by {d!r}: choose from {', '.join(DIMENSIONS)}")
        expr = DIMENSIONS[d]
        if alias:
            expr = re.sub(
                r"\b(tenant|model|engine_name|lora_name|service_tier|priority|pd_role)\b",
                rf"{alias}.\1",
                expr,
            )
        out.append((d, expr))
    return out


def _bucket_expr(bucket: str | None, column: str) -> str | None:
    if bucket is None:
        return None
    seconds = int(parse_bucket(bucket).total_seconds())
    return f"toStartOfInterval({column}, INTERVAL {seconds} SECOND, 'UTC')"


def group(
    by: Sequence[str], bucket: str | None, alias: str = "", time_column: str = "finished_at"
) -> tuple[str, str, list[str]]:
    """(select list, GROUP BY/ORDER BY list, output key names) for dimensions and bucket."""
    dims = _dims(by, alias)
    select = [f"{expr} AS {name}" for name, expr in dims]
    keys = [name for name, _ in dims]
    b = _bucket_expr(bucket, f"{alias}.{time_column}" if alias else time_column)
    if b is not None:
        select.append(f"{b} AS bucket")
        keys.append("bucket")
    return ", ".join(select), ", ".join(keys), keys


def with_group(select: str, rest: str) -> str:
    return f"{select}, {rest}" if select else rest


def group_clause(keys: str) -> str:
    return f"GROUP BY {keys} ORDER BY {keys}" if keys else ""


ANOTHER_TENANT = "another tenant"


def hidden_source(db: str, scope: Scope, params: dict[str, Any]) -> tuple[str, str]:
    """``(source expression, join)`` for ``source_request_uid`` of the segments aliased ``s``: as
    stored for an unscoped reader, else :data:`ANOTHER_TENANT` unless the source request is one of
    the scope's tenants' (adds the query parameters it needs to ``params``)."""
    if scope.tenants is None:
        return "s.source_request_uid", ""
    params["tenants"] = list(scope.tenants)
    params["another"] = ANOTHER_TENANT
    source = (
        "if(s.source_request_uid IS NULL OR has({tenants:Array(String)}, src.tenant), "
        "s.source_request_uid, {another:String})"
    )
    join = (
        f"LEFT JOIN (SELECT request_uid, tenant FROM {db}.requests_v) AS src "
        "ON s.source_request_uid = src.request_uid"
    )
    return source, join


def segments_sql(db: str, request_uid: str | Sequence[str], *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """A request's timeline segments, in position order.

    Given several uids, the segments of all of them, each row with its ``request_uid``.

    ``source_request_uid`` names the request that computed a cached prefix. A tenant-scoped
    reader sees it only when that request belongs to one of its tenants; otherwise (another
    tenant's, or a source not stored, which cannot be shown to be its own) it reads
    :data:`ANOTHER_TENANT`. An unscoped reader (the admin) sees every uid.
    """
    params: dict[str, Any]
    if isinstance(request_uid, str):
        params, which, uid_col, order = {"uid": request_uid}, "s.request_uid = {uid:String}", "", "s.start"
    else:
        params = {"uids": list(request_uid)}
        which, uid_col = "has({uids:Array(String)}, s.request_uid)", "s.request_uid AS request_uid, "
        order = "s.request_uid, s.start"
    source, join = hidden_source(db, scope, params)
    sql = (
        f"SELECT {uid_col}s.start AS start, s.end AS end, s.kind AS kind, s.status AS status, "
        f"s.draft_accepted AS draft_accepted, {source} AS source_request_uid, s.kv_fate AS kv_fate "
        f"FROM {db}.token_segments_v AS s {join} WHERE {which} ORDER BY {order}"
    )
    return sql, params


#: One meaning per word (issue 31), for every grouped query over ``request_costs_v`` (aliased
#: ``c``): ``requests`` counts API requests, as a client sent them (an ``n = 2`` completion is
#: one; its billed sequence is the one with ``list_prompt_billed``), ``sequences`` the engine
#: requests that served them (two for ``n = 2``). Token sums are per sequence unless a name says
#: otherwise.
REQUEST_COUNTS = "countIf(c.list_prompt_billed = 1) AS requests, count() AS sequences"

#: A timeline segment's fields, in the order :func:`requests_by_uid_sql` packs them.
SEGMENT_FIELDS = ("start", "end", "kind", "status", "draft_accepted", "source_request_uid", "kv_fate")


@dataclass(frozen=True)
class Param:
    """One argument of a query beyond grouping and scope.

    Attributes:
        name: The library's keyword (and the SQL builder's).
        type: ``str`` or ``int``.
        default: The library's default (None = not given).
        doc: One line, for the CLI's help and the OpenAPI docs.
        http: Its public name when not ``name``: the query-string key, the CLI option ``--<http>``
            and the name its errors use.
        choices: The values allowed (checked before any query runs), and ``what`` names them.
        ge, le: Bounds of an int.
    """

    name: str
    type: type
    default: Any
    doc: str
    http: str = ""
    choices: tuple[str, ...] = ()
    what: str = ""
    ge: int | None = None
    le: int | None = None

    @property
    def wire(self) -> str:
        return self.http or self.name

    def check(self, value: Any) -> Any:
        """The value, or a QueryError when it is not one of :attr:`choices` or outside ``ge``/``le``.

        The HTTP route declares the same bounds to FastAPI; checking here too covers the CLI and
        the library, so every entry point refuses the same values with the same message.
        """
        if self.choices and value not in self.choices:
            raise QueryError(
                f"unknown {self.what or self.name} {value!r}: choose from {', '.join(self.choices)}"
            )
        if value is not None and self.type is int:
            if self.ge is not None and value < self.ge:
                raise QueryError(f"bad {self.wire} {value}: at least {self.ge}")
            if self.le is not None and value > self.le:
                raise QueryError(f"bad {self.wire} {value}: at most {self.le}")
        return value


@dataclass(frozen=True)
class QuerySpec:
    """One query: its name, SQL, grouping, parameters and doc.

    Attributes:
        name: The library's method name.
        sql: The pure SQL builder ``(db, *, [by], [bucket], scope, **params) -> (sql, params)``.
        doc: What it answers (CLI help, OpenAPI description).
        group_by: The default grouping; None when the query takes no ``by``.
        dims: The dimensions it may be grouped by.
        bucket: Whether it takes a time bucket (``1h``).
        params: Its other arguments.
        key: A lookup of one object by its id (a request uid): the id's name. The library method
            takes it first; a lookup returns one object or None.
        lookup: A lookup's fetch ``(queries, key, *, scope, **params) -> object | None`` (it may
            run several queries: ``sql`` is unused).
        gated: A lookup whose answer depends on what the caller may read: its fetch takes
            ``allowed`` (the library: True; the API: whether the caller's token holds the
            endpoint's permission).
        rows: The key of a found object whose list is its rows for an export (``records``).
    """

    name: str
    sql: Callable[..., tuple[str, dict[str, Any]]] | None
    doc: str
    group_by: str | None = None
    dims: tuple[str, ...] = tuple(DIMENSIONS)
    bucket: bool = False
    params: tuple[Param, ...] = ()
    key: str | None = None
    lookup: Callable[..., Any] | None = None
    gated: bool = False
    rows: str = ""

    def fetch(self, queries: Any, key: str, *, scope: Scope, allowed: bool = True, **arguments: Any) -> Any:
        """Run a lookup (its params checked as :meth:`build` checks them)."""
        assert self.lookup is not None, self.name
        kwargs = self._arguments(arguments)
        if self.gated:
            kwargs["allowed"] = allowed
        return self.lookup(queries, key, scope=scope, **kwargs)

    def _arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            p.name: p.check(v) if (v := arguments.get(p.name, p.default)) is not None else v
            for p in self.params
        }
        unknown = set(arguments) - set(kwargs)
        if unknown:
            raise TypeError(f"{self.name}() got unexpected arguments {sorted(unknown)}")
        return kwargs

    def build(
        self, db: str, *, by: Sequence[str] | None, bucket: str | None, scope: Scope, **arguments: Any
    ) -> tuple[str, dict[str, Any]]:
        assert self.sql is not None, self.name
        kwargs = self._arguments(arguments)
        if self.group_by is not None:
            kwargs["by"] = (self.group_by,) if by is None else tuple(by)
        if self.bucket:
            kwargs["bucket"] = bucket
        return self.sql(db, scope=scope, **kwargs)
