"""Every workaround for a Faust, aiokafka or Tansu behaviour, fenced in one module.

Nothing else in SparSEEty reaches into Faust's private parts or compensates for a client or
broker quirk; each piece below names the behaviour it works around. When an upstream fixes one,
its piece is deleted here and its caller keeps working through the same function.

(Client settings are no workaround: their one translation is ``sparseety/kafka.py``'s.)

2. **Skipped records** (:class:`Refetcher`, :func:`fill_holes`): faust-streaming 0.15.3 can drop
   records that are being delivered while it suspends the flow for a rebalance or recovery: it
   advances its read offset anyway, then discards the re-fetched copies as already read (seen
   here right after a restart). Engine events carry gap-free seqs, so the assembler would notice
   and flag the requests; this makes sure it does not have to: the worker tracks the next offset
   it expects per partition and, when a batch starts later (or has a hole), reads the missing
   offsets itself with a plain aiokafka consumer. On a non-compacted, non-transactional topic
   (engine-events) offsets have no legitimate holes.
3. **The table's changelog** (:class:`ChangelogTable`): the worker keeps raw bytes in Faust's
   memory store and writes its changelog itself, which needs the store's private ``data`` dict
   and ``_key_partition`` map (Faust has no public per-partition key listing). Tansu reports the
   high watermark at record-batch granularity and Faust's recovery reads up to the watermark, so
   it would miss the rest of the last batch: every flush ends with a lone marker record.
   Faust's ``Table.send_changelog`` costs ~0.25 ms of CPU per record here (``send_soon``, its
   producer buffer, ``publish_message``, sensors, then aiokafka's ``send``); a worker at batch 256
   rewrites every live request's state at each flush, so that path alone cost several times the
   fold (``benchmarks/bench_worker.py --profile``). The records go as aiokafka record batches
   (``create_batch``/``send_batch``) on the producer Faust started (its private ``_producer``),
   to the same changelog topic and partition, in the same order. The worker's outputs go the same
   way (:func:`send_batches`): through Faust's ``Topic.send`` each record cost the same per-record
   path, a visible share of the worker's CPU per fold CPU-second (``bench_worker.py``'s stages);
   their partition is the one aiokafka's own ``send`` would pick (its configured partitioner on
   the key, the producer's private ``_partition``), so records keep their partitions.
   aiokafka queues one record batch per partition and makes the next ``send_batch`` wait until
   that one is sent, so the worker's producer batches are 512 KiB (``streams/app.py``,
   ``PRODUCER_BATCH_BYTES``), not Faust's default 16 KiB: a batch-256 checkpoint (~1.2 MiB)
   went out as ~80 produce requests one after the other.
4. **The terminal spinner** (:func:`without_spinner`): faust-streaming's ``Worker`` keeps its
   progress spinner when the log level is WARN or above and then sets the root logger to DEBUG
   (``Worker._setup_spinner_handler``), so with ``--loglevel warning`` every aiokafka debug
   message (several per produced batch) is formatted for the spinner: seen as the largest item
   of a worker profile after the fold. Workers run without it.
5. **Time bounds** on a batch-granular broker: a workaround for the broker, not Faust, used by
   the replay (no Faust there): :mod:`sparseety.broker_compat`.

6. **A broker that lost its log** (:class:`LostLogWatch`): the embedded Tansu keeps topics,
   committed offsets and the table's changelog in memory; when it restarts, ``up`` or ``broker
   start`` recreate the configured topics empty, but not the changelog. A running Faust worker
   does not notice: it rejoins the group, "recovers" nothing from the missing changelog, and then
   waits forever on sends to it, holding positions beyond the new log's end (issue 12: the worker
   sat in recovery while 3,247 of 3,929 requests never reached the store). The watch notices the
   changelog or input topic that was there and is gone or was recreated (a new topic id: Tansu
   recreates a missing topic that a metadata request names, and the worker's own producer asks
   for its changelog; a CI run saw a worker wait out 180 s that way, issue 33); the worker then
   ends at once, without committing its old positions into the new broker, so a fresh one
   (``sparseety up``) starts from the new log. Nothing may be written first: a worker whose
   positions the new log outgrew (an engine's journal drained into it) fetches the new log's
   records from there and would fold them, and its writes would land in the new log, or, sent
   on its old metadata, in a partition Tansu acknowledges and never serves (a later worker's
   recovery then waits forever; ``sparseety/broker_compat.py``; a CI run, issue 33). So the
   watch is asked on every rebalance and before every housekeeping tick, and a batch is folded
   only within two ticks of the broker last confirming the log and on broker connections the
   consumer had when it did (:class:`ConsumerConnections`): a batch after a pause, an outage or
   a reconnection waits for a fresh answer; otherwise the timer's answers keep it fresh, at a
   tuple of the consumer's connections per batch (~1 us). A second CI run (issue 33) showed why
   the time alone was not enough: a broker restarted within two ticks of the last answer, and
   the old worker folded a batch of the new log and wrote its state before its watch answered.
   What is left: a write already in flight when the broker stops (aiokafka sends it again to
   the new broker), and a fresh worker that then meets such an unreadable partition waits in
   recovery (Faust's "No event received for active tp" every 5 s; ``docs/operations.md``).

7. **Batches from the consumer** (:func:`deliver_in_batches`): faust-streaming 0.15.3 hands
   every fetched record to an agent through ``wait_first`` (four asyncio tasks per record), its
   conductor, a channel queue, a ``Stream`` and an ``Event``; at small engine steps that cost more
   than decoding and folding the record. The worker's input topic is instead collected from
   Faust's own fetch (``Consumer._wait_next_records``, with ``getmany``'s checks per record)
   into batches, by overriding the consumer's private ``_drain_messages`` in a subclass installed
   through the transport's ``Consumer`` class. ``getmany`` itself is not used: an async
   generator step and a high-watermark read (for Faust's monitor) per record cost as much as
   the record's Avro decoding at batch 4; the watermark is read once per partition and fetch.

8. **The table manager's start-up second** (:func:`table_manager_without_start_pause`):
   faust-streaming 0.15.3's ``TableManager.on_start`` sleeps a fixed second before it
   finalises the app's tables and starts their recovery, so that tables declared after the
   app started are still taken; the conductor waits for it ("Waiting for tables to be
   registered...") before the consumer subscribes and joins the group. The worker declares its
   one table before the app starts, so that second was a second of every start and of every
   failover (issue 33: the restarted worker's log, 1.0 s each time). The subclass does the same
   without the sleep; a table declared later fails loudly (Faust's "Too late to add tables").

9. **The fetch wait** (:func:`with_fetch_wait`): faust-streaming 0.15.3 builds the worker's
   aiokafka consumer with ``fetch_max_wait_ms=1500``, fixed. A broker answers a fetch as soon as
   it has ``fetch_min_bytes`` (1) for it, so on Apache Kafka the wait only bounds an idle fetch;
   the embedded Tansu does not: it holds a fetch that found nothing for most of the wait even
   when records arrive meanwhile (measured with a plain consumer against the embedded broker,
   one record produced every 50-700 ms: delivery p50 523 ms, max 1,559 ms at a 1,500 ms wait;
   85 / 223 ms at 500; 18 ms p50 at 100). Every record then waited up to 1.5 s before the worker
   saw it, most of the undisturbed freshness target (issue 33). The worker's consumer is built
   by a consumer-thread subclass that sets aiokafka's fetch wait to ``worker.fetch_wait_s``
   before the consumer starts (the private ``_fetch_max_wait_ms``, which ``start()`` hands to its
   ``Fetcher``).

Faust and aiokafka are imported inside the functions: replay imports this module and must not
pull in Faust.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any, Protocol

from sparseety.broker_compat import TopicIds
from sparseety.config import Config
from sparseety.errors import ConfigError
from sparseety.kafka import Record, aiokafka_settings

log = logging.getLogger("sparseety.worker")


class Consumed(Protocol):
    """What the worker reads of a consumed record: a :class:`~sparseety.kafka.Record` (refetched
    records, tests) or the message Faust's consumer built for it (item 7 hands those over as they
    are: a copy into a Record cost ~0.6 us a record, ~1 % of the worker's CPU at batch-4 steps)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes: ...


