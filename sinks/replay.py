"""Replay and backfill: re-read a topic range through a processor into the same sink.

``sparseety replay --topic T --from X --to Y`` reads ``[X, Y)`` of every partition of ``T`` with a
fresh consumer (manual assignment, no group, nothing committed), decodes each record, passes it
through a processor (:mod:`sparseety.sinks.processors`) and adds the results to the sink the live
consumer uses. The sink's tables are idempotent, so replaying a range twice, or a range the live
sink already wrote, leaves every table (FINAL) and every aggregate unchanged. ``--dry-run`` writes
into scratch copies of the tables instead and reports, per table, how many rows would be new,
would change, are unchanged, or would lose to a newer version already stored.

Bounds are offsets (an integer, for every partition), times (ISO-8601, or a duration ago such as
``2h``), ``beginning`` or ``end``. Kafka resolves a time to an offset with ``offsets_for_times``;
some brokers (the embedded one) resolve at record-batch granularity, so records older than the
start are skipped one by one. Their high watermark is also batch-granular, so "end" is where
a partition stays quiet after the watermark, and records written after the replay started are
left out by their timestamp (``sparseety/broker_compat.py``).

aiokafka reads here (confluent-kafka's consumer is slow on the embedded broker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sparseety import events as ev
from sparseety.broker_compat import offsets_for_time, outside_time_range
from sparseety.config import Config
from sparseety.errors import DecodeError, KafkaUnavailableError, ReplayError, SinkWriteError
from sparseety.kafka import aiokafka_settings, make_decoder
from sparseety.times import QueryError, parse_time

from .base import FlushResult, Sink
from .processors import Processor

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Bound:
    """One end of a replay range: an offset, a wall-clock time (ns), or an open end."""

    kind: Literal["offset", "time", "beginning", "end"]
    value: int = 0

    def __str__(self) -> str:
        if self.kind == "offset":
            return f"offset {self.value}"
        if self.kind == "time":
            return datetime.fromtimestamp(self.value / 1e9).astimezone().isoformat()
        return self.kind


def parse_bound(text: str, *, now_ns: int) -> Bound:
    """``beginning``, ``end``/``now``, an offset (integer), a duration ago (``15m``, ``2h``) or an
    ISO-8601 time (naive = UTC).

    Raises:
        ReplayError: none of those.
    """
    t = text.strip()
    low = t.lower()
    if low in ("beginning", "earliest"):
        return Bound("beginning")
    if low in ("end", "latest", "now"):
        return Bound("end", now_ns)
    if t.isdigit():
        return Bound("offset", int(t))
    try:
        return Bound("time", parse_time(t, now_ns=now_ns, name="bound"))
    except QueryError:
        raise ReplayError(
            f"cannot read {text!r} as a replay bound: use an offset, an ISO-8601 time, a duration "
            f"ago (e.g. 2h), beginning or end",
            bound=text,
        ) from None


@dataclass
class PartitionPlan:
    """Where one partition's replay starts and stops."""

    partition: int
    start: int
    stop_offset: int | None  # exclusive
    min_ns: int | None  # skip records older than this
    max_ns: int | None  # skip records at or after this
    hint: int  # from here on, a record at or after max_ns ends the partition
    watermark: int
    read: int = 0
    kept: int = 0
    position: int = 0
    done: bool = False


@dataclass
class ReplayReport:
    """What a replay read and wrote."""

    topic: str
    dry_run: bool
    plans: list[PartitionPlan] = field(default_factory=list)
    records_read: int = 0
    records_in_range: int = 0
    records_out: int = 0
    undecodable: list[tuple[int, int, str]] = field(default_factory=list)
    rejected: int = 0
    written: FlushResult = field(default_factory=FlushResult)
    diff: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0
    processor_summary: str = ""

    @property
    def records_per_s(self) -> float:
        """Records in range per second of wall time."""
        return self.records_in_range / self.seconds if self.seconds else 0.0

    @property
    def rows_per_s(self) -> float:
        """Rows written (or staged, in a dry run) per second."""
        return self.written.total_rows / self.seconds if self.seconds else 0.0


