"""The Faust worker: a thin shell that decodes, calls the assembler, sends, and checkpoints.

Per batch of events (``compat.deliver_in_batches``: up to ``worker.take_max`` records or
``worker.take_within_s`` seconds, straight from Faust's consumer), per partition:

1. decode each event (bad bytes or invalid events become DeadLetter records: never dropped);
2. fold it with the partition's :class:`~streams.assembler.Assembler`;
3. send the outputs and wait until Kafka acknowledged them;
4. write the state keys the batch changed to the changelog-backed table, epoch keys last
   (``TableStore`` over ``compat.ChangelogTable``).

The batch's records are acked after the handler returns, and Faust commits offsets only after flushing
its producer, so a crash at any point replays events whose effects are either absent or
recognised by the per-key seq guards (see ``streams/state.py``). Outputs are keyed and
deterministic: re-sent ones overwrite themselves downstream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from operator import attrgetter
from typing import Any

import faust

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import DecodeError, EncodeError
from sparseety.kafka import make_decoder, make_encoder
from sparseety.lifecycle import clear_ready, ready_file
from sparseety.schema_store import SchemaStore

from . import metrics
from .assembler import DLQ, TIMELINES, USAGE, Assembler, Output
from .compat import (
    ChangelogTable,
    Consumed,
    ConsumerConnections,
    LostLogWatch,
    Refetcher,
    deliver_in_batches,
    fill_holes,
    send_batches,
    table_manager_without_start_pause,
    with_fetch_wait,
)
from .runtime import create_app as create_faust_app
from .runtime import raw_topic
from .state import TableStore

log = logging.getLogger("sparseety.worker")
ENGINE_STOPPED = ev.ENGINE_STOPPED
_PARTITION = attrgetter("partition")

STATE_TABLE = "state"
#: The worker's exit status when the broker lost its log (see ``compat.LostLogWatch``).
EXIT_LOG_LOST = 3
#: Largest state record the worker writes to (and reads back from) its changelog. An epoch's
#: record carries its reorder buffer (up to ``worker.reorder_max_events`` events): a worker that
#: met an engine mid-stream after the broker lost its log buffered 1,276,589 bytes of it before
#: declaring the gap, past Kafka's 1 MiB default, and crashed on the send (issue 12).
STATE_RECORD_MAX_BYTES = 16 * 1024 * 1024
#: The worker producer's record batch size. aiokafka queues one batch per partition and makes
#: the next ``send_batch`` wait until it is sent, so a checkpoint of ~1.2 MiB (batch 256: ~3,900
#: state keys per 500 events) went out at Faust's default 16 KiB as ~80 produce requests one
#: after the other. Under Kafka's 1 MiB default ``max.message.bytes`` of the output topics.
PRODUCER_BATCH_BYTES = 512 * 1024


class AssemblerWorker:
    """Holds one assembler per assigned partition and runs batches through them."""

    def __init__(self, app: faust.App, cfg: Config, table: Any, topics: dict[str, Any]) -> None:
        self.app = app
        self.cfg = cfg
        self.table = table
        self.topics = topics
        # One schema store for the four codecs: loading one fingerprints every schema version
        # in pure Python (~20 ms a load quiet, part of every restart's start-up: issue 33).
        schemas = SchemaStore.load()
        self.decoder = make_decoder(cfg, schemas)
        self.encoders = {
            TIMELINES: make_encoder(cfg, "RequestAccounting", cfg.topics.timelines, schemas),
            USAGE: make_encoder(cfg, "UsageWindow", cfg.topics.usage, schemas),
            DLQ: make_encoder(cfg, "DeadLetter", cfg.topics.dlq, schemas),
        }
        self.partitions: dict[int, tuple[TableStore, Assembler]] = {}
        self.next_offset: dict[int, int] = {}  # per partition: the offset the next batch must start at
        self.refetcher = Refetcher(cfg, cfg.topics.engine_events, cfg.worker.app_id)
        # The agent and the housekeeping timer both write state: one at a time, so each
        # partition's changelog ends with a lone marker (see compat.ChangelogTable.write).
        self.lock = asyncio.Lock()

    def reset(self) -> None:
        """Forget cached state and positions (after a rebalance the table and the group are the truth)."""
        self.partitions.clear()
        self.next_offset.clear()
        metrics.forget_partitions()

    async def export_lag(self, consumer: Any, assigned: set[int]) -> None:
        """Lag gauges per assigned partition: high watermark - the next offset to process (before
        the first batch: the group's committed offset, else the start of the log)."""
        from faust.types import TP

        tps = {p: TP(self.cfg.topics.engine_events, p) for p in sorted(assigned)}
        if not tps:
            return
        highwaters = await consumer.highwaters(*tps.values())
        positions = {p: self.next_offset.get(p) for p in tps}
        for p in [p for p, pos in positions.items() if pos is None]:
            positions[p] = await self.refetcher.committed(p)
        unknown = [tps[p] for p, pos in positions.items() if pos is None]
        if unknown:
            for tp, start in (await consumer.earliest_offsets(*unknown)).items():
                positions[tp.partition] = start
        for p, tp in tps.items():
            position, highwater = positions.get(p), highwaters.get(tp)
            if position is not None and highwater is not None:
                metrics.set_lag(p, highwater=highwater, position=position)

    def _for(self, partition: int) -> tuple[TableStore, Assembler]:
        pair = self.partitions.get(partition)
        if pair is None:
            store = TableStore(ChangelogTable(self.table, partition))
            pair = self.partitions[partition] = (store, Assembler(self.cfg.worker, store))
        return pair

    async def process(self, records: list[Consumed]) -> None:
        async with self.lock:
            await self._process(records)

    async def _process(self, records: list[Consumed]) -> None:
        partitions = set(map(_PARTITION, records))
        by_partition: dict[int, list[Consumed]] = defaultdict(list)
        if len(partitions) == 1:  # the usual batch: no grouping per record
            by_partition[partitions.pop()] = records
        else:
            for record in records:
                by_partition[record.partition].append(record)
        for partition, batch in by_partition.items():
            batch = await self._fill_holes(partition, batch)
            if not batch:
                continue
            store, asm = self._for(partition)
            outputs: list[Output] = []
            # Each event is folded right after it is decoded (while its objects are in cache:
            # ~3 % of the worker's CPU at batch-4 steps against decoding the batch first). The
            # decode and fold stages split the loop's thread CPU by their shares of its wall
            # time (two perf_counter reads per event; a thread-CPU read costs ~0.5 us).
            # Per event, the loop is the worker's own overhead (at batch-4 engine steps a few
            # microseconds of ~50 per event): bound methods in locals, no call per valid event.
            decode, validate = self.decoder.decode, ev.validate_engine_event
            apply, extend = asm.apply, outputs.extend
            perf = time.perf_counter
            last_ts_ns = 0
            engines: dict[str, int] = {}
            stopped: set[str] = set()
            decoding = 0.0
            cpu = time.thread_time()
            started = t0 = perf()
            for msg in batch:
                value = msg.value
                try:
                    event = validate(decode(value)[1], value)
                except DecodeError as exc:
                    outputs.append(self._dead_letter(msg, exc))
                    t1 = perf()
                    decoding += t1 - t0
                    t0 = t1
                    continue
                t1 = perf()
                decoding += t1 - t0
                extend(apply(event))
                last_ts_ns = event["ts_ns"]
                name = event["engine_name"]
                engines[name] = max(engines.get(name, 0), last_ts_ns)
                if event["payload"][0] == ENGINE_STOPPED:
                    stopped.add(name)
                elif stopped:
                    stopped.discard(name)
                t0 = perf()
            loop_cpu = time.thread_time() - cpu
            wall = perf() - started
            decode_cpu = loop_cpu * min(1.0, decoding / wall) if wall > 0 else 0.0
            metrics.STAGE_CPU.labels("decode").inc(decode_cpu)
            metrics.STAGE_CPU.labels("fold").inc(loop_cpu - decode_cpu)
            metrics.EVENTS_IN.inc(len(batch))
            if last_ts_ns:
                metrics.LAST_EVENT_TS.labels(str(partition)).set(last_ts_ns / 1e9)
                metrics.engine_seen(engines, stopped)
            metrics.FOLD_SECONDS.observe(time.perf_counter() - started)
            log.debug(
                "partition %d: offsets %d..%d -> %d outputs",
                partition,
                batch[0].offset,
                batch[-1].offset,
                len(outputs),
            )
            await self.send(outputs)
            cpu = time.thread_time()
            await store.flush()
            metrics.STAGE_CPU.labels("state").inc(time.thread_time() - cpu)
            self.next_offset[partition] = batch[-1].offset + 1
            self._export(asm)

    def _dead_letter(self, msg: Consumed, exc: DecodeError) -> Output:
        """The dead letter ``msg`` becomes: it did not decode, or its event is invalid."""
        exc.at(msg.topic, msg.partition, msg.offset)
        record = ev.dead_letter_record(exc, msg.key, "assembler")
        metrics.DEAD_LETTERS.labels("assembler", type(exc).__name__).inc()
        return Output(DLQ, ev.dead_letter_key(exc, msg.key), ev.DEAD_LETTER, record)

    async def _fill_holes(self, partition: int, batch: list[Consumed]) -> list[Consumed]:
        """Drop re-deliveries of what was processed and re-read what the consumer skipped."""
        return await fill_holes(
            self.refetcher, partition, self.next_offset.get(partition), batch, metrics.REFETCHED.inc
        )

    async def tick(self, assigned: set[int]) -> None:
        """Processing-time housekeeping for every assigned partition, busy or not."""
        async with self.lock:
            await self._tick(assigned)

    async def _tick(self, assigned: set[int]) -> None:
        for partition in assigned:
            self._for(partition)
        for _, (store, asm) in list(self.partitions.items()):
            outputs = asm.tick()
            if outputs:
                await self.send(outputs)
            await store.flush()

    async def send(self, outputs: list[Output]) -> None:
        """Send and wait for Kafka's acknowledgement (before the state that caused them is written)."""
        by_topic: dict[str, list[tuple[bytes | None, bytes]]] = defaultdict(list)
        cpu = time.thread_time()
        for out in outputs:
            try:
                value = self.encoders[out.topic].encode(out.record)
            except EncodeError as exc:  # a bug upstream; keep the evidence
                log.error("cannot encode %s %s: %s", out.record_name, out.key, exc)
                metrics.DEAD_LETTERS.labels("assembler-output", "EncodeError").inc()
                continue
            by_topic[out.topic].append((out.key.encode(), value))
            metrics.OUTPUTS.labels(out.topic).inc()
        encoded = time.thread_time()
        await asyncio.gather(
            *(send_batches(self.app, self.topics[t].get_topic_name(), items) for t, items in by_topic.items())
        )
        metrics.STAGE_CPU.labels("encode").inc(encoded - cpu)
        metrics.STAGE_CPU.labels("send").inc(time.thread_time() - encoded)

    def _export(self, asm: Assembler) -> None:
        metrics.export(id(asm), asm.stats)


def create_app(cfg: Config) -> faust.App:
    """The assembler's Faust app for ``cfg`` (topics must exist: see ``sparseety.kafka.ensure_topics``)."""
    w = cfg.worker
    app = create_faust_app(
        cfg,
        w.app_id,
        session_timeout_s=w.session_timeout,
        table_standby_replicas=w.standby_replicas,
        broker_commit_interval=w.commit_interval_s,
        producer_max_request_size=STATE_RECORD_MAX_BYTES,
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        consumer_max_fetch_size=STATE_RECORD_MAX_BYTES,
        TableManager=table_manager_without_start_pause(),
    )

    topics = {
        TIMELINES: raw_topic(app, cfg.topics.timelines),
        USAGE: raw_topic(app, cfg.topics.usage),
        DLQ: raw_topic(app, cfg.topics.dlq),
    }
    # bytes key/value types make Faust use the raw serializer for the changelog and recovery.
    table = app.Table(
        STATE_TABLE,
        partitions=cfg.topics.partitions,
        key_type=bytes,
        value_type=bytes,
        extra_topic_configs={"max.message.bytes": str(STATE_RECORD_MAX_BYTES)},
    )
    worker = AssemblerWorker(app, cfg, table, topics)
    app.sparseety_worker = worker  # type: ignore[attr-defined]

    # Faust sets changelog_topic_name on every Collection; its TableT type does not declare it.
    watch = LostLogWatch(cfg, table.changelog_topic_name)  # type: ignore[attr-defined]

    async def broker_has_our_log() -> bool:
        """Exit if the broker lost this worker's log (compat item 6); False while it does not
        answer. Asked before the worker writes on its own (a tick) and when its partitions
        change: a write sent to a restarted Tansu lands in its new log (or, sent on the old
        metadata, in a partition nobody can read back), never to be undone."""
        lost = await watch.lost()
        if lost:
            log.error(
                "the broker lost this worker's topics and offsets (%s gone or recreated empty: an "
                "in-memory broker restarted); exiting without committing, run `sparseety up` to "
                "start a worker on the new log",
                ", ".join(sorted(lost)),
            )
            logging.shutdown()
            clear_ready(ready_file(cfg.data_path, "worker"))
            os._exit(EXIT_LOG_LOST)
        return lost is not None

    connections = ConsumerConnections(app)

    async def fold_on_our_log(records: list[Consumed]) -> None:
        # The timer below confirms the log every tick; after a pause, an outage or a reconnection
        # a batch waits for a fresh answer, so no record of a restarted broker's new log is
        # folded (item 6).
        waited = 0
        fresh = not connections.changed() and watch.confirmed_within(2 * w.tick_interval_s)
        while not fresh and not await broker_has_our_log():
            if not waited:
                log.warning("the broker does not say whether it still has this worker's log: not folding yet")
            waited += 1
            await asyncio.sleep(w.tick_interval_s)
        if waited:
            log.warning("the broker has this worker's log: folding again")
        await worker.process(records)

    with_fetch_wait(app, w.fetch_wait_s)
    deliver_in_batches(
        app,
        raw_topic(app, cfg.topics.engine_events),
        fold_on_our_log,
        max_records=w.take_max,
        within_s=w.take_within_s,
    )

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def _revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        await broker_has_our_log()  # a group the broker forgot is a rebalance too
        worker.reset()

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def _assigned(sender: Any, *args: Any, **kwargs: Any) -> None:
        await broker_has_our_log()

    @app.timer(w.tick_interval_s)
    async def housekeeping() -> None:
        # nothing written while the broker cannot say it still has the log the state belongs to
        if not app.rebalancing and await broker_has_our_log():
            assigned = {
                tp.partition for tp in app.consumer.assignment() if tp.topic == cfg.topics.engine_events
            }
            await worker.tick(assigned)
            try:
                async with worker.lock:  # the refetcher's client is shared with the agent
                    await worker.export_lag(app.consumer, assigned)
            except Exception as exc:  # metrics never stop the worker
                log.debug("lag metrics not updated: %r", exc)

    @app.timer(w.tick_interval_s)
    async def broker_lost_its_log() -> None:
        # apart from housekeeping: that one may be the task waiting on the lost changelog; while
        # it keeps the confirmation fresh, asking again would only double the admin requests
        if not watch.confirmed_within(w.tick_interval_s):
            await broker_has_our_log()

    return app