# --- 2. records the stream consumer skipped -------------------------------------------------


class Refetcher:
    """Reads offset ranges and committed offsets of one topic, outside the consumer group."""

    def __init__(self, cfg: Config, topic: str, group_id: str) -> None:
        self.cfg = cfg
        self.topic = topic
        self.group_id = group_id
        self._consumer: Any = None

    async def _client(self) -> Any:
        if self._consumer is None:
            from aiokafka import AIOKafkaConsumer

            # group_id only for OffsetFetch; the consumer never subscribes, so it never joins.
            self._consumer = AIOKafkaConsumer(
                **aiokafka_settings(self.cfg), group_id=self.group_id, enable_auto_commit=False
            )
            await self._consumer.start()
        return self._consumer

    async def committed(self, partition: int) -> int | None:
        """The group's committed offset for ``partition`` (None when nothing was committed)."""
        from aiokafka import TopicPartition

        client = await self._client()
        offset = await client.committed(TopicPartition(self.topic, partition))
        return int(offset) if offset is not None else None

    async def fetch(self, partition: int, start: int, end: int, timeout_s: float = 10.0) -> list[Record]:
        """Records with offsets in [start, end) (fewer if the log has holes there)."""
        from aiokafka import TopicPartition

        client = await self._client()
        tp = TopicPartition(self.topic, partition)
        client.assign([tp])
        client.seek(tp, start)
        out: list[Record] = []
        waited = 0.0
        while waited < timeout_s:
            batch = await client.getmany(tp, timeout_ms=500)
            msgs = batch.get(tp, [])
            if not msgs:
                waited += 0.5
                if await client.position(tp) >= end:
                    break
                continue
            for m in msgs:
                if start <= m.offset < end:
                    out.append(Record(m.topic, m.partition, m.offset, m.key, m.value))
            if msgs[-1].offset >= end - 1:
                break
        return out

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


