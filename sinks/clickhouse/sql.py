"""Your own SQL on the store, read-only, and scoped to your tenants (``sparseety sql``,
``POST /api/v1/sql``; docs/clickhouse.md, "Your own SQL").

Every query runs as ``SELECT * FROM (<your query>) SETTINGS readonly = 1 [, ...]``: one
``SELECT`` (or ``WITH ... SELECT``, ``UNION``), nothing that writes, no table function that reads
outside the store (``file``, ``url``, ``remote``: ClickHouse refuses them in readonly mode), and
settings it cannot change back.

A caller scoped to tenants also gets ``additional_table_filters``: ClickHouse adds a filter to
every read of a table, whatever names it (the table, a view over it, a subquery):

- ``requests``, ``usage_1m``, ``expert_load``: the tenant column is one of the caller's;
- ``token_segments``, ``kv_blocks``, ``request_tokens``: the request is one of its tenants'
  (segments whose cached prefix another tenant's request computed are left out: their
  ``source_request_uid`` is another tenant's, which the API shows as ``another tenant``);
- ``prices``: readable (the store's price list);
- every other table (``dead_letters``, ``schema_migrations``, anything added later): no rows.

Views get no filter of their own: what they read is filtered.

Before it runs, a scoped query's syntax tree is checked, so that nothing reads around the filters:
tables must be the store's (``<database>.<table>``) or the query's own ``WITH`` names; no table
function (``merge`` reads tables under other names), no ``IN <table>``, no ``system`` or other
database, no ``file()``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparseety.errors import QueryError

if TYPE_CHECKING:
    from .client import Store

#: The most rows one answer carries (the caller adds LIMIT for less).
MAX_ROWS = 100_000
#: Tables with a tenant column.
TENANT_TABLES = ("requests", "usage_1m", "expert_load")
#: Tables whose rows belong to a request.
REQUEST_TABLES = ("token_segments", "kv_blocks", "request_tokens")
#: Tables every caller reads whole.
OPEN_TABLES = ("prices",)
#: Scalar functions a scoped caller may not call (they read outside the store).
DENIED_FUNCTIONS = frozenset({"file"})
_IN = frozenset(
    {"in", "notIn", "globalIn", "globalNotIn", "nullIn", "notNullIn", "globalNullIn", "globalNotNullIn"}
)


def _lit(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _body(sql: str) -> str:
    body = sql.strip()
    while body.endswith(";"):
        body = body[:-1].rstrip()
    if not body:
        raise QueryError("no SQL given")
    if ";" in body:
        raise QueryError("one statement at a time (a ';' inside the query; quote it as \\x3B in strings)")
    if re.search(r"\bFORMAT\s+\w+\s*$", body, re.IGNORECASE):
        raise QueryError("leave out FORMAT: the answer's format is the caller's --format / JSON")
    return body


def table_filters(database: str, tables: Sequence[str], tenants: Sequence[str]) -> str:
    """The ``additional_table_filters`` map for a caller that sees ``tenants``, over every table
    of ``database`` (``tables``)."""
    seen = "[" + ", ".join(_lit(t) for t in tenants) + "]"
    own = f"request_uid IN (SELECT request_uid FROM {database}.requests WHERE has({seen}, tenant))"
    entries = []
    for table in tables:
        if table in TENANT_TABLES:
            expr = f"has({seen}, tenant)"
        elif table == "token_segments":
            source = own.replace("request_uid IN", "source_request_uid IN", 1)
            expr = f"{own} AND (source_request_uid IS NULL OR {source})"
        elif table in REQUEST_TABLES:
            expr = own
        elif table in OPEN_TABLES:
            expr = "1"
        else:
            expr = "0"
        entries.append(f"{_lit(f'{database}.{table}')}: {_lit(expr)}")
    return "{" + ", ".join(entries) + "}"


def _check_tree(store: Store, body: str) -> None:
    """Refuse a scoped query that could read around the table filters (see the module doc)."""
    db = store.database
    databases = {str(r["name"]) for r in store.query("SELECT name FROM system.databases")}
    plain = {
        str(r["name"])
        for r in store.query("SELECT name FROM system.tables WHERE database = currentDatabase()")
    }
    try:
        lines = [str(r["explain"]) for r in store.query(f"EXPLAIN AST {body}")]
    except Exception as exc:
        raise QueryError(f"the SQL does not parse: {str(exc).splitlines()[0][:300]}") from None
    parsed = [(len(line) - len(line.lstrip(" ")), line.strip()) for line in lines]
    for i, (depth, text) in enumerate(parsed):
        head = text.split(" (")[0]
        if head.startswith("Function ") and head.split()[1] in DENIED_FUNCTIONS:
            raise QueryError(f"function {head.split()[1]}() is not available to a tenant-scoped caller")
        if head == "TableExpression" and i + 1 < len(parsed):
            child = parsed[i + 1][1].split(" (")[0]
            if child.startswith("Function "):
                raise QueryError(
                    f"table function {child.split()[1]}() is not available to a tenant-scoped caller"
                )
            if child.startswith("TableIdentifier "):
                name = child.split()[1]
                where, _, table = name.rpartition(".")
                if where and where != db:
                    raise QueryError(
                        f"{name}: a tenant-scoped caller reads the store's tables ({db}.<table>) only"
                    )
                if not where and table in plain:
                    raise QueryError(f"{name}: name the store's tables as {db}.<table>")
        if head.startswith("Function ") and head.split()[1] in _IN:
            # x IN db.table reads the table as a set: only IN (SELECT ...), which the filters see
            args = []
            for d, t in parsed[i + 2 :]:
                if d <= depth + 1:
                    break
                if d == depth + 2:
                    args.append(t.split(" (")[0])
            ref = args[1].split()[1] if len(args) == 2 and args[1].startswith("Identifier ") else ""
            if ref and (ref.partition(".")[0] in databases or ref in plain):
                raise QueryError(f"IN {ref}: write IN (SELECT ... FROM {ref}) instead")


def run_sql(
    store: Store, sql: str, *, tenants: Sequence[str] | None = None, max_rows: int = MAX_ROWS
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only query; ``tenants`` None = every row (an admin), else only theirs.

    Returns:
        Column names and rows (at most ``max_rows``).

    Raises:
        QueryError: not one query, not read-only, refused for a scoped caller, or ClickHouse
            refused it (its message, first line).
    """
    body = _body(sql)
    settings = ["readonly = 1", f"max_result_rows = {int(max_rows)}", "result_overflow_mode = 'break'"]
    if tenants is not None:
        _check_tree(store, body)
        tables = [
            str(r["name"])
            for r in store.query(
                "SELECT name FROM system.tables "
                "WHERE database = {db:String} AND NOT is_temporary AND engine != 'View'",
                {"db": store.database},
            )
        ]
        settings.append(f"additional_table_filters = {table_filters(store.database, tables, tenants)}")
    wrapped = f"SELECT * FROM ({body}) SETTINGS {', '.join(settings)}"
    try:
        return store.query_rows(wrapped)
    except Exception as exc:
        raise QueryError(f"the store refused the SQL: {_first_line(exc)}") from None


def run_sql_raw(
    store: Store,
    sql: str,
    fmt: str,
    parameters: dict[str, Any] | None = None,
    *,
    max_rows: int = MAX_ROWS,
) -> bytes:
    """One read-only query of an all-tenant caller, answered in ClickHouse's output format
    ``fmt`` (``Native``, ``TabSeparated``, ...): the ClickHouse HTTP interface's subset
    (``sparseety.api.clickhouse_http``). ``parameters`` are ``{name:Type}`` values as text.

    Raises:
        QueryError: not one read-only query, or ClickHouse refused it.
    """
    body = _body(sql)
    settings = f"readonly = 1, max_result_rows = {int(max_rows)}, result_overflow_mode = 'break'"
    try:
        return store.raw(f"SELECT * FROM ({body}) SETTINGS {settings}", parameters or None, fmt)
    except Exception as exc:
        raise QueryError(f"the store refused the SQL: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc)
    m = re.search(
        r"DB::Exception: (?:Code: \d+\. DB::Exception: )?(.*?)(?: \(version [^)]*\))?(?: \([A-Z_]+\))*$",
        text.splitlines()[0] if text else "",
    )
    return (m.group(1) if m else text.splitlines()[0] if text else type(exc).__name__)[:500]
