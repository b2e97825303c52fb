"""ClickHouseSink: the sink contract over a :class:`~sparseety.sinks.clickhouse.client.Store`.

Records are buffered per partition in *chunks* (a contiguous offset range of one partition).
:meth:`ClickHouseSink.flush` writes every pending chunk with one insert per table (all
partitions together, so the store sees about one insert per table per flush), retrying with
exponential backoff. When a table's insert keeps failing, the chunks are retried one by one to
find the partitions at fault; those stay buffered and are reported in a
:class:`~sparseety.errors.SinkWriteError`, the others count as written.

Idempotency comes from the tables, not from the writer: every row has a deterministic key and
the tables are ReplacingMergeTrees, so a chunk written twice (crash between write and offset
commit, replay) reads back once under FINAL. Each insert also carries an
``insert_deduplication_token`` that is reused only by retries of that same insert, so an insert
that succeeded on the server but failed on the way back is not stored twice. Tokens are never
derived from Kafka positions: the embedded broker keeps topics in memory, so after its restart the
same offsets carry new records, and a position token would silently drop them.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tenacity

from sparseety.config import Config
from sparseety.errors import SinkWriteError, StoreError
from sparseety.sinks.base import Batch, Chunk, ChunkBuffer, FlushResult, Sink
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.rows import RECORDS, RowBuffer
from sparseety.sinks.clickhouse.tables import SINK_TABLES, Table

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0


@dataclass(eq=False)
class _Chunk(Chunk):
    rows: RowBuffer = field(default_factory=RowBuffer)
    written: set[str] = field(default_factory=set)
    sealed: bool = False

    def pending_tables(self) -> list[Table]:
        return [t for t in SINK_TABLES if t.name not in self.written and self.rows.rows(t)]


class _InsertFailed(Exception):
    """An insert failed after all its attempts (internal)."""


class ClickHouseSink(Sink):
    """Batched, idempotent writer of RequestAccounting, UsageWindow and DeadLetter records.

    Args:
        store: Where to write (tables in ``store.database``, migrated).
        batch_max_rows: How many buffered rows call for a flush (read by callers that batch).
        max_retries: Extra attempts per insert before it counts as failing.
        retry_backoff_s: First backoff; doubles per attempt, capped at 10 s.
        own_store: Close ``store`` in :meth:`close`.
        sleep: Injected for tests.
    """

    records = RECORDS

    def __init__(
        self,
        store: Store,
        *,
        batch_max_rows: int = 50_000,
        max_retries: int = 8,
        retry_backoff_s: float = 0.5,
        own_store: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.batch_max_rows = batch_max_rows
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._own_store = own_store
        self._sleep = sleep
        self._buffer = ChunkBuffer(lambda topic, partition, offset: _Chunk(topic, partition, offset, offset))
        self._pending_rows = 0
        self._token_prefix = uuid.uuid4().hex[:12]
        self._inserts = itertools.count()
        self.totals = FlushResult()

    @classmethod
    def from_config(cls, cfg: Config, **options: Any) -> ClickHouseSink:
        """Open (and migrate) the configured store and build a sink that owns it.

        Options: ``store`` (use this open store instead; not closed by the sink), ``owner``
        (recorded as the owner of an embedded path), ``migrate`` (default True).
        """
        from sparseety.sinks.clickhouse.migrate import migrate

        store = options.pop("store", None)
        owner = options.pop("owner", "sparseety sink")
        own = store is None
        if store is None:
            store = Store.open(cfg, owner=owner)
        try:
            if options.pop("migrate", True):
                migrate(store)
        except BaseException:
            if own:
                store.close()
            raise
        return cls(
            store,
            batch_max_rows=cfg.sink.batch_max_rows,
            max_retries=cfg.sink.max_retries,
            retry_backoff_s=cfg.sink.retry_backoff_s,
            own_store=own,
            **options,
        )

    # --- buffering --------------------------------------------------------------------------

    def add(
        self, record_name: str, record: Mapping[str, Any], *, topic: str, partition: int, offset: int
    ) -> None:
        chunk = self._buffer.chunk_for(topic, partition, offset)
        mark = chunk.rows.mark()
        try:
            added = chunk.rows.add(record_name, record, topic=topic, partition=partition, offset=offset)
        except Exception:
            chunk.rows.rollback(mark)  # a half-appended record would misalign the columns
            raise
        self._pending_rows += added
        chunk.last = offset

    def pending_rows(self) -> int:
        return self._pending_rows

    def pending_batches(self) -> list[Batch]:
        return self._buffer.batches()

    def discard(self, topic: str, partition: int) -> int:
        before = self._pending_rows
        self._buffer.discard(topic, partition)
        self._recount()
        return before - self._pending_rows

    def _recount(self) -> None:
        self._pending_rows = sum(c.rows.rows(t) for c in self._buffer.chunks for t in c.pending_tables())

    def _seal(self) -> list[_Chunk]:
        """Close every open chunk (later records start new ones); return all to write."""
        chunks = self._buffer.seal()
        for c in chunks:
            c.sealed = True
        return chunks

    # --- writing ----------------------------------------------------------------------------

    def target(self, table: Table) -> str:
        """``db.table`` an insert for ``table`` goes to."""
        return self.store.table(table.name)

    def flush(self) -> FlushResult:
        result = self._write_chunks(self._seal())
        self.totals.merge(result)
        if result.failed:
            raise SinkWriteError(
                f"sink could not write {len(result.failed)} batch(es) after {self.max_retries} retries: "
                + ", ".join(
                    f"{b.topic}[{b.partition}]@{b.first_offset}..{b.last_offset}" for b in result.failed
                )
                + "; they stay buffered and will be retried",
                failed=[b.as_tuple() for b in result.failed],
                result=result,
            )
        return result

    def _write_chunks(self, chunks: list[_Chunk]) -> FlushResult:
        """Write ``chunks``, one insert per table; the result names the chunks that failed."""
        result = FlushResult()
        failed: list[_Chunk] = []
        for table in SINK_TABLES:
            todo = [c for c in chunks if c not in failed and table in c.pending_tables()]
            if not todo:
                continue
            try:
                self._write(table, todo, result, self.max_retries)
            except _InsertFailed as exc:
                if len(todo) == 1:
                    failed.append(todo[0])
                    log.error("sink: writing %s for %s failed: %s", table.name, todo[0].batch, exc)
                    continue
                # Find the partitions at fault: one attempt per chunk (the store may be down).
                for c in todo:
                    try:
                        self._write(table, [c], result, 0)
                    except _InsertFailed as one:
                        failed.append(c)
                        log.error("sink: writing %s for %s failed: %s", table.name, c.batch, one)
        done = [c for c in chunks if c not in failed]
        result.written.extend(c.batch for c in done)
        result.failed.extend(c.batch for c in failed)
        self._buffer.remove(done)
        self._recount()
        return result

    def _write(self, table: Table, chunks: list[_Chunk], result: FlushResult, retries: int) -> None:
        if len(chunks) == 1:
            cols: list[list[Any]] = [chunks[0].rows.columns[table.name][c] for c in table.columns]
        else:
            cols = []
            for c in table.columns:
                merged = list(chunks[0].rows.columns[table.name][c])
                for ch in chunks[1:]:
                    merged.extend(ch.rows.columns[table.name][c])
                cols.append(merged)
        n = len(cols[0])
        token = f"{self._token_prefix}-{next(self._inserts)}"

        def warn(state: tenacity.RetryCallState) -> None:
            log.warning(
                "sink: insert into %s failed (attempt %d of %d), retrying in %.1f s: %s",
                table.name,
                state.attempt_number,
                retries + 1,
                state.upcoming_sleep,
                state.outcome.exception() if state.outcome else None,
            )

        # every attempt reuses the token: a retry of an insert the server did store is dropped
        insert = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retries + 1),
            wait=tenacity.wait_exponential(multiplier=self.retry_backoff_s, max=MAX_BACKOFF_S),
            retry=tenacity.retry_if_exception_type(StoreError),
            sleep=self._sleep,
            before_sleep=warn,
            reraise=True,
        )
        try:
            insert(
                self.store.insert,
                self.target(table),
                cols,
                table.columns,
                settings={"insert_deduplication_token": token},
            )
        except StoreError as exc:
            raise _InsertFailed(str(exc)) from exc
        for c in chunks:
            c.written.add(table.name)
        result.rows[table.name] = result.rows.get(table.name, 0) + n
        result.inserts += 1

    def close(self) -> None:
        if self._own_store:
            self.store.close()