_OFFSET = attrgetter("offset")


async def fill_holes(
    refetcher: Refetcher,
    partition: int,
    expected: int | None,
    batch: list[Consumed],
    on_refetch: Callable[[int], None],
) -> list[Consumed]:
    """``batch`` without re-deliveries of what was processed, plus what the consumer skipped.

    ``expected`` is the offset the batch must start at (None: unknown, then the group's
    committed offset); ``on_refetch`` is told how many records were re-read.
    """
    if expected is None:
        expected = await refetcher.committed(partition)
    if expected is not None and list(map(_OFFSET, batch)) == list(range(expected, expected + len(batch))):
        return batch  # exactly the offsets expected (the usual batch): nothing to drop or re-read
    out: list[Consumed] = []
    for msg in batch:
        if expected is not None and msg.offset < expected:
            continue  # already processed in this session (or committed)
        if expected is not None and msg.offset > expected:
            missing = await refetcher.fetch(partition, expected, msg.offset)
            if missing:
                log.warning(
                    "stream consumer skipped offsets %d..%d of partition %d; re-read %d records",
                    expected,
                    msg.offset - 1,
                    partition,
                    len(missing),
                )
                on_refetch(len(missing))
                out.extend(missing)
        out.append(msg)
        expected = msg.offset + 1
    return out


# --- 3. the table's changelog ---------------------------------------------------------------


