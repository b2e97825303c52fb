"""The two process models that serve the API over a store this process owns.

* :func:`run_store` — ``sparseety store``: the sink's batch consumer loop and the API in ONE process
  and one event loop, sharing one :class:`Store`. This is the embedded
  stack's store process: chDB lets one process open a data path, so everything else (CLI queries,
  dashboards, collect jobs) goes through this process's API.
* :func:`run_api` — ``sparseety api``: the API alone over the store (when no sink runs).

Both write the admin token and endpoint record under ``<data_dir>/api/`` and remove them on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from sparseety.api.auth import TokenTable, check_exposure, remove_admin_token, write_admin_token
from sparseety.api.backend import Backend
from sparseety.api.server import ApiServer
from sparseety.config import Config
from sparseety.lifecycle import clear_ready, exit_after, mark_ready, ready_file

log = logging.getLogger("sparseety.api")


def _tokens(cfg: Config) -> tuple[TokenTable, str]:
    admin = write_admin_token(cfg.data_path)
    return TokenTable(cfg.api.tokens, admin_token=admin), admin


def _api_server(cfg: Config, backend: Backend, loglevel: str, access_log: bool) -> ApiServer:
    """The HTTP server both process kinds run (the API app over ``backend``)."""
    from sparseety.api.app import create_api

    return ApiServer(
        create_api(backend),
        host=cfg.api.host,
        port=cfg.api.port,
        data_path=cfg.data_path,
        log_level=loglevel,
        access_log=access_log,
    )


def run_store(
    cfg: Config,
    *,
    loglevel: str = "info",
    session_timeout_s: float | None = None,
    commit_interval_s: float = 2.8,
    access_log: bool = False,
) -> None:
    """Run the sink worker and the API in this process until it is stopped (SIGTERM/SIGINT).

    Raises:
        ConfigError: an open API (no tokens) on a non-loopback host.
        StoreLockedError: another process owns the embedded store.
        KafkaUnavailableError: Kafka did not answer.
    """
    from sparseety.kafka import ensure_topics, wait_for_kafka
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.writer import ClickHouseSink
    from sparseety.sinks.consumer import SinkConsumer, run

    check_exposure(cfg.api.host, cfg.api.tokens)
    wait_for_kafka(cfg)
    ensure_topics(cfg, [cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq])
    store = Store.open(cfg, owner="sparseety store")
    admin = ""
    backend = None
    sink: ClickHouseSink | None = None

    def cleanup() -> None:
        if sink is not None:
            sink.close()
        if backend is not None:
            backend.close()
        if admin:
            remove_admin_token(cfg.data_path, admin)
        store.close()

    try:
        sink = ClickHouseSink.from_config(cfg, store=store)  # migrates; leaves the store open
        loop = SinkConsumer(
            cfg, sink, session_timeout_s=session_timeout_s, commit_interval_s=commit_interval_s
        )
        tokens, admin = _tokens(cfg)
        backend = Backend(cfg, store, tokens=tokens, sink_feeder=loop.feeder)
        server = _api_server(cfg, backend, loglevel, access_log)
    except BaseException:
        log.exception("the store process failed")
        exit_after(cleanup, 1)  # a stalled chDB shutdown must not keep a stopped process alive
    run(
        loop,
        cfg=cfg,
        role="store",
        loglevel=loglevel,
        cleanup=cleanup,
        started=server.start,
        stopping=server.stop,
    )


async def _serve_until_signalled(server: ApiServer, ready: Path) -> None:
    await server.start()
    mark_ready(ready)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        clear_ready(ready)
        await server.stop()


def run_api(cfg: Config, *, loglevel: str = "info", access_log: bool = False) -> None:
    """Serve the API alone over the configured store until SIGTERM/SIGINT.

    Raises:
        ConfigError: an open API (no tokens) on a non-loopback host.
        StoreLockedError: another process (e.g. ``sparseety store``) owns the embedded store.
    """
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.migrate import migrate

    check_exposure(cfg.api.host, cfg.api.tokens)
    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    with Store.open(cfg, owner="sparseety api") as store:
        migrate(store, ttl_days=cfg.clickhouse.ttl_days)
        tokens, admin = _tokens(cfg)
        backend = Backend(cfg, store, tokens=tokens)
        try:
            server = _api_server(cfg, backend, loglevel, access_log)
            asyncio.run(_serve_until_signalled(server, ready_file(cfg.data_path, "api")))
        finally:
            backend.close()
            remove_admin_token(cfg.data_path, admin)
