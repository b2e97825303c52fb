"""The sink as a real Faust worker (``sparseety sink`` in its own process) against the real broker
and chDB: records land in the tables, bad bytes land in the dlq with their position, and a sink
killed between its write and its offset commit counts nothing twice after a restart."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from sparseety.config import Config
from sparseety.kafka import make_encoder, make_producer
from sparseety.queries.registry import Queries
from sparseety.sinks.clickhouse.client import Store
from tests import factories as f
from tests.helpers import ComponentProcess, read_topic, wait_for

Positions = dict[tuple[str, int], int]  # (topic, partition) -> last offset produced


def sink_config(kafka_cfg: Config, unique: str) -> Config:
    return kafka_cfg.replace(
        sink={**kafka_cfg.sink.model_dump(), "group_id": f"sink-{unique}", "batch_interval_s": 0.3},
        clickhouse={**kafka_cfg.clickhouse.model_dump(), "database": "acct"},
    )


def produce(cfg: Config, items: list[tuple[str, bytes, bytes]]) -> Positions:
    """Produce (topic, key, value); return the last offset per partition."""
    producer = make_producer(cfg)
    last: Positions = {}

    def delivered(err: Any, msg: Any) -> None:
        assert err is None, err
        tp = (msg.topic(), msg.partition())
        last[tp] = max(last.get(tp, -1), msg.offset())

    for topic, key, value in items:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
    assert producer.flush(30) == 0
    return last


def accounting_items(cfg: Config, n: int, start: int = 0) -> list[tuple[str, bytes, bytes]]:
    enc = make_encoder(cfg, "RequestAccounting", cfg.topics.timelines)
    out = []
    for i in range(start, start + n):
        rec = f.accounting(
            f"{f.EID}/r{i}",
            tenant=f"t{i % 3}",
            prompt_tokens=100 + i,
            finished_ts_ns=1_700_000_000 * 10**9 + i,
        )
        out.append((cfg.topics.timelines, rec["request_uid"].encode(), enc.encode(rec)))
    return out


def committed(cfg: Config, tps: list[tuple[str, int]]) -> Positions:
    """The sink group's committed offsets (next offset to read; -1001 when none)."""
    consumer = Consumer(cfg.kafka.librdkafka(**{"group.id": cfg.sink.group_id, "enable.auto.commit": False}))
    try:
        got = consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=10)
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): tp.offset for tp in got}


def last_offsets(topic: str, records: list[tuple[Any, ...]]) -> Positions:
    """The last offset per partition of ``records`` (``read_topic``'s tuples) of ``topic``."""
    last: Positions = {}
    for part, offset, _, _ in records:
        last[(topic, part)] = max(last.get((topic, part), -1), offset)
    return last


def all_committed(cfg: Config, last: Positions) -> bool:
    done = committed(cfg, list(last))
    return all(done[tp] > off for tp, off in last.items())


@pytest.fixture
def sink_process(kafka_cfg: Config, unique: str, tmp_path: Path) -> Iterator[Callable[..., ComponentProcess]]:
    procs: list[ComponentProcess] = []
    cfg = sink_config(kafka_cfg, unique)

    def start(*extra: str, crash_after_writes: int | None = None) -> ComponentProcess:
        args = ["sink", "--session-timeout", "6", "--commit-interval", "0.5", "--loglevel", "info", *extra]
        # the crash hook lives in tests: the sink CLI run through tests.crashing_sink
        command = None
        if crash_after_writes is not None:
            command = [sys.executable, "-m", "tests.crashing_sink", str(crash_after_writes)]
        p = ComponentProcess(cfg, args, tmp_path / f"sink-{len(procs)}.log", command).start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def settled(cfg: Config, sink: ComponentProcess, last: Positions) -> bool:
    """Whether the (live) sink dead-lettered three records and committed everything, the dead
    letters' own offsets in the DLQ too."""
    assert sink.alive(), sink.tail()
    dead = read_topic(cfg, cfg.topics.dlq, decode=False, quiet_s=0.3)
    dlq_last = {(cfg.topics.dlq, p): o for p, o, _, _ in dead}
    return len(dead) == 3 and all_committed(cfg, {**last, **dlq_last})


