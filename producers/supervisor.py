"""The emitter's background thread: takes items from the hand-off, builds and encodes them,
produces them through the ledger, restarts a stalled Kafka client, emits heartbeats, exports
metrics (:mod:`.reporting`) and journals at shutdown (the design: :mod:`.emitter`'s docstring)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety import events as ev
from sparseety.lifecycle import name_os_thread

from .handoff import Item
from .kafka_client import producer_settings, rdkafka_log
from .ledger import Ledger, OnDelivery, WarnOnce
from .reporting import Reporter

if TYPE_CHECKING:
    from .emitter import Emitter

log = logging.getLogger("sparseety.producer")


class Supervisor:
    """Runs one emitter's background thread (see the module docstring)."""

    def __init__(
        self,
        owner: Emitter,
        *,
        producer_factory: Callable[[dict[str, Any]], Any],
        stall_s: float,
        unbound_journal_dir: Path,
    ) -> None:
        pc = owner.cfg.producer
        self.owner = owner
        self.flush_timeout = pc.flush_timeout_s
        self._hb_interval = pc.heartbeat_interval_s
        self._factory = producer_factory
        self._stall_base = self._stall_s = stall_s
        self._warn_once = WarnOnce(owner.stream)
        self.ledger = Ledger(
            self._produce,
            limit_bytes=pc.memory_limit_bytes,
            journal_dir=unbound_journal_dir,
            journal_max_bytes=pc.spill_max_bytes,
            stream=owner.stream,
            on_progress=self._on_progress,
            warn_once=self._warn_once,
            bootstrap=owner.cfg.kafka.bootstrap,
        )
        self.handling = False
        # An event follows another without an idle wait between them: yield the GIL first.
        self._yield_before_next = False
        self._producer: Any = None
        self._encoder: Any = None
        self._fatal = False
        self._born = self._last_progress = time.monotonic()
        self._next_hb = time.monotonic() + self._hb_interval
        self._next_metrics = 0.0
        self._report = Reporter(owner, self.ledger)
        self.stopping = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"sparseety-emitter-{owner.stream}", daemon=True
        )

    def _run(self) -> None:
        owner = self.owner
        name_os_thread(self.thread.name)  # sparseety-emitter-<stream>, as top -H shows it
        try:
            self._setup()
            while True:
                self.handling = True
                batch = owner.handoff.take(1024)
                self._handle_batch(batch)
                self.handling = False
                self._service(idle=not batch)
                if self.stopping.is_set() and not owner.handoff:
                    break
            self._final_flush()
        except Exception:  # the thread must never die silently; events would pile up
            log.exception("sparseety producer %s/%s: background thread failed", owner.engine_id, owner.stream)
        finally:
            self._report.sync_metrics()
            self._report.log_totals()
            with contextlib.suppress(Exception):
                self.ledger.close_journal()
            self.done.set()

    def _setup(self) -> None:
        from sparseety.kafka import make_encoder

        owner = self.owner
        while self._encoder is None:
            try:
                self._encoder = make_encoder(owner.cfg, "EngineEvent", owner.topic)
            except Exception as exc:  # registry unreachable: events wait in the queue meanwhile
                self._warn_once("encoder", "cannot create the Avro encoder (retrying every 5 s): %s", exc)
                if self.stopping.wait(5.0):
                    return
        self._new_producer()
        # The Kafka client connects meanwhile; the journal and the key need the stream's name.
        while not owner.bound_event.wait(0.05):
            if self.stopping.is_set():
                return
            if self._producer is not None:
                self._producer.poll(0)
        ledger = self.ledger
        leftovers = ledger.journal_dir.is_dir() and any(ledger.journal_dir.glob("*.seg"))
        if leftovers and ledger.open_journal() and ledger.journal:
            log.info(
                "sparseety producer %s: %d bytes left in journal %s from an earlier run; draining first",
                owner.stream,
                ledger.journal_bytes,
                ledger.journal_dir,
            )

    def _new_producer(self) -> None:
        conf = producer_settings(
            self.owner.cfg,
            memory_limit_bytes=self.ledger.limit_bytes,
            stream=self.owner.stream,
            error_cb=self._on_error,
        )
        try:
            self._producer = self._factory(conf)
        except Exception as exc:
            self._producer = None
            self._warn_once("producer", "cannot create the Kafka producer: %s", exc)
        self._born = time.monotonic()

    def _produce(self, value: bytes, on_delivery: OnDelivery) -> bool:
        """The ledger's produce call: False when there is no client or it cannot take more."""
        producer = self._producer
        if producer is None:
            return False
        try:
            producer.produce(self.owner.topic, value=value, key=self.ledger.key, on_delivery=on_delivery)
        except BufferError:
            return False
        except Exception as exc:  # KafkaException: fatal state, closed client
            self._warn_once("produce", "produce() failed: %s", exc)
            self._fatal = True
            return False
        return True

    def _on_progress(self) -> None:
        self._last_progress = time.monotonic()
        self._stall_s = self._stall_base

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = True
            log.warning("sparseety producer %s: fatal Kafka client error: %s", self.owner.stream, err)
        else:
            rdkafka_log.info("kafka client: %s", err)

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
        owner = self.owner
        try:
            if built is None:
                raise ValueError("the builder failed or returned fewer events than announced")
            payload_type, payload = built
            event = ev.envelope(
                engine_name=owner.engine_name,
                engine_id_=owner.engine_id,
                stream=owner.stream,
                seq=seq,
                ts_ns=ts_ns,
                mono_ns=mono_ns,
                payload_type=payload_type,
                payload=payload,
            )
            ev.validate_engine_event(event)
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
        producer = self._producer
        if producer is not None:
            producer.poll(0.005 if idle else 0)
        elif idle:
            time.sleep(0.005)
        if idle:
            self._yield_before_next = False  # the wait left the GIL to the engine thread
        ledger = self.ledger
        ledger.requeue_failed()
        now = time.monotonic()
        if self._fatal or (ledger.inflight and now - max(self._last_progress, self._born) > self._stall_s):
            self._restart_producer()
        ledger.pump()
        ledger.flush_journal()
        if now >= self._next_hb and not self.stopping.is_set():
            self._next_hb = now + self._hb_interval
            self.owner.emit(self._build_heartbeat)
        if now >= self._next_metrics:
            self._next_metrics = now + 1.0
            self._report.sync_metrics()

    def _restart_producer(self) -> None:
        old = self._producer
        ledger = self.ledger
        why = "fatal error" if self._fatal else f"no delivery progress for {self._stall_s:.0f} s"
        self._fatal = False
        ledger.stats.restarts += 1
        self._stall_s = min(self._stall_s * 2, 30.0)
        (log.warning if ledger.stats.restarts <= 3 else log.debug)(
            "sparseety producer %s: recreating the Kafka client (%s, %d messages unacknowledged)",
            self.owner.stream,
            why,
            ledger.inflight,
        )
        if old is not None:
            self._producer = None
            _purge(old, 5.0)
            if ledger.inflight:
                ledger.forget_inflight()
            ledger.requeue_failed()
        self._new_producer()

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
        producer = self._producer
        if producer is not None and ledger.inflight:
            _purge(producer, 3.0)
        ledger.requeue_failed()
        ledger.spill_backlog()
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.flush(0)

    def _build_heartbeat(self) -> tuple[str, dict[str, Any]]:
        counters = self.owner.counters()
        return ev.HEARTBEAT, {
            name: counters[name] for name in ("queued", "produced", "dropped", "spilled", "drained")
        }


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


def _purge(producer: Any, wait_s: float) -> None:
    """Purge a client and poll until its messages came back as failed (or ``wait_s`` passed)."""
    with contextlib.suppress(Exception):
        producer.purge()
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        while len(producer) > 0 and time.monotonic() < deadline:
            producer.poll(0.05)
