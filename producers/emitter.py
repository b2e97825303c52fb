"""The engine-side publisher every producer shares: a cheap hand-off on the hot path, and the
parts that build, encode and produce the events.

This module's docstring is the design; the parts' docstrings point here. :class:`Emitter` is
the composition root: it makes the parts, hands each what it needs and nothing more, and is
the only one the engine-side producers (vLLM, SGLang, the proxy) talk to. By default
(``producer.relay = "process"``) the encoding and producing run in a relay process, so that
their Python never competes with the engine's for the GIL::

    engine process:   engine thread --emit()--> Handoff --take()--> Shipper (builds payloads)
                                                                       | wire frames (pipe / socket)
    relay process:    Inbox --take()--> Supervisor --route()--> Ledger --produce()--> KafkaLink
                                           |                      |
                                           +-- Reporter           +-- Journal (disk)

``producer.relay = "unix:<path>"`` sends the frames to a sidecar (``sparseety relay``) instead
of a child; ``"thread"`` runs the Supervisor on the engine's hand-off in this process (the
design before the relay; tests with a fake Kafka client use it).

* :mod:`.shipper` (engine side, its own thread, sleeping on the hand-off's ``ready`` event):
  ``builder(*args)`` turns the references into payloads, and a columnar :class:`~.wire.Batch`
  of them goes to the relay. A dead relay is restarted (:mod:`.shipper` says what is lost).
* :mod:`.relay` (the relay): its :class:`~.relay.Inbox` feeds the same Supervisor that the
  thread mode runs; a full inbox stops the reading, which fills the pipe and then the engine's
  bounded hand-off, which refuses and counts. The engine never waits.
* :mod:`.handoff` (hot path, :meth:`Emitter.emit`): take the next ``seq``, read the wall and
  monotonic clocks, and append one :data:`~.handoff.Item` ``(first seq, count, ts_ns, mono_ns,
  builder, args)`` to a bounded deque (``count`` is 0 for ``emit``, or how many seqs one
  ``emit_many`` took). Nothing is built, encoded or sent there, nothing blocks (the lock only
  orders seq assignment with the append), nothing raises. When the deque is full, or the
  hand-off is not open yet or closed again, the event is dropped: its seq is skipped, a gap the
  assembler detects, and it is counted.
* :mod:`.supervisor` (the background thread; gets its source of items, the ledger, the link, a
  frozen :class:`~.supervisor.StreamSettings` and, once the engine is named, a
  :class:`~.supervisor.StreamIdentity`): ``builder(*args)`` makes the payload (in the relay the
  payload came built), the envelope and the Avro encoding follow, and the encoded value goes to
  the ledger.
  It polls the link, recreates a link that makes no progress for a while (a broker that lost
  its producer state, a fatal idempotence error), exports metrics (:mod:`.reporting`) and, in
  thread mode, emits heartbeats (with a relay the shipper numbers them and the relay fills in
  their counters).
* :mod:`.ledger` (what is owed to Kafka): librdkafka keeps messages (never timing out) while
  their bytes stay under ``producer.memory_limit_bytes``; beyond that, events are appended to a
  disk journal (:mod:`.journal`, ``producer.spill_dir``/engine/stream, bounded by
  ``spill_max_bytes``). While the journal holds anything, new events go behind it, and it
  drains in order as Kafka acknowledges again, so the partition sees each stream's seqs in
  order. Failed deliveries, and the unacknowledged messages of a purged link, go back to the
  head of the line. At shutdown whatever Kafka did not take within ``flush_timeout_s`` is
  written to the journal, which the next start drains first.
* :mod:`.kafka_client` (:class:`~.kafka_client.KafkaLink`): the confluent-kafka producer
  (idempotent, compressed, batched; key = engine name, so one engine's streams share a
  partition), its (re)creation, ``produce(value, on_delivery)``, ``poll``, ``flush`` and its
  fatal errors. The supervisor owns its life; the ledger only produces on it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import SparseetyError

from .handoff import Builder, Handoff
from .journal import journal_dir
from .kafka_client import KafkaLink, ProducerFactory, WarnOnce, confluent_producer, producer_settings
from .ledger import EmitterStats, Ledger
from .reporting import counters
from .shipper import Shipper, relay_factory
from .supervisor import StreamIdentity, StreamSettings, Supervisor

log = logging.getLogger(__name__)


def record(payload_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Identity builder: the payload is already a record."""
    return payload_type, payload


