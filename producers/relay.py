"""The relay: everything the producer does after the hooks, outside the engine's interpreter.

The engine side (:mod:`.shipper`) hands each stream's built payloads over as :mod:`.wire`
frames; here they get their envelope, are validated and Avro-encoded, go through the ledger
to Kafka or the disk journal, and the stream's heartbeats, metrics and ``delivery.json`` are
kept: the in-process emitter's :class:`~.supervisor.Supervisor`, fed by an :class:`Inbox`
instead of the engine's hand-off. Two ways to run it:

* **child** (``producer.relay = "process"``, the default): the plugin starts
  ``python -m sparseety.producers.relay`` per stream, frames on its stdin, reports on its
  stdout. The end of stdin (the engine stopped, or died) makes it deliver or journal what it
  holds and exit.
* **sidecar** (``producer.relay = "unix:<path>"``): ``sparseety relay --socket <path>`` serves
  any number of streams, one connection each, with its own configuration (Kafka, spill dir).

Backpressure runs the other way: a full inbox stops the reading, the pipe fills, the engine
side's write waits (outside the GIL), and the engine's bounded hand-off refuses events, which
are counted and leave seq gaps. The engine never waits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from sparseety import events as ev
from sparseety.config import Config
from sparseety.kafka import make_encoder

from . import wire
from .handoff import Builder, Item
from .journal import journal_dir
from .kafka_client import KafkaLink, WarnOnce, confluent_producer, producer_settings
from .ledger import EmitterStats, Ledger
from .plugin_log import ensure_log_handler
from .supervisor import StreamIdentity, StreamSettings, Supervisor

log = logging.getLogger("sparseety.relay")

#: How often the relay reports to the engine while something changes, and at least.
REPORT_CHECK_S = 0.05
REPORT_EVERY_S = 1.0


def _listed(payloads: list[Any]) -> list[Any]:
    return payloads


def _record(payload_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return payload_type, payload


def _failed() -> None:
    raise ValueError("the event's builder raised in the engine process")


class Inbox:
    """Items received from the engine, waiting for the supervisor thread (a
    :class:`~.handoff.Source`). :meth:`put` blocks while more than ``max_events`` wait: the
    reading stops and the backpressure reaches the engine's hand-off."""

    def __init__(self, max_events: int, heartbeat: Builder) -> None:
        self._max = max_events
        self._heartbeat = heartbeat
        self._items: deque[Item] = deque()
        self._cond = threading.Condition()
        self._queued = 0
        self._closed = False
        self.engine_queued = 0
        self.engine_dropped: dict[str, int] = {}
        self.next_seq = 0  # one past the highest seq received

    def _items_of(self, batch: wire.Batch) -> list[Item]:
        out: list[Item] = []
        for seq, count, ts, mono, payload in zip(
            batch.seqs, batch.counts, batch.ts_ns, batch.mono_ns, batch.payloads, strict=True
        ):
            if count:
                out.append((seq, count, ts, mono, _listed, (payload,)))
            elif payload[0] == ev.HEARTBEAT and payload[1] is None:
                out.append((seq, 0, ts, mono, self._heartbeat, ()))
            elif payload[0] == wire.FAILED:
                out.append((seq, 0, ts, mono, _failed, ()))
            else:
                out.append((seq, 0, ts, mono, _record, payload))
        return out

    def put(self, batch: wire.Batch, dropped: dict[str, int]) -> None:
        items = self._items_of(batch)
        events = sum(c or 1 for c in batch.counts)
        with self._cond:
            while self._queued > self._max and not self._closed:
                self._cond.wait(0.5)
            self._items.extend(items)
            self._queued += events
            self.engine_queued = batch.queued
            self.engine_dropped = dropped
            if items:
                self.next_seq = max(self.next_seq, items[-1][0] + (items[-1][1] or 1))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def queued(self) -> int:
        return self._queued + self.engine_queued

    @property
    def dropped_by(self) -> dict[str, int]:
        return self.engine_dropped

    def __bool__(self) -> bool:
        return bool(self._items)

    def take(self, limit: int) -> list[Item]:
        taken: list[Item] = []
        with self._cond:
            items = self._items
            while items and len(taken) < limit:
                taken.append(items.popleft())
            self._queued -= sum(item[1] or 1 for item in taken)
            self._cond.notify_all()
        return taken


def exported_totals(baseline: wire.Totals, engine_dropped: dict[str, int]) -> dict[str, int]:
    """What a predecessor relay exported, in :class:`~.reporting.Reporter`'s keys."""
    out = {
        "produced": baseline.produced,
        "spilled": baseline.spilled,
        "drained": baseline.drained,
        "restarts": baseline.restarts,
        "dropped": sum(baseline.dropped_by.values()) + sum(engine_dropped.values()),
    }
    for reason, value in {**baseline.dropped_by, **engine_dropped}.items():
        out["r:" + reason] = value
    return out