class ChangelogTable:
    """One partition of a Faust table of raw bytes, read and written through its memory store.

    Faust's memory store is ``table.data``: ``.data`` (key -> value) and ``._key_partition``
    (key -> changelog partition), both private.
    """

    def __init__(self, table: Any, partition: int) -> None:
        self.table = table
        self.partition = partition
        self.flushes = 0
        # The memory store's dict (created once with the table's store, then only cleared and
        # updated in place): looked up once, not through Faust's ``Table.data`` property on
        # every read (the fold reads each new prefix block's key here: ~30 per admission).
        self._values: dict[bytes, bytes] | None = None

    def get(self, key: bytes) -> bytes | None:
        values = self._values
        if values is None:
            values = self._values = self.table.data.data
        return values.get(key)

    def keys(self, prefix: bytes) -> list[bytes]:
        """This partition's keys starting with ``prefix`` (the store holds every partition's)."""
        store = self.table.data
        owner = store._key_partition
        return [k for k in list(store.data) if k.startswith(prefix) and owner.get(k) == self.partition]

    async def write(self, items: list[tuple[bytes, bytes]], deleted: list[bytes]) -> None:
        """Store and send ``items`` in order, then the deletions; wait for the changelog's acks,
        then write the marker on its own (so a batch-granular watermark still covers them)."""
        store = self.table.data
        records: list[tuple[bytes, bytes | None]] = []
        for key, value in items:
            store.data[key] = value
            store._key_partition[key] = self.partition
            records.append((key, value))
        for key in deleted:
            store.data.pop(key, None)
            store._key_partition.pop(key, None)
            records.append((key, None))
        if not records:
            return
        await self._send(records)
        self.flushes += 1
        await self._send([(f"m|{self.partition}".encode(), str(self.flushes).encode())])

    async def _send(self, records: list[tuple[bytes, bytes | None]]) -> None:
        """Send ``records`` to this partition of the changelog as record batches; return once
        all are acknowledged (see item 3 above)."""
        topic = self.table.changelog_topic.get_topic_name()
        await send_batches(self.table.app, topic, list(records), self.partition)


async def send_batches(
    app: Any,
    topic: str,
    records: Sequence[tuple[bytes | None, bytes | None]],
    partition: int | None = None,
) -> None:
    """Send ``records`` (key, value) to ``topic`` as aiokafka record batches on the producer Faust
    started, in order per partition (``partition``, else the one aiokafka's ``send`` would pick
    for the key); return once all are acknowledged (item 3 above)."""
    if not records:
        return
    producer = app.producer._ensure_producer()  # the started AIOKafkaProducer
    by_partition: dict[int, list[tuple[bytes | None, bytes | None]]] = {}
    if partition is None:
        await producer.client._wait_on_metadata(topic)
        pick = producer._partition
        for key, value in records:
            by_partition.setdefault(pick(topic, None, key, value, key, value), []).append((key, value))
    else:
        by_partition[partition] = list(records)
    pending: list[Awaitable[Any]] = []
    for part, items in by_partition.items():
        batch = producer.create_batch()
        for key, value in items:
            if batch.append(key=key, value=value, timestamp=None) is None:
                if batch.record_count():
                    pending.append(await producer.send_batch(batch, topic, partition=part))
                    batch = producer.create_batch()
                if batch.append(key=key, value=value, timestamp=None) is None:
                    # Larger than a whole batch: aiokafka sends it alone (up to the request size).
                    pending.append(await producer.send(topic, value, key=key, partition=part))
        if batch.record_count():
            pending.append(await producer.send_batch(batch, topic, partition=part))
    await asyncio.gather(*pending)


# --- 4. the terminal spinner ------------------------------------------------------------------


def without_spinner(worker: Any) -> None:
    """Run a ``faust.Worker`` without its terminal spinner (see item 4 above); call before
    ``execute_from_commandline``, which configures logging."""
    worker.spinner = None


# --- 6. a broker that lost its log ----------------------------------------------------------


