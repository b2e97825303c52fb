"""The sink's fast path (sinks/clickhouse/avro_batch.py): ClickHouse decodes RequestAccounting
payloads itself and writes exactly the rows the Python path writes, or hands the batch back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from sparseety.errors import DecodeError
from sparseety.schema_store import SchemaStore, full_name, read_schema_files, schema_dir
from sparseety.serde import Decoder, Encoder
from sparseety.sinks.clickhouse import avro_batch
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.tables import SINK_TABLES
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store

CONTRACT = SchemaStore.load()
NOW = time.time_ns()  # request_tokens' TTL drops rows that finished long ago as they are inserted


@pytest.fixture
def stores(tmp_path_factory: pytest.TempPathFactory, unique: str) -> Iterator[tuple[Store, Store]]:
    with (
        throwaway_store(chdb_config(tmp_path_factory, f"py{unique}")) as py,
        throwaway_store(chdb_config(tmp_path_factory, f"fast{unique}")) as fast,
    ):
        migrate(py)
        migrate(fast)
        yield py, fast


def shapes() -> list[dict[str, Any]]:
    """RequestAccounting records of every shape that changes which rows are written."""
    u = f"{f.EID}/r"
    return [
        f.accounting(f"{u}1", finished_ts_ns=NOW),  # segments, one block use, raw tokens
        f.accounting(  # nothing nested, no token records (written before schema v3)
            f"{u}2",
            finished_ts_ns=NOW + 1,
            block_uses=[],
            timeline={"segments": [], "attention_window": None},
            token_privacy="",
            prompt_token_ids=[],
            output_token_ids=[],
            evicted_tokens=5,  # schema v1's window release: both paths add it to window_released_tokens
            window_released_tokens=3,
        ),
        f.accounting(  # experts, window, hashed tokens, every segment enum, a LoRA
            f"{u}3",
            finished_ts_ns=NOW + 2,
            lora_name="adapter-ä",
            expert_num_layers=2,
            expert_num_experts=3,
            expert_counts=[3, 1, 0, 4, 0, 2**40],
            block_uses=[
                {"block_hash": b"\x00\xff\x80h0", "lifetime_seq": -1, "role": "recomputed", "tokens": 16},
                {"block_hash": b"", "lifetime_seq": 9, "role": "computed", "tokens": 0},
                {"block_hash": b"h2", "lifetime_seq": 2**40, "role": "cached", "tokens": 16},
            ],
            timeline={
                "segments": [
                    f.segment(
                        0, 4, "prompt", "cached", source_request_uid=f"{u}0", kv_fate="window_released"
                    ),
                    f.segment(4, 8, "prompt", "recomputed_after_preemption", kv_fate="skipped"),
                    f.segment(8, 9, "prompt", "recomputed_after_eviction"),
                    f.segment(9, 10, "prompt", "not_computed"),
                    f.segment(10, 12, "output", "computed", draft_accepted=True),
                ],
                "attention_window": 4096,
            },
            token_privacy="hashed",
            prompt_token_ids=[],
            prompt_token_hashes=[-(2**63), 0, 2**63 - 1],
            output_token_ids=[],
        ),
        f.accounting(  # expert counts without layers: no expert_load row; privacy none
            f"{u}4",
            finished_ts_ns=NOW + 3,
            expert_num_layers=0,
            expert_num_experts=0,
            expert_counts=[1, 2],
            token_privacy="none",
            prompt_token_ids=[],
            output_token_ids=[],
        ),
        f.accounting(  # incomplete, closed by idle timeout, unicode tenant and ids
            f"{u}5-é",
            tenant="テナント 🚀",
            model="mödel",
            session_id="sess-ü",
            complete=False,
            finish_reason="incomplete",
            incomplete_reason="idle_timeout",
            seq_gap=True,
            consistent=False,
            finished_ts_ns=NOW + 4,
            est_flops=float("nan"),
        ),
        # two versions of one request: the complete one wins whatever the order
        f.accounting(f"{u}6", complete=False, incomplete_reason="engine_stopped", finished_ts_ns=NOW + 9),
        f.accounting(f"{u}6", finished_ts_ns=NOW + 5, output_tokens=7),
        f.accounting(f"{u}7", finished_ts_ns=-5, token_privacy=""),  # a negative clock: _version clamps
        # KV memory-time: two groups (byte-ms floored once per request), and bytes unknown (NULL)
        f.accounting(
            f"{u}8", finished_ts_ns=NOW + 6, kv_groups=[_kv(), _kv(bytes_per_block=1000)], kv_peak_bytes=7
        ),
        f.accounting(f"{u}9", finished_ts_ns=NOW + 7, kv_groups=[_kv(bytes_per_block=0)], kv_peak_bytes=3),
    ]


def _kv(**over: Any) -> dict[str, Any]:
    return f.kv_group(never_held_blocks=1, block_ns=3_000_000_001, block_ns_amortized=2_000_000_003, **over)


def snapshot(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows under FINAL, every column, in a total order."""
    out = {}
    for t in SINK_TABLES:
        _, rows = store.query_rows(f"SELECT * FROM {store.table(t.name)} FINAL ORDER BY ALL")
        out[t.name] = [tuple(repr(v) for v in r) for r in rows]  # repr: NaN equals NaN
    return out