def open_store(cfg: Config) -> Store:
    return Store.open(cfg)


def test_records_land_and_bad_bytes_go_to_the_dlq(
    kafka_cfg: Config, unique: str, sink_process: Callable[..., ComponentProcess]
) -> None:
    cfg = sink_config(kafka_cfg, unique)
    usage_enc = make_encoder(cfg, "UsageWindow", cfg.topics.usage)
    engine_event = make_encoder(cfg, "EngineEvent", cfg.topics.engine_events).encode(f.one_of_each()[0])
    good = accounting_items(cfg, 12)
    truncated = good[0][2][:-7]
    items = [
        *good,
        *[
            (cfg.topics.usage, f"u{i}".encode(), usage_enc.encode(f.usage_window(usage_id=f"u{i}")))
            for i in range(4)
        ],
        (cfg.topics.timelines, b"bad-1", b"\x00garbage"),
        (cfg.topics.timelines, b"bad-2", truncated),
        (cfg.topics.usage, b"bad-3", engine_event),  # decodes, but is no sink record
    ]
    last = produce(cfg, items)
    sink = sink_process()

    wait_for(lambda: settled(cfg, sink, last), 120, 1, "every record written and committed")
    sink.stop()
    assert not sink.alive()

    dead = read_topic(cfg, cfg.topics.dlq)
    by_key = {d[2]: d[3] for d in dead}
    assert {k: v["error_type"] for k, v in by_key.items()} == {
        b"bad-1": "BadMagicError",
        b"bad-2": "TruncatedPayloadError",
        b"bad-3": "InvalidEventError",
    }
    assert by_key[b"bad-1"]["value"] == b"\x00garbage" and by_key[b"bad-2"]["value"] == truncated
    assert all(d["component"] == "sink" and d["offset"] >= 0 for d in by_key.values())
    assert by_key[b"bad-3"]["topic"] == cfg.topics.usage

    with open_store(cfg) as store:
        q = Queries(store)
        rows = store.query(f"SELECT request_uid, tenant, prompt_tokens FROM {store.database}.requests_v")
        assert sorted(r["prompt_tokens"] for r in rows) == [100 + i for i in range(12)]
        assert store.query(f"SELECT count() AS n FROM {store.database}.token_segments_v") == [{"n": 36}]
        assert {
            r["usage_id"] for r in store.query(f"SELECT usage_id FROM {store.table('usage_1m')} FINAL")
        } == {f"u{i}" for i in range(4)}
        letters = store.query(
            "SELECT dlq_topic, topic, partition, offset, error_type, hex(value) AS value "
            f"FROM {store.table('dead_letters')} FINAL"
        )
        assert {(d["dlq_topic"], d["error_type"]) for d in letters} == {
            (cfg.topics.dlq, "BadMagicError"),
            (cfg.topics.dlq, "TruncatedPayloadError"),
            (cfg.topics.dlq, "InvalidEventError"),
        }
        stored = {d["error_type"]: d for d in letters}
        want = by_key[b"bad-1"]
        assert (stored["BadMagicError"]["topic"], stored["BadMagicError"]["partition"]) == (
            want["topic"],
            want["partition"],
        )
        assert stored["BadMagicError"]["offset"] == want["offset"]
        assert stored["BadMagicError"]["value"] == b"\x00garbage".hex().upper()
        assert sum(r["requests"] for r in q.cost(by=["tenant"])) == 12


