"""Helpers for tests that run real components: produce events, run workers, read topics."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from sparseety import events as ev
from sparseety.api.client import RemoteQueries
from sparseety.config import Config, load_config, to_env
from sparseety.kafka import make_decoder, make_encoder, make_producer

VENV_BIN = Path(sys.executable).parent


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stack_env(data: Path, broker_port: int, **settings: str) -> dict[str, str]:
    """The environment of a ``sparseety up`` stack: this process's without its SPARSEETY_*
    variables, the data dir ``data``, the broker on ``broker_port``, the API on a free port, a 6 s
    worker session timeout, then ``settings`` (``api_port="8080"`` is SPARSEETY_API_PORT)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    return env | {
        "SPARSEETY_DATA_DIR": str(data),
        "SPARSEETY_BROKER_PORT": str(broker_port),
        "SPARSEETY_API_PORT": str(free_port()),
        "SPARSEETY_WORKER_SESSION_TIMEOUT_S": "6",
        **{f"SPARSEETY_{k.upper()}": v for k, v in settings.items()},
    }


def produce_events(cfg: Config, events: Iterable[dict[str, Any]], topic: str | None = None) -> int:
    """Encode EngineEvents and produce them keyed by engine name; returns the count."""
    topic = topic or cfg.topics.engine_events
    enc = make_encoder(cfg, "EngineEvent", topic)
    producer = make_producer(cfg)
    n = 0
    for e in events:
        producer.produce(topic, key=e["engine_name"].encode(), value=enc.encode(e))
        n += 1
        if n % 1000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0, "events not delivered"
    return n


def produce_raw(cfg: Config, topic: str, items: Iterable[tuple[bytes | None, bytes]]) -> None:
    producer = make_producer(cfg)
    for key, value in items:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def read_topic(
    cfg: Config, topic: str, *, decode: bool = True, quiet_s: float = 1.0
) -> list[tuple[Any, ...]]:
    """Everything currently in ``topic``: (partition, offset, key, decoded record or raw value).

    Reads until the topic stays quiet for ``quiet_s``: this broker reports the high watermark at
    record-batch granularity, so the watermark cannot tell where a partition ends.
    """
    consumer = Consumer(
        cfg.kafka.librdkafka(**{"group.id": "reader", "enable.auto.commit": False, "fetch.wait.max.ms": 20})
    )
    md = consumer.list_topics(topic, timeout=10).topics[topic]
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
    dec = make_decoder(cfg)
    out = []
    while True:
        msg = consumer.poll(quiet_s)
        if msg is None:
            break
        if msg.error():
            continue
        value = dec.decode(msg.value())[1] if decode else msg.value()
        out.append((msg.partition(), msg.offset(), msg.key(), value))
    consumer.close()
    return out


def latest_by_key(records: list[tuple[Any, ...]]) -> dict[bytes, Any]:
    """What a compacted topic (or a ReplacingMergeTree) keeps: the last value per key."""
    out: dict[bytes, Any] = {}
    for _, _, key, value in sorted(records, key=lambda r: (r[0], r[1])):
        out[key] = value
    return out


