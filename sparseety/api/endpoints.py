"""How each registry query is served: its HTTP route, its ``sparseety query`` command, the text of
its 404, the permission it needs and the tables the CLI prints.

The query itself (SQL, grouping, params, lookup) is declared once in
:data:`~sparseety.queries.registry.QUERIES`; here each gets one :class:`Endpoint`, from
which the API's handlers (:mod:`sparseety.api.app`), the CLI's commands (:mod:`sparseety.api.cli`)
and the remote client (:mod:`sparseety.api.client`) are built. Adding a query is its
:class:`~sparseety.queries.registry.QuerySpec`, its method in
:class:`~sparseety.queries.registry.QueryMethods`, and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sparseety.queries import registry as q
from sparseety.queries.registry import Param, QuerySpec


@dataclass(frozen=True)
class Endpoint:
    """How one query is served.

    Attributes:
        query: The query (:data:`~sparseety.queries.registry.QUERIES`).
        route: ``/api/v1/<route>`` and ``sparseety query <route>``.
        path: The HTTP path under ``/api/v1/`` when it is not ``route``. A lookup's id is in the
            path when the path names it (``{request_id:path}``), else a required query-string
            parameter.
        command: The ``sparseety query`` command when it is not ``route``.
        selected_by: For a query served on another query's route (or command): the param that,
            when non-zero there, runs this one instead (its default there is 0).
        switch: A param that only selects this variant (it is no param of the query itself).
        what: What a lookup finds (``request``), for the 404 message ``no <what> '<id>'``.
        echo_key: A lookup's HTTP body starts with ``{<key>: <id>}`` (its object lacks the id).
        money_objects: Keys of nested objects whose values are USD (Decimal) except booleans,
            so a remote client restores them.
        tables: How the CLI prints a found object in table/csv form (a list of tables); None
            prints the object itself.
        permission: The per-token permission (``token_ids``) a gated lookup's route passes as
            ``allowed``.
        table_columns: The columns ``--format table`` shows without ``--wide`` (empty: all); JSON,
            CSV and exports always carry every column.
    """

    query: QuerySpec
    route: str
    path: str = ""
    command: str = ""
    selected_by: str | None = None
    switch: Param | None = None
    what: str = ""
    echo_key: bool = False
    money_objects: tuple[str, ...] = ()
    tables: Callable[[dict[str, Any]], list[list[dict[str, Any]]]] | None = None
    permission: str = ""
    table_columns: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.query.name

    @property
    def params(self) -> tuple[Param, ...]:
        """Every param the route and the command take: the query's, and a :attr:`switch`."""
        return self.query.params + ((self.switch,) if self.switch else ())

    @property
    def label(self) -> str:
        """What answers name the query (``query`` in the API's body, the metrics' label)."""
        return self.name if self.selected_by or self.query.key else self.route

    @property
    def api_path(self) -> str:
        """``/api/v1/...`` that serves it."""
        return f"/api/v1/{self.path or self.route}"

    @property
    def cli_name(self) -> str:
        """``sparseety query <cli_name>``."""
        return self.command or self.route

    @property
    def key_in_path(self) -> bool:
        """Whether a lookup's id is part of its path (else a query-string parameter)."""
        return self.query.key is not None and f"{{{self.query.key}" in self.api_path

    @property
    def not_found(self) -> str:
        """The start of a lookup's 404 text (``no request``)."""
        return f"no {self.what or self.query.key}"


# --- the CLI's table shapes ----------------------------------------------------------------------


def _readable(name: str, value: Any) -> Any:
    """A wall-clock ``*_ts_ns`` as ISO-8601 UTC with the ns beside it (0 stays 0: not known)."""
    if name.endswith("_ts_ns") and isinstance(value, int) and value > 0:
        at = datetime.fromtimestamp(value / 1e9, UTC).isoformat(timespec="milliseconds")
        return f"{at.replace('+00:00', 'Z')} ({value})"
    return value


