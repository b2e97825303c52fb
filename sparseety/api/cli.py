"""API commands: ``store`` (sink + API in one process), ``api`` (API alone), ``query``, ``dashboard``,
``ingest``.

``query`` has one command per entry of the query registry
(:data:`~sparseety.api.endpoints.ENDPOINTS`, options derived from its query's grouping and
params) plus the request lookups; it opens the store here, or goes through the HTTP API of the
process that owns it.

Mounted on ``sparseety`` by ``sparseety/cli.py``; heavy imports happen inside the commands.
``ingest`` lives with the trace readers (``producers/logs/cli.py``) and is mounted from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from sparseety.api import params
from sparseety.api.endpoints import Endpoint, commands
from sparseety.cli_context import CliContext, pass_ctx
from sparseety.errors import AmbiguousIdError
from sparseety.producers.logs.cli import ingest_cmd
from sparseety.queries.registry import QueryError, Scope
from sparseety.sinks.cli import echo_rows
from sparseety.times import parse_time

LOGLEVEL = click.option(
    "--loglevel", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"])
)


def _listen(c: CliContext, host: str | None, port: int | None) -> Any:
    cfg = c.cfg
    if host is None and port is None:
        return cfg
    api = cfg.api.model_dump()
    api.update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
    return cfg.replace(api=api)


@click.command("store")
@click.option("--host", default=None, help="Address the API listens on [api.host: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="API port [api.port: 8765]; 0 = any free port.")
@click.option(
    "--session-timeout",
    type=float,
    default=None,
    help="Consumer session, s [sink.session_timeout_s; unset: 2 on the embedded broker, else 6].",
)
@click.option("--commit-interval", type=float, default=2.8, show_default=True, help="Offset commits, s.")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (paths and status only).")
@LOGLEVEL
@pass_ctx
def store_cmd(
    c: CliContext,
    host: str | None,
    port: int | None,
    session_timeout: float | None,
    commit_interval: float,
    access_log: bool,
    loglevel: str,
) -> None:
    """The store process: the sink worker and the HTTP API in one process over one store.

    It owns the embedded (chDB) store, writes the timelines, usage and dlq topics to it, and serves
    queries, collect jobs, /metrics and the dashboard. Without api.tokens the API is open and
    listens on loopback only. `sparseety query ...` goes through it while it runs.
    """
    from sparseety.api.process import run_store

    run_store(
        _listen(c, host, port),
        loglevel=loglevel,
        session_timeout_s=session_timeout,
        commit_interval_s=commit_interval,
        access_log=access_log,
    )


@click.command("api")
@click.option("--host", default=None, help="Address to listen on [api.host: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port [api.port: 8765]; 0 = any free port.")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (paths and status only).")
@LOGLEVEL
@pass_ctx
def api_cmd(c: CliContext, host: str | None, port: int | None, access_log: bool, loglevel: str) -> None:
    """The HTTP API alone over the store (when no sink runs; OpenAPI docs at /docs)."""
    from sparseety.api.process import run_api

    run_api(_listen(c, host, port), loglevel=loglevel, access_log=access_log)


# --- query -------------------------------------------------------------------------------------


def _scope(since: str | None, until: str | None, tenants: tuple[str, ...]) -> Scope:
    now = time.time_ns()

    def bound(text: str | None) -> int | None:
        if text is None:
            return None
        try:
            return parse_time(text, now_ns=now, name="time")
        except QueryError as e:
            raise click.BadParameter(f"{text!r} is not a time: {e}") from None

    return Scope(bound(since), bound(until), tuple(tenants) or None)


#: A query's output: shown (table, json, csv) or, with --output, exported (parquet, csv).
QUERY_FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "csv", "parquet"]),
    default="table",
    show_default=True,
    help="parquet and csv with --output: the rows as a file (ClickHouse's own FORMAT for SQL queries).",
)
OUTPUT = click.option(
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Export the rows to FILE (--format parquet|csv).",
)


def _scoped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options every query shares: time range, tenants, output format and file."""
    for opt in reversed(
        [
            click.option("--since", help="Finished at or after: ISO-8601 time or a duration ago (1h)."),
            click.option("--until", help="Finished before: ISO-8601 time or a duration ago."),
            click.option("--tenant", "tenants", multiple=True, help="Only these tenants (repeatable)."),
            QUERY_FORMAT,
            OUTPUT,
        ]
    ):
        fn = opt(fn)
    return fn


