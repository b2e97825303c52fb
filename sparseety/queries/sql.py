"""Your own SQL on the store: parsed by ClickHouse, checked against an allow-list, then run under
the server's settings (``sparseety sql``, ``POST /api/v1/sql``, ``/clickhouse``;
docs/clickhouse.md, "Your own SQL").

A query is never trusted as text. It goes through three steps, each on the store itself:

1. ``formatQuery()`` turns it into ClickHouse's canonical text: one statement, no comments (a
   trailing ``--`` can no longer hide what follows it), or a parse error.
2. ``EXPLAIN AST`` of that text is checked (:func:`check_tree`): one ``SELECT`` (``WITH``,
   ``UNION``, ``INTERSECT``/``EXCEPT``) of known node kinds only; no ``SETTINGS``, ``FORMAT`` or
   ``INTO OUTFILE`` anywhere; no table function; no function that reads outside the store
   (:data:`DENIED_FUNCTIONS`); every table read named in the caller's allow-list
   (:func:`readable_tables`).
3. The canonical text runs as ``SELECT * FROM (<text>)`` on a read-only client (a
   :class:`~sparseety.sinks.clickhouse.client.ReaderPool`'s: ``readonly = 2`` for its whole life)
   with the settings the server chooses: the caller's limits
   (:class:`~sparseety.config.QueryLimits`) and, for a caller scoped to tenants or without the
   ``token_ids`` permission, ``additional_table_filters``. Nothing in the query can change them,
   since step 2 refused every ``SETTINGS``.

Who may read what (:class:`Access`; the API's permissions, :mod:`sparseety.api.auth`, are the
same ones):

- ``requests``, ``usage_1m``, ``expert_load``: the caller's tenants' rows (tenant column);
- ``token_segments``, ``kv_blocks``: rows of its tenants' requests (segments whose cached prefix
  another tenant's request computed are left out, as the API shows them as ``another tenant``);
- ``request_tokens`` (token ids, keyed hashes): only with the ``token_ids`` permission, then its
  tenants' requests' rows;
- ``prices``: every token reads the price list (as ``GET /api/v1/prices``); only an all-tenant
  token sets prices;
- ``dead_letters``, ``schema_migrations``: all-tenant tokens only (as ``/api/v1/dead-letters``);
- the store's views: any caller; what a view reads is filtered as above (a filter applies to
  every read of a table, whatever names it);
- ClickHouse's own metadata tables (:data:`SYSTEM_TABLES`: what ClickHouse clients read on
  connect): all-tenant tokens only, but ``system.one`` (one row, no data), which any caller may
  name. Nothing else: no other database, no file, no URL.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparseety.errors import QueryError, SparseetyError, SqlRefusedError, StoreError

if TYPE_CHECKING:
    from sparseety.sinks.clickhouse.client import Store

#: The most rows one answer carries when no limits are given (the caller adds LIMIT for less).
MAX_ROWS = 100_000
#: Tables with a tenant column.
TENANT_TABLES = ("requests", "usage_1m", "expert_load")
#: Tables whose rows belong to a request.
REQUEST_TABLES = ("token_segments", "kv_blocks")
#: Token content (ids, keyed hashes): the ``token_ids`` permission.
TOKEN_TABLES = ("request_tokens",)
#: Tables every caller reads whole.
OPEN_TABLES = ("prices",)
#: ClickHouse's metadata tables an all-tenant caller may read (clickhouse-connect's handshake
#: reads ``system.settings``; Grafana's data source lists databases, tables and columns).
SYSTEM_TABLES = frozenset(
    {"one", "settings", "databases", "tables", "columns", "functions", "data_type_families", "time_zones"}
)
#: Functions no caller may use: they read files, dictionaries or tables by a name in a string,
#: models, HTTP headers or the host's settings, or only stall the store.
DENIED_FUNCTIONS = frozenset(
    {
        "file",
        "joinGet",
        "joinGetOrNull",
        "catboostEvaluate",
        "hasColumnInTable",
        "getClientHTTPHeader",
        "getServerSetting",
        "getMergeTreeSetting",
        "getMacro",
        "getServerPort",
        "getOSKernelVersion",
        "lemmatize",
        "stem",
        "synonyms",
        "naiveBayesClassifier",
        "sleep",
        "sleepEachRow",
        "addressToLine",
        "addressToLineWithInlines",
        "addressToSymbol",
        "demangle",
    }
)
#: Function name prefixes no caller may use (the same reasons).
DENIED_PREFIXES = ("dict", "filesystem")
#: The syntax-tree nodes a query may have: SELECT and its expressions, nothing else.
NODE_KINDS = frozenset(
    {
        "SelectWithUnionQuery",
        "SelectIntersectExceptQuery",
        "SelectQuery",
        "ExpressionList",
        "Literal",
        "Identifier",
        "Function",
        "Lambda",
        "QueryParameter",
        "Asterisk",
        "QualifiedAsterisk",
        "ColumnsRegexpMatcher",
        "ColumnsListMatcher",
        "QualifiedColumnsRegexpMatcher",
        "QualifiedColumnsListMatcher",
        "ColumnsTransformerList",
        "ColumnsExceptTransformer",
        "ColumnsApplyTransformer",
        "ColumnsReplaceTransformer",
        "ColumnsReplaceTransformer::Replacement",
        "TablesInSelectQuery",
        "TablesInSelectQueryElement",
        "TableExpression",
        "TableIdentifier",
        "TableJoin",
        "ArrayJoin",
        "Subquery",
        "WithElement",
        "OrderByElement",
        "InterpolateElement",
        "WindowDefinition",
        "WindowListElement",
        "SampleRatio",
    }
)
_IN = frozenset(
    {"in", "notIn", "globalIn", "globalNotIn", "nullIn", "notNullIn", "globalNullIn", "globalNotNullIn"}
)
_LINE = re.compile(r"^(?P<kind>\S+)(?: (?P<name>.*?))?(?: \(alias [^)]*\))?(?: \(children \d+\))?$")


@dataclass(frozen=True)
class Access:
    """What one caller's SQL may read.

    Attributes:
        tenants: The tenants whose rows it reads; None = every tenant (an all-tenant token).
        token_ids: It may read token content (``request_tokens``).
    """

    tenants: tuple[str, ...] | None = None
    token_ids: bool = True

    @property
    def admin(self) -> bool:
        return self.tenants is None


#: An admin with every permission: the local CLI on the store it opened itself.
ADMIN = Access()


def readable_tables(access: Access, tables: Sequence[str], views: Sequence[str]) -> frozenset[str]:
    """The store's tables and views (unqualified names) ``access`` may name in a query."""
    allowed = set(views) | {t for t in tables if t in TENANT_TABLES + REQUEST_TABLES + OPEN_TABLES}
    if access.token_ids:
        allowed |= {t for t in tables if t in TOKEN_TABLES}
    if access.admin:
        allowed |= {t for t in tables if t not in TOKEN_TABLES}
    return frozenset(allowed)


