"""ClickHouseSink: the sink contract over a :class:`~sparseety.sinks.clickhouse.client.Store`.

Records are buffered per partition in *chunks* (a contiguous offset range of one partition).
:meth:`ClickHouseSink.flush` writes every pending chunk with one insert per table (all
partitions together, so the store sees about one insert per table per flush), retrying with
exponential backoff. When a table's insert keeps failing, the chunks are retried one by one to
find the partitions at fault, and the failure is classified:

* a *data error* (a value the column cannot hold, a type mismatch: the same rows would fail
  forever) never stops a partition. The chunk is bisected by record until the failing records
  are isolated; every other record is written, and each failing one becomes a row of
  ``dead_letters`` (component ``sink``, the record as JSON, the error, its topic/partition/offset).
  The chunk then counts as written and the partition moves on.
* an *infrastructure error* (the store unreachable, out of disk) keeps the chunk buffered and is
  reported in a :class:`~sparseety.errors.SinkWriteError`; the consumer pauses that partition and
  retries it later (``sparseety:sink_stopped_partitions``, alert ``SparseetySinkPartitionsStopped``).

An error is a data error when the client says so (``DataError``, a Python value/overflow error
while serializing) or ClickHouse answers with a value/type error code; an unclassified error
counts as one only when the store still answers ``SELECT 1`` right after it.

Idempotency comes from the tables, not from the writer: every row has a deterministic key and
the tables are ReplacingMergeTrees, so a chunk written twice (crash between write and offset
commit, replay) reads back once under FINAL. Each insert also carries an
``insert_deduplication_token`` that is reused only by retries of that same insert, so an insert
that succeeded on the server but failed on the way back is not stored twice. Tokens are never
derived from Kafka positions: the embedded broker keeps topics in memory, so after its restart the
same offsets carry new records, and a position token would silently drop them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import SinkWriteError, StoreError
from sparseety.kafka import Record
from sparseety.lifecycle import pid_alive
from sparseety.schema_store import SchemaStore, WireSchema
from sparseety.serde import SINGLE_OBJECT_HEADER

from ..base import Batch, Chunk, ChunkBuffer, FlushResult, Sink
from . import avro_batch
from .client import Store
from .rows import RECORDS, RowBuffer
from .tables import DEAD_LETTERS, SINK_TABLES, Table

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
#: A dead-lettered record's JSON is cut to this many characters (the error says so).
MAX_DEAD_VALUE_CHARS = 64 * 1024

#: Exception classes (by name, as :class:`StoreError` records them in ``cause``) that mean the
#: rows themselves cannot be written: clickhouse-connect's ``DataError`` and Python's own errors
#: while serializing a value (``struct.error`` for an int out of an Int32's range).
_DATA_ERROR_CAUSES = frozenset({"DataError", "OverflowError", "ValueError", "TypeError", "error"})
#: ClickHouse error codes that are about values, not about the server: CANNOT_PARSE_TEXT (6),
#: CANNOT_PARSE_INPUT_ASSERTION_FAILED (27), CANNOT_PARSE_DATETIME (41), ILLEGAL_TYPE_OF_ARGUMENT
#: (43), TYPE_MISMATCH (53), ARGUMENT_OUT_OF_BOUND (69), CANNOT_CONVERT_TYPE (70),
#: CANNOT_PARSE_NUMBER (72), INCORRECT_DATA (117), VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE (321),
#: DECIMAL_OVERFLOW (407).
_DATA_ERROR_CODES = frozenset({6, 27, 41, 43, 53, 69, 70, 72, 117, 321, 407})


#: ClickHouse error codes that are about the server, however well it answers ``SELECT 1``:
#: TIMEOUT_EXCEEDED (159), TOO_MANY_SIMULTANEOUS_QUERIES (202), SOCKET_TIMEOUT (209),
#: NETWORK_ERROR (210), ABORTED (236), MEMORY_LIMIT_EXCEEDED (241), TABLE_IS_READ_ONLY (242),
#: NOT_ENOUGH_SPACE (243), TOO_MANY_PARTS (252), READONLY (164), UNKNOWN_TABLE (60).
_INFRA_ERROR_CODES = frozenset({60, 159, 164, 202, 209, 210, 236, 241, 242, 243, 252})


def is_data_error(exc: StoreError) -> bool:
    """Whether ``exc`` is about the rows (retrying cannot help), not about the store."""
    cause = exc.fields.get("cause")
    code = exc.fields.get("code")
    return cause in _DATA_ERROR_CAUSES or code in _DATA_ERROR_CODES


def is_infra_error(exc: StoreError) -> bool:
    """Whether ``exc`` is known to be about the store (a data error never is)."""
    return not is_data_error(exc) and exc.fields.get("code") in _INFRA_ERROR_CODES


@dataclass(eq=False)
class _Chunk(Chunk):
    rows: RowBuffer = field(default_factory=RowBuffer)
    written: set[str] = field(default_factory=set)
    sealed: bool = False
    #: ``(offset, record name, record, rows per table before it)`` of every record, so that a
    #: chunk that cannot be written can be split by record and its bad records dead-lettered.
    records: list[tuple[int, str, Mapping[str, Any], dict[str, int]]] = field(default_factory=list)
    #: RequestAccounting payloads taken undecoded (:meth:`ClickHouseSink.add_encoded`), by
    #: writer fingerprint; written together (every table) or handed back together.
    encoded: dict[int, list[Record]] = field(default_factory=dict)
    encoded_written: bool = False

    def encoded_records(self) -> int:
        """Undecoded records still to write."""
        return 0 if self.encoded_written else sum(len(v) for v in self.encoded.values())

    def pending_tables(self) -> list[Table]:
        return [t for t in SINK_TABLES if t.name not in self.written and self.rows.rows(t)]


class _InsertFailed(Exception):
    """An insert failed after all its attempts (internal); ``data``: a data error."""

    def __init__(self, message: str, *, data: bool, infra: bool = False) -> None:
        super().__init__(message)
        self.data = data
        self.infra = infra


class ClickHouseSink(Sink):
    """Batched, idempotent writer of RequestAccounting, UsageWindow and DeadLetter records.

    Args:
        store: Where to write (tables in ``store.database``, migrated).
        batch_max_rows: How many buffered rows call for a flush (read by callers that batch).
        max_retries: Extra attempts per insert before it counts as failing.
        retry_backoff_s: First backoff; doubles per attempt, capped at 10 s.
        own_store: Close ``store`` in :meth:`close`.
        encoded: Take RequestAccounting payloads of the current schema undecoded when the store
            is embedded (:mod:`~sparseety.sinks.clickhouse.avro_batch`); False keeps every record
            on the Python path.
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
        encoded: bool = True,
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
        self.encoded = encoded
        self._container_schemas: dict[int, str] = {}
        self._scratch: Path | None = None
        self.totals = FlushResult()

    @classmethod
    def from_config(cls, cfg: Config, **options: Any) -> ClickHouseSink:
        """Open (and migrate) the configured store and build a sink that owns it.

        Options: ``store`` (use this open store instead; not closed by the sink), ``owner``
        (recorded as the owner of an embedded path), ``migrate`` (default True).
        """
        from .migrate import migrate

        store = options.pop("store", None)
        owner = options.pop("owner", "sparseety sink")
        own = store is None
        if store is None:
            store = Store.open(cfg, owner=owner)
        try:
            if options.pop("migrate", True):
                migrate(store, ttl_days=cfg.clickhouse.ttl_days)
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
        chunk.records.append((offset, record_name, record, mark))
        chunk.last = offset

    def takes_encoded(self, writer: WireSchema, store: SchemaStore) -> bool:
        """RequestAccounting of the current schema, into an embedded store: ClickHouse decodes it.

        Older writer schemas lack fields (they are resolved in Python), and a ClickHouse server
        cannot read the sink's local file, so both keep the Python path.
        """
        current = store.current.get(ev.REQUEST_ACCOUNTING)
        return (
            self.encoded
            and self.store.target.kind == "chdb"
            and writer.name == ev.REQUEST_ACCOUNTING
            and current is not None
            and writer.fingerprint == current.fingerprint
            and avro_batch.fits(writer)
        )

    def add_encoded(
        self, writer: WireSchema, value: bytes, *, key: bytes | None, topic: str, partition: int, offset: int
    ) -> None:
        if writer.fingerprint not in self._container_schemas:
            if writer.name != ev.REQUEST_ACCOUNTING or not avro_batch.fits(writer):
                raise ValueError(f"{writer.name} ({writer.fingerprint:016x}) is not taken undecoded")
            self._container_schemas[writer.fingerprint] = avro_batch.container_schema(writer)
        chunk = self._buffer.chunk_for(topic, partition, offset)
        chunk.encoded.setdefault(writer.fingerprint, []).append(Record(topic, partition, offset, key, value))
        chunk.last = offset
        # its child rows are known once ClickHouse has read it: until then it counts as its one
        # requests row (what bounds a batch here is the payload bytes, which are small)
        self._pending_rows += 1

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
        self._pending_rows = sum(
            sum(c.rows.rows(t) for t in c.pending_tables()) + c.encoded_records() for c in self._buffer.chunks
        )

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
        self.totals.merge(dataclasses.replace(result, undecoded=[]))  # handed back: not ours to count
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
        failed: list[_Chunk] = self._write_encoded(chunks, result)
        for table in SINK_TABLES:
            todo = [c for c in chunks if c not in failed and table in c.pending_tables()]
            if not todo:
                continue
            try:
                self._write(table, todo, result, self.max_retries)
            except _InsertFailed as exc:
                if len(todo) == 1:
                    if not self._salvage(table, todo[0], exc, result):
                        failed.append(todo[0])
                    continue
                # Find the partitions at fault: one attempt per chunk (the store may be down).
                for c in todo:
                    try:
                        self._write(table, [c], result, 0)
                    except _InsertFailed as one:
                        if not self._salvage(table, c, one, result):
                            failed.append(c)
        done = [c for c in chunks if c not in failed]
        # a chunk whose records were all handed back undecoded is not written: they come back
        # through add() as new chunks
        result.written.extend(c.batch for c in done if c.records or c.encoded)
        result.failed.extend(c.batch for c in failed)
        self._buffer.remove(done)
        self._recount()
        return result

    def _write_encoded(self, chunks: list[_Chunk], result: FlushResult) -> list[_Chunk]:
        """Write the undecoded records of ``chunks`` (:mod:`avro_batch`); return the chunks that
        failed on a store error (they stay buffered).

        When ClickHouse refuses the batch for its data (a body it cannot parse, a value the
        Python path would judge), nothing of it is retried here: every record goes back to the
        caller in ``result.undecoded``, which decodes them one by one (dead-lettering the bad
        ones) and adds them again. Tables written before the refusal hold rows the rewrite
        replaces with the same rows (same key, same ``_version``).
        """
        todo = [c for c in chunks if c.encoded_records()]
        if not todo:
            return []
        groups: dict[int, list[Record]] = defaultdict(list)
        for c in todo:
            for fp, records in c.encoded.items():
                groups[fp].extend(records)
        try:
            for fp, records in groups.items():
                self._write_container(self._container_schemas[fp], records, result)
        except _InsertFailed as exc:
            if exc.data or not (exc.infra or not self._store_answers()):
                log.warning(
                    "sink: ClickHouse refused %d undecoded records (%s); decoding them in Python",
                    sum(c.encoded_records() for c in todo),
                    exc,
                )
                for c in todo:
                    for records in c.encoded.values():
                        result.undecoded.extend(records)
                    c.encoded = {}
                return []
            log.error(
                "sink: writing undecoded records for %s failed (store error): %s",
                [c.batch for c in todo],
                exc,
            )
            return todo
        for c in todo:
            c.encoded_written = True
        return []

    def _write_container(self, schema_json: str, records: list[Record], result: FlushResult) -> None:
        """One container file for ``records``, parsed once into a temporary table; checked by one
        query, then one insert per table from that table."""
        container = avro_batch.build_container(
            schema_json, (memoryview(e.value)[SINGLE_OBJECT_HEADER:] for e in records)
        )
        path = self._scratch_dir() / f"accounting-{os.getpid()}-{uuid.uuid4().hex}.avro"
        stage = f"sparseety_sink_stage_{uuid.uuid4().hex}"
        try:
            try:
                path.write_bytes(container.data)
                self.store.command(avro_batch.stage_sql(stage, str(path)))
                _, rows = self.store.query_rows(avro_batch.check_sql(stage, container.nonce))
            except StoreError as exc:
                # whatever ClickHouse says about this file (a body it cannot parse, or a store
                # that is down): the Python path judges each record, and writes or holds them
                raise _InsertFailed(f"reading the batch failed: {exc}", data=True) from exc
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
            n, bad, per_table = avro_batch.row_counts(rows[0])
            if n != container.records or bad:
                raise _InsertFailed(
                    f"{bad} of {container.records} records need the Python path's judgement"
                    + (f" (ClickHouse read {n})" if n != container.records else ""),
                    data=True,
                )
            for table in avro_batch.TABLES:
                if per_table[table.name]:
                    sql = avro_batch.insert_sql(table, self.target(table), stage)

                    def insert(settings: dict[str, Any], sql: str = sql) -> object:
                        return self.store.command(sql, settings=settings)

                    self._attempts(table, self.max_retries, insert)
                    # rows counted by ClickHouse over the same records in the check above
                    result.rows[table.name] = result.rows.get(table.name, 0) + per_table[table.name]
                    result.inserts += 1
        finally:
            with contextlib.suppress(Exception):
                self.store.command(f"DROP TEMPORARY TABLE IF EXISTS {stage}")

    def _scratch_dir(self) -> Path:
        """Where container files live: inside the embedded store's own path (chDB reads it)."""
        if self._scratch is None:
            assert self.store.target.path is not None
            scratch = self.store.target.path / "sparseety-sink"
            scratch.mkdir(exist_ok=True)
            for old in scratch.glob("accounting-*.avro"):  # left by a process that crashed
                pid = old.name.split("-")[1]
                if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                    with contextlib.suppress(OSError):
                        old.unlink()
            self._scratch = scratch
        return self._scratch

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
        self._insert(table, cols, result, retries)
        for chunk in chunks:
            chunk.written.add(table.name)

    def _store_answers(self) -> bool:
        """Whether the store still answers a trivial query (then a failing insert is about its rows)."""
        try:
            self.store.query("SELECT 1")
        except Exception:
            return False
        return True

    def _salvage(self, table: Table, chunk: _Chunk, exc: _InsertFailed, result: FlushResult) -> bool:
        """Write what can be written of ``chunk`` into ``table`` after its insert failed.

        Returns False (the chunk stays buffered, its partition is paused) on an infrastructure
        error. On a data error the chunk is bisected by record: every record that can be written
        is, each one that cannot becomes a ``dead_letters`` row, and the table counts as written.
        """
        if exc.infra or not (exc.data or self._store_answers()):
            log.error("sink: writing %s for %s failed (store error): %s", table.name, chunk.batch, exc)
            return False
        log.warning(
            "sink: writing %s for %s failed on its data, isolating the bad records: %s",
            table.name,
            chunk.batch,
            exc,
        )
        bounds = [mark[table.name] for *_, mark in chunk.records] + [chunk.rows.rows(table)]
        rejected: list[tuple[int, str]] = []
        # An unclassified error counts as a data error only if the store took other rows of this
        # chunk, or another record failed with a classified data error: an error that every
        # row gets (an overloaded server that still answers SELECT 1) is not about the rows.
        proof = {"data": exc.data}

        def split(lo: int, hi: int, error: _InsertFailed | None) -> None:
            if bounds[lo] == bounds[hi]:
                return
            if error is None:
                columns = chunk.rows.columns[table.name]
                cols = [columns[c][bounds[lo] : bounds[hi]] for c in table.columns]
                try:
                    self._insert(table, cols, result, 0)
                    proof["data"] = True
                    return
                except _InsertFailed as failed:
                    if failed.infra or not (failed.data or self._store_answers()):
                        raise
                    proof["data"] = proof["data"] or failed.data
                    error = failed
            if hi - lo == 1:
                rejected.append((lo, str(error)))
                return
            mid = (lo + hi) // 2
            split(lo, mid, None)
            split(mid, hi, None)

        try:
            split(0, len(chunk.records), exc)
            if rejected and not proof["data"]:
                raise _InsertFailed(f"every record failed: {exc}", data=False, infra=True)
            if rejected:
                self._dead_letter(table, chunk, rejected, result)
        except _InsertFailed as infra:
            log.error("sink: writing %s for %s failed (store error): %s", table.name, chunk.batch, infra)
            return False
        chunk.written.add(table.name)
        return True

    def _dead_letter(
        self, table: Table, chunk: _Chunk, rejected: list[tuple[int, str]], result: FlushResult
    ) -> None:
        """Write the records at ``rejected`` (index, error) of ``chunk`` to ``dead_letters``.

        Keyed by the record's own position (``dlq_topic`` = ``sink:<topic>:<table>``), so a
        replay of the same range rewrites the same rows.
        """
        now = time.time_ns()
        rows: dict[str, list[Any]] = {c: [] for c in DEAD_LETTERS.columns}
        for i, error in rejected:
            offset, name, record, _ = chunk.records[i]
            value = json.dumps(record, default=_json_default, sort_keys=True)
            if len(value) > MAX_DEAD_VALUE_CHARS:
                value = value[:MAX_DEAD_VALUE_CHARS]
                error += f" (record JSON cut to {MAX_DEAD_VALUE_CHARS} characters)"
            for col, v in (
                ("dlq_topic", f"sink:{chunk.topic}:{table.name}"),
                ("dlq_partition", chunk.partition),
                ("dlq_offset", offset),
                ("error_type", "SinkDataError"),
                ("reason", f"{name} -> {table.name}: {error}"[:4096]),
                ("component", "sink"),
                ("topic", chunk.topic),
                ("partition", chunk.partition),
                ("offset", offset),
                ("key", None),
                ("value", value),
                ("ts_ns", now),
            ):
                rows[col].append(v)
            log.error(
                "sink: dead-lettered %s at %s[%d]@%d (%s)", name, chunk.topic, chunk.partition, offset, error
            )
        self._insert(DEAD_LETTERS, [rows[c] for c in DEAD_LETTERS.columns], result, self.max_retries)
        result.rejected += len(rejected)

    def _insert(self, table: Table, cols: list[list[Any]], result: FlushResult, retries: int) -> None:
        self._attempts(
            table,
            retries,
            lambda settings: self.store.insert(self.target(table), cols, table.columns, settings=settings),
        )
        result.rows[table.name] = result.rows.get(table.name, 0) + len(cols[0])
        result.inserts += 1

    def _attempts(self, table: Table, retries: int, insert_with: Callable[[dict[str, Any]], object]) -> None:
        """``insert_with(settings)`` with up to ``retries`` retries; :class:`_InsertFailed` after."""
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
            # a data error fails the same way every time: do not wait for it
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, StoreError) and not is_data_error(e)),
            sleep=self._sleep,
            before_sleep=warn,
            reraise=True,
        )
        try:
            insert(insert_with, {"insert_deduplication_token": token})
        except StoreError as exc:
            raise _InsertFailed(str(exc), data=is_data_error(exc), infra=is_infra_error(exc)) from exc

    def close(self) -> None:
        if self._own_store:
            self.store.close()


def _json_default(value: Any) -> Any:
    """JSON for what records hold besides JSON types (bytes: hex)."""
    if isinstance(value, bytes | bytearray):
        return value.hex()
    return repr(value)
