"""``sparseety ingest FILE``: publish a trace file to the engine-events topic, with progress."""

from __future__ import annotations

import click

from sparseety.cli_context import CliContext, pass_ctx


@click.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "recording", "jsonl", "vllm-log"]),
    default="auto",
    show_default=True,
    help="recording: SparSEEty event recording (events.bin); jsonl: one request per line; "
    "vllm-log: a vLLM server log with --enable-log-requests (rotated segments: give them all).",
)
@click.option(
    "--log-year", type=int, default=None, help="Year of a vLLM log's dates [its file's mtime year]."
)
@click.option(
    "--log-utc-offset", type=int, default=0, show_default=True, help="vLLM log clock offset, minutes."
)
@click.option("--engine", "engine_name", default=None, help="Engine name of a JSONL trace [trace-<stem>].")
@click.option("--tenant", "default_tenant", default="", help="Tenant of JSONL lines that name none.")
@click.option("--model", "default_model", default="", help="Model of JSONL lines that name none.")
@click.option("--strict", is_flag=True, help="Publish nothing if any line is bad (default: skip + report).")
@click.option(
    "--max-line-bytes",
    type=click.IntRange(min=2),
    default=1024 * 1024,
    show_default=True,
    help="A longer JSONL line is a bad line.",
)
@click.option(
    "--max-depth",
    type=click.IntRange(min=3),
    default=64,
    show_default=True,
    help="JSON nested deeper in a line is a bad line.",
)
@pass_ctx
def ingest_cmd(
    c: CliContext,
    paths: tuple[str, ...],
    fmt: str,
    log_year: int | None,
    log_utc_offset: int,
    engine_name: str | None,
    default_tenant: str,
    default_model: str,
    strict: bool,
    max_line_bytes: int,
    max_depth: int,
) -> None:
    """Publish a trace file (recording, JSONL log or vLLM server log) to the engine-events topic.

    Several PATHS only for the rotated segments of one vLLM log (read oldest first).

    Bad lines are skipped, reported with their line numbers and sent to the dlq topic with their
    bytes; the exit status is 1 when any line was skipped. The assembler then folds the events
    like a live engine's (or replay the engine-events topic into the store).
    """
    from sparseety.kafka import ensure_topics, wait_for_kafka

    from .ingest import Limits, ingest
    from .vllm_log import rotation_order

    if len(paths) > 1 and fmt != "vllm-log":
        raise click.UsageError("several files only with --format vllm-log (the segments of one log)")
    ordered = rotation_order(paths)
    path = str(ordered[-1])
    cfg = c.cfg
    wait_for_kafka(cfg)
    ensure_topics(cfg, [cfg.topics.engine_events, cfg.topics.dlq])
    err = click.get_text_stream("stderr")
    with click.progressbar(length=1, label=f"ingesting {path}", file=err) as bar:

        def progress(done: int, total: int) -> None:
            bar.length = max(total, 1)
            bar.update(done - bar.pos)

        report = ingest(
            cfg,
            path,
            fmt=fmt,
            engine_name=engine_name,
            default_tenant=default_tenant,
            default_model=default_model,
            strict=strict,
            progress=progress,
            limits=Limits(max_line_bytes, max_depth),
            segments=list(ordered[:-1]),
            log_year=log_year,
            log_utc_offset_s=log_utc_offset * 60,
        )
    click.echo(
        f"{report.format}: {report.records_read} records read, {report.requests} requests, "
        f"{report.events_published} events published to {report.topic} in {report.seconds:.2f} s "
        f"({report.events_per_s:,.0f} events/s); engines: {', '.join(report.engine_ids) or '-'}"
    )
    if report.skipped:
        click.echo(f"{report.skipped} lines that are not request records skipped (not dead-lettered)")
    if report.hint:
        click.echo(f"hint: {report.hint}", err=True)
    if report.bad:
        for line, reason in report.errors:
            click.echo(f"  skipped line {line}: {reason}", err=True)
        more = report.bad - len(report.errors)
        click.echo(
            f"{report.bad} bad lines skipped"
            + (f" ({more} not listed)" if more > 0 else "")
            + f"; {report.dead_lettered} sent to {c.cfg.topics.dlq}",
            err=True,
        )
        raise SystemExit(1)


COMMANDS = [ingest_cmd]