def test_sigkill_between_write_and_commit_counts_nothing_twice(
    kafka_cfg: Config, unique: str, sink_process: Callable[..., ComponentProcess]
) -> None:
    cfg = sink_config(kafka_cfg, unique)
    items = accounting_items(cfg, 60)
    last = produce(cfg, items)
    expected: Counter[str] = Counter()
    for i in range(60):
        expected[f"t{i % 3}"] += 100 + i

    first = sink_process(crash_after_writes=1)
    wait_for(lambda: not first.alive(), 90, 0.5, "the sink to kill itself after its first write")
    assert first.proc is not None and first.proc.returncode == -9, first.tail()
    assert "crash-after-writes hook" in first.tail()

    # The window really was hit: rows are stored, their offsets are not committed.
    with open_store(cfg) as store:
        written = store.query(f"SELECT count() AS n FROM {store.database}.requests_v")[0]["n"]
    assert written > 0
    assert all(off < 0 for off in committed(cfg, list(last)).values())

    second = sink_process()
    wait_for(
        lambda: (second.alive() or pytest.fail(second.tail())) and all_committed(cfg, last), 120, 1, "commit"
    )
    second.stop()
    time.sleep(0.2)

    with open_store(cfg) as store:
        q = Queries(store)
        tokens = store.query(
            "SELECT tenant, sum(prompt_tokens) AS p, count() AS n "
            f"FROM {store.database}.requests_v GROUP BY tenant"
        )
        assert {r["tenant"]: r["p"] for r in tokens} == dict(expected)
        assert sum(r["n"] for r in tokens) == 60
        assert store.query(f"SELECT count() AS n FROM {store.database}.token_segments_v") == [{"n": 180}]
        assert {r["tenant"]: r["requests"] for r in q.cost(by=["tenant"])} == {"t0": 20, "t1": 20, "t2": 20}
        raw = store.query(f"SELECT count() AS n FROM {store.table('requests')}")[0]["n"]
        assert raw >= 60  # the re-read batch was written again: FINAL (and every query) hides it


def test_a_poison_record_is_dead_lettered_and_the_partitions_move_on(
    kafka_cfg: Config, unique: str, sink_process: Callable[..., ComponentProcess]
) -> None:
    """Issue 12: a record the store cannot hold (a segment position past Int32, which Avro's
    encoder does not range-check) between good ones: every good one is in SQL within seconds,
    the poison is in dead_letters, and no partition stops."""
    cfg = sink_config(kafka_cfg, unique)
    enc = make_encoder(cfg, "RequestAccounting", cfg.topics.timelines)
    poison = f.accounting(f"{f.EID}/poison", tenant="t0", finished_ts_ns=1_700_000_000 * 10**9)
    poison["timeline"]["segments"][0]["end"] = 2**31 - 1 + 2**31  # beyond Int32
    items = [
        *accounting_items(cfg, 6),
        (cfg.topics.timelines, poison["request_uid"].encode(), enc.encode(poison)),
        *accounting_items(cfg, 6, start=6),
    ]
    last = produce(cfg, items)
    sink = sink_process()
    started = time.monotonic()

    def committed_past_the_poison() -> bool:
        assert sink.alive(), sink.tail()
        return all_committed(cfg, last)

    # committed = written (offsets are committed only after their rows are stored)
    wait_for(committed_past_the_poison, 60, 0.5, "every offset committed, the poison's included")
    assert time.monotonic() - started < 60
    log = sink.tail(400)
    sink.stop()
    assert "dead-lettered" in log and "until their writes succeed" not in log

    with open_store(cfg) as store:  # chDB: one process per path, so after the sink stopped
        uids = {r["request_uid"] for r in store.query(f"SELECT request_uid FROM {store.database}.requests_v")}
        assert uids >= {f"{f.EID}/r{i}" for i in range(12)}
        segs = store.query(
            f"SELECT request_uid, count() AS n FROM {store.database}.token_segments_v GROUP BY request_uid"
        )
        assert {r["request_uid"]: r["n"] for r in segs if r["request_uid"] != poison["request_uid"]} == {
            f"{f.EID}/r{i}": 3 for i in range(12)
        }
        (letter,) = store.query(
            "SELECT dlq_topic, topic, partition, offset, error_type, reason, value "
            f"FROM {store.table('dead_letters')} FINAL WHERE component = 'sink'"
        )
        assert letter["dlq_topic"] == f"sink:{cfg.topics.timelines}:token_segments"
        assert letter["topic"] == cfg.topics.timelines and letter["error_type"] == "SinkDataError"
        assert (cfg.topics.timelines, letter["partition"]) in last and letter["offset"] >= 0
        assert poison["request_uid"] in letter["value"] and "end" in letter["reason"]


