"""``sparseety sink``: a batch consumer loop that writes the timelines, usage and dlq topics to a sink.

The sink keeps no state between batches, so it needs no stream processor: a plain librdkafka
consumer in the sink's own consumer group (``cfg.sink.group_id``) hands it batches of up to
``batch_max_messages`` records (``Consumer.consume``, gathered for at most
``sink.batch_interval_s``, or less once the records fetched so far are drained), and per batch:

1. decode each payload (or, for a sink that takes it undecoded, read only its header: see
   below); undecodable bytes, or a record that does not belong on a sink topic,
   become a DeadLetter sent to the dlq topic (reason, raw bytes, topic, partition, offset) and
   awaited until Kafka has it; a dead letter on the dlq topic that cannot be read is stored in
   ``dead_letters`` directly (re-sending it would loop). Nothing is dropped silently.
2. add the records to the sink and flush it: rows are written before the batch is done.
3. commit the batch's offsets (commit-after-write; at most every ``commit_interval_s``, when
   the topics go quiet, and always before a partition is given away or the process stops). A
   crash anywhere before that re-reads the batch, and the sink's idempotent tables absorb the
   repeat (at-least-once).

A sink may take records undecoded (:meth:`Sink.takes_encoded`: the ClickHouse sink, for
RequestAccounting of the current schema into an embedded store, where ClickHouse decodes them).
Only the header is read here, so a framing error (bad magic, unknown fingerprint, a header cut
short) is still dead-lettered before anything is buffered. When the store refuses such a batch
(a corrupt body), the sink hands its records back (``FlushResult.undecoded``) and this loop
decodes each one as above: bad ones go to the dlq topic, the rest are written in Python.

A partition whose write keeps failing (:class:`~sparseety.errors.SinkWriteError`) is stopped
alone: its messages are held (their offsets are not committed), the partition is paused, and the
loop retries the buffered batches every ``batch_interval_s``; once written, the held offsets are
committed and the partition resumes. The other partitions keep flowing.

Rebalances (another sink process joins the group, or one leaves) give partitions away: their
buffered rows and held messages are dropped, never committed, so the new owner re-reads them
from the last commit.

A broker that lost its log (the embedded Tansu restarted under a running sink) recreates the
topics empty: the group forgets its members, the sink's partitions are lost and assigned again,
and an assignment whose topics have new ids starts at the new log's start, never at a position
of the old log (``sinks/lost_log.py`` names the Tansu behaviour this guards against).

The store is opened once per process (:class:`~sparseety.sinks.clickhouse.client.Store`); the
store process (``sparseety store``) runs this loop and the HTTP API in one event loop over one store.

Words, one meaning each: a *record* is one consumed Kafka record (:class:`~sparseety.kafka.Record`);
the *sink* is where records go (:class:`~sparseety.sinks.base.Sink`); the *store* is the ClickHouse
store, and the *store process* the process that owns it; the *feeder* (:class:`SinkFeeder`) runs a
batch of records through the sink, the *consumer loop* (:class:`SinkConsumer`) feeds it from Kafka.
(*Worker* names the Faust assembler worker elsewhere, so it is not used here.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, Protocol

from sparseety import events as ev
from sparseety.broker_compat import TopicIds
from sparseety.config import Config
from sparseety.errors import DecodeError, InvalidEventError, SinkWriteError
from sparseety.kafka import Record, make_decoder, make_encoder, make_producer
from sparseety.lifecycle import clear_ready, mark_ready, run_then_exit
from sparseety.lograte import thin_kafka_client_logs

from .base import FlushResult, Sink
from .lost_log import say_log_lost

log = logging.getLogger("sparseety.sink")

TP = tuple[str, int]
COMPONENT = "sink"
#: A batch is handed over early when no record arrived for this long (the fetch queue is drained).
DRAIN_S = 0.1


class Partitions(Protocol):
    """Consumer controls the feeder needs (the Kafka consumer's in production, fakes in tests)."""

    def pause(self, tps: set[TP]) -> None: ...

    def resume(self, tps: set[TP]) -> None: ...

    def ack(self, message: Any) -> None: ...


def fail_closed() -> None:
    """Exit at once, committing nothing.

    An unexpected error must not let the loop go on to commit the batch: its records may never
    have been written. Exiting without cleanup leaves the offsets where they are, and the
    restarted sink re-reads the batch.
    """
    log.critical("sink: unexpected error; exiting without acknowledging the batch", exc_info=True)
    logging.shutdown()
    os._exit(70)


class SinkFeeder:
    """Runs batches of consumed records through a sink (the Kafka-independent part).

    Args:
        sink: Where records go.
        decoder: ``decode(bytes) -> (record name, record)`` raising DecodeError.
        dlq_topic: The dead-letter topic (its own unreadable records are stored, not re-sent).
        send_dead_letters: Coroutine that sends ``[(key, DeadLetter record)]`` to the dlq topic
            and returns once Kafka acknowledged them.
        partitions: Pause/resume/ack controls. A message of a batch is acknowledged (its offset may
            be committed) when :meth:`process` returns, unless its partition is held; held
            messages are passed to ``partitions.ack`` once written.
        max_rows: Write as soon as this many rows are buffered, also within a batch.
    """

    def __init__(
        self,
        sink: Sink,
        decoder: Any,
        dlq_topic: str,
        send_dead_letters: Callable[[list[tuple[bytes | None, dict[str, Any]]]], Awaitable[None]],
        partitions: Partitions,
        *,
        max_rows: int = 50_000,
    ) -> None:
        self.sink = sink
        self.max_rows = max_rows
        self.decoder = decoder
        self.dlq_topic = dlq_topic
        self.send_dead_letters = send_dead_letters
        self.partitions = partitions
        self.lock = asyncio.Lock()
        self.held: dict[TP, list[Any]] = defaultdict(list)
        self.writes = 0
        self.records = 0
        self.dead_letters = 0
        self.totals = FlushResult()
        #: writer fingerprint -> whether the sink takes its records undecoded
        self._undecoded: dict[int, bool] = {}

    async def process(self, messages: Sequence[Record]) -> None:
        """Decode, add and write one batch; hold the messages of partitions that failed."""
        async with self.lock:
            try:
                dead: list[tuple[bytes | None, dict[str, Any]]] = []
                for m in messages:
                    self._add(m, dead)
                    if self.sink.pending_rows() >= self.max_rows:
                        await self._flush()  # bounds memory; the batch is still acked after all of it
                if dead:
                    await self.send_dead_letters(dead)
                    self.dead_letters += len(dead)
                await self._flush()
                self._hold([m for m in messages if (m.topic, m.partition) in self._pending()])
            except Exception:
                fail_closed()

    async def retry(self) -> None:
        """Write what failed before (called by the loop while partitions are stopped)."""
        if not self.sink.pending_batches():
            return
        async with self.lock:
            try:
                await self._flush()
            except Exception:
                fail_closed()

    def revoked(self, tps: set[TP]) -> None:
        """Partitions taken away: drop their buffered rows and held messages (never acked, so
        whoever gets them re-reads from the last commit)."""
        for tp in tps:
            self.sink.discard(*tp)
            self.held.pop(tp, None)

    def _add(
        self, m: Record, dead: list[tuple[bytes | None, dict[str, Any]]], *, undecoded: bool = True
    ) -> None:
        """Buffer one message (``undecoded``: the sink may take it without decoding)."""
        try:
            if undecoded and self._add_undecoded(m):
                self.records += 1
                return
            name, record = self.decoder.decode(m.value)
            if not self.sink.accepts(name):
                raise InvalidEventError(
                    f"{name} does not belong on {m.topic}: the sink stores "
                    + ", ".join(sorted(n.rsplit(".", 1)[-1] for n in self.sink.records)),
                    raw=m.value,
                    record=name,
                )
            try:
                self.sink.add(name, record, topic=m.topic, partition=m.partition, offset=m.offset)
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidEventError(
                    f"{name} cannot be stored: {exc!r}", raw=m.value, record=name
                ) from exc
        except DecodeError as exc:
            exc.at(m.topic, m.partition, m.offset)
            record = ev.dead_letter_record(exc, m.key, COMPONENT)
            log.warning("sink: dead-lettering %s[%d]@%d: %s", m.topic, m.partition, m.offset, exc)
            if m.topic == self.dlq_topic:
                self.sink.add(ev.DEAD_LETTER, record, topic=m.topic, partition=m.partition, offset=m.offset)
            else:
                dead.append((m.key, record))
            return
        self.records += 1

    def _add_undecoded(self, m: Record) -> bool:
        """Hand ``m`` to the sink undecoded if it takes its writer schema (the header is read:
        a framing error raises DecodeError)."""
        writer = self.decoder.header(m.value)
        if writer is None:
            return False
        takes = self._undecoded.get(writer.fingerprint)
        if takes is None:
            takes = self._undecoded[writer.fingerprint] = self.sink.takes_encoded(writer, self.decoder.store)
        if takes:
            self.sink.add_encoded(
                writer, m.value, key=m.key, topic=m.topic, partition=m.partition, offset=m.offset
            )
        return takes

    def _pending(self) -> set[TP]:
        return {(b.topic, b.partition) for b in self.sink.pending_batches()}

    async def _flush(self) -> None:
        try:
            result = await asyncio.to_thread(self.sink.flush)
        except SinkWriteError as exc:
            result = exc.result
            log.error("sink: %s", exc)
        back, result.undecoded = result.undecoded, []
        self.totals.merge(result)
        if result.total_rows:
            self.writes += 1
            log.info(
                "sink: wrote %s",
                ", ".join(f"{t}={n}" for t, n in result.rows.items()),
            )
        if back:
            # the store refused a batch the sink took undecoded: decode each record here, so
            # that bad ones reach the dlq topic like any undecodable record, and write the rest
            dead: list[tuple[bytes | None, dict[str, Any]]] = []
            self.records -= len(back)  # counted again below, unless they turn out undecodable
            for m in back:
                self._add(m, dead, undecoded=False)
            if dead:
                await self.send_dead_letters(dead)
                self.dead_letters += len(dead)
            await self._flush()
            return
        self._release()

    def _hold(self, messages: list[Record]) -> None:
        if not messages:
            return
        stopped = set()
        for m in messages:
            tp = (m.topic, m.partition)
            self.held[tp].append(m)  # not acked: its offset is not committed until it is written
            stopped.add(tp)
        self.partitions.pause(stopped)
        log.error("sink: stopped %s until their writes succeed", sorted(stopped))

    def _release(self) -> None:
        pending = self._pending()
        done = {tp for tp in self.held if tp not in pending}
        for tp in done:
            for m in self.held.pop(tp):
                self.partitions.ack(m)
        if done:
            self.partitions.resume(done)
            log.warning("sink: resumed %s", sorted(done))


class KafkaPartitions:
    """Pause, resume and ack over a confluent-kafka consumer, and the offsets ready to commit.

    ``ack`` only notes the next offset to commit; the loop commits them (:class:`SinkConsumer`). A paused
    partition's messages that still arrive are dropped by the loop (:meth:`accepts`), and
    ``resume`` seeks the partition back to the first offset not yet acknowledged, so whether
    librdkafka purges a paused partition's prefetched messages or not, nothing is skipped.
    """

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.paused: set[TP] = set()
        self.acked: dict[TP, int] = {}  # next offset to commit, per partition
        self.committed: dict[TP, int] = {}
        #: the last acknowledged position per partition, kept when a partition goes away: what
        #: the sink had read when the broker lost its log
        self.last: dict[TP, int] = {}

    def _tps(self, tps: set[TP], offsets: dict[TP, int] | None = None) -> list[Any]:
        from confluent_kafka import TopicPartition

        if offsets is None:
            return [TopicPartition(t, p) for t, p in sorted(tps)]
        return [TopicPartition(t, p, offsets[(t, p)]) for t, p in sorted(tps)]

    def pause(self, tps: set[TP]) -> None:
        self.consumer.pause(self._tps(tps))
        self.paused |= tps

    def resume(self, tps: set[TP]) -> None:
        self.paused -= tps
        self.consumer.resume(self._tps(tps))
        for tp in tps:
            if tp in self.acked:
                self.consumer.seek(self._tps({tp}, self.acked)[0])

    def ack(self, message: Any) -> None:
        tp = (message.topic, message.partition)
        self.acked[tp] = max(self.acked.get(tp, 0), message.offset + 1)
        self.last[tp] = self.acked[tp]

    def accepts(self, tp: TP) -> bool:
        return tp not in self.paused

    def to_commit(self, only: set[TP] | None = None) -> dict[TP, int]:
        return {
            tp: off
            for tp, off in self.acked.items()
            if (only is None or tp in only) and off > self.committed.get(tp, -1)
        }

    def forget(self, tps: set[TP]) -> None:
        for tp in tps:
            self.paused.discard(tp)
            self.acked.pop(tp, None)
            self.committed.pop(tp, None)


def consumer_settings(cfg: Config, session_timeout_s: float) -> dict[str, Any]:
    """librdkafka settings of the sink's group consumer: nothing committed automatically."""
    return cfg.kafka.librdkafka(
        **{
            "group.id": cfg.sink.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": int(session_timeout_s * 1000),
            "heartbeat.interval.ms": int(min(3.0, session_timeout_s / 3) * 1000),
            "fetch.wait.max.ms": 100,
            "enable.partition.eof": False,
        }
    )


class SinkConsumer:
    """The batch loop: consume, write, commit; rebalances and stopped partitions.

    ``consume`` and ``commit`` run on the loop's own consumer thread (a one-thread executor), so
    the event loop stays free for the API that shares it in the store process; the next batch is
    gathered there while the current one is written. Rebalance callbacks run on that thread too,
    inside ``consume``: they wait for the batch being written (``_busy``), so a partition is given
    away only after its written offsets are committed and its buffer is dropped.

    Args:
        cfg: Topics, group, batch settings.
        sink: Where records go (open; closed by the caller).
        session_timeout_s: Group session timeout; None: ``sink.session_timeout_s`` resolved.
        commit_interval_s: Least time between offset commits (commits only ever follow writes).
        batch_max_messages: Most messages one batch takes.
    """

    def __init__(
        self,
        cfg: Config,
        sink: Sink,
        *,
        session_timeout_s: float | None = None,
        commit_interval_s: float = 2.8,
        batch_max_messages: int = 20_000,
    ) -> None:
        from confluent_kafka import Consumer

        self.cfg = cfg
        self.topics = [cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq]
        session = cfg.sink.session_timeout if session_timeout_s is None else session_timeout_s
        self.consumer = Consumer(consumer_settings(cfg, session))
        self.partitions = KafkaPartitions(self.consumer)
        self.producer = make_producer(cfg)
        self.encoder = make_encoder(cfg, "DeadLetter", cfg.topics.dlq)
        self.feeder = SinkFeeder(
            sink,
            make_decoder(cfg),
            cfg.topics.dlq,
            self.send_dead_letters,
            self.partitions,
            max_rows=cfg.sink.batch_max_rows,
        )
        self.interval_s = cfg.sink.batch_interval_s
        self.commit_interval_s = commit_interval_s
        self.batch_max_messages = batch_max_messages
        self.assigned: set[TP] = set()
        self.topic_ids = TopicIds(cfg, self.topics)
        self.on_ready: Callable[[], None] | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sparseety-sink-consumer")
        self._busy = threading.Lock()
        #: set once a batch was written: a gathering that finds nothing returns at once (not at the
        #: end of its interval), so the written offsets are committed without waiting for it
        self._wrote = threading.Event()
        self._last_commit = 0.0
        self._last_retry = 0.0

    # --- Kafka side -------------------------------------------------------------------------

    async def send_dead_letters(self, items: list[tuple[bytes | None, dict[str, Any]]]) -> None:
        """Produce dead letters and return once Kafka acknowledged every one of them."""
        errors: list[Any] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)

        for key, r in items:
            key = key or f"{r['topic']}/{r['partition']}/{r['offset']}".encode()
            self.producer.produce(
                self.cfg.topics.dlq, key=key, value=self.encoder.encode(r), on_delivery=delivered
            )
        left = await asyncio.to_thread(self.producer.flush, 60)
        if left or errors:
            raise RuntimeError(f"dead letters not acknowledged by Kafka: {left} left, errors {errors[:3]}")

    def _assigned(self, consumer: Any, tps: list[Any]) -> None:
        got = {(tp.topic, tp.partition) for tp in tps}
        recreated = self.topic_ids.recreated()
        if recreated:
            self._from_new_start(consumer, tps, recreated)
        self.assigned = got
        log.warning("sink: assigned partitions %s", sorted(got))
        if self.on_ready is not None:
            self.on_ready()
            self.on_ready = None

    def _from_new_start(self, consumer: Any, tps: list[Any], recreated: set[str]) -> None:
        """The broker recreated ``recreated`` (it lost its log): start their partitions at the new
        log's start instead of any committed position, which belongs to the old log."""
        from confluent_kafka import OFFSET_BEGINNING

        with self._busy:
            say_log_lost(recreated, self.partitions.last)
            old = {tp for tp in self.partitions.last if tp[0] in recreated}
            self.feeder.revoked(old & self.assigned)
            self.partitions.forget(old)
            for tp in old:
                self.partitions.last.pop(tp, None)
        for tp in tps:
            if tp.topic in recreated:
                tp.offset = OFFSET_BEGINNING
        consumer.assign(tps)  # librdkafka takes these start offsets instead of the committed ones

    def _revoked(self, consumer: Any, tps: list[Any]) -> None:
        gone = {(tp.topic, tp.partition) for tp in tps}
        with self._busy:  # the batch being written finishes (and is acked) first
            self.assigned -= gone
            self._commit_now(gone)  # what was written is committed before someone else owns it
            self.feeder.revoked(gone)
            self.partitions.forget(gone)
        log.warning("sink: revoked partitions %s", sorted(gone))

    def _lost(self, consumer: Any, tps: list[Any]) -> None:
        gone = {(tp.topic, tp.partition) for tp in tps}
        with self._busy:
            self.assigned -= gone
            self.feeder.revoked(gone)  # no commit: the group already gave them to someone else
            self.partitions.forget(gone)
        log.warning("sink: lost partitions %s", sorted(gone))

    def _commit_now(self, only: set[TP] | None = None) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        offsets = self.partitions.to_commit(only)
        if not offsets:
            return
        try:
            self.consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())],
                asynchronous=False,
            )
        except KafkaException as exc:
            # not fatal: the rows are written; the next commit (or the new owner's re-read,
            # absorbed by the idempotent tables) covers these offsets
            log.warning("sink: offset commit failed: %s", exc)
            return
        self.partitions.committed.update(offsets)

    def _consume(self) -> list[Record]:
        """Up to ``batch_max_messages`` records: gathered for at most ``interval_s``, and handed
        over early once the fetched records are drained (nothing new for ``DRAIN_S``), so the end
        of a burst is written at once instead of after the full interval. With nothing gathered,
        it returns after ``DRAIN_S`` once a batch was written meanwhile, so that batch's offsets
        are committed then, not an interval later."""
        from confluent_kafka import KafkaException

        out: list[Record] = []
        deadline = time.monotonic() + self.interval_s
        while len(out) < self.batch_max_messages:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = self.consumer.consume(self.batch_max_messages - len(out), min(left, DRAIN_S))
            if not got and (out or self._wrote.is_set()):
                break
            for m in got:
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    log.warning("sink: consumer: %s", err)
                    continue
                tp: TP = (m.topic(), m.partition())  # type: ignore[assignment]
                if self.partitions.accepts(tp):
                    # a null value (tombstone) is no record: b"" is dead-lettered as undecodable
                    out.append(Record(tp[0], tp[1], m.offset() or 0, m.key(), m.value() or b""))
        return out

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume, write and commit until ``stop`` is set; then commit, leave the group.

        The next batch is gathered (on the consumer thread) while the current one is written, so
        a record waits for at most one gathering interval plus one write, not two writes.
        """
        loop = asyncio.get_running_loop()
        self.consumer.subscribe(
            self.topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost
        )
        gathering = loop.run_in_executor(self._thread, self._consume)
        try:
            while not stop.is_set():
                batch = await gathering
                now = time.monotonic()
                if now - self._last_commit >= self.commit_interval_s or not batch:
                    self._last_commit = now
                    self._wrote.clear()  # what was written so far is committed now
                    await loop.run_in_executor(self._thread, self._commit_now)
                gathering = loop.run_in_executor(self._thread, self._consume)
                with self._busy:  # a rebalance callback waits until this batch is written and acked
                    # records of partitions given away or stopped meanwhile are not ours to write
                    batch = [
                        m
                        for m in batch
                        if (m.topic, m.partition) in self.assigned
                        and self.partitions.accepts((m.topic, m.partition))
                    ]
                    if batch:
                        await self.feeder.process(batch)
                        for m in batch:
                            if (m.topic, m.partition) not in self.feeder.held:
                                self.partitions.ack(m)
                        self._wrote.set()
                    if self.feeder.held and now - self._last_retry >= self.interval_s:
                        self._last_retry = now
                        await self.feeder.retry()
            await gathering  # not written: never acked, so re-read after a restart
            await loop.run_in_executor(self._thread, self._commit_now)
        finally:
            if not gathering.done():
                await asyncio.wait([gathering])
            await loop.run_in_executor(self._thread, self.consumer.close)  # leaves the group
            self._thread.shutdown(wait=False)


async def serve(
    sink_consumer: SinkConsumer,
    ready: Path,
    *,
    started: Callable[[], Awaitable[None]] | None = None,
    stopping: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run the loop (and whatever ``started``/``stopping`` bring up beside it) until SIGTERM/SIGINT.

    The readiness file appears once the group gave this process its partitions (and ``started``
    returned)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if started is not None:
        await started()
    sink_consumer.on_ready = lambda: mark_ready(ready)
    try:
        await sink_consumer.run(stop)
    finally:
        clear_ready(ready)
        if stopping is not None:
            await stopping()


def run(
    sink_consumer: SinkConsumer,
    *,
    cfg: Config,
    role: str,
    loglevel: str = "info",
    cleanup: Callable[[], object] | None = None,
    started: Callable[[], Awaitable[None]] | None = None,
    stopping: Callable[[], Awaitable[None]] | None = None,
) -> NoReturn:
    """Run the sink loop until SIGTERM/SIGINT, then exit the process
    (:func:`sparseety.lifecycle.run_then_exit`: readiness file, bounded ``cleanup``)."""
    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    thin_kafka_client_logs()
    run_then_exit(
        cfg.data_path,
        role,
        lambda ready: asyncio.run(serve(sink_consumer, ready, started=started, stopping=stopping)),
        cleanup=cleanup,
        log=log,
    )
