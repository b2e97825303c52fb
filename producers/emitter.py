"""The engine-side publisher every producer shares: a cheap hand-off on the hot path, and a
background thread that builds, encodes and produces the events.

Hot path (:meth:`Emitter.emit`): take the next ``seq``, read the wall and monotonic clocks, and
append ``(seq, ts_ns, mono_ns, builder, args)`` to a bounded deque. Nothing is built, encoded or
sent there, nothing blocks (the lock only orders seq assignment with the append), nothing raises.
When the deque is full the event is dropped: its seq is skipped, a gap the assembler detects.

Background thread: ``builder(*args)`` turns the references into a payload, the envelope and the
Avro encoding follow, then confluent-kafka produces it (idempotent, compressed, batched; key =
engine name, so one engine's streams share a partition). Delivery outcomes are counted.

Kafka away: librdkafka keeps messages (never timing out) while their bytes stay under
``producer.memory_limit_bytes``; beyond that, events are appended to a disk journal
(``producer.spill_dir``/engine/stream, bounded by ``spill_max_bytes``). While the journal holds
anything, new events go behind it, and it drains in order as Kafka acknowledges again, so the
partition sees each stream's seqs in order. A client that makes no progress for a while (a
broker that lost its producer state, a fatal idempotence error) is purged and recreated; its
unacknowledged messages go back to the head of the line. At shutdown whatever Kafka did not
take within ``flush_timeout_s`` is written to the journal, which the next start drains first.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import SparseetyError
from sparseety.producers import metrics
from sparseety.producers.journal import Journal, JournalError, JournalFullError

log = logging.getLogger("sparseety.producer")

Builder = Callable[..., Any]
#: (first seq, 0 or the emit_many count, wall ns, monotonic ns, builder, builder args)
_Item = tuple[int, int, int, int, Builder, tuple[Any, ...]]

#: Memory a queued message costs beside its value: librdkafka's message struct, key copy and the
#: Python delivery callback. Measured here: ~580 B of RSS per queued 100-byte message.
MSG_OVERHEAD = 512

_NEW, _BACKLOG, _JOURNAL = 0, 1, 2


def record(payload_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Identity builder: the payload is already a record."""
    return payload_type, payload


def new_epoch() -> str:
    """A fresh engine epoch: milliseconds since the Unix epoch (sortable) + a random suffix."""
    return f"{time.time_ns() // 1_000_000:x}-{os.urandom(3).hex()}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


@dataclass
class EmitterStats:
    """Totals since the emitter started (the Heartbeat's counters)."""

    produced: int = 0
    spilled: int = 0
    drained: int = 0
    restarts: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())


class _RateLimitedLog(logging.Filter):
    """One line per message kind per ``every_s`` (librdkafka repeats connection errors fast)."""

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def filter(self, rec: logging.LogRecord) -> bool:
        key = rec.getMessage()[:60]
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.every_s:
            return False
        self._last[key] = now
        return True


_rdkafka_log = logging.getLogger("sparseety.producer.librdkafka")
_rdkafka_log.addFilter(_RateLimitedLog())


