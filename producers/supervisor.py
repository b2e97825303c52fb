"""The emitter's background thread: takes items from the hand-off, builds and encodes them,
routes them through the ledger, recreates a stalled Kafka link, emits heartbeats, exports
metrics (:mod:`.reporting`) and journals at shutdown (the design: :mod:`.emitter`'s docstring)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import ProducerConfig
from sparseety.lifecycle import name_os_thread
from sparseety.serde import Encoder

from .delivery import DeliveryWatch
from .handoff import Handoff, Item, Source
from .kafka_client import KafkaLink, WarnOnce
from .ledger import Ledger
from .reporting import Reporter, counters

log = logging.getLogger("sparseety.producer")


@dataclass(frozen=True)
class StreamSettings:
    """What the background thread knows of its stream from the start.

    Args:
        stream: ``core`` or ``worker-<rank>`` (thread name, log lines, metric labels).
        producer: The ``producer`` config section (flush timeout, heartbeat interval).
        stall_s: A link with unacknowledged messages and no progress for this long is
            recreated (doubling while Kafka stays away, up to 30 s).
    """

    stream: str
    producer: ProducerConfig
    stall_s: float = 10.0


@dataclass(frozen=True)
class StreamIdentity:
    """Who the stream belongs to, known once the engine is named (:meth:`Supervisor.bind`)."""

    engine_name: str
    engine_id: str


class Supervisor:
    """Runs one stream's background thread (see the module docstring).

    Args:
        settings: The stream's settings.
        handoff: Where the items wait: the engine's hand-off, or a relay's inbox.
        ledger: Admits, spills and drains encoded events; produces through ``link``.
        link: The stream's Kafka client (made and recreated here; the ledger produces on it).
        new_encoder: Makes the Avro encoder (retried every 5 s while the registry is away).
        warn_once: Logs each kind of problem once (shared with the ledger and the link).
        heartbeats: Where this thread hands its heartbeats (they take a seq); None in a relay,
            whose heartbeats the engine side numbers and the relay fills in.
        exported: Metric totals an earlier relay of the stream exported (:class:`Reporter`).
        announce: Hands the stream's announcement (EngineStarted) over again: called every
            ``producer.announce_interval_s`` and when Kafka takes events again after the link
            was down or stalled (:attr:`recoveries` counts those moments). None in a relay,
            whose engine side announces.
    """

    def __init__(
        self,
        settings: StreamSettings,
        *,
        handoff: Source,
        ledger: Ledger,
        link: KafkaLink,
        new_encoder: Callable[[], Encoder],
        warn_once: WarnOnce,
        heartbeats: Handoff | None = None,
        exported: dict[str, int] | None = None,
        announce: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.handoff = handoff
        self._heartbeats = heartbeats
        self._announce = announce
        self._next_announce = time.monotonic() + settings.producer.announce_interval_s
        self.recoveries = 0
        self._troubled = False  # the link was down or recreated since the last acknowledgement
        self.ledger = ledger
        self.link = link
        self.identity = StreamIdentity("", "")
        self.flush_timeout = settings.producer.flush_timeout_s
        self._hb_interval = settings.producer.heartbeat_interval_s
        self._new_encoder = new_encoder
        self._stall_s = settings.stall_s
        self._warn_once = warn_once
        self.handling = False
        # An event follows another without an idle wait between them: yield the GIL first.
        self._yield_before_next = False
        self._encoder: Encoder | None = None
        self._last_progress = time.monotonic()
        self._produced_seen = 0  # ledger.stats.produced at the last check: progress when it grows
        self._next_hb = time.monotonic() + self._hb_interval
        self._next_metrics = 0.0
        self._report = Reporter(handoff, ledger, settings.stream, exported)
        self._watch = DeliveryWatch(settings.stream, str(link.settings.get("bootstrap.servers", "")))
        self._acked = False  # acknowledged since the last delivery check
        self.bound = threading.Event()
        self.stopping = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"sparseety-emitter-{settings.stream}", daemon=True
        )

    def bind(self, identity: StreamIdentity, journal_dir: Path) -> None:
        """Name the stream: its Kafka key and journal folder; the thread may go on from here."""
        self.identity = identity
        self.link.key = identity.engine_name.encode()
        self.ledger.bind(journal_dir)
        self.bound.set()

    def stop(self, timeout: float | None) -> None:
        """Let the thread deliver or journal what is left (Kafka gets ``timeout``, default
        ``producer.flush_timeout_s``) and wait for it to end."""
        if timeout is not None:
            self.flush_timeout = timeout
        self.stopping.set()
        self.thread.join(self.flush_timeout + 10.0)

    def _run(self) -> None:
        name_os_thread(self.thread.name)  # sparseety-emitter-<stream>, as top -H shows it
        handoff = self.handoff
        try:
            self._setup()
            while True:
                self.handling = True
                batch = handoff.take(1024)
                self._handle_batch(batch)
                self.handling = False
                self._service(idle=not batch)
                if self.stopping.is_set() and not handoff:
                    break
            self._final_flush()
        except Exception:  # the thread must never die silently; events would pile up
            log.exception(
                "sparseety producer %s/%s: background thread failed",
                self.identity.engine_id,
                self.settings.stream,
            )
        finally:
            self._report.sync_metrics(self.identity.engine_name)
            self._report.log_totals(self.identity.engine_id)
            with contextlib.suppress(Exception):
                self.ledger.close_journal()
            self._watch.close(self.ledger.journal_dir if self.bound.is_set() else None)
            self.done.set()

    def _setup(self) -> None:
        while self._encoder is None:
            try:
                self._encoder = self._new_encoder()
            except Exception as exc:  # registry unreachable: events wait in the queue meanwhile
                self._warn_once("encoder", "cannot create the Avro encoder (retrying every 5 s): %s", exc)
                if self.stopping.wait(5.0):
                    return
        self.link.connect()
        # The Kafka client connects meanwhile; the journal and the key need the stream's name.
        while not self.bound.wait(0.05):
            if self.stopping.is_set():
                return
            self.link.poll(0)
        ledger = self.ledger
        leftovers = ledger.journal_dir.is_dir() and any(ledger.journal_dir.glob("*.seg"))
        if leftovers and ledger.open_journal() and ledger.journal:
            log.info(
                "sparseety producer %s: %d bytes left in journal %s from an earlier run; draining first",
                self.settings.stream,
                ledger.journal_bytes,
                ledger.journal_dir,
            )

    def _handle_batch(self, batch: list[Item]) -> None:
        """Build, encode and route every event of the hand-offs taken in one go."""
        for item in batch:
            self._handle(item)

    def _handle(self, item: Item) -> None:
        seq, many, ts_ns, mono_ns, build, args = item  # many: 0 for emit(), the count for emit_many()
        count = many or 1
        try:
            built = list(build(*args)) if many else [build(*args)]
        except Exception as exc:
            built = []
            self._warn_once(f"build:{getattr(build, '__name__', build)}", "could not build events: %r", exc)
        for i in range(count):
            if self._yield_before_next:
                _yield_gil()
            self._handle_one(seq + i, ts_ns, mono_ns, built[i] if i < len(built) else None)
            self._yield_before_next = True

    def _handle_one(
        self, seq: int, ts_ns: int, mono_ns: int, built: tuple[str, dict[str, Any]] | None
    ) -> None:
        identity = self.identity
        try:
            if built is None:
                raise ValueError("the builder failed or returned fewer events than announced")
            payload_type, payload = built
            event = ev.envelope(
                engine_name=identity.engine_name,
                engine_id_=identity.engine_id,
                stream=self.settings.stream,
                seq=seq,
                ts_ns=ts_ns,
                mono_ns=mono_ns,
                payload_type=payload_type,
                payload=payload,
            )
            ev.validate_engine_event(event)
            assert self._encoder is not None  # made in _setup, before the first item
            value = self._encoder.encode(event)
        except Exception as exc:
            self.ledger.drop("unencodable")
            self._warn_once(
                f"encode:{type(exc).__name__}",
                "dropped an event (seq %d) that could not be encoded: %r",
                seq,
                exc,
            )
            return
        self.ledger.route(value)

    def _service(self, *, idle: bool) -> None:
        link, ledger = self.link, self.ledger
        link.poll(0.005 if idle else 0)
        if idle:
            self._yield_before_next = False  # the wait left the GIL to the engine thread
        ledger.requeue_failed()
        now = time.monotonic()
        if ledger.stats.produced != self._produced_seen:  # acknowledged since the last check
            self._produced_seen = ledger.stats.produced
            self._last_progress = now
            self._stall_s = self.settings.stall_s
            self._acked = True
            if self._troubled or link.brokers_down:
                # Kafka is back: a broker that lost its log lost the epoch's EngineStarted too
                self._troubled = False
                self.recoveries += 1
                self._next_announce = now  # below
            link.brokers_down = False
        if link.fatal or (ledger.inflight and now - max(self._last_progress, link.born) > self._stall_s):
            self._restart_link()
        ledger.pump()
        ledger.flush_journal()
        if self._announce is not None and now >= self._next_announce and not self.stopping.is_set():
            self._next_announce = now + self.settings.producer.announce_interval_s
            self._announce()
        if self._heartbeats is not None and now >= self._next_hb and not self.stopping.is_set():
            self._next_hb = now + self._hb_interval
            self._heartbeats.emit(self.build_heartbeat)
        if now >= self._next_metrics:
            self._next_metrics = now + 1.0
            self._report.sync_metrics(self.identity.engine_name)
            self._watch.update(
                engine=self.identity.engine_name,
                journal_dir=ledger.journal_dir if self.bound.is_set() else None,
                waiting=ledger.inflight + len(ledger.backlog),
                last_progress=max(self._last_progress, link.born),
                acked=self._acked,
                error=link.last_error,
                brokers_down=link.brokers_down,
            )
            self._acked = False

    def _restart_link(self) -> None:
        link, ledger = self.link, self.ledger
        why = "fatal error" if link.fatal else f"no delivery progress for {self._stall_s:.0f} s"
        ledger.stats.restarts += 1
        self._troubled = True
        self._stall_s = min(self._stall_s * 2, 30.0)
        (log.warning if ledger.stats.restarts <= 3 else log.debug)(
            "sparseety producer %s: recreating the Kafka client (%s, %d messages unacknowledged)",
            self.settings.stream,
            why,
            ledger.inflight,
        )
        had_client = link.connected
        link.discard(5.0)  # its messages come back as failed deliveries: first in line again
        if had_client:
            if ledger.inflight:
                ledger.forget_inflight()
            ledger.requeue_failed()
        link.connect()

    def _final_flush(self) -> None:
        ledger = self.ledger
        start = time.monotonic()
        deadline = start + self.flush_timeout
        progress_mark = (ledger.stats.produced, start)
        while time.monotonic() < deadline and ledger.pending:
            self._service(idle=True)
            now = time.monotonic()
            if ledger.stats.produced != progress_mark[0]:
                progress_mark = (ledger.stats.produced, now)
            elif now - progress_mark[1] > 2.0:
                break  # Kafka makes no progress: journal the rest now, before a SIGKILL comes
        if ledger.inflight:
            self.link.purge(3.0)
        ledger.requeue_failed()
        ledger.spill_backlog()
        self.link.flush(0)

    def build_heartbeat(self) -> tuple[str, dict[str, Any]]:
        """A Heartbeat of this thread's totals (built when its turn comes)."""
        totals = counters(self.ledger.stats, self.handoff)
        names = ("queued", "produced", "dropped", "spilled", "drained")
        return ev.HEARTBEAT, {name: totals[name] for name in names}


def _yield_gil() -> None:
    """Release the GIL for a moment so an engine thread waiting for it takes it now, not after
    the 5 ms switch interval.

    ``time.sleep(0)``: on Linux it arms a timer and sleeps out the thread's 50 µs timer slack,
    long enough for the waiting thread to wake and take the GIL, at ~20 µs of CPU a call; so it
    runs only between events handled back to back, not after an event the thread then idles
    on. ``os.sched_yield()`` (~1 µs) returns before the waiter wakes and takes the GIL back: on a
    quiet machine the engine thread waited out the switch interval at p90.
    """
    time.sleep(0)