class Replay:
    """One replay run.

    Args:
        cfg: Configuration (Kafka, topics, decoding).
        topic: Topic to read.
        start, stop: Range bounds (see :func:`parse_bound`); ``[start, stop)``.
        sink: Where results go (a dry-run sink for ``--dry-run``).
        processor: Record -> records (default: the topic's, see ``processor_for_topic``).
        partitions: Only these partitions (default all).
        idle_s: How long a partition must stay quiet past its watermark to count as ended.
        progress: Called with (records read so far, estimated total).
    """

    def __init__(
        self,
        cfg: Config,
        topic: str,
        start: Bound,
        stop: Bound,
        sink: Sink,
        processor: Processor,
        *,
        partitions: list[int] | None = None,
        idle_s: float = 1.0,
        progress: Progress | None = None,
        dry_run: bool = False,
    ) -> None:
        if start.kind == "end":
            raise ReplayError("a replay cannot start at the end")
        if stop.kind == "beginning":
            raise ReplayError("a replay cannot stop at the beginning")
        self.cfg = cfg
        self.topic = topic
        self.start = start
        self.stop = stop
        self.sink = sink
        self.processor = processor
        self.partitions = partitions
        self.idle_s = idle_s
        self.progress = progress
        self.decoder = make_decoder(cfg)
        self.report = ReplayReport(topic, dry_run)

    def run(self) -> ReplayReport:
        """Read the range, store the results, flush; return the report.

        Raises:
            ReplayError: the topic does not exist, or the sink could not write (nothing is lost:
                the range is still in Kafka; run the replay again).
        """
        started = time.monotonic()
        asyncio.run(self._read())
        self._flush()
        finish = getattr(self.processor, "finish", None)
        if callable(finish):
            for name, record in finish():
                self._add(name, record, -1, 0)
            self._flush()
        self.report.seconds = time.monotonic() - started
        summary = getattr(self.processor, "summary", None)
        if callable(summary):
            self.report.processor_summary = summary()
        return self.report

    async def _plan(self, consumer: Any) -> list[PartitionPlan]:
        from aiokafka import TopicPartition

        parts = consumer.partitions_for_topic(self.topic)
        if not parts:
            await consumer._client.force_metadata_update()  # first call knows no topic yet
            parts = consumer.partitions_for_topic(self.topic)
        if not parts:
            raise ReplayError(f"topic {self.topic} does not exist", topic=self.topic)
        chosen = sorted(parts) if self.partitions is None else sorted(set(self.partitions) & set(parts))
        tps = [TopicPartition(self.topic, p) for p in chosen]
        consumer.assign(tps)
        low = await consumer.beginning_offsets(tps)
        high = await consumer.end_offsets(tps)
        starts = {tp: low[tp] for tp in tps}
        if self.start.kind == "offset":
            starts = {tp: max(low[tp], self.start.value) for tp in tps}
        elif self.start.kind == "time":
            starts = await offsets_for_time(consumer, tps, self.start.value, high)
        hints = {tp: 0 for tp in tps}
        if self.stop.kind == "time":
            hints = await offsets_for_time(consumer, tps, self.stop.value, high)
        plans = []
        for tp in tps:
            consumer.seek(tp, starts[tp])
            plans.append(
                PartitionPlan(
                    partition=tp.partition,
                    start=starts[tp],
                    stop_offset=self.stop.value if self.stop.kind == "offset" else None,
                    min_ns=self.start.value if self.start.kind == "time" else None,
                    max_ns=self.stop.value if self.stop.kind in ("time", "end") else None,
                    hint=hints[tp],
                    watermark=high[tp],
                    position=starts[tp],
                )
            )
        return plans

    async def _read(self) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import KafkaConnectionError

        consumer = AIOKafkaConsumer(
            **aiokafka_settings(self.cfg),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=100,
            max_partition_fetch_bytes=8 * 1024 * 1024,
        )
        try:
            await consumer.start()
        except KafkaConnectionError as exc:
            await consumer.stop()
            raise KafkaUnavailableError(
                f"cannot replay: Kafka at {self.cfg.kafka.bootstrap} does not answer ({exc}); "
                "is the broker up (`sparseety status`)?",
                bootstrap=self.cfg.kafka.bootstrap,
            ) from exc
        try:
            plans = await self._plan(consumer)
            self.report.plans = plans
            by_partition = {p.partition: p for p in plans}
            for p in plans:
                if p.stop_offset is not None and p.start >= p.stop_offset:
                    p.done = True
            estimate = sum(max(0, (p.stop_offset or p.watermark) - p.start) for p in plans)
            quiet_since = {p.partition: time.monotonic() for p in plans}
            while not all(p.done for p in plans):
                batches = await consumer.getmany(timeout_ms=200, max_records=10_000)
                now = time.monotonic()
                for tp, records in batches.items():
                    plan = by_partition[tp.partition]
                    if plan.done:
                        continue
                    if records:
                        quiet_since[tp.partition] = now
                    for r in records:
                        self._record(plan, r)
                        if plan.done:
                            break
                for p in plans:
                    if (
                        not p.done
                        and p.position >= p.watermark
                        and now - quiet_since[p.partition] >= self.idle_s
                    ):
                        p.done = True
                if self.sink.pending_rows() >= getattr(self.sink, "batch_max_rows", 50_000):
                    await asyncio.to_thread(self._flush)
                if self.progress:
                    self.progress(self.report.records_read, max(estimate, self.report.records_read))
        finally:
            await consumer.stop()

    def _record(self, plan: PartitionPlan, r: Any) -> None:
        plan.position = r.offset + 1
        if plan.stop_offset is not None and r.offset >= plan.stop_offset:
            plan.done = True
            return
        self.report.records_read += 1
        plan.read += 1
        if outside_time_range(plan, r.offset, r.timestamp * 1_000_000):
            return
        if plan.stop_offset is not None and r.offset + 1 >= plan.stop_offset:
            plan.done = True
        plan.kept += 1
        self.report.records_in_range += 1
        try:
            name, record = self.decoder.decode(r.value)
        except DecodeError as exc:
            exc.at(self.topic, r.partition, r.offset)
            self.report.undecodable.append((r.partition, r.offset, type(exc).__name__))
            if self.topic == self.cfg.topics.dlq:
                # the live sink stores unreadable dead letters as dead letters: so does a replay
                self._add(ev.DEAD_LETTER, ev.dead_letter_record(exc, r.key, "sink"), r.partition, r.offset)
            return
        for out_name, out in self.processor(name, record, self.topic, r.partition, r.offset):
            self._add(out_name, out, r.partition, r.offset)

    def _add(self, name: str, record: dict[str, Any], partition: int, offset: int) -> None:
        if not self.sink.accepts(name):
            self.report.rejected += 1
            return
        self.sink.add(name, record, topic=self.topic, partition=partition, offset=offset)
        self.report.records_out += 1

    def _flush(self) -> None:
        try:
            self.report.written.merge(self.sink.flush())
        except SinkWriteError as exc:
            raise ReplayError(
                f"replay stopped: the sink could not write ({exc}); nothing is lost, the range is "
                f"still in Kafka: run the replay again",
                failed=exc.failed,
            ) from exc