def _check_output(fmt: str, output: str | None) -> None:
    if fmt == "parquet" and output is None:
        raise click.UsageError("--format parquet writes a file: give --output FILE")
    if output is not None and fmt not in ("parquet", "csv"):
        raise click.UsageError("--output exports the rows: use --format parquet or csv")


def _export(c: CliContext, output: str, call: Callable[[Any], bytes | None], missing: str = "") -> None:
    """Write what ``call(queries)`` exports to ``output`` (a lookup that found nothing: an error)."""
    from pathlib import Path

    from sparseety.api.client import open_queries

    with open_queries(c.cfg, "sparseety query") as q:
        data = call(q)
    if data is None:
        raise click.ClickException(missing or "nothing to export")
    Path(output).write_bytes(data)
    click.echo(f"wrote {len(data)} bytes to {output}", err=True)


def _run_query(
    c: CliContext,
    fmt: str,
    call: Callable[[Any], Any],
    columns: tuple[str, ...] = (),
    wide: bool = True,
    tenants: tuple[str, ...] = (),
) -> None:
    from sparseety.api.client import open_queries

    with open_queries(c.cfg, "sparseety query") as q:
        rows = call(q)
    if not rows and tenants:  # an empty answer must not look like a tenant that used nothing
        named = ", ".join(repr(t) for t in tenants)
        click.echo(
            f"(no stored request of {named} in this range: check the name; "
            f"`sparseety query cost --by tenant` lists the tenants that have requests)",
            err=True,
        )
    if fmt == "table" and columns and not wide and rows:
        hidden = [k for k in rows[0] if k not in columns]
        rows = [{k: r.get(k) for k in columns if k in r} for r in rows]
        echo_rows(rows, fmt)
        if hidden:
            click.echo(f"({len(hidden)} more columns: --wide, or --format json|csv)", err=True)
        return
    echo_rows(rows, fmt)


@click.group("query")
def query() -> None:
    """Ask the store: costs, savings, waste, experts, duplication, one request.

    While the store process runs (it owns the embedded store), queries go through its HTTP API.
    """


def _registry_command(specs: list[Endpoint]) -> click.Command:
    """``sparseety query <route>``: the route's plain query, or a variant its param selects."""
    plain, variants = specs[0], specs[1:]
    switches = {s.selected_by: s for s in variants if s.selected_by}

    @_scoped
    @pass_ctx
    def cmd(
        c: CliContext,
        since: str | None,
        until: str | None,
        tenants: tuple[str, ...],
        fmt: str,
        output: str | None,
        by: tuple[str, ...] = (),
        bucket: str | None = None,
        **given: Any,
    ) -> None:
        _check_output(fmt, output)
        scope = _scope(since, until, tenants)
        spec = next((s for name, s in switches.items() if given.get(name)), plain)
        try:  # the registry's checks, before any store is opened: a usage error, not a traceback
            arguments = {p.name: p.check(given[p.name]) for p in spec.query.params}
            if spec is plain and plain.query.bucket:
                arguments["bucket"] = params.bucket(bucket)
        except QueryError as e:
            raise click.UsageError(str(e)) from None
        if spec is plain and plain.query.group_by is not None:
            arguments["by"] = by or (plain.query.group_by,)
        if output is not None:
            _export(c, output, lambda q: q.export(spec.query, fmt, scope=scope, **arguments))
            return
        _run_query(
            c,
            fmt,
            lambda q: q.ask(spec.query, scope=scope, **arguments),
            spec.table_columns,
            given.pop("wide", True),
            tenants,
        )

    if plain.table_columns:
        cmd = click.option("--wide", is_flag=True, help="Every column in --format table.")(cmd)
    if plain.query.bucket:
        cmd = click.option("--bucket", help="Time buckets, e.g. 1h, 15m, 1d.")(cmd)
    if plain.query.group_by is not None:
        cmd = click.option(
            "--by",
            multiple=True,
            type=click.Choice(plain.query.dims),
            help=f"Group by (repeatable; default {plain.query.group_by}).",
        )(cmd)
    return _with_params(cmd, specs, switches)