def test_a_corrupt_body_on_the_fast_path_is_dead_lettered_and_the_rest_stored(
    kafka_cfg: Config, unique: str, sink_process: Callable[..., ComponentProcess]
) -> None:
    """RequestAccounting of the current schema reaches the embedded store undecoded (ClickHouse
    decodes it). A body with a valid header but bytes fastavro rejects makes ClickHouse refuse
    the batch; the sink then decodes that batch in Python: the bad record goes to the dlq topic
    with its reason and raw bytes, every other record is stored once. A header that names no
    known schema is dead-lettered before anything is buffered."""
    cfg = sink_config(kafka_cfg, unique)
    good = accounting_items(cfg, 10)
    trailing = good[3][2] + b"\x00"  # a good header and record, then a stray byte
    bad_utf8 = bytearray(good[4][2])
    bad_utf8[11] = 0xFF  # inside request_uid, the first field
    unknown = b"\xc3\x01" + b"\x01" * 8 + good[5][2][10:]
    items = [
        *good,
        (cfg.topics.timelines, b"bad-trailing", trailing),
        (cfg.topics.timelines, b"bad-utf8", bytes(bad_utf8)),
        (cfg.topics.timelines, b"bad-fingerprint", unknown),
        *accounting_items(cfg, 10, start=10),
    ]
    last = produce(cfg, items)
    sink = sink_process()

    wait_for(
        lambda: settled(cfg, sink, last),
        120,
        1,
        "every record written or dead-lettered, and committed",
    )
    log = sink.tail(400)
    sink.stop()
    assert "decoding them in Python" in log  # the fast path refused the batch, then fell back
    assert "until their writes succeed" not in log

    by_key = {d[2]: d[3] for d in read_topic(cfg, cfg.topics.dlq)}
    assert {k: v["error_type"] for k, v in by_key.items()} == {
        b"bad-trailing": "CorruptPayloadError",
        b"bad-utf8": "CorruptPayloadError",
        b"bad-fingerprint": "UnknownSchemaError",
    }
    assert by_key[b"bad-trailing"]["value"] == trailing and "left over" in by_key[b"bad-trailing"]["reason"]
    assert by_key[b"bad-utf8"]["value"] == bytes(bad_utf8)
    assert by_key[b"bad-fingerprint"]["value"] == unknown
    assert all(d["topic"] == cfg.topics.timelines and d["offset"] >= 0 for d in by_key.values())

    with open_store(cfg) as store:
        final = store.query(f"SELECT request_uid, prompt_tokens FROM {store.table('requests')} FINAL")
        assert sorted(r["prompt_tokens"] for r in final) == [100 + i for i in range(20)]
        # nothing of the refused batch was written before the fallback: every row exists once
        assert store.query(f"SELECT count() AS n FROM {store.table('requests')}") == [{"n": 20}]
        assert store.query(f"SELECT count() AS n FROM {store.table('token_segments')} FINAL") == [{"n": 60}]
        assert store.query(f"SELECT count() AS n FROM {store.table('kv_blocks')} FINAL") == [{"n": 20}]
        letters = store.query(f"SELECT error_type FROM {store.table('dead_letters')} FINAL")
        assert sorted(d["error_type"] for d in letters) == [
            "CorruptPayloadError",
            "CorruptPayloadError",
            "UnknownSchemaError",
        ]