class LostLogWatch:
    """Whether the worker's changelog or input topic, once seen, is gone from the broker or is
    there under a new id (see item 6).

    Asked from a timer; the admin request runs on a thread with its own client
    (:class:`sparseety.broker_compat.TopicIds`), so it answers even when the worker's own
    clients wait on the lost topic.
    """

    def __init__(self, cfg: Config, changelog_topic: str) -> None:
        self.ids = TopicIds(cfg, [changelog_topic, cfg.topics.engine_events])
        self._asking = asyncio.Lock()  # one question at a time: the answers update ``ids``
        #: when (``time.monotonic``) the last question was asked that the broker answered with
        #: all the topics as first seen
        self.confirmed_at = float("-inf")

    async def lost(self) -> set[str] | None:
        """The topics that the broker lost since they were first seen (empty while it has them
        all); None while it does not answer."""
        async with self._asking:
            asked = time.monotonic()
            lost = await asyncio.to_thread(self.ids.lost)
        if lost == set():
            self.confirmed_at = max(self.confirmed_at, asked)
        return lost

    def confirmed_within(self, seconds: float) -> bool:
        """Whether the broker said it still had the log at most ``seconds`` ago."""
        return time.monotonic() - self.confirmed_at <= seconds


class ConsumerConnections:
    """Whether the worker's consumer opened a broker connection since last asked (item 6).

    Records from a restarted broker come over a connection opened after the restart, so a batch
    fetched on a connection the worker had not seen waits for the watch to confirm the log,
    however recent its last confirmation. Reads aiokafka's private ``AIOKafkaClient._conns``
    of the consumer Faust runs in its consumer thread (``Consumer._thread._consumer``): a dict
    read from this thread, so a read that races a change counts as a change.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._seen: tuple[Any, ...] = ()

    def _now(self) -> tuple[Any, ...]:
        try:
            conns = self.app.consumer._thread._consumer._client._conns
        except AttributeError as exc:  # pinned faust-streaming or aiokafka changed
            raise RuntimeError(f"no consumer connections ({exc}): revisit streams/compat.py item 6") from exc
        try:
            return tuple(conns.values())
        except RuntimeError:  # changed while read
            return ()

    def changed(self) -> bool:
        """True when a connection was opened or closed since the last call (and on the first)."""
        now = self._now()
        seen, self._seen = self._seen, now
        # aiokafka's connections compare by identity: a reconnection is a new object
        return not now or now != seen


# --- 7. batches straight from the consumer --------------------------------------------------

BatchHandler = Callable[[list[Consumed]], Awaitable[None]]


def deliver_in_batches(
    app: Any, source: Any, handler: BatchHandler, *, max_records: int, within_s: float
) -> None:
    """Make ``app``'s consumer hand the records of the topic ``source`` (a Faust topic of raw
    bytes, ``runtime.raw_topic``) to ``handler`` in batches.

    Call before anything touches ``app.consumer``. The consumer group, the assignment, the
    table's recovery and standby reads, offset tracking and the periodic commit stay Faust's;
    only the delivery of ``topic``'s records changes (see :class:`_BatchDrain`).
    """
    if getattr(app, "_consumer", None) is not None:
        raise RuntimeError("deliver_in_batches: the app's consumer exists already")
    if max_records <= 0 or within_s <= 0:
        raise ConfigError("deliver_in_batches needs max_records > 0 and within_s > 0")
    transport = app.transport
    base = transport.Consumer
    if not callable(getattr(base, "_drain_messages", None)):  # pinned faust-streaming changed
        raise RuntimeError(f"{base.__qualname__} has no _drain_messages: revisit streams/compat.py item 7")
    # An instance attribute: Transport.create_consumer instantiates ``self.Consumer``.
    transport.Consumer = type(
        f"Batch{base.__name__}",
        (_BatchDrain, base),
        {
            "batch_topic": source.get_topic_name(),
            "batch_handler": staticmethod(handler),
            "batch_max": max_records,
            "batch_within_s": within_s,
        },
    )
    # Subscribed like an agent's topic (acks on), but no channel ever receives its records.
    app.topics.add(source)


async def _deliver_each(callback: Callable[[Any], Awaitable[Any]], messages: list[Any]) -> None:
    """Faust's callback for each of ``messages``, in order (one task for a fetch's records)."""
    for message in messages:
        await callback(message)


class _BatchDrain:
    """Replaces faust-streaming 0.15.3's ``Consumer._drain_messages`` for one topic.

    Faust hands every fetched record to its conductor through ``wait_first(callback(message),
    suspend_flow.wait())``: four asyncio tasks and an ``asyncio.wait`` per record, then the
    conductor, a channel queue, a ``Stream`` and an ``Event`` before an agent sees it. At the
    engine's small StepBatches that path cost more than decoding and folding the record
    (``benchmarks/bench_worker.py --py-spy``, docs/benchmarks.md). Here the records of
    ``batch_topic`` that one or more fetches return (:meth:`_fetch`: ``Consumer.getmany`` as one
    loop, which keeps Faust's flow control, generation check and active-partition filter) are
    collected for up to
    ``batch_within_s`` or ``batch_max`` records, tracked as in flight (so a rebalance's
    ``wait_empty`` waits for them), handed to ``batch_handler`` at once, and acked only after it
    returned: Faust then commits them as it commits an agent's acks. Records of other topics (the
    table's changelog during recovery and for standbys) go to Faust's callback in order, as
    before, but one fetch's records in one task raced once against a suspended flow
    (``wait_first``), not four tasks per record: a restarted worker's ~15k changelog records
    spent about a third of the recovery's CPU there (issue 33, a py-spy profile). As in Faust's
    own loop, a flow suspended mid-way abandons what is not yet delivered.
    """

    batch_topic: str
    batch_handler: BatchHandler
    batch_max: int
    batch_within_s: float

    async def _drain_messages(self, fetcher: Any) -> None:
        me: Any = self
        callback = me.callback
        consumer_stopped, fetcher_stopped = me._stopped.is_set, fetcher._stopped.is_set
        read_offset = me._read_offset
        acks_enabled_for = me.app.topics.acks_enabled_for
        track = me.track_message
        topic, most, within = self.batch_topic, self.batch_max, self.batch_within_s
        batch: list[Any] = []
        first = 0.0
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                wait = max(0.0, within - (time.monotonic() - first)) if batch else 1.0
                others: list[Any] = []  # this fetch's records of other topics, in order
                for tp, message in await self._fetch(wait):
                    offset = message.offset
                    last = read_offset[tp]
                    if last is not None and offset < last:
                        continue  # a re-delivery Faust's own loop drops too
                    if last and offset - last > 1 and acks_enabled_for(message.topic):
                        await me._add_gap(tp, last + 1, offset)
                    if message.topic == topic:
                        if not batch:
                            first = time.monotonic()
                        track(message)
                        batch.append(message)
                    else:
                        others.append(message)
                    read_offset[tp] = offset
                    if len(batch) >= most:  # the rest of this fetch waits in the generator
                        await self._hand_over(batch)
                        batch = []
                if others:
                    await me.wait_first(_deliver_each(callback, others), me.suspend_flow.wait())
                if batch and time.monotonic() - first >= within:
                    await self._hand_over(batch)
                    batch = []
        except me.consumer_stopped_errors:
            if me.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if me.transport.app.should_stop:
                return
            raise
        except Exception as exc:  # the consumer service crashes, and with it the worker
            log.exception("batch delivery of %s failed: %r", topic, exc)
            raise

    async def _fetch(self, timeout: float) -> Any:
        """faust-streaming 0.15.3's ``Consumer.getmany`` without an async generator and with one
        high-watermark read per partition and fetch (Faust reads it, for its monitor only, per
        record: together a visible share of the worker's CPU at small StepBatches). Returns an
        iterator of ``(tp, message)`` that keeps Faust's checks per record, as the records are
        taken: the flow still active, the same consumer generation, an active (or buffered)
        partition."""
        me: Any = self
        records, active_partitions = await me._wait_next_records(timeout)
        app = me.app
        generation_id = app.consumer_generation_id
        if records is None or me.should_stop:
            return ()
        if not me.flow_active:
            me.log.dev("getmany called while flow not active. Seek back to committed offsets.")
            try:
                await me.perform_seek()
            except Exception as ex:
                me.log.warning(f"exception performing seek when flow not active {ex}")
            return ()
        return self._messages(records, active_partitions, generation_id)

    def _messages(self, records: Any, active_partitions: Any, generation_id: int) -> Iterator[Any]:
        me: Any = self
        app = me.app
        to_message = me._to_message
        buffered = me._buffered_partitions
        seen: set[Any] = set()
        if len(records) == 1:
            # One partition (a worker's usual fetch): Faust's round-robin over topics and
            # partitions (three generators a record) is this list in order.
            ((tp, listed),) = records.items()
            for record in listed:
                if not me.flow_active or app.consumer_generation_id != generation_id:
                    return
                if active_partitions is None or tp in active_partitions or tp in buffered:
                    if not seen:
                        seen.add(tp)
                        app.monitor.track_tp_end_offset(tp, me.highwater(tp))
                    yield tp, to_message(tp, record)
            return
        for tp, record in me.scheduler.iterate(records):
            if not me.flow_active or app.consumer_generation_id != generation_id:
                return
            if active_partitions is None or tp in active_partitions or tp in buffered:
                if tp not in seen:
                    seen.add(tp)
                    app.monitor.track_tp_end_offset(tp, me.highwater(tp))
                yield tp, to_message(tp, record)

    async def _hand_over(self, messages: list[Any]) -> None:
        me: Any = self
        await self.batch_handler(messages)  # Faust's messages: Consumed, no copies
        now = time.monotonic()
        inbound = me.app.monitor.stream_inbound_time  # the livelock detector reads it per partition
        ack = me.ack
        tp = None
        for m in messages:
            ack(m)
            if m.tp is not tp:  # each partition's time once per run of its records
                tp = m.tp
                inbound[tp] = now
        commit_every = me._commit_every
        if commit_every is not None and me._n_acked >= commit_every:
            me._n_acked = 0
            await me.commit()


# --- 8. the table manager's start-up second -------------------------------------------------


def table_manager_without_start_pause() -> type:
    """Faust's ``TableManager`` without the fixed second ``on_start`` sleeps before it
    finalises the tables (item 8); pass it as the app's ``TableManager`` setting."""
    from faust.tables import TableManager

    if not callable(getattr(TableManager, "_update_channels", None)):  # pinned faust-streaming changed
        raise RuntimeError("TableManager has no _update_channels: revisit streams/compat.py item 8")

    class PromptTableManager(TableManager):  # type: ignore[misc]
        async def on_start(self) -> None:
            if not self.should_stop:
                await self._update_channels()
                await self.recovery.start()

    return PromptTableManager


# --- 9. the fetch wait ------------------------------------------------------------------------


def with_fetch_wait(app: Any, wait_s: float) -> None:
    """Make ``app``'s consumer ask the broker to hold a fetch for at most ``wait_s`` (item 9).

    Call before anything touches ``app.consumer``; composes with :func:`deliver_in_batches`.
    """
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    if getattr(app, "_consumer", None) is not None:
        raise RuntimeError("with_fetch_wait: the app's consumer exists already")
    if wait_s <= 0:
        raise ConfigError("with_fetch_wait needs wait_s > 0")
    if not callable(getattr(AIOKafkaConsumerThread, "_create_worker_consumer", None)):
        raise RuntimeError("no ConsumerThread._create_worker_consumer: revisit streams/compat.py item 9")
    wait_ms = max(1, round(wait_s * 1000))

    class FetchWaitConsumerThread(AIOKafkaConsumerThread):  # type: ignore[misc]
        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            if not hasattr(consumer, "_fetch_max_wait_ms"):  # pinned aiokafka changed
                raise RuntimeError("no AIOKafkaConsumer._fetch_max_wait_ms: revisit streams/compat.py item 9")
            # read by AIOKafkaConsumer.start(), which builds its Fetcher with it
            consumer._fetch_max_wait_ms = wait_ms
            return consumer

    def _new_consumer_thread(self: Any) -> Any:
        return FetchWaitConsumerThread(self, loop=self.loop, beacon=self.beacon)

    transport = app.transport
    base = transport.Consumer
    # An instance attribute, as deliver_in_batches': Transport.create_consumer instantiates it.
    transport.Consumer = type(
        f"FetchWait{base.__name__}", (base,), {"_new_consumer_thread": _new_consumer_thread}
    )