def wait_for(predicate: Any, timeout: float, interval: float = 0.5, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_folded(cfg: Config, worker: ComponentProcess, expected: int, timeout: float, what: str) -> None:
    """Wait until the timelines topic holds ``expected`` requests (the last record of each key);
    the worker must stay alive meanwhile."""
    wait_for(
        lambda: len(latest_by_key(read_topic(cfg, cfg.topics.timelines))) >= expected or not worker.alive(),
        timeout,
        2,
        what,
    )
    assert worker.alive(), worker.tail()


def finished_job(client: Any, job: dict[str, Any], headers: dict[str, str], timeout_s: float = 60.0) -> Any:
    """``job`` (an API job's JSON) polled through ``client`` until it is neither queued nor
    running; it must have succeeded."""
    deadline = time.monotonic() + timeout_s
    while job["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"job did not finish: {job}"
        time.sleep(0.2)
        job = client.get(f"/api/v1/jobs/{job['id']}", headers=headers).json()
    assert job["state"] == "succeeded", job
    return job


class ComponentProcess:
    """A ``sparseety`` subcommand in its own process, configured through SPARSEETY_* variables.

    ``command`` replaces the ``sparseety`` executable (e.g. a test module wrapping its CLI).
    """

    def __init__(self, cfg: Config, args: list[str], log: Path, command: list[str] | None = None) -> None:
        self.cfg, self.args, self.log = cfg, args, log
        self.command = command or [str(VENV_BIN / "sparseety")]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ComponentProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update(to_env(self.cfg))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, *self.args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill(signal.SIGTERM)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


@contextlib.contextmanager
def serving(app: Any, what: str = "the app") -> Iterator[str]:
    """``app`` (ASGI) served by uvicorn on a free local port in a thread: yields its base URL;
    stopped afterwards."""
    import threading

    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


def chdb_config(tmp_path_factory: Any, database: str | None = None, **overrides: Any) -> Config:
    """A config on the test process's one chDB path (chDB allows one per process), own database."""
    path = tmp_path_factory.getbasetemp() / "chdb-unit"
    db = database or f"t{uuid.uuid4().hex[:10]}"
    return load_config(clickhouse={"dsn": f"chdb://{path}", "database": db}, **overrides)


@contextlib.contextmanager
def throwaway_store(cfg: Config) -> Iterator[Any]:
    """``cfg``'s store, open; its database is dropped and the store closed afterwards."""
    from sparseety.sinks.clickhouse.client import Store

    store = Store.open(cfg)
    try:
        yield store
    finally:
        store.command(f"DROP DATABASE IF EXISTS {store.database}")
        store.close()


def write_accounting(
    store: Any, records: Iterable[dict[str, Any]], prices: Sequence[Any] = (), *, partitions: int = 1
) -> None:
    """Migrate ``store``, write ``records`` (RequestAccounting) through the sink, the i-th to
    partition i % ``partitions`` at offset i, and set ``prices``."""
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.prices import set_prices
    from sparseety.sinks.clickhouse.writer import ClickHouseSink

    migrate(store)
    sink = ClickHouseSink(store)
    for i, rec in enumerate(records):
        sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=i % partitions, offset=i)
    sink.flush()
    set_prices(store, list(prices))


def table_rows(store: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every sink table's content under FINAL, in key order (the store as queries see it)."""
    from sparseety.sinks.clickhouse.tables import SINK_TABLES

    out = {}
    for t in SINK_TABLES:
        _, rows = store.query_rows(
            f"SELECT {', '.join(t.columns)} FROM {store.table(t.name)} FINAL ORDER BY {', '.join(t.key)}"
        )
        out[t.name] = rows
    return out


@contextlib.contextmanager
def accounting_store(
    tmp_path_factory: Any, records: Iterable[dict[str, Any]], prices: Sequence[Any] = (), **kw: Any
) -> Iterator[Any]:
    """A throwaway chDB store holding ``records`` and ``prices`` (:func:`write_accounting`)."""
    with throwaway_store(chdb_config(tmp_path_factory)) as store:
        write_accounting(store, records, prices, **kw)
        yield store


def store_fixtures(fill: Callable[[Any], None], data_dir: str = "store") -> tuple[Any, Any]:
    """Module-scoped fixtures for a test module: ``cfg``, a chDB config with a data dir of its own,
    and ``store``, its throwaway store filled once by ``fill``. Bind them to those names:
    ``cfg, store = store_fixtures(seed)``."""

    @pytest.fixture(scope="module")
    def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
        return chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp(data_dir)))

    @pytest.fixture(scope="module")
    def store(cfg: Config) -> Iterator[Any]:
        with throwaway_store(cfg) as s:
            fill(s)
            yield s

    return cfg, store


@contextlib.contextmanager
def running_broker(data_dir: Path) -> Iterator[Any]:
    """A Tansu broker of its own on a free port (no topics), stopped afterwards: for tests that
    stop or restart the broker, which the session's shared one must never be."""
    from sparseety.broker import EmbeddedBroker

    broker = EmbeddedBroker(load_config(data_dir=str(data_dir), broker={"port": free_port()}))
    broker.start(create_topics=False)
    try:
        yield broker
    finally:
        broker.stop()


def plain_event(event: dict[str, Any]) -> dict[str, Any]:
    """A decoded event with StepBatch's unpacked ``array('i')`` columns as lists (same ints), to
    compare with the dicts the factories build."""
    from array import array

    from sparseety import events as ev

    payload = event.get("payload")
    if isinstance(payload, tuple) and payload[0] == ev.STEP_BATCH:
        body = {k: v.tolist() if isinstance(v, array) else v for k, v in payload[1].items()}
        return {**event, "payload": (payload[0], body)}
    return event


def stored_uids(cfg: Config) -> list[str]:
    """The request uids the running store's API lists (up to 10,000)."""
    with RemoteQueries.from_config(cfg) as q:
        return [str(r["request_uid"]) for r in q.requests(limit=10_000)]


def finished_uids(events: Iterable[dict[str, Any]]) -> set[str]:
    """The uids of the requests that ``events`` (EngineEvents) finish."""
    return {
        f"{e['engine_id']}/{e['payload'][1]['request_id']}"
        for e in events
        if e["payload"][0] == ev.REQUEST_FINISHED
    }
