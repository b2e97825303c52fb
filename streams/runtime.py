"""The Faust runtime of the assembler worker (``streams/app.py``): the app factory, raw topics,
and the run-and-exit wrapper. (The sink needs no stream processor: it is a plain
batch consumer loop, ``sinks/consumer.py``.)

Workarounds for Faust's and the brokers' quirks are not here but in ``streams/compat.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import faust

from sparseety.config import Config
from sparseety.kafka import client_security
from sparseety.lifecycle import mark_ready, run_then_exit
from sparseety.lograte import thin_kafka_client_logs

from .compat import without_spinner

log = logging.getLogger("sparseety")


def faust_broker_settings(cfg: Config) -> dict[str, Any]:
    """Faust's broker and credentials settings, from the one translation of the librdkafka
    options (:func:`sparseety.kafka.client_security`)."""
    sec = client_security(cfg)
    settings: dict[str, Any] = {"broker": ",".join(f"kafka://{h}" for h in cfg.kafka.bootstrap.split(","))}
    if sec.sasl:
        settings["broker_credentials"] = faust.SASLCredentials(
            username=sec.sasl_username,
            password=sec.sasl_password,
            mechanism=sec.sasl_mechanism,
            ssl_context=sec.ssl_context,
        )
    elif sec.protocol == "SSL":
        settings["broker_credentials"] = faust.SSLCredentials(sec.ssl_context)
    return settings


def create_app(cfg: Config, app_id: str, *, session_timeout_s: float, **settings: Any) -> faust.App:
    """A Faust app (consumer group ``app_id``) on the configured Kafka, with in-memory tables,
    no web server, and the configured topic layout (topics must exist: see
    ``sparseety.kafka.ensure_topics``; Faust would otherwise create them with the broker's default
    partition count). ``settings`` adds or overrides Faust settings."""
    datadir = cfg.data_path / "faust" / app_id
    datadir.mkdir(parents=True, exist_ok=True)
    return faust.App(
        app_id,
        **{
            **faust_broker_settings(cfg),
            "store": "memory://",
            "topic_partitions": cfg.topics.partitions,
            "topic_replication_factor": cfg.topics.replication_factor,
            "broker_session_timeout": session_timeout_s,
            "broker_heartbeat_interval": min(3.0, session_timeout_s / 3),
            "consumer_auto_offset_reset": "earliest",
            "web_enabled": False,
            "datadir": str(datadir),
            **settings,
        },
    )


def raw_topic(app: faust.App, *names: str) -> Any:
    """A topic (or several read as one) of raw bytes keys and values: the codecs are ours."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


class _ReadyWorker(faust.Worker):
    """A Faust worker that writes a readiness file once started (and after each recovery)."""

    ready_path: Path

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        mark_ready(self.ready_path)


def run(
    app: faust.App,
    *services: Any,
    cfg: Config,
    role: str,
    loglevel: str = "info",
    cleanup: Callable[[], object] | None = None,
) -> NoReturn:
    """Run ``app`` (and ``services`` beside it) until SIGTERM/SIGINT, then exit the process
    (:func:`sparseety.lifecycle.run_then_exit`: readiness file, bounded ``cleanup``)."""

    def body(ready: Path) -> None:
        thin_kafka_client_logs()  # a broker outage: one line per reconnect attempt otherwise
        worker = _ReadyWorker(app, *services, loglevel=loglevel, quiet=True)
        worker.ready_path = ready
        without_spinner(worker)
        worker.execute_from_commandline()

    run_then_exit(cfg.data_path, role, body, cleanup=cleanup, log=log)