def _with_params(cmd: Any, specs: list[Endpoint], switches: dict[str, Any]) -> click.Command:
    """Add every registry param of ``specs`` as an option (a bool as a flag) and register ``cmd``
    as ``sparseety query <the first spec's command>``."""
    plain = specs[0]
    for p in reversed([p for s in specs for p in s.params]):
        if p.type is bool:
            cmd = click.option(f"--{p.wire.replace('_', '-')}", p.name, is_flag=True, help=p.doc)(cmd)
            continue
        default = 0 if p.name in switches else p.default
        # --request-id, and (as it always was) --request_id
        dashed = [f"--{p.wire.replace('_', '-')}"] if "_" in p.wire else []
        cmd = click.option(
            f"--{p.wire}",
            *dashed,
            p.name,
            type=click.Choice(p.choices) if p.choices else p.type,
            default=default,
            show_default=default is not None,
            help=p.doc,
        )(cmd)
    cmd.__doc__ = plain.query.doc.split("\n\n")[0]
    return query.command(plain.cli_name)(cmd)  # type: ignore[no-any-return]


def _lookup_command(specs: list[Endpoint]) -> click.Command:
    """``sparseety query <command> ID``: a lookup (one object), or a variant its param selects."""
    plain, variants = specs[0], specs[1:]
    switches = {s.selected_by: s for s in variants if s.selected_by}

    @click.argument("key", metavar=(plain.query.key or "id").upper())
    @click.option("--tenant", "tenants", multiple=True, help="Only if it belongs to these tenants.")
    @QUERY_FORMAT
    @OUTPUT
    @pass_ctx
    def cmd(
        c: CliContext, key: str, tenants: tuple[str, ...], fmt: str, output: str | None, **given: Any
    ) -> None:
        from sparseety.api.client import open_queries

        _check_output(fmt, output)
        spec = next((s for name, s in switches.items() if given.get(name)), plain)
        try:
            arguments = {p.name: p.check(given[p.name]) for p in spec.query.params}
        except QueryError as e:
            raise click.UsageError(str(e)) from None
        scope = Scope(tenants=tuple(tenants) or None)
        if output is not None:
            missing = f"{spec.not_found} {key!r}"
            _export(
                c, output, lambda q: q.export(spec.query, fmt, key=key, scope=scope, **arguments), missing
            )
            return
        try:
            with open_queries(c.cfg, "sparseety query") as q:
                found = q.fetch(spec.query, key, scope=scope, **arguments)
        except AmbiguousIdError as e:
            # listed, never guessed: the caller picks one uid
            echo_rows(e.candidates, fmt)
            raise click.ClickException(str(e)) from None
        if found is None:
            raise click.ClickException(f"{spec.not_found} {key!r}")
        if fmt == "json" or spec.tables is None:
            echo_rows(found, fmt)
            return
        for i, table in enumerate(spec.tables(found)):
            if i:
                click.echo()
            echo_rows(table, fmt)

    return _with_params(cmd, specs, switches)


for _name, _specs in commands().items():
    (_lookup_command if _specs[0].query.key is not None else _registry_command)(_specs)


@click.command("dashboard")
@click.option(
    "--output",
    "--out",
    "out",
    default="dashboard.html",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The HTML file to write (--out: its older name).",
)
@click.option("--request", "request_uids", multiple=True, help="Draw these requests' timelines (repeatable).")
@click.option("--since", help="Finished at or after: ISO-8601 time or a duration ago (1h).")
@click.option("--until", help="Finished before: ISO-8601 time or a duration ago.")
@click.option("--tenant", "tenants", multiple=True, help="Only these tenants (repeatable).")
@pass_ctx
def dashboard_cmd(
    c: CliContext,
    out: str,
    request_uids: tuple[str, ...],
    since: str | None,
    until: str | None,
    tenants: tuple[str, ...],
) -> None:
    """Write a self-contained HTML dashboard (charts work offline)."""
    from sparseety.api.client import RemoteQueries, open_queries
    from sparseety.api.dashboard import render_dashboard
    from sparseety.api.params import scope

    sc = scope(tuple(tenants) or None, since=since, until=until, now_ns=time.time_ns())
    with open_queries(c.cfg, "sparseety dashboard") as q:
        pipeline = q.pipeline() if isinstance(q, RemoteQueries) and not tenants else None
        path = render_dashboard(q, out, scope=sc, request_uids=list(request_uids) or None, pipeline=pipeline)
    click.echo(f"dashboard written to {path}")


COMMANDS = [store_cmd, api_cmd, query, dashboard_cmd, ingest_cmd]