def new_epoch() -> str:
    """A fresh engine epoch: milliseconds since the Unix epoch (sortable) + a random suffix."""
    return f"{time.time_ns() // 1_000_000:x}-{os.urandom(3).hex()}"


class Emitter:
    """Publishes one event stream (engine epoch + stream name) to the engine-events topic.

    Args:
        cfg: The configuration (kafka, topics, schema registry, producer sections).
            ``producer.relay`` says where the events are encoded and produced: ``process`` (a
            relay child process, the default), ``unix:<path>`` (a sidecar relay) or ``thread``
            (a background thread of this process; see the module docstring).
        engine_name: Stable engine name: the Kafka key. None: not known yet; :meth:`bind`
            names the stream before the first event.
        epoch: This engine start's epoch (``engine_id = engine_name@epoch``).
        stream: ``core`` for the engine-core process, ``worker-<rank>`` for model runners.
        producer_factory: Builds the Kafka client from librdkafka settings (tests pass fakes;
            implies ``thread``).
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
        producer_factory: ProducerFactory | None = None,
        stall_s: float = 10.0,
    ) -> None:
        self.cfg = cfg
        self.engine_name = ""
        self.epoch = ""
        self.engine_id = ""
        self.stream = stream
        self.topic = cfg.topics.engine_events
        pc = cfg.producer
        self.handoff = Handoff(pc.queue_max_events)
        self.mode = "thread" if producer_factory is not None else pc.relay
        self._supervisor: Supervisor | None = None
        self._shipper: Shipper | None = None
        self._announcement: tuple[str, dict[str, Any]] | None = None
        if self.mode == "thread":
            self._supervisor = _in_process(
                cfg, self.handoff, stream, producer_factory, stall_s, self._announce_again
            )
        else:
            self._shipper = Shipper(
                self.handoff,
                stream=stream,
                connect=relay_factory(self.mode, stream),
                config=cfg.model_dump(),
                heartbeat_s=pc.heartbeat_interval_s,
                announce_s=pc.announce_interval_s,
                flush_timeout_s=pc.flush_timeout_s,
            )
        if engine_name is not None and epoch is not None:
            self.bind(engine_name, epoch)
        (self._supervisor or self._shipper).thread.start()  # type: ignore[union-attr]

    def bind(self, engine_name: str, epoch: str) -> None:
        """Name the stream (once, before the first event)."""
        if self.bound:
            raise SparseetyError(f"emitter already bound to {self.engine_id}", stream=self.stream)
        self.engine_name = engine_name
        self.epoch = epoch
        self.engine_id = ev.engine_id(engine_name, epoch)
        journal = journal_dir(self.cfg.spill_path, engine_name, self.stream)
        if self._shipper is not None:
            self._shipper.bind(engine_name, self.engine_id)
            how = f"through a relay ({'a child process' if self.mode == 'process' else self.mode})"
        else:
            assert self._supervisor is not None
            self._supervisor.bind(StreamIdentity(engine_name, self.engine_id), journal)
            how = "from a thread of this process"
        # where events wait if Kafka is away: under the stack's data dir when SPARSEETY_DATA_DIR
        # names it, so that `sparseety status` finds an engine that cannot deliver (a sidecar
        # relay spills where its own configuration says)
        log.info(
            "sparseety producer %s: events go %s to Kafka %s; spill journal %s (producer.spill_dir, "
            "default <data_dir>/spill: set SPARSEETY_DATA_DIR to the stack's data dir)",
            self.engine_id,
            how,
            self.cfg.kafka.bootstrap,
            journal,
        )
        self.handoff.open()

    @property
    def bound(self) -> bool:
        if self._shipper is not None:
            return self._shipper.bound.is_set()
        assert self._supervisor is not None
        return self._supervisor.bound.is_set()

    @property
    def stats(self) -> EmitterStats:
        """Delivery totals (in relay mode: the relay's last report, and the engine side's losses
        at the hand-off and to dead relays; in thread mode drops at the hand-off are only in
        :meth:`counters`)."""
        if self._shipper is not None:
            return self._shipper.stats
        assert self._supervisor is not None
        return self._supervisor.ledger.stats

    # --- hot path ----------------------------------------------------------------------------

    def emit(self, build: Builder, *args: Any) -> None:
        """Hand one event to the background thread; ``build(*args)`` makes its payload there.

        Never raises and never blocks on I/O. The seq is taken even when the event is dropped
        (queue full, emitter closed), so the loss shows as a gap.
        """
        self.handoff.emit(build, *args)

    def emit_many(self, count: int, build: Builder, *args: Any) -> None:
        """Hand ``count`` events of one moment over at once (e.g. a step's admissions):
        ``build(*args)`` returns their ``count`` payloads. One lock and one append per batch
        instead of per event; seqs are consecutive, and a dropped batch leaves ``count`` gaps."""
        self.handoff.emit_many(count, build, *args)

    def emit_record(self, payload_type: str, payload: dict[str, Any]) -> None:
        """Hand one ready payload record to the background thread."""
        self.emit(record, payload_type, payload)

    def announce(self, payload_type: str, payload: dict[str, Any]) -> None:
        """Hand the stream's announcement (EngineStarted) over now, and again every
        ``producer.announce_interval_s``, after Kafka recovers from an outage and after a relay
        restart: a fresh worker, or a broker that lost its log, gets the configuration back
        (the fold keeps the first it saw; docs/streams.md)."""
        self._announcement = (payload_type, payload)
        if self._shipper is not None:
            self._shipper.announcement = self._announcement
        self.emit(record, payload_type, payload)

    def _announce_again(self) -> None:
        if self._announcement is not None:
            self.emit(record, *self._announcement)

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Events waiting in the hand-off queue."""
        return self.handoff.queued

    def idle(self) -> bool:
        """Whether everything emitted so far was acknowledged by Kafka."""
        if self._shipper is not None:
            return self._shipper.idle
        sup = self._supervisor
        assert sup is not None
        return not self.handoff and not sup.handling and sup.ledger.idle

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
        self.handoff.close()
        (self._shipper or self._supervisor).stop(timeout)  # type: ignore[union-attr]
        return self.stats

    # --- reporting ---------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """produced / dropped / spilled / drained / queued / restarts totals."""
        if self._shipper is not None:
            s = self._shipper.stats  # the engine side's drops are in it already
            return dict(counters(s, Handoff(1)), queued=self.handoff.queued)
        return counters(self.stats, self.handoff)


def _in_process(
    cfg: Config,
    handoff: Handoff,
    stream: str,
    producer_factory: ProducerFactory | None,
    stall_s: float,
    announce: Callable[[], None],
) -> Supervisor:
    """The ``thread`` mode's parts: link, ledger and the supervisor thread in this process."""
    from sparseety.kafka import make_encoder

    pc = cfg.producer
    topic = cfg.topics.engine_events
    warn_once = WarnOnce(stream)
    link = KafkaLink(
        producer_settings(cfg, memory_limit_bytes=pc.memory_limit_bytes, stream=stream),
        topic=topic,
        factory=producer_factory or confluent_producer,
        warn_once=warn_once,
    )
    ledger = Ledger(
        link,
        limit_bytes=pc.memory_limit_bytes,
        journal_dir=journal_dir(cfg.spill_path, "_unbound", stream),
        journal_max_bytes=pc.spill_max_bytes,
        stream=stream,
        warn_once=warn_once,
        bootstrap=cfg.kafka.bootstrap,
    )
    return Supervisor(
        StreamSettings(stream=stream, producer=pc, stall_s=stall_s),
        handoff=handoff,
        ledger=ledger,
        link=link,
        new_encoder=functools.partial(make_encoder, cfg, "EngineEvent", topic),
        warn_once=warn_once,
        heartbeats=handoff,
        announce=announce,
    )


__all__ = ["Emitter", "EmitterStats", "SparseetyError", "new_epoch", "record"]
