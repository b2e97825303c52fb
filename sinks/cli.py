"""Sink commands: ``sink``, ``replay``, ``db`` and ``prices`` (``query`` is the API's: it may go
through the store process's HTTP API, ``sparseety/api/cli.py``).

Mounted on ``sparseety`` by ``sparseety/cli.py``; heavy imports (Faust, clickhouse-connect,
aiokafka) happen inside the commands.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import click

from sparseety.cli_context import CliContext, pass_ctx
from sparseety.config import Config

FORMAT = click.option(
    "--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True
)


@contextlib.contextmanager
def _store(cfg: Config, owner: str, *, check: bool = True) -> Iterator[Any]:
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.migrate import ensure_migrated

    store = Store.open(cfg, owner=owner)
    try:
        if check:
            ensure_migrated(store)
        yield store
    finally:
        store.close()


def echo_rows(rows: Any, fmt: str) -> None:
    """Rows (or one object) in the chosen format."""
    from sparseety.sinks.output import render, render_object

    if isinstance(rows, dict) and fmt == "json":
        click.echo(render_object(rows))
    else:
        click.echo(render(rows if isinstance(rows, list) else [rows], fmt))


# --- sink --------------------------------------------------------------------------------------


@click.command("sink")
@click.option(
    "--sink",
    "sink_names",
    multiple=True,
    default=("clickhouse",),
    show_default=True,
    help="Registered sink (repeat to write to several: --sink clickhouse --sink otel).",
)
@click.option("--session-timeout", type=float, default=30.0, show_default=True, help="Consumer session, s.")
@click.option(
    "--commit-interval",
    type=float,
    default=2.8,
    show_default=True,
    help="Least time between offset commits (each follows a write), s.",
)
@click.option(
    "--loglevel", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"])
)
@pass_ctx
def sink_cmd(
    c: CliContext,
    sink_names: tuple[str, ...],
    session_timeout: float,
    commit_interval: float,
    loglevel: str,
) -> None:
    """Write the timelines, usage and dlq topics to the store (a batch consumer loop).

    Batches are written before their offsets are committed (at-least-once); the tables are
    idempotent, so nothing is counted twice. This process owns an embedded (chDB) store.
    """
    from sparseety.kafka import ensure_topics, wait_for_kafka
    from sparseety.lifecycle import exit_after
    from sparseety.sinks.base import load_sink_class
    from sparseety.sinks.consumer import SinkConsumer, run
    from sparseety.sinks.fanout import FanOutSink

    cfg = c.cfg
    names = list(dict.fromkeys(sink_names))
    classes = [load_sink_class(name) for name in names]  # fail before waiting for Kafka
    wait_for_kafka(cfg)
    ensure_topics(cfg, [cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq])
    sink = classes[0].from_config(cfg) if len(classes) == 1 else FanOutSink.from_config(cfg, names=names)
    try:
        loop = SinkConsumer(cfg, sink, session_timeout_s=session_timeout, commit_interval_s=commit_interval)
    except BaseException:
        logging.getLogger("sparseety.sink").exception("the sink failed")
        exit_after(sink.close, 1)  # a stalled chDB shutdown must not keep a stopped process alive
    run(loop, cfg=cfg, role="sink", loglevel=loglevel, cleanup=sink.close)


# --- replay ------------------------------------------------------------------------------------


@click.command("replay")
@click.option("--topic", required=True, help="timelines, usage, dlq, engine-events or a topic name.")
@click.option("--from", "start", default="beginning", show_default=True, help="Offset, time, 2h, beginning.")
@click.option("--to", "stop", default="end", show_default=True, help="Offset, time, 30m, end (exclusive).")
@click.option("--partition", "partitions", type=int, multiple=True, help="Only these partitions.")
@click.option("--processor", default=None, help="Registered processor (default: the topic's).")
@click.option("--dry-run", is_flag=True, help="Report what would change; write nothing.")
@click.option(
    "--idle", type=float, default=1.0, show_default=True, help="Quiet seconds that end a partition."
)
@FORMAT
@pass_ctx
def replay_cmd(
    c: CliContext,
    topic: str,
    start: str,
    stop: str,
    partitions: tuple[int, ...],
    processor: str | None,
    dry_run: bool,
    idle: float,
    fmt: str,
) -> None:
    """Re-read a topic range through the same processor and sink (idempotent)."""
    from sparseety.sinks.clickhouse.dryrun import DryRunSink
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.writer import ClickHouseSink
    from sparseety.sinks.processors import load_processor, processor_for_topic
    from sparseety.sinks.replay import Replay, parse_bound

    cfg = c.cfg
    name = cfg.topics.resolve(topic)
    now = time.time_ns()
    lo, hi = parse_bound(start, now_ns=now), parse_bound(stop, now_ns=now)
    proc = load_processor(processor, cfg) if processor else processor_for_topic(cfg, name)
    with _store(cfg, "sparseety replay", check=False) as store:
        migrate(store, ttl_days=cfg.clickhouse.ttl_days)
        sink_cls = DryRunSink if dry_run else ClickHouseSink
        sink = sink_cls(
            store,
            batch_max_rows=cfg.sink.batch_max_rows,
            max_retries=cfg.sink.max_retries,
            retry_backoff_s=cfg.sink.retry_backoff_s,
        )
        try:
            click.echo(f"replaying {name} [{lo}, {hi}){' (dry run)' if dry_run else ''}", err=True)
            with click.progressbar(length=1, label="records", file=click.get_text_stream("stderr")) as bar:

                def progress(done: int, total: int) -> None:
                    bar.length = max(total, 1)
                    bar.update(done - bar.pos)

                report = Replay(
                    cfg,
                    name,
                    lo,
                    hi,
                    sink,
                    proc,
                    partitions=list(partitions) or None,
                    idle_s=idle,
                    progress=progress,
                    dry_run=dry_run,
                ).run()
            if isinstance(sink, DryRunSink):
                report.diff = sink.diff()
        finally:
            sink.close()
    _print_report(report, fmt)


def _print_report(report: Any, fmt: str) -> None:
    from sparseety.sinks.output import render

    click.echo(
        f"{report.records_in_range} records in range ({report.records_read} read) in "
        f"{report.seconds:.2f} s: {report.records_per_s:,.0f} records/s, "
        f"{report.written.total_rows} rows {'staged' if report.dry_run else 'written'} "
        f"({report.rows_per_s:,.0f} rows/s)",
        err=True,
    )
    if report.processor_summary:
        click.echo(report.processor_summary, err=True)
    if report.undecodable:
        click.echo(
            f"{len(report.undecodable)} undecodable records (already dead-lettered by the live sink), "
            f"first at partition {report.undecodable[0][0]} offset {report.undecodable[0][1]}",
            err=True,
        )
    if report.rejected:
        click.echo(f"{report.rejected} records the sink does not store were skipped", err=True)
    if report.dry_run:
        rows = [{"table": t, **counts} for t, counts in report.diff.items()]
    else:
        rows = [{"table": t, "rows_written": n} for t, n in report.written.rows.items()]
    click.echo(render(rows, fmt))


# --- db ----------------------------------------------------------------------------------------


@click.group("db")
def db() -> None:
    """The store's schema (versioned migrations)."""