def payloads(records: list[dict[str, Any]]) -> list[bytes]:
    enc = Encoder(CONTRACT, "RequestAccounting")
    return [enc.encode(r) for r in records]


def add_encoded(sink: ClickHouseSink, values: list[bytes], topic: str = "timelines") -> None:
    dec = Decoder(CONTRACT)
    for i, value in enumerate(values):
        writer = dec.header(value)
        assert writer is not None and sink.takes_encoded(writer, CONTRACT)
        sink.add_encoded(writer, value, key=None, topic=topic, partition=i % 2, offset=i)


def test_fast_path_writes_the_rows_the_python_path_writes(stores: tuple[Store, Store]) -> None:
    py_store, fast_store = stores
    records = shapes()
    values = payloads(records)
    dec = Decoder(CONTRACT)

    py = ClickHouseSink(py_store, encoded=False)
    for i, value in enumerate(values):
        name, rec = dec.decode(value)
        py.add(name, rec, topic="timelines", partition=i % 2, offset=i)
    py_result = py.flush()

    fast = ClickHouseSink(fast_store)
    add_encoded(fast, values)
    assert fast.pending_rows() == len(values)  # one requests row each until ClickHouse read them
    fast_result = fast.flush()

    assert fast_result.undecoded == []
    assert fast.pending_batches() == [] and fast.pending_rows() == 0
    expected = snapshot(py_store)
    assert all(expected[t.name] for t in avro_batch.TABLES)  # every table gets rows
    assert snapshot(fast_store) == expected
    (moved,) = py_store.query(
        f"SELECT window_released_tokens FROM {py_store.database}.requests WHERE request_uid = '{f.EID}/r2'"
    )
    assert moved["window_released_tokens"] == 3 + 5  # evicted_tokens added (events.MOVED_FIELDS)
    # rows per table are ClickHouse's count over the same file, equal to what Python appended
    assert fast_result.rows == py_result.rows
    assert sorted(fast_result.written, key=str) == sorted(py_result.written, key=str)
    assert fast_result.inserts == 5
    assert not list((fast_store.target.path / "sparseety-sink").glob("*.avro"))  # type: ignore[operator]
    assert fast_store.query_rows("SELECT name FROM system.tables WHERE is_temporary")[1] == []

    # rewriting (a crash between write and commit, then the re-read) changes nothing
    add_encoded(fast, values)
    fast.flush()
    assert snapshot(fast_store) == expected


def test_only_the_current_schema_into_an_embedded_store(stores: tuple[Store, Store]) -> None:
    _, store = stores
    current = CONTRACT.wire("RequestAccounting")
    sink = ClickHouseSink(store)
    assert sink.takes_encoded(current, CONTRACT)
    assert not ClickHouseSink(store, encoded=False).takes_encoded(current, CONTRACT)
    assert not sink.takes_encoded(CONTRACT.wire("UsageWindow"), CONTRACT)
    older = [
        w
        for w in CONTRACT.by_fingerprint.values()
        if w.name == full_name("RequestAccounting") and w.fingerprint != current.fingerprint
    ]
    assert older and not any(sink.takes_encoded(w, CONTRACT) for w in older)
    assert read_schema_files(schema_dir() / "history")  # the history the check above relies on

    class Server:  # a ClickHouse server cannot read the sink's local file
        target = type("T", (), {"kind": "http", "path": None})()

    assert not ClickHouseSink(Server()).takes_encoded(current, CONTRACT)  # type: ignore[arg-type]


