"""Sink commands: ``sink`` and ``replay`` (``query``, ``db``, ``prices`` and ``sql`` are the API's:
they go through the store process's HTTP API while it runs, ``sparseety/api/cli.py`` and
``sparseety/api/admin_cli.py``).

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
    from .clickhouse.client import Store
    from .clickhouse.migrate import ensure_migrated

    store = Store.open(cfg, owner=owner)
    try:
        if check:
            ensure_migrated(store)
        yield store
    finally:
        store.close()


def echo_rows(rows: Any, fmt: str) -> None:
    """Rows (or one object) in the chosen format."""
    from .output import render, render_object

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
@click.option(
    "--session-timeout",
    type=float,
    default=None,
    help="Consumer session, s [sink.session_timeout_s; unset: 2 on the embedded broker, else 6].",
)
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
    session_timeout: float | None,
    commit_interval: float,
    loglevel: str,
) -> None:
    """Write the timelines, usage and dlq topics to the store (a batch consumer loop).

    Batches are written before their offsets are committed (at-least-once); the tables are
    idempotent, so nothing is counted twice. This process owns an embedded (chDB) store.
    """
    from sparseety.kafka import ensure_topics, wait_for_kafka
    from sparseety.lifecycle import exit_after

    from .base import load_sink_class
    from .consumer import SinkConsumer, run
    from .fanout import FanOutSink

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
    from .clickhouse.dryrun import DryRunSink
    from .clickhouse.migrate import migrate
    from .clickhouse.writer import ClickHouseSink
    from .processors import load_processor, processor_for_topic
    from .replay import Replay, parse_bound

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
    from .output import render

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


COMMANDS = [sink_cmd, replay_cmd]