@db.command("migrate")
@pass_ctx
def db_migrate(c: CliContext) -> None:
    """Apply pending migrations (idempotent; ON CLUSTER when clickhouse.cluster is set)."""
    from sparseety.sinks.clickhouse.migrate import migrate

    with _store(c.cfg, "sparseety db migrate", check=False) as store:
        applied = migrate(store, ttl_days=c.cfg.clickhouse.ttl_days)
        where = f"{store!r}" + (f" on cluster {store.cluster}" if store.cluster else "")
        if applied:
            for m in applied:
                click.echo(f"applied {m.version:03d}_{m.name} to {where}")
        else:
            click.echo(f"{where} is up to date")


@db.command("status")
@FORMAT
@pass_ctx
def db_status(c: CliContext, fmt: str) -> None:
    """List migrations and whether each is applied; exit 1 when some are pending."""
    from sparseety.sinks.clickhouse.migrate import status

    with _store(c.cfg, "sparseety db status", check=False) as store:
        states = status(store)
    rows = [
        {
            "version": s.version,
            "name": s.name,
            "applied": s.applied,
            "applied_at": None
            if s.applied_ns is None
            else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.applied_ns / 1e9)),
            "checksum_ok": s.checksum_ok,
        }
        for s in states
    ]
    echo_rows(rows, fmt)
    if not all(s.applied and s.checksum_ok for s in states):
        raise SystemExit(1)


# --- prices ------------------------------------------------------------------------------------


@click.group("prices")
def prices() -> None:
    """Prices per model and class (USD per 1M tokens, or per GPU-hour), with effective dates."""


@prices.command("set")
@click.option("--model", required=True)
@click.option(
    "--class",
    "token_class",
    required=True,
    type=click.Choice(["input", "cached_input", "output", "gpu_hour"]),
)
@click.option("--usd", required=True, help="USD per 1M tokens (per GPU-hour for gpu_hour), e.g. 0.15.")
@click.option("--effective-from", default="", help="ISO-8601 time (default: always).")
@click.option("--note", default="")
@pass_ctx
def prices_set(c: CliContext, model: str, token_class: str, usd: str, effective_from: str, note: str) -> None:
    """Set one price."""
    from sparseety.sinks.clickhouse.prices import Price, parse_time, parse_usd, set_prices

    price = Price(model, token_class, parse_usd(usd), parse_time(effective_from), note)
    with _store(c.cfg, "sparseety prices") as store:
        set_prices(store, [price])
    click.echo(f"{model} {token_class}: ${price.usd} from {effective_from or 'always'}")


@prices.command("load")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@pass_ctx
def prices_load(c: CliContext, path: str) -> None:
    """Set prices from a TOML ([[prices]]) or CSV (model,token_class,usd,effective_from) file."""
    from sparseety.sinks.clickhouse.prices import load_prices_file, set_prices

    entries = load_prices_file(path)
    with _store(c.cfg, "sparseety prices") as store:
        n = set_prices(store, entries)
    click.echo(f"{n} prices set from {path}")


@prices.command("list")
@click.option("--model", default=None)
@FORMAT
@pass_ctx
def prices_list(c: CliContext, model: str | None, fmt: str) -> None:
    """List stored prices."""
    from sparseety.sinks.clickhouse.prices import list_prices

    with _store(c.cfg, "sparseety prices") as store:
        echo_rows(list_prices(store, model), fmt)


COMMANDS = [sink_cmd, replay_cmd, db, prices]