def _corrupt(value: bytes, how: str) -> bytes:
    body_start = 10
    if how == "trailing":  # fastavro: bytes left over
        return value + b"\x00"
    if how == "truncated":
        return value[:-3]
    if how == "utf8":  # request_uid is the first field: its length, then its bytes
        return value[: body_start + 1] + b"\xff" + value[body_start + 2 :]
    if how == "enum":  # a block use's role index out of range: found by re-encoding
        rec = f.accounting(
            f"{f.EID}/bad",
            finished_ts_ns=NOW,
            block_uses=[{"block_hash": b"zz", "lifetime_seq": 1, "role": "cached", "tokens": 4}],
        )
        good = payloads([rec])[0]
        marker = b"\x04zz\x02\x02"  # bytes "zz", lifetime_seq 1, role index 1 (cached)
        assert good.count(marker) == 1
        return good.replace(marker, b"\x04zz\x02\x0e")  # role index 7
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["trailing", "truncated", "utf8", "enum"])
def test_a_corrupt_body_hands_the_batch_back(stores: tuple[Store, Store], how: str) -> None:
    _, store = stores
    values = payloads(shapes())
    bad = _corrupt(values[2], how)
    with pytest.raises(DecodeError):
        Decoder(CONTRACT).decode(bad)  # the Python path dead-letters it
    values[2] = bad
    sink = ClickHouseSink(store)
    add_encoded(sink, values)
    result = sink.flush()
    # nothing written, every record handed back (each partition's in order) for the Python path
    assert result.total_rows == 0 and result.written == [] and result.failed == []
    back = sorted(result.undecoded, key=lambda m: m.offset)
    assert [m.value for m in back] == values
    assert [(m.topic, m.partition, m.offset) for m in back] == [
        ("timelines", i % 2, i) for i in range(len(values))
    ]
    for p in (0, 1):
        offsets = [m.offset for m in result.undecoded if m.partition == p]
        assert offsets == sorted(offsets)
    assert sink.pending_rows() == 0 and sink.pending_batches() == []
    assert all(not rows for rows in snapshot(store).values())
    assert sink.totals.undecoded == []


def test_container_round_trips_through_clickhouse(stores: tuple[Store, Store]) -> None:
    _, store = stores
    writer = CONTRACT.wire("RequestAccounting")
    values = payloads(shapes())
    container = avro_batch.build_container(avro_batch.container_schema(writer), (v[10:] for v in values))
    assert avro_batch.fits(writer)
    path = store.target.path / "sparseety-sink-test.avro"  # type: ignore[operator]
    path.write_bytes(container.data)
    try:
        _, rows = store.query_rows(avro_batch.check_sql(avro_batch.file_source(str(path)), container.nonce))
        records, bad, per_table = avro_batch.row_counts(rows[0])
        assert (records, bad) == (len(values), 0)
        assert per_table["requests"] == len(values)
        _, rows = store.query_rows(
            avro_batch.check_sql(avro_batch.file_source(str(path)), container.nonce + 1)
        )
        assert avro_batch.row_counts(rows[0])[1] == len(values)  # a wrong nonce fails every row
    finally:
        path.unlink()


