"""The engine-side publisher every producer shares: a cheap hand-off on the hot path, and a
background thread that builds, encodes and produces the events.

This module's docstring is the design; the parts' docstrings point here. :class:`Emitter` is
the composition root: it makes the parts, hands each what it needs and nothing more, and is
the only one the engine-side producers (vLLM, SGLang, the proxy) talk to::

    engine thread --emit()--> Handoff --take()--> Supervisor --route()--> Ledger --produce()--> KafkaLink
                                                      |                     |
                                                      +-- Reporter          +-- Journal (disk)

* :mod:`.handoff` (hot path, :meth:`Emitter.emit`): take the next ``seq``, read the wall and
  monotonic clocks, and append one :data:`~.handoff.Item` ``(first seq, count, ts_ns, mono_ns,
  builder, args)`` to a bounded deque (``count`` is 0 for ``emit``, or how many seqs one
  ``emit_many`` took). Nothing is built, encoded or sent there, nothing blocks (the lock only
  orders seq assignment with the append), nothing raises. When the deque is full, or the
  hand-off is not open yet or closed again, the event is dropped: its seq is skipped, a gap the
  assembler detects, and it is counted.
* :mod:`.supervisor` (the background thread; gets the hand-off, the ledger, the link, a frozen
  :class:`~.supervisor.StreamSettings` and, once the engine is named, a
  :class:`~.supervisor.StreamIdentity`): ``builder(*args)`` turns the references into a
  payload, the envelope and the Avro encoding follow, and the encoded value goes to the ledger.
  It polls the link, recreates a link that makes no progress for a while (a broker that lost
  its producer state, a fatal idempotence error), emits heartbeats and exports metrics
  (:mod:`.reporting`).
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
import re
import time
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import SparseetyError

from .handoff import Builder, Handoff
from .kafka_client import KafkaLink, ProducerFactory, WarnOnce, confluent_producer, producer_settings
from .ledger import EmitterStats, Ledger
from .reporting import counters
from .supervisor import StreamIdentity, StreamSettings, Supervisor

log = logging.getLogger(__name__)


def record(payload_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Identity builder: the payload is already a record."""
    return payload_type, payload


def new_epoch() -> str:
    """A fresh engine epoch: milliseconds since the Unix epoch (sortable) + a random suffix."""
    return f"{time.time_ns() // 1_000_000:x}-{os.urandom(3).hex()}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


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
        producer_factory: ProducerFactory | None = None,
        stall_s: float = 10.0,
    ) -> None:
        from sparseety.kafka import make_encoder

        self.cfg = cfg
        self.engine_name = ""
        self.epoch = ""
        self.engine_id = ""
        self.stream = stream
        self.topic = cfg.topics.engine_events
        pc = cfg.producer
        self.handoff = Handoff(pc.queue_max_events)
        warn_once = WarnOnce(stream)
        link = KafkaLink(
            producer_settings(cfg, memory_limit_bytes=pc.memory_limit_bytes, stream=stream),
            topic=self.topic,
            factory=producer_factory or confluent_producer,
            warn_once=warn_once,
        )
        ledger = Ledger(
            link,
            limit_bytes=pc.memory_limit_bytes,
            journal_dir=cfg.spill_path / "_unbound" / _safe(stream),
            journal_max_bytes=pc.spill_max_bytes,
            stream=stream,
            warn_once=warn_once,
            bootstrap=cfg.kafka.bootstrap,
        )
        self._supervisor = Supervisor(
            StreamSettings(stream=stream, producer=pc, stall_s=stall_s),
            handoff=self.handoff,
            ledger=ledger,
            link=link,
            new_encoder=functools.partial(make_encoder, cfg, "EngineEvent", self.topic),
            warn_once=warn_once,
        )
        if engine_name is not None and epoch is not None:
            self.bind(engine_name, epoch)
        self._supervisor.thread.start()

    def bind(self, engine_name: str, epoch: str) -> None:
        """Name the stream (once, before the first event)."""
        if self.bound:
            raise SparseetyError(f"emitter already bound to {self.engine_id}", stream=self.stream)
        self.engine_name = engine_name
        self.epoch = epoch
        self.engine_id = ev.engine_id(engine_name, epoch)
        journal = self.cfg.spill_path / _safe(engine_name) / _safe(self.stream)
        self._supervisor.bind(StreamIdentity(engine_name, self.engine_id), journal)
        # where events wait if Kafka is away: under the stack's data dir when SPARSEETY_DATA_DIR
        # names it, so that `sparseety status` finds an engine that cannot deliver
        log.info(
            "sparseety producer %s: Kafka %s; spill journal %s (producer.spill_dir, default "
            "<data_dir>/spill: set SPARSEETY_DATA_DIR to the stack's data dir)",
            self.engine_id,
            self.cfg.kafka.bootstrap,
            journal,
        )
        self.handoff.open()

    @property
    def bound(self) -> bool:
        return self._supervisor.bound.is_set()

    @property
    def stats(self) -> EmitterStats:
        """Totals kept by the background thread (drops at the hand-off are in :meth:`counters`)."""
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

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Events waiting in the hand-off queue."""
        return self.handoff.queued

    def idle(self) -> bool:
        """Whether everything emitted so far was acknowledged by Kafka."""
        return not self.handoff and not self._supervisor.handling and self._supervisor.ledger.idle

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
        self._supervisor.stop(timeout)
        return self.stats

    # --- reporting ---------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """produced / dropped / spilled / drained / queued / restarts totals."""
        return counters(self.stats, self.handoff)


__all__ = ["Emitter", "EmitterStats", "SparseetyError", "new_epoch", "record"]