class Emitter:
    """Publishes one event stream (engine epoch + stream name) to the engine-events topic.

    Args:
        cfg: The configuration (kafka, topics, schema registry, producer sections).
        engine_name: Stable engine name: the Kafka key. None: not known yet; the Kafka client
            starts connecting anyway and :meth:`bind` names the stream before the first event.
        epoch: This engine start's epoch (``engine_id = engine_name@epoch``).
        stream: ``core`` for the engine-core process, ``worker-<rank>`` for model runners.
        producer_factory: Builds the Kafka client from librdkafka settings (tests pass fakes).
        stall_s: A client with unacknowledged messages and no progress for this long is
            recreated (doubling while Kafka stays away, up to 30 s).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        engine_name: str | None,
        epoch: str | None,
        stream: str = ev.CORE_STREAM,
        producer_factory: Callable[[dict[str, Any]], Any] | None = None,
        stall_s: float = 10.0,
    ) -> None:
        self.cfg = cfg
        self.engine_name = ""
        self.epoch = ""
        self.engine_id = ""
        self.stream = stream
        self.topic = cfg.topics.engine_events
        self._key = b""
        pc = cfg.producer
        self._qmax = pc.queue_max_events
        self._limit = pc.memory_limit_bytes
        self._hb_interval = pc.heartbeat_interval_s
        self._flush_timeout = pc.flush_timeout_s
        self._journal_dir = cfg.spill_path / "_unbound" / _safe(stream)
        self._journal_max = pc.spill_max_bytes
        self._bound = threading.Event()
        self._factory = producer_factory or _confluent_producer
        self._stall_base = self._stall_s = stall_s

        # hot path (any thread): guarded by _lock
        self._lock = threading.Lock()
        self._q: deque[_Item] = deque()
        self._seq = 0
        self._queued = 0  # events (not hand-offs) in _q
        self._queue_full = 0
        self._closed = False

        # background thread only
        self.stats = EmitterStats()
        self._producer: Any = None
        self._encoder: Any = None
        self._journal: Journal | None = None
        self._journal_broken = False
        self._journal_left = 0  # journal bytes not yet read, as of the last service round
        self._handling = False
        self._backlog: deque[tuple[int, bytes, int]] = deque()
        self._backlog_bytes = 0
        self._inflight_bytes = 0
        self._inflight = 0
        self._failed: list[tuple[int, bytes, int]] = []
        self._order = itertools.count()
        self._fatal = False
        self._born = self._last_progress = time.monotonic()
        self._next_hb = time.monotonic() + self._hb_interval
        self._next_metrics = 0.0
        self._exported: dict[str, int] = {}
        self._logged_errors: set[str] = set()

        if engine_name is not None and epoch is not None:
            self.bind(engine_name, epoch)
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sparseety-emitter-{stream}", daemon=True)
        self._thread.start()

    def bind(self, engine_name: str, epoch: str) -> None:
        """Name the stream (once, before the first event)."""
        if self._bound.is_set():
            raise SparseetyError(f"emitter already bound to {self.engine_id}", stream=self.stream)
        self.engine_name = engine_name
        self.epoch = epoch
        self.engine_id = ev.engine_id(engine_name, epoch)
        self._key = engine_name.encode()
        self._journal_dir = self.cfg.spill_path / _safe(engine_name) / _safe(self.stream)
        self._bound.set()

    @property
    def bound(self) -> bool:
        return self._bound.is_set()

    # --- hot path ----------------------------------------------------------------------------

    def emit(self, build: Builder, *args: Any) -> None:
        """Hand one event to the background thread; ``build(*args)`` makes its payload there.

        Never raises and never blocks on I/O. The seq is taken even when the event is dropped
        (queue full, emitter closed), so the loss shows as a gap.
        """
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            if self._queued >= self._qmax or self._closed or not self.engine_id:
                self._queue_full += 1
                return
            self._queued += 1
            self._q.append((seq, 0, time.time_ns(), time.monotonic_ns(), build, args))

    def emit_many(self, count: int, build: Builder, *args: Any) -> None:
        """Hand ``count`` events of one moment over at once (e.g. a step's admissions):
        ``build(*args)`` returns their ``count`` payloads. One lock and one append per batch
        instead of per event; seqs are consecutive, and a dropped batch leaves ``count`` gaps."""
        if count <= 0:
            return
        with self._lock:
            seq = self._seq
            self._seq = seq + count
            if self._queued + count > self._qmax or self._closed or not self.engine_id:
                self._queue_full += count
                return
            self._queued += count
            self._q.append((seq, count, time.time_ns(), time.monotonic_ns(), build, args))

    def emit_record(self, payload_type: str, payload: dict[str, Any]) -> None:
        """Hand one ready payload record to the background thread."""
        self.emit(record, payload_type, payload)

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Events waiting in the hand-off queue."""
        return self._queued

    def idle(self) -> bool:
        """Whether everything emitted so far was acknowledged by Kafka."""
        return (
            not self._q
            and not self._handling
            and not self._inflight
            and not self._backlog
            and not self._journal_left
        )

    def wait_idle(self, timeout: float) -> bool:
        """Wait until :meth:`idle` (for tests and request-level producers); True if reached."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.02)
        return self.idle()

    def close(self, timeout: float | None = None) -> EmitterStats:
        """Stop accepting events, deliver or journal everything, log the totals.

        Args:
            timeout: How long Kafka may take (default ``producer.flush_timeout_s``); what it has
                not acknowledged by then goes to the journal. Returns early once Kafka makes no
                progress for 2 s.
        """
        if timeout is not None:
            self._flush_timeout = timeout
        with self._lock:
            self._closed = True
        self._stopping.set()
        self._thread.join(self._flush_timeout + 10.0)
        return self.stats

    # --- background thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._setup()
            while True:
                self._handling = True
                batch = self._take(1024)
                for item in batch:
                    self._handle(item)
                    time.sleep(0)  # hand the GIL to the engine thread if it waits for it
                self._handling = False
                self._service(idle=not batch)
                if self._stopping.is_set() and not self._q:
                    break
            self._final_flush()
        except Exception:  # the thread must never die silently; events would pile up
            log.exception("sparseety producer %s/%s: background thread failed", self.engine_id, self.stream)
        finally:
            self._sync_metrics()
            self._log_totals()
            if self._journal is not None:
                with contextlib.suppress(Exception):
                    self._journal.close()
            self._done.set()

    def _setup(self) -> None:
        from sparseety.kafka import make_encoder

        while self._encoder is None:
            try:
                self._encoder = make_encoder(self.cfg, "EngineEvent", self.topic)
            except Exception as exc:  # registry unreachable: events wait in the queue meanwhile
                self._log_once("encoder", "cannot create the Avro encoder (retrying every 5 s): %s", exc)
                if self._stopping.wait(5.0):
                    return
        self._new_producer()
        # The Kafka client connects meanwhile; the journal and the key need the stream's name.
        while not self._bound.wait(0.05):
            if self._stopping.is_set():
                return
            if self._producer is not None:
                self._producer.poll(0)
        leftovers = self._journal_dir.is_dir() and any(self._journal_dir.glob("*.seg"))
        if leftovers and self._open_journal() and self._journal:
            log.info(
                "sparseety producer %s: %d bytes left in journal %s from an earlier run; draining first",
                self.stream,
                self._journal.pending_bytes,
                self._journal_dir,
            )

    def _new_producer(self) -> None:
        conf = self._producer_conf()
        try:
            self._producer = self._factory(conf)
        except Exception as exc:
            self._producer = None
            self._log_once("producer", "cannot create the Kafka producer: %s", exc)
        self._born = time.monotonic()

    def _producer_conf(self) -> dict[str, Any]:
        from sparseety.kafka import producer_conf

        limit_kb = max(1024, self._limit // 1024 * 2)
        return producer_conf(
            self.cfg,
            **{
                # Kafka away: keep messages (bounded by our own accounting) instead of failing them.
                "message.timeout.ms": 0,
                "queue.buffering.max.kbytes": limit_kb,
                "queue.buffering.max.messages": 10_000_000,
                "reconnect.backoff.ms": 100,
                "reconnect.backoff.max.ms": 2000,
                "client.id": f"sparseety-{self.stream}",
                "error_cb": self._on_error,
                "logger": _rdkafka_log,
            },
        )

    def _take(self, n: int) -> list[_Item]:
        q = self._q
        out: list[_Item] = []
        with contextlib.suppress(IndexError):
            for _ in range(n):
                out.append(q.popleft())
        if out:
            taken = sum(item[1] or 1 for item in out)
            with self._lock:
                self._queued -= taken
        return out

    def _handle(self, item: _Item) -> None:
        seq, many, ts_ns, mono_ns, build, args = item  # many: 0 for emit(), the count for emit_many()
        count = many or 1
        try:
            built = list(build(*args)) if many else [build(*args)]
        except Exception as exc:
            built = []
            self._log_once(f"build:{getattr(build, '__name__', build)}", "could not build events: %r", exc)
        for i in range(count):
            self._handle_one(seq + i, ts_ns, mono_ns, built[i] if i < len(built) else None)
            time.sleep(0)  # let the engine thread have the GIL between events

    def _handle_one(
        self, seq: int, ts_ns: int, mono_ns: int, built: tuple[str, dict[str, Any]] | None
    ) -> None:
        try:
            if built is None:
                raise ValueError("the builder failed or returned fewer events than announced")
            payload_type, payload = built
            event = ev.envelope(
                engine_name=self.engine_name,
                engine_id_=self.engine_id,
                stream=self.stream,
                seq=seq,
                ts_ns=ts_ns,
                mono_ns=mono_ns,
                payload_type=payload_type,
                payload=payload,
            )
            ev.validate_engine_event(event)
            value = self._encoder.encode(event)
        except Exception as exc:
            self._drop("unencodable")
            self._log_once(
                f"encode:{type(exc).__name__}",
                "dropped an event (seq %d) that could not be encoded: %r",
                seq,
                exc,
            )
            return
        self._route(seq, value)

    def _route(self, seq: int, value: bytes) -> None:
        if self._journal is not None and self._journal:
            self._spill(value)  # stay behind what waits on disk
            return
        n = len(value) + MSG_OVERHEAD
        mem = self._inflight_bytes + self._backlog_bytes
        if mem + n <= self._limit:
            if not self._backlog and self._try_produce(value, _NEW):
                return
            self._backlog.append((next(self._order), value, _NEW))
            self._backlog_bytes += n
            return
        self._spill(value)

    def _try_produce(self, value: bytes, origin: int) -> bool:
        p = self._producer
        if p is None:
            return False
        n = len(value) + MSG_OVERHEAD
        order = next(self._order)
        try:
            p.produce(
                self.topic,
                value=value,
                key=self._key,
                on_delivery=functools.partial(self._on_delivery, order, origin, n),
            )
        except BufferError:
            return False
        except Exception as exc:  # KafkaException: fatal state, closed client
            self._log_once("produce", "produce() failed: %s", exc)
            self._fatal = True
            return False
        self._inflight += 1
        self._inflight_bytes += n
        return True

    def _on_delivery(self, order: int, origin: int, n: int, err: Any, msg: Any) -> None:
        self._inflight -= 1
        self._inflight_bytes -= n
        if err is None:
            self.stats.produced += 1
            if origin == _JOURNAL:
                self.stats.drained += 1
            self._last_progress = time.monotonic()
            self._stall_s = self._stall_base
            return
        self._failed.append((order, msg.value(), origin))
        if "PURGE" not in err.name():
            self._log_once(f"delivery:{err.name()}", "delivery failed, will retry: %s", err)

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = True
            log.warning("sparseety producer %s: fatal Kafka client error: %s", self.stream, err)
        else:
            _rdkafka_log.info("kafka client: %s", err)

    def _spill(self, value: bytes) -> None:
        if self._journal is None and not self._open_journal():
            self._drop("journal_error")
            return
        assert self._journal is not None
        try:
            self._journal.append(self._key, value)
        except JournalFullError:
            self._drop("journal_full")
            return
        except OSError as exc:
            self._log_once("journal-write", "cannot write the journal: %s", exc)
            self._drop("journal_error")
            return
        self._journal_left = self._journal.pending_bytes
        if self.stats.spilled == 0:
            log.warning(
                "sparseety producer %s: Kafka is not keeping up or away; spilling to %s",
                self.stream,
                self._journal_dir,
            )
        self.stats.spilled += 1

    def _open_journal(self) -> bool:
        if self._journal_broken:
            return False
        try:
            self._journal = Journal(self._journal_dir, self._journal_max)
        except JournalError as exc:
            self._journal_broken = True
            log.error(
                "sparseety producer %s: %s; events that do not fit in memory are lost", self.stream, exc
            )
            return False
        return True

    def _drop(self, reason: str) -> None:
        self.stats.dropped_by[reason] = self.stats.dropped_by.get(reason, 0) + 1

    def _service(self, *, idle: bool) -> None:
        p = self._producer
        if p is not None:
            p.poll(0.005 if idle else 0)
        elif idle:
            time.sleep(0.005)
        self._requeue_failed()
        now = time.monotonic()
        if self._fatal or (self._inflight and now - max(self._last_progress, self._born) > self._stall_s):
            self._restart_producer()
        self._pump()
        if self._journal is not None:
            self._journal.flush()
            self._journal_left = self._journal.pending_bytes
        if now >= self._next_hb and not self._stopping.is_set():
            self._next_hb = now + self._hb_interval
            self.emit(self._build_heartbeat)
        if now >= self._next_metrics:
            self._next_metrics = now + 1.0
            self._sync_metrics()

    def _requeue_failed(self) -> None:
        if not self._failed:
            return
        failed = sorted(self._failed)
        self._failed.clear()
        self._backlog.extendleft(reversed(failed))
        self._backlog_bytes += sum(len(v) + MSG_OVERHEAD for _, v, _ in failed)

    def _pump(self, budget: int = 20_000) -> None:
        backlog = self._backlog
        while backlog and budget:
            _, value, origin = backlog[0]
            n = len(value) + MSG_OVERHEAD
            if self._inflight_bytes + n > self._limit or not self._try_produce(value, origin):
                return
            backlog.popleft()
            self._backlog_bytes -= n
            budget -= 1
        j = self._journal
        if j is None or not j:
            return
        while budget:
            rec = j.peek()
            if rec is None:
                j.compact()
                return
            value = rec[1]
            if self._inflight_bytes + len(value) + MSG_OVERHEAD > self._limit:
                return
            if not self._try_produce(value, _JOURNAL):
                return
            j.pop()
            budget -= 1

    def _restart_producer(self) -> None:
        old = self._producer
        why = "fatal error" if self._fatal else f"no delivery progress for {self._stall_s:.0f} s"
        self._fatal = False
        self.stats.restarts += 1
        self._stall_s = min(self._stall_s * 2, 30.0)
        (log.warning if self.stats.restarts <= 3 else log.debug)(
            "sparseety producer %s: recreating the Kafka client (%s, %d messages unacknowledged)",
            self.stream,
            why,
            self._inflight,
        )
        if old is not None:
            self._producer = None
            with contextlib.suppress(Exception):
                old.purge()
            deadline = time.monotonic() + 5.0
            with contextlib.suppress(Exception):
                while len(old) > 0 and time.monotonic() < deadline:
                    old.poll(0.05)
            if self._inflight:
                log.error(
                    "sparseety producer %s: %d purged messages never came back; counted as dropped",
                    self.stream,
                    self._inflight,
                )
                for _ in range(self._inflight):
                    self._drop("purge_lost")
                self._inflight = 0
                self._inflight_bytes = 0
            self._requeue_failed()
        self._new_producer()

    def _final_flush(self) -> None:
        start = time.monotonic()
        deadline = start + self._flush_timeout
        progress_mark = (self.stats.produced, start)
        while time.monotonic() < deadline and (
            self._inflight or self._backlog or (self._journal is not None and self._journal)
        ):
            self._service(idle=True)
            now = time.monotonic()
            if self.stats.produced != progress_mark[0]:
                progress_mark = (self.stats.produced, now)
            elif now - progress_mark[1] > 2.0:
                break  # Kafka makes no progress: journal the rest now, before a SIGKILL comes
        p = self._producer
        if p is not None and self._inflight:
            with contextlib.suppress(Exception):
                p.purge()
            end = time.monotonic() + 3.0
            with contextlib.suppress(Exception):
                while len(p) > 0 and time.monotonic() < end:
                    p.poll(0.05)
        self._requeue_failed()
        if self._backlog:
            left = [(self._key, v) for _, v, _ in self._backlog]
            if self._journal is None:
                self._open_journal()
            written = self._journal.prepend(left) if self._journal is not None else 0
            self.stats.spilled += written
            for _ in range(len(left) - written):
                self._drop("journal_full")
            self._backlog.clear()
            self._backlog_bytes = 0
        if p is not None:
            with contextlib.suppress(Exception):
                p.flush(0)

    def _build_heartbeat(self) -> tuple[str, dict[str, Any]]:
        return ev.HEARTBEAT, {
            "queued": self._queued,
            "produced": self.stats.produced,
            "dropped": self.stats.dropped + self._queue_full,
            "spilled": self.stats.spilled,
            "drained": self.stats.drained,
        }

    # --- reporting ---------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """produced / dropped / spilled / drained / queued / restarts totals."""
        return {
            "produced": self.stats.produced,
            "dropped": self.stats.dropped + self._queue_full,
            "spilled": self.stats.spilled,
            "drained": self.stats.drained,
            "queued": self._queued,
            "restarts": self.stats.restarts,
        }

    def _sync_metrics(self) -> None:
        labels = (self.engine_name, self.stream)
        now = {
            "produced": self.stats.produced,
            "spilled": self.stats.spilled,
            "drained": self.stats.drained,
            "dropped": self.stats.dropped + self._queue_full,
        }
        for outcome, value in now.items():
            delta = value - self._exported.get(outcome, 0)
            if delta > 0:
                metrics.EVENTS.labels(*labels, outcome).inc(delta)
        reasons = dict(self.stats.dropped_by, queue_full=self._queue_full)
        for reason, value in reasons.items():
            delta = value - self._exported.get("r:" + reason, 0)
            if delta > 0:
                metrics.DROPPED.labels(*labels, reason).inc(delta)
            self._exported["r:" + reason] = value
        delta = self.stats.restarts - self._exported.get("restarts", 0)
        if delta > 0:
            metrics.RESTARTS.labels(*labels).inc(delta)
        self._exported.update(now, restarts=self.stats.restarts)
        metrics.QUEUE.labels(*labels).set(self._queued)
        metrics.MEMORY.labels(*labels).set(self._inflight_bytes + self._backlog_bytes)
        metrics.JOURNAL.labels(*labels).set(self._journal.pending_bytes if self._journal is not None else 0)

    def _log_totals(self) -> None:
        c = self.counters()
        left = self._journal.pending_bytes if self._journal is not None else 0
        log.info(
            "sparseety producer %s/%s stopped: produced=%d dropped=%d spilled=%d drained=%d "
            "restarts=%d journal_bytes_left=%d%s",
            self.engine_id,
            self.stream,
            c["produced"],
            c["dropped"],
            c["spilled"],
            c["drained"],
            c["restarts"],
            left,
            f" (dropped by reason: {dict(self.stats.dropped_by, queue_full=self._queue_full)})"
            if c["dropped"]
            else "",
        )

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key in self._logged_errors:
            return
        self._logged_errors.add(key)
        log.warning("sparseety producer %s: " + msg, self.stream, *args)


def _confluent_producer(conf: dict[str, Any]) -> Any:
    from confluent_kafka import Producer

    return Producer(conf)


def journal_dir(cfg: Config, engine_name: str, stream: str) -> Path:
    """Where an emitter of ``engine_name``/``stream`` spills."""
    return cfg.spill_path / _safe(engine_name) / _safe(stream)


__all__ = ["Emitter", "EmitterStats", "SparseetyError", "journal_dir", "new_epoch", "record"]