def test_the_worker_dead_letters_a_refused_batch_s_bad_records(stores: tuple[Store, Store]) -> None:
    """SinkFeeder over the fast path: a corrupt body's batch is decoded in Python after
    ClickHouse refused it; the bad payload goes to the dlq topic with its raw bytes, a bad header
    never reaches the sink, and the rest is written once and acknowledged."""
    import asyncio

    from sparseety.config import load_config
    from sparseety.kafka import make_decoder
    from sparseety.sinks.consumer import SinkFeeder
    from tests.unit.test_sink_worker import Controls, Msg

    _, store = stores
    values = payloads(shapes())
    trailing = values[1] + b"\x07"
    msgs = [Msg("timelines", i % 2, i, v, key=f"k{i}".encode()) for i, v in enumerate(values)]
    msgs[1] = Msg("timelines", 1, 1, trailing, key=b"bad-body")
    msgs.append(Msg("timelines", 0, 8, b"\xc3\x01\x00", key=b"bad-header"))
    sent: list[tuple[bytes | None, dict[str, Any]]] = []

    async def send(items: list[tuple[bytes | None, dict[str, Any]]]) -> None:
        sent.extend(items)

    sink = ClickHouseSink(store)
    controls = Controls()
    worker = SinkFeeder(sink, make_decoder(load_config()), "dlq", send, controls)
    asyncio.run(worker.process(msgs))

    assert [(k, d["error_type"], d["partition"], d["offset"]) for k, d in sent] == [
        (b"bad-header", "TruncatedPayloadError", 0, 8),  # before buffering
        (b"bad-body", "CorruptPayloadError", 1, 1),  # after ClickHouse refused the batch
    ]
    assert sent[1][1]["value"] == trailing and "left over" in sent[1][1]["reason"]
    assert worker.records == len(values) - 1 and worker.dead_letters == 2
    assert controls.paused == set() and worker.held == {} and sink.pending_batches() == []
    uids = [r[0] for r in store.query_rows(f"SELECT request_uid FROM {store.table('requests')}")[1]]
    expected = [r["request_uid"] for i, r in enumerate(shapes()) if i != 1]
    # each written by one insert, nothing by the refused attempt (one insert collapses the two
    # versions of r6: optimize_on_insert)
    assert sorted(uids) == sorted(set(expected))
    assert worker.totals.rows["requests"] == len(expected) and worker.totals.undecoded == []


def test_a_store_error_after_the_check_keeps_the_batch_buffered(stores: tuple[Store, Store]) -> None:
    """An insert that fails on the store itself (not on the data) stops those partitions: the
    batch stays buffered undecoded, nothing is handed back, and the next flush writes it."""
    from sparseety.errors import SinkWriteError, StoreError

    _, store = stores

    class Failing:
        """The real store, whose INSERT ... SELECT fails with a server error while ``down``."""

        down = True

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def command(self, sql: str, *args: Any, **kwargs: Any) -> Any:
            if self.down and sql.startswith("INSERT"):
                raise StoreError("Code: 241. MEMORY_LIMIT_EXCEEDED", code=241, cause="DatabaseError")
            return store.command(sql, *args, **kwargs)

    failing = Failing()
    sink = ClickHouseSink(failing, max_retries=0)  # type: ignore[arg-type]
    values = payloads(shapes())
    add_encoded(sink, values)
    with pytest.raises(SinkWriteError) as err:
        sink.flush()
    assert err.value.result.undecoded == [] and len(err.value.result.failed) == 2
    assert {(b.topic, b.partition) for b in sink.pending_batches()} == {("timelines", 0), ("timelines", 1)}
    assert sink.pending_rows() == len(values)

    failing.down = False
    result = sink.flush()
    assert result.rows["requests"] == len(values) and sink.pending_batches() == []
    py = ClickHouseSink(stores[0], encoded=False)
    dec = Decoder(CONTRACT)
    for i, value in enumerate(values):
        py.add(*dec.decode(value), topic="timelines", partition=i % 2, offset=i)
    py.flush()
    assert snapshot(store) == snapshot(stores[0])


def test_a_writer_with_a_string_field_the_check_does_not_know_keeps_the_python_path() -> None:
    import dataclasses
    import json

    writer = CONTRACT.wire("RequestAccounting")
    assert avro_batch.fits(writer)
    schema = json.loads(writer.json)
    schema["fields"].append({"name": "region", "type": "string", "default": ""})
    assert not avro_batch.fits(dataclasses.replace(writer, json=json.dumps(schema)))
    timeline = next(fld for fld in json.loads(writer.json)["fields"] if fld["name"] == "timeline")
    segment = timeline["type"]["fields"][0]["type"]["items"]
    segment["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    schema = json.loads(writer.json)
    schema["fields"] = [timeline if fld["name"] == "timeline" else fld for fld in schema["fields"]]
    assert not avro_batch.fits(dataclasses.replace(writer, json=json.dumps(schema)))
