"""``sparseety worker``: run the assembler (a Faust worker) against the configured Kafka."""

from __future__ import annotations

import click

from sparseety.cli_context import CliContext, pass_ctx


@click.command("worker")
@click.option(
    "--loglevel", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"])
)
@pass_ctx
def worker(c: CliContext, loglevel: str) -> None:
    """Run an assembler worker: engine events in, request accounting and usage windows out.

    Start several with the same configuration to share the partitions (one consumer group).
    """
    from sparseety.kafka import ensure_topics, wait_for_kafka

    from .app import create_app
    from .runtime import run

    cfg = c.cfg
    wait_for_kafka(cfg)
    ensure_topics(cfg)
    if cfg.worker.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.worker.metrics_port)
    app = create_app(cfg)
    run(app, cfg=cfg, role="worker", loglevel=loglevel)


COMMANDS = [worker]
