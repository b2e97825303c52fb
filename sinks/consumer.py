"""``sparseety sink``: a Faust worker that writes the timelines, usage and dlq topics to a sink.

Per batch of events (``stream.take_events(max, within)``, about one batch per
``sink.batch_interval_s``):

1. decode each payload; undecodable bytes, or a record that does not belong on a sink topic,
   become a DeadLetter sent to the dlq topic (reason, raw bytes, topic, partition, offset) and
   awaited until Kafka has it; a dead letter on the dlq topic that cannot be read is stored in
   ``dead_letters`` directly (re-sending it would loop). Nothing is dropped silently.
2. add the records to the sink and flush it: rows are written before the body returns.
3. return: Faust acks the batch's events, then at its next commit flushes its producer and
   commits the acked offsets. A crash anywhere before that re-reads the batch, and the sink's
   idempotent tables absorb the repeat.

A partition whose write keeps failing (:class:`~sparseety.errors.SinkWriteError`) is stopped
alone: its events are held unacked (so its offset cannot be committed past them), the
partition is paused, and a timer retries the buffered batches; once written, the held events
are acked and the partition resumes. The other partitions keep flowing.

The store is opened once per process (:class:`~sparseety.sinks.clickhouse.client.Store`);
:func:`create_app` takes an open store so the process that owns an embedded chDB path can also
serve queries from it (the HTTP API runs beside the sink in one process).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import DecodeError, InvalidEventError, SinkWriteError
from sparseety.kafka import make_decoder, make_encoder
from sparseety.sinks.base import FlushResult, Sink
from sparseety.streams.compat import FaustPartitions, hold_unacked

log = logging.getLogger("sparseety.sink")

TP = tuple[str, int]
COMPONENT = "sink"


class Message(Protocol):
    """What the worker uses of a Faust message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes

    def incref(self, n: int = 1) -> None: ...


class Partitions(Protocol):
    """Consumer controls the worker needs (Faust's in production, fakes in tests)."""

    def pause(self, tps: set[TP]) -> None: ...

    def resume(self, tps: set[TP]) -> None: ...

    def ack(self, message: Any) -> None: ...


def fail_closed() -> None:
    """Exit at once, acknowledging nothing.

    An unexpected error must not reach Faust's take loop: it would ack the batch on its way out
    and the next commit would skip records that were never written. Exiting without cleanup
    leaves the offsets where they are, and the restarted sink re-reads the batch.
    """
    log.critical("sink: unexpected error; exiting without acknowledging the batch", exc_info=True)
    logging.shutdown()
    os._exit(70)


class SinkWorker:
    """Runs batches of consumed messages through a sink (the Faust-independent part).

    Args:
        sink: Where records go.
        decoder: ``decode(bytes) -> (record name, record)`` raising DecodeError.
        dlq_topic: The dead-letter topic (its own unreadable records are stored, not re-sent).
        send_dead_letters: Coroutine that sends ``[(key, DeadLetter record)]`` to the dlq topic
            and returns once Kafka acknowledged them.
        partitions: Pause/resume/ack controls.
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

    async def process(self, messages: Sequence[Message]) -> None:
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
        """Write what failed before (called by a timer while partitions are stopped)."""
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

    def _add(self, m: Message, dead: list[tuple[bytes | None, dict[str, Any]]]) -> None:
        try:
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

    def _pending(self) -> set[TP]:
        return {(b.topic, b.partition) for b in self.sink.pending_batches()}

    async def _flush(self) -> None:
        try:
            result = await asyncio.to_thread(self.sink.flush)
        except SinkWriteError as exc:
            result = exc.result
            log.error("sink: %s", exc)
        self.totals.merge(result)
        if result.total_rows:
            self.writes += 1
            log.info(
                "sink: wrote %s",
                ", ".join(f"{t}={n}" for t, n in result.rows.items()),
            )
        self._release()

    def _hold(self, messages: list[Message]) -> None:
        if not messages:
            return
        stopped = set()
        for m in messages:
            hold_unacked(m)  # its offset is not committed until it is written and acked
            tp = (m.topic, m.partition)
            self.held[tp].append(m)
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


def create_app(
    cfg: Config,
    sink: Sink,
    *,
    session_timeout_s: float = 30.0,
    commit_interval_s: float = 2.8,
    take_max: int = 10_000,
) -> Any:
    """The sink's Faust app (its own consumer group, ``cfg.sink.group_id``).

    Topics must exist (``sparseety.kafka.ensure_topics``): Faust would otherwise create them with
    the broker's default partition count.
    """
    from sparseety.streams.runtime import create_app as create_faust_app
    from sparseety.streams.runtime import raw_topic, send_awaited

    app = create_faust_app(
        cfg,
        cfg.sink.group_id,
        session_timeout_s=session_timeout_s,
        topic_allow_declare=False,
        broker_rebalance_timeout=max(session_timeout_s, 10.0),
        broker_commit_interval=commit_interval_s,
    )
    source = raw_topic(app, cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq)
    dlq = raw_topic(app, cfg.topics.dlq)
    encoder = make_encoder(cfg, "DeadLetter", cfg.topics.dlq)

    async def send_dead_letters(items: list[tuple[bytes | None, dict[str, Any]]]) -> None:
        await send_awaited(
            dlq,
            [
                (key or f"{r['topic']}/{r['partition']}/{r['offset']}".encode(), encoder.encode(r))
                for key, r in items
            ],
        )

    worker = SinkWorker(
        sink,
        make_decoder(cfg),
        cfg.topics.dlq,
        send_dead_letters,
        FaustPartitions(app),
        max_rows=cfg.sink.batch_max_rows,
    )
    app.sparseety_sink = worker  # type: ignore[attr-defined]
    within = cfg.sink.batch_interval_s

    @app.agent(source)
    async def write(stream: Any) -> None:
        async for events in stream.take_events(take_max, within=within):
            await worker.process([e.message for e in events])

    @app.timer(max(within, 1.0))
    async def retry_stopped() -> None:
        await worker.retry()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def _revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
        worker.revoked({(tp.topic, tp.partition) for tp in revoked})

    return app