def request_tables(found: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """A request as the CLI prints it in table/csv: its fields, its cost per mode, its segments."""
    rest = {k: v for k, v in found.items() if k not in ("segments", "cost")}
    return [
        [{"field": k, "value": _readable(k, v)} for k, v in rest.items()],
        [{"mode": k, "usd": v} for k, v in found["cost"].items()],
        list(found["segments"]),
    ]


def token_records_tables(found: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Token records as the CLI prints them in table/csv: the header, then the records."""
    head = {
        k: found[k] for k in ("request_uid", "tenant", "model", "privacy", "content", "note", "tokenizer")
    }
    return [[{"field": k, "value": v} for k, v in head.items()], list(found["records"])]


# --- one endpoint per query ------------------------------------------------------------------------

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(q.COST, "cost"),
    Endpoint(q.SAVINGS, "savings"),
    Endpoint(q.WASTE, "waste"),
    Endpoint(q.PREFIX_EVICTIONS, "evictions"),
    Endpoint(q.SPEC_EFFICIENCY, "spec"),
    Endpoint(q.ENGINES, "engines"),
    Endpoint(q.GPU_TIME, "gpu"),
    Endpoint(q.USAGE, "usage"),
    Endpoint(q.EXPERT_LOAD, "experts"),
    Endpoint(q.WHATIF, "whatif"),
    Endpoint(q.REGRESSIONS, "regressions"),
    Endpoint(q.ROUTING_ADVICE, "routing"),
    Endpoint(q.DUPLICATION, "duplication"),
    Endpoint(q.DUPLICATED_BLOCKS, "duplication", selected_by="limit"),
    Endpoint(q.SESSIONS, "sessions"),
    Endpoint(q.OUTLIERS, "outliers"),
    Endpoint(
        q.REQUESTS,
        "requests",
        table_columns=(
            "request_uid",
            "external_request_id",
            "choice_index",
            "tenant",
            "model",
            "finished_at",
            "consistent",
            "prompt_tokens",
            "output_tokens",
            "cache_read_tokens",
            "uncached_computed_tokens",
        ),
    ),
    Endpoint(q.TIMELINES, "timelines"),
    Endpoint(q.PD_BILLS, "pd-bills"),
    Endpoint(
        q.REQUEST,
        "request",
        path="requests/{request_id:path}",
        what="request",
        money_objects=("cost",),
        tables=request_tables,
    ),
    Endpoint(q.TOKENS_STATISTICS, "tokens", path="tokens/statistics", what="request", echo_key=True),
    Endpoint(
        q.TOKEN_RECORDS,
        "tokens",
        path="requests/{request_id:path}/tokens",
        what="request",
        selected_by="records",
        switch=Param(
            "records", bool, False, "Token records (ids, text, statuses) instead of the statistics."
        ),
        permission="token_ids",
        tables=token_records_tables,
    ),
)
#: The endpoints by query name.
BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}


def endpoint(spec: QuerySpec) -> Endpoint:
    """How ``spec`` is served."""
    return BY_NAME[spec.name]


def routes() -> dict[str, list[Endpoint]]:
    """Route -> the grouped queries it serves (the plain one first, then those a param selects).

    Lookups (one object by id) are listed by :func:`lookups`.
    """
    out: dict[str, list[Endpoint]] = {}
    for e in sorted(ENDPOINTS, key=lambda e: e.selected_by is not None):
        if e.query.key is None:
            out.setdefault(e.route, []).append(e)
    return out


def lookups() -> list[Endpoint]:
    """The lookups, in the order their paths must be matched: a path that ends in a catch-all
    ``{id:path}`` after the longer paths it would swallow (``requests/{id}/tokens``)."""
    return sorted(
        (e for e in ENDPOINTS if e.query.key is not None), key=lambda e: e.api_path.endswith(":path}")
    )


def commands() -> dict[str, list[Endpoint]]:
    """``sparseety query`` command -> the queries it runs (plain first, then param-selected)."""
    out: dict[str, list[Endpoint]] = {}
    for e in sorted(ENDPOINTS, key=lambda e: e.selected_by is not None):
        out.setdefault(e.cli_name, []).append(e)
    return out
