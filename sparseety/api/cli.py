"""API commands: ``store`` (sink + API in one process), ``api`` (API alone), ``dashboard``, ``ingest``.

Mounted on ``sparseety`` by ``sparseety/cli.py``; heavy imports happen inside the commands.
``ingest`` lives with the trace readers (``producers/logs/cli.py``) and is mounted from here.
"""

from __future__ import annotations

from typing import Any

import click

from sparseety.cli_context import CliContext, pass_ctx
from sparseety.producers.logs.cli import ingest_cmd

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
@click.option("--session-timeout", type=float, default=30.0, show_default=True, help="Consumer session, s.")
@click.option("--commit-interval", type=float, default=2.8, show_default=True, help="Offset commits, s.")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (paths and status only).")
@LOGLEVEL
@pass_ctx
def store_cmd(
    c: CliContext,
    host: str | None,
    port: int | None,
    session_timeout: float,
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


@click.command("dashboard")
@click.option("--out", "out", default="dashboard.html", show_default=True, type=click.Path(dir_okay=False))
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
    import time

    from sparseety.api.client import RemoteQueries, open_queries
    from sparseety.api.dashboard import render_dashboard
    from sparseety.api.params import scope

    sc = scope(tuple(tenants) or None, since=since, until=until, now_ns=time.time_ns())
    with open_queries(c.cfg, "sparseety dashboard") as q:
        pipeline = q.pipeline() if isinstance(q, RemoteQueries) and not tenants else None
        path = render_dashboard(q, out, scope=sc, request_uids=list(request_uids) or None, pipeline=pipeline)
    click.echo(f"dashboard written to {path}")


COMMANDS = [store_cmd, api_cmd, dashboard_cmd, ingest_cmd]