def _lit(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def table_filters(database: str, tables: Sequence[str], access: Access) -> str | None:
    """The ``additional_table_filters`` map for ``access`` over every table of ``database``
    (``tables``); None when it reads every row of every table it may name."""
    if access.tenants is None:
        if access.token_ids:
            return None
        return "{" + ", ".join(f"{_lit(f'{database}.{t}')}: '0'" for t in tables if t in TOKEN_TABLES) + "}"
    seen = "[" + ", ".join(_lit(t) for t in access.tenants) + "]"
    own = f"request_uid IN (SELECT request_uid FROM {database}.requests WHERE has({seen}, tenant))"
    entries = []
    for table in tables:
        if table in TENANT_TABLES:
            expr = f"has({seen}, tenant)"
        elif table == "token_segments":
            source = own.replace("request_uid IN", "source_request_uid IN", 1)
            expr = f"{own} AND (source_request_uid IS NULL OR {source})"
        elif table in REQUEST_TABLES or (table in TOKEN_TABLES and access.token_ids):
            expr = own
        elif table in OPEN_TABLES:
            expr = "1"
        else:
            expr = "0"
        entries.append(f"{_lit(f'{database}.{table}')}: {_lit(expr)}")
    return "{" + ", ".join(entries) + "}"


@dataclass
class Node:
    """One node of ``EXPLAIN AST``: its kind (``Function``), name (``file``), children."""

    kind: str
    name: str = ""
    children: list[Node] = field(default_factory=list)

    def walk(self) -> Iterator[Node]:
        yield self
        for c in self.children:
            yield from c.walk()


def parse_ast(lines: Sequence[str]) -> Node:
    """The tree of ``EXPLAIN AST``'s lines (one node a line, children indented one more)."""
    root = Node("")
    stack: list[tuple[int, Node]] = [(-1, root)]
    for line in lines:
        depth = len(line) - len(line.lstrip(" "))
        m = _LINE.match(line.strip())
        kind, name = (m.group("kind"), m.group("name") or "") if m else (line.strip(), "")
        node = Node(kind, name)
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((depth, node))
    if len(root.children) != 1:
        raise SqlRefusedError("one statement at a time")
    return root.children[0]


def _denied(function: str) -> bool:
    return function in DENIED_FUNCTIONS or function.startswith(DENIED_PREFIXES)


@dataclass(frozen=True)
class Catalog:
    """What the checks need to know of the store: its database, tables and views, and the
    tables of the current database (an unqualified name that is none of them is a ``WITH``
    name of the query)."""

    database: str
    tables: tuple[str, ...]
    views: tuple[str, ...]
    current: str
    current_tables: frozenset[str]


def check_tree(tree: Node, access: Access, catalog: Catalog) -> None:
    """Refuse anything but one SELECT of the tables ``access`` may read (see the module doc).

    Raises:
        QueryError: naming what is refused and why.
    """
    if tree.kind != "SelectWithUnionQuery":
        raise SqlRefusedError(
            f"one SELECT per query (WITH, UNION allowed), not {tree.kind or 'an empty query'}"
        )
    # Anything after the list of SELECTs is the query's own INTO OUTFILE, FORMAT or SETTINGS.
    if [c.kind for c in tree.children] != ["ExpressionList"]:
        raise SqlRefusedError("INTO OUTFILE, FORMAT and SETTINGS are not part of a query here")
    allowed = readable_tables(access, catalog.tables, catalog.views)
    for node in tree.walk():
        if node.kind not in NODE_KINDS:
            what = "SETTINGS" if node.kind == "Set" else node.kind
            raise SqlRefusedError(f"{what} is not allowed in a query here (the store sets its own settings)")
        if node.kind == "Function" and _denied(node.name):
            raise SqlRefusedError(
                f"function {node.name}() is not available: SQL reads the store's tables only"
            )
        if node.kind == "TableExpression" and node.children and node.children[0].kind == "Function":
            name = node.children[0].name
            raise SqlRefusedError(
                f"table function {name}() is not available: SQL reads the store's tables only"
            )
        if node.kind == "TableIdentifier":
            _check_table(node.name, access, catalog, allowed)
        if node.kind == "Function" and node.name in _IN and node.children:
            args = node.children[0].children
            if len(args) == 2 and args[1].kind == "Identifier" and _is_table(args[1].name, catalog):
                if not access.admin:
                    raise SqlRefusedError(
                        f"IN {args[1].name}: write IN (SELECT ... FROM {args[1].name}) instead"
                    )
                _check_table(args[1].name, access, catalog, allowed)


def _is_table(name: str, catalog: Catalog) -> bool:
    where, _, table = name.rpartition(".")
    return bool(where) or table in catalog.current_tables


def _check_table(name: str, access: Access, catalog: Catalog, allowed: frozenset[str]) -> None:
    where, _, table = name.rpartition(".")
    if not where:
        if table not in catalog.current_tables:
            return  # a WITH name of the query (or nothing: ClickHouse answers that)
        where = catalog.current
    if where == catalog.database:
        if table in allowed:
            return
        if table in TOKEN_TABLES:
            raise SqlRefusedError(f"{name}: token content needs a token with the token_ids permission")
        if table in catalog.tables:
            raise SqlRefusedError(f"{name}: readable with an all-tenant token only")
        raise SqlRefusedError(f"{name}: no such table or view in the store")
    if where == "system" and (table == "one" or (access.admin and table in SYSTEM_TABLES)):
        return  # system.one: ClickHouse reads it itself for a SELECT without FROM in a UNION
    raise SqlRefusedError(f"{name}: SQL reads the store's tables and views ({catalog.database}.<table>) only")


def catalog(store: Store) -> Catalog:
    """The store's tables and views, and the current database's tables (one statement: an
    aggregate without GROUP BY answers one row even when neither database has a table)."""
    (row,) = store.query(
        "SELECT currentDatabase() AS current, "
        "groupArrayIf(name, database = {db:String} AND engine != 'View') AS tables, "
        "groupArrayIf(name, database = {db:String} AND engine = 'View') AS views, "
        "groupArrayIf(name, database = currentDatabase()) AS current_tables "
        "FROM system.tables WHERE (database = {db:String} OR database = currentDatabase()) "
        "AND NOT is_temporary",
        {"db": store.database},
    )
    return Catalog(
        database=store.database,
        tables=tuple(sorted(map(str, row["tables"]))),
        views=tuple(sorted(map(str, row["views"]))),
        current=str(row["current"]),
        current_tables=frozenset(map(str, row["current_tables"])),
    )


def checked(
    store: Store, sql: str, access: Access, parameters: Mapping[str, Any] | None = None
) -> tuple[str, Catalog]:
    """The canonical text of one allowed query and the catalog it was checked against.

    Raises:
        QueryError: it does not parse, is not one SELECT, or reads what ``access`` may not.
        StoreError: ``store`` is not read-only (a caller's SQL runs on :meth:`Store.readers`).
    """
    if not store.read_only:
        raise StoreError("a caller's SQL runs on a read-only client (Store.readers), not the store's own")
    sql = sql.strip()
    while sql.endswith(";"):
        sql = sql[:-1].rstrip()
    if not sql:
        raise QueryError("no SQL given")
    try:
        (row,) = store.query("SELECT formatQuery({q:String}) AS text", {"q": sql})
    except Exception as exc:
        raise QueryError(f"the SQL does not parse: {clickhouse_message(exc)}") from None
    text = str(row["text"])
    if not re.match(r"(SELECT|WITH|\()\b", text):
        raise SqlRefusedError(f"one SELECT per query (WITH, UNION allowed), not {text.split(None, 1)[0]}")
    # Clauses stand on lines of their own in the canonical text (a newline inside a string
    # literal is written \n there), so these are the query's own, at any depth; refused before
    # EXPLAIN would apply them to itself. The tree check below refuses them again.
    if re.search(r"^\s*SETTINGS\b", text, re.MULTILINE):
        raise SqlRefusedError("SETTINGS are not part of a query here: the store sets its own settings")
    if re.search(r"^\s*INTO OUTFILE\b", text, re.MULTILINE):
        raise SqlRefusedError("INTO OUTFILE is not part of a query here: SQL writes nothing")
    if re.search(r"^FORMAT \w+$", text.rsplit("\n", 1)[-1]):
        raise SqlRefusedError("leave out FORMAT: the answer's format is the caller's --format / JSON")
    try:
        # As a subquery, so that the settings the client adds attach to the outer SELECT, not to
        # the query explained; the canonical text cannot close the parenthesis early (its
        # parentheses balance outside string literals, and it has no comments).
        explained = store.query(f"SELECT explain FROM (EXPLAIN AST {text})", dict(parameters or {}))
        lines = [str(r["explain"]) for r in explained]
    except Exception as exc:
        raise QueryError(f"the SQL does not parse: {clickhouse_message(exc)}") from None
    cat = catalog(store)
    check_tree(parse_ast(lines), access, cat)
    return text, cat


def settings_for(access: Access, cat: Catalog, limits: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings an allowed query runs under (on a read-only client): ``limits`` (the caller's:
    :meth:`~sparseety.config.QueryLimits.settings`; default at most :data:`MAX_ROWS` rows),
    and the caller's table filters."""
    out: dict[str, Any] = {"max_result_rows": MAX_ROWS, "result_overflow_mode": "break"}
    out.update(limits or {})
    filters = table_filters(cat.database, cat.tables, access)
    if filters is not None:
        out["additional_table_filters"] = filters
    return out


def run_sql(
    store: Store,
    sql: str,
    *,
    access: Access = ADMIN,
    limits: Mapping[str, Any] | None = None,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one allowed query for ``access`` under ``limits``.

    Returns:
        Column names and rows (at most the limits' ``max_result_rows``).

    Raises:
        QueryError: refused (see :func:`checked`), or ClickHouse refused it (its message's
            first line; a limit reached says which).
    """
    text, cat = checked(store, sql, access)
    try:
        return store.query_rows(f"SELECT * FROM ({text})", settings=settings_for(access, cat, limits))
    except Exception as exc:
        raise _refused(exc) from None


def run_sql_raw(
    store: Store,
    sql: str,
    fmt: str,
    parameters: dict[str, Any] | None = None,
    *,
    access: Access = ADMIN,
    limits: Mapping[str, Any] | None = None,
) -> bytes:
    """:func:`run_sql` answered in ClickHouse's output format ``fmt`` (``Native``,
    ``TabSeparated``, ...): the ClickHouse HTTP interface's subset
    (``sparseety.api.clickhouse_http``). ``parameters`` are ``{name:Type}`` values as text.

    Raises:
        QueryError: refused, or ClickHouse refused it.
    """
    if not re.fullmatch(r"\w+", fmt):
        raise QueryError(f"unknown format {fmt!r}")
    text, cat = checked(store, sql, access, parameters)
    try:
        return store.raw(
            f"SELECT * FROM ({text})", parameters or None, fmt, settings=settings_for(access, cat, limits)
        )
    except Exception as exc:
        raise _refused(exc) from None


def _refused(exc: Exception) -> QueryError:
    code = exc.fields.get("code") if isinstance(exc, SparseetyError) else None
    return QueryError(f"the store refused the SQL: {clickhouse_message(exc)}", code=code)


def clickhouse_message(exc: BaseException) -> str:
    """ClickHouse's own message in an error's first line (without its code and version)."""
    text = str(exc)
    m = re.search(
        r"DB::Exception: (?:Code: \d+\. DB::Exception: )?(.*?)(?: \(version [^)]*\))?(?: \([A-Z_]+\))*$",
        text.splitlines()[0] if text else "",
    )
    return (m.group(1) if m else text.splitlines()[0] if text else type(exc).__name__)[:500]