class StreamRelay:
    """One stream's encoder, ledger and Kafka link, fed by frames (see the module docstring)."""

    def __init__(self, cfg: Config, hello: wire.Hello, first: wire.Batch | None) -> None:
        pc = cfg.producer
        self.hello = hello
        stream = hello.stream
        topic = cfg.topics.engine_events
        warn_once = WarnOnce(stream)
        link = KafkaLink(
            producer_settings(cfg, memory_limit_bytes=pc.memory_limit_bytes, stream=stream),
            topic=topic,
            factory=confluent_producer,
            warn_once=warn_once,
        )
        journal = journal_dir(cfg.spill_path, hello.engine_name, stream)
        ledger = Ledger(
            link,
            limit_bytes=pc.memory_limit_bytes,
            journal_dir=journal,
            journal_max_bytes=pc.spill_max_bytes,
            stream=stream,
            warn_once=warn_once,
            bootstrap=cfg.kafka.bootstrap,
        )
        b = hello.baseline
        ledger.stats = EmitterStats(b.produced, b.spilled, b.drained, b.restarts, dict(b.dropped_by))
        engine_dropped = dict(first.dropped_by) if first is not None else {}
        self.inbox = Inbox(pc.queue_max_events, self._heartbeat)
        self.supervisor = Supervisor(
            StreamSettings(stream=stream, producer=pc),
            handoff=self.inbox,
            ledger=ledger,
            link=link,
            new_encoder=lambda: make_encoder(cfg, "EngineEvent", topic),
            warn_once=warn_once,
            exported=exported_totals(b, engine_dropped),
        )
        self.supervisor.bind(StreamIdentity(hello.engine_name, hello.engine_id), journal)
        self.supervisor.thread.start()
        log.info(
            "sparseety relay %s/%s (pid %d): Kafka %s; spill journal %s",
            hello.engine_id,
            stream,
            os.getpid(),
            cfg.kafka.bootstrap,
            journal,
        )

    def _heartbeat(self) -> tuple[str, dict[str, Any]]:
        return self.supervisor.build_heartbeat()

    def report(self, *, final: bool = False) -> wire.Report:
        sup, ledger = self.supervisor, self.supervisor.ledger
        s = ledger.stats
        return wire.Report(
            next_seq=self.inbox.next_seq,
            idle=not self.inbox and not sup.handling and ledger.idle,
            totals=wire.Totals(s.produced, s.spilled, s.drained, s.restarts, dict(s.dropped_by)),
            memory_bytes=ledger.memory_bytes,
            journal_bytes=ledger.journal_bytes,
            final=final,
            recoveries=sup.recoveries,
        )

    def close(self) -> None:
        self.inbox.close()
        self.supervisor.stop(None)


def serve(rfile: BinaryIO, send: Callable[[wire.Report], None], cfg: Config | None = None) -> int:
    """Relay one stream: a :class:`~.wire.Hello`, then batches until the end of ``rfile``.

    Args:
        rfile: The engine's frames.
        send: Writes one report back (errors are ignored: the engine may be gone).
        cfg: The relay's own configuration (a sidecar); None: the engine's, from the Hello.
    Returns:
        0, or 1 when the stream ended inside a frame (the engine died mid-write).
    """
    hello = wire.read(rfile)
    if not isinstance(hello, wire.Hello):
        raise wire.WireError(f"expected a Hello frame first, got {type(hello).__name__}")
    cfg = cfg or Config.model_validate(hello.config)
    first = wire.read(rfile)
    if first is not None and not isinstance(first, wire.Batch):
        raise wire.WireError(f"expected Batch frames, got {type(first).__name__}")
    relay = StreamRelay(cfg, hello, first)
    done = threading.Event()

    def reporter() -> None:
        last: wire.Report | None = None
        sent_at = 0.0
        while not done.wait(REPORT_CHECK_S):
            now = time.monotonic()
            report = relay.report()
            if report != last or now - sent_at >= REPORT_EVERY_S:
                with contextlib.suppress(OSError, ValueError):
                    send(report)
                last, sent_at = report, now

    thread = threading.Thread(target=reporter, name="sparseety-relay-report", daemon=True)
    thread.start()
    rc = 0
    try:
        frame: wire.Frame | None = first
        while frame is not None:
            if not isinstance(frame, wire.Batch):
                raise wire.WireError(f"expected Batch frames, got {type(frame).__name__}")
            relay.inbox.put(frame, frame.dropped_by)
            frame = wire.read(rfile)
    except wire.WireError as exc:
        log.warning("sparseety relay %s/%s: %s", hello.engine_id, hello.stream, exc)
        rc = 1
    finally:
        relay.close()
        done.set()
        thread.join(1.0)
        with contextlib.suppress(OSError, ValueError):
            send(relay.report(final=True))
    return rc


def serve_socket(path: Path, cfg: Config, stop: threading.Event | None = None) -> None:
    """The sidecar: accept streams on the Unix socket ``path``, one thread each, until ``stop``."""
    stop = stop or threading.Event()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    server.settimeout(0.5)
    log.info("sparseety relay: serving streams on %s (Kafka %s)", path, cfg.kafka.bootstrap)
    threads: list[threading.Thread] = []

    def one(conn: socket.socket) -> None:
        lock = threading.Lock()

        def send(report: wire.Report) -> None:
            with lock:
                conn.sendall(wire.encode(report))

        with conn, conn.makefile("rb") as rfile:
            try:
                serve(rfile, send, cfg)
            except Exception:
                log.exception("sparseety relay: a stream failed")

    try:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            t = threading.Thread(target=one, args=(conn,), name="sparseety-relay-stream", daemon=True)
            t.start()
            threads.append(t)
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for t in threads:
            t.join(30.0)


def main() -> int:
    """Child mode: frames on stdin, reports on stdout (which nothing else may write to: fd 1
    is pointed at stderr, so a library's stray print cannot corrupt the frames)."""
    multiprocessing.current_process().name = "sparseety-relay"  # the log lines' process name
    ensure_log_handler()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    lock = threading.Lock()

    def send(report: wire.Report) -> None:
        with lock:
            wire.write_fd(out_fd, report)

    try:
        return serve(sys.stdin.buffer, send)
    except wire.WireError as exc:
        log.error("sparseety relay: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
