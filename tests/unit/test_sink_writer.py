"""ClickHouseSink: rows land complete, rewrites change nothing, retries and failing partitions,
and the sink entry point."""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.errors import PluginLoadError, SinkWriteError, StoreError
from sparseety.sinks import base
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.rows import request_version
from sparseety.sinks.clickhouse.tables import KV_COLUMNS
from sparseety.sinks.clickhouse.writer import ClickHouseSink, is_data_error
from tests import factories as f
from tests.helpers import chdb_config, table_rows, throwaway_store


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, unique: str) -> Iterator[Store]:
    with throwaway_store(chdb_config(tmp_path_factory, f"t{unique}")) as s:
        migrate(s)
        yield s


def rich(uid: str, **over: Any) -> dict[str, Any]:
    """A RequestAccounting with segments, block uses and expert counts."""
    return f.accounting(
        uid,
        expert_num_layers=2,
        expert_num_experts=2,
        expert_counts=[3, 1, 0, 4],
        block_uses=[
            {"block_hash": b"\x00\xffh0", "lifetime_seq": 3, "role": "cached", "tokens": 4},
            {"block_hash": b"h1", "lifetime_seq": 9, "role": "computed", "tokens": 4},
        ],
        **over,
    )


def write(sink: ClickHouseSink, records: list[tuple[str, dict[str, Any]]], topic: str = "t") -> None:
    for i, (name, rec) in enumerate(records):
        sink.add(name, rec, topic=topic, partition=i % 2, offset=i)
    sink.flush()


TOKEN_FIELDS = ("token_privacy", "prompt_token_ids", "prompt_token_hashes", "output_token_ids")


def test_every_field_lands(store: Store) -> None:
    # finished now: request_tokens' TTL (30 days) drops rows of 1970 as they are inserted
    rec = rich(f"{f.EID}/r1", lora_name="adapter", incomplete_reason=None, finished_ts_ns=time.time_ns())
    write(ClickHouseSink(store), [(ev.REQUEST_ACCOUNTING, rec), (ev.USAGE_WINDOW, f.usage_window())])
    (row,) = store.query(f"SELECT * FROM {store.database}.requests_v")
    for field, value in rec.items():
        if field not in (
            "block_uses",
            "timeline",
            "expert_counts",
            "kv_groups",
            "kv_peak_bytes",
            *TOKEN_FIELDS,
            *ev.MOVED_FIELDS,  # no column: added to window_released_tokens (rich() has 0)
        ):
            assert row[field] == value, field
    (tokens,) = store.query(f"SELECT * FROM {store.database}.request_tokens_v")
    assert tokens["privacy"] == rec["token_privacy"] == "raw"
    assert {k: tokens[k] for k in TOKEN_FIELDS[1:]} == {k: rec[k] for k in TOKEN_FIELDS[1:]}
    assert tokens["tenant"] == rec["tenant"]
    assert (row["segment_count"], row["block_use_count"], row["_version"]) == (3, 2, request_version(rec))
    segs = store.query(f"SELECT * FROM {store.database}.token_segments_v ORDER BY idx")
    assert [{k: s[k] for k in rec["timeline"]["segments"][0]} for s in segs] == rec["timeline"]["segments"]
    blocks = store.query(
        "SELECT lower(hex(block_hash)) AS h, lifetime_seq, role, tokens "
        f"FROM {store.database}.kv_blocks_v ORDER BY idx"
    )
    assert [tuple(b.values()) for b in blocks] == [
        ("00ff6830", 3, "cached", 4),
        (b"h1".hex(), 9, "computed", 4),
    ]
    (experts,) = store.query(
        f"SELECT num_layers, num_experts, counts FROM {store.database}.expert_load FINAL"
    )
    assert experts == {"num_layers": 2, "num_experts": 2, "counts": [3, 1, 0, 4]}
    (usage,) = store.query(f"SELECT * FROM {store.database}.usage_1m FINAL")
    moved = set(ev.MOVED_FIELDS)
    assert {k: usage[k] for k in f.usage_window() if k not in moved} == {
        k: v for k, v in f.usage_window().items() if k not in moved
    }


def test_dead_letters_keep_raw_bytes_and_position(store: Store) -> None:
    dl = f.dead_letter(value=b"\xc3\x01\xff\x00garbage", key=None)
    sink = ClickHouseSink(store)
    sink.add(ev.DEAD_LETTER, dl, topic="dlq", partition=1, offset=42)
    sink.flush()
    (row,) = store.query(
        f"SELECT dlq_topic, dlq_partition, dlq_offset, topic, partition, offset, error_type, key, "
        f"hex(value) AS value_hex FROM {store.database}.dead_letters FINAL"
    )
    assert row == {
        "dlq_topic": "dlq",
        "dlq_partition": 1,
        "dlq_offset": 42,
        "topic": "t",
        "partition": 0,
        "offset": 5,
        "error_type": "BadMagicError",
        "key": None,
        "value_hex": b"\xc3\x01\xff\x00garbage".hex().upper(),
    }


def test_writing_the_same_records_again_changes_nothing(store: Store) -> None:
    records = [(ev.REQUEST_ACCOUNTING, rich(f"{f.EID}/r{i}")) for i in range(5)]
    records += [(ev.USAGE_WINDOW, f.usage_window(usage_id=f"u{i}")) for i in range(3)]
    records += [(ev.DEAD_LETTER, f.dead_letter())]
    write(ClickHouseSink(store), records)
    first = table_rows(store)
    assert len(first["requests"]) == 5 and len(first["token_segments"]) == 15
    write(ClickHouseSink(store), records)  # a crash between write and commit, then a re-read
    write(ClickHouseSink(store), list(reversed(records[:5])), topic="other")  # a replay in another order
    assert table_rows(store) == first
    raw = store.query(f"SELECT count() AS n FROM {store.table('requests')}")[0]["n"]
    assert raw >= 5  # duplicates may still be unmerged: FINAL hides them


def test_a_complete_record_wins_over_an_incomplete_one_in_any_order(store: Store) -> None:
    uid = f"{f.EID}/r1"
    incomplete = rich(uid, complete=False, incomplete_reason="idle_timeout", finished_ts_ns=900)
    complete = rich(uid, finished_ts_ns=500)
    complete["timeline"]["segments"] = complete["timeline"]["segments"][:2]
    complete["block_uses"] = complete["block_uses"][:1]
    assert request_version(complete) > request_version(incomplete)
    for order in ([incomplete, complete], [complete, incomplete]):
        store.command(f"TRUNCATE TABLE {store.table('requests')}")
        for t in ("token_segments", "kv_blocks"):
            store.command(f"TRUNCATE TABLE {store.table(t)}")
        for rec in order:
            write(ClickHouseSink(store), [(ev.REQUEST_ACCOUNTING, rec)])
        (row,) = store.query(f"SELECT complete, segment_count FROM {store.database}.requests_v")
        assert row == {"complete": True, "segment_count": 2}
        # the older version's third segment and second block are not current
        assert store.query(f"SELECT count() AS n FROM {store.database}.token_segments_v") == [{"n": 2}]
        assert store.query(f"SELECT count() AS n FROM {store.database}.kv_blocks_v") == [{"n": 1}]


class FlakyStore:
    """A Store whose inserts fail while ``fail`` says so."""

    def __init__(self, store: Store, fail: Any) -> None:
        self.store = store
        self.fail = fail
        self.calls: list[tuple[str, int, dict[str, Any]]] = []

    def table(self, name: str) -> str:
        return self.store.table(name)

    def insert(self, table: str, columns: Any, names: Any, *, settings: dict[str, Any]) -> None:
        n = len(columns[0])
        self.calls.append((table, n, settings))
        if self.fail(table, columns, names, len(self.calls)):
            raise StoreError("Code: 210. NETWORK_ERROR (injected)", code=210)
        self.store.insert(table, columns, names, settings=settings)


def test_retries_with_backoff_then_succeeds(store: Store) -> None:
    flaky = FlakyStore(store, lambda table, cols, names, call: call <= 3)
    sleeps: list[float] = []
    sink = ClickHouseSink(flaky, max_retries=5, retry_backoff_s=0.5, sleep=sleeps.append)  # type: ignore[arg-type]
    sink.add(ev.USAGE_WINDOW, f.usage_window(), topic="u", partition=0, offset=0)
    result = sink.flush()
    assert sleeps == [0.5, 1.0, 2.0]
    assert result.rows == {"usage_1m": 1} and sink.pending_rows() == 0
    # every attempt of one insert carries the same deduplication token
    assert len({c[2]["insert_deduplication_token"] for c in flaky.calls}) == 1


def test_a_partition_that_keeps_failing_stops_alone_and_keeps_its_data(store: Store) -> None:
    broken = {"on": True}

    def fail(table: str, cols: Any, names: Any, call: int) -> bool:
        # rows of partition 1 (usage ids ending in 1) cannot be written
        return bool(
            broken["on"]
            and "usage_1m" in table
            and any(u.endswith("p1") for u in cols[names.index("usage_id")])
        )

    flaky = FlakyStore(store, fail)
    sink = ClickHouseSink(flaky, max_retries=2, retry_backoff_s=0, sleep=lambda s: None)  # type: ignore[arg-type]
    for p in (0, 1):
        for o in range(3):
            sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id=f"{o}p{p}"), topic="u", partition=p, offset=o)
    with pytest.raises(SinkWriteError) as info:
        sink.flush()
    assert info.value.failed == [("u", 1, 0, 2)]
    ids = {r["usage_id"] for r in store.query(f"SELECT usage_id FROM {store.table('usage_1m')} FINAL")}
    assert ids == {"0p0", "1p0", "2p0"}
    assert sink.pending_rows() == 3 and [b.as_tuple() for b in sink.pending_batches()] == [("u", 1, 0, 2)]
    # more data for the stopped partition goes into a new batch; once the store heals, all lands
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="3p1"), topic="u", partition=1, offset=3)
    broken["on"] = False
    result = sink.flush()
    assert [b.as_tuple() for b in result.written] == [("u", 1, 0, 2), ("u", 1, 3, 3)]
    ids = {r["usage_id"] for r in store.query(f"SELECT usage_id FROM {store.table('usage_1m')} FINAL")}
    assert ids == {"0p0", "1p0", "2p0", "0p1", "1p1", "2p1", "3p1"}


def test_pending_rows_and_discard(store: Store) -> None:
    sink = ClickHouseSink(store)
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="a"), topic="u", partition=0, offset=0)
    sink.add(ev.REQUEST_ACCOUNTING, rich(f"{f.EID}/r1"), topic="t", partition=1, offset=0)  # 8 rows
    assert sink.pending_rows() == 9
    assert sink.discard("t", 1) == 8 and sink.pending_rows() == 1
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="b"), topic="u", partition=0, offset=5)
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="c"), topic="u", partition=0, offset=5)
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="d"), topic="u", partition=0, offset=4)  # seek back
    assert [b.as_tuple() for b in sink.pending_batches()] == [("u", 0, 0, 5), ("u", 0, 4, 4)]


def test_the_clickhouse_sink_is_registered() -> None:
    assert base.load_sink_class("clickhouse") is ClickHouseSink
    assert "clickhouse" in base.available_sinks()


def test_sink_plugins_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [
        EntryPoint("notasink", "sparseety.config:Config", base.ENTRY_POINT_GROUP),
        EntryPoint("broken", "sparseety.no_such_module:X", base.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(base, "entry_points", lambda group: [e for e in eps if e.group == group])
    with pytest.raises(PluginLoadError, match="not a subclass"):
        base.load_sink_class("notasink")
    with pytest.raises(PluginLoadError, match="failed to load"):
        base.load_sink_class("broken")
    with pytest.raises(PluginLoadError, match="registered: broken, notasink"):
        base.load_sink_class("missing")


def test_a_record_that_fails_half_way_leaves_no_partial_rows(store: Store) -> None:
    sink = ClickHouseSink(store)
    broken = rich(f"{f.EID}/r1")
    del broken["block_uses"][1]["tokens"]  # fails after the request row and segments were appended
    with pytest.raises(KeyError):
        sink.add(ev.REQUEST_ACCOUNTING, broken, topic="t", partition=0, offset=0)
    sink.add(ev.REQUEST_ACCOUNTING, rich(f"{f.EID}/r2"), topic="t", partition=0, offset=1)
    assert sink.flush().rows == {
        "requests": 1,
        "token_segments": 3,
        "kv_blocks": 2,
        "expert_load": 1,
        "request_tokens": 1,
    }
    assert [
        r["request_uid"] for r in store.query(f"SELECT request_uid FROM {store.database}.requests_v")
    ] == [f"{f.EID}/r2"]


def test_from_config_shares_an_open_store(store: Store) -> None:
    cfg = load_config(clickhouse={"dsn": f"chdb://{store.target.path}", "database": store.database})
    sink = ClickHouseSink.from_config(cfg, store=store, owner="ignored")
    sink.add(ev.USAGE_WINDOW, f.usage_window(), topic="u", partition=0, offset=0)
    sink.flush()
    sink.close()  # not its store: still open
    assert store.query(f"SELECT count() AS n FROM {store.table('usage_1m')}") == [{"n": 1}]


def test_a_poison_record_is_dead_lettered_and_every_good_one_is_written(store: Store) -> None:
    """Issue 12: a value a column cannot hold never stops the partition."""
    sink = ClickHouseSink(store, max_retries=3, retry_backoff_s=0, sleep=lambda s: None)
    for o in range(7):
        over = {"prompt_tokens": 2**63} if o == 3 else {}  # beyond Int64
        sink.add(ev.REQUEST_ACCOUNTING, rich(f"r{o}", **over), topic="acc", partition=1, offset=o)
    sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id="u0"), topic="u", partition=0, offset=0)
    result = sink.flush()
    assert result.failed == [] and result.rejected == 1 and sink.pending_rows() == 0
    uids = {r["request_uid"] for r in store.query(f"SELECT request_uid FROM {store.table('requests')} FINAL")}
    assert uids == {f"r{o}" for o in range(7)} - {"r3"}
    dead = store.query(
        f"SELECT dlq_topic, component, topic, partition, offset, reason, value "
        f"FROM {store.table('dead_letters')} FINAL"
    )
    assert len(dead) == 1
    d = dead[0]
    assert (d["dlq_topic"], d["component"], d["topic"], d["partition"], d["offset"]) == (
        "sink:acc:requests",
        "sink",
        "acc",
        1,
        3,
    )
    assert "prompt_tokens" in d["reason"] and '"request_uid": "r3"' in d["value"]
    # the child rows of the good records landed too
    n = store.query(f"SELECT count() AS n FROM {store.table('kv_blocks')} FINAL")[0]["n"]
    assert n == 2 * 7  # the poison's block rows fit their columns: only its requests row is lost


def test_an_unclassified_error_while_the_store_answers_is_a_data_error(store: Store) -> None:
    class Picky(FlakyStore):
        def query(self, sql: str) -> Any:
            return self.store.query(sql)

        def insert(self, table: str, columns: Any, names: Any, *, settings: dict[str, Any]) -> None:
            if self.fail(table, columns, names, 0):
                raise StoreError("refused (injected, no code)", code=None, cause="OSError")
            self.store.insert(table, columns, names, settings=settings)

    def fail(table: str, cols: Any, names: Any, call: int) -> bool:
        return "usage_1m" in table and "bad" in cols[names.index("usage_id")]

    picky = Picky(store, fail)
    sink = ClickHouseSink(picky, max_retries=1, retry_backoff_s=0, sleep=lambda s: None)  # type: ignore[arg-type]
    for o, uid in enumerate(["a", "bad", "c"]):
        sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id=uid), topic="u", partition=0, offset=o)
    result = sink.flush()
    assert result.rejected == 1 and result.failed == []
    ids = {r["usage_id"] for r in store.query(f"SELECT usage_id FROM {store.table('usage_1m')} FINAL")}
    assert ids == {"a", "c"}


def test_an_error_every_row_gets_is_not_a_data_error_even_if_the_store_answers(store: Store) -> None:
    class Overloaded(FlakyStore):
        def query(self, sql: str) -> Any:
            return self.store.query(sql)

        def insert(self, table: str, columns: Any, names: Any, *, settings: dict[str, Any]) -> None:
            self.calls.append((table, len(columns[0]), settings))
            raise StoreError("something odd (injected)", code=None, cause="OSError")

    sink = ClickHouseSink(Overloaded(store, None), max_retries=0, retry_backoff_s=0, sleep=lambda s: None)  # type: ignore[arg-type]
    for o in range(3):
        sink.add(ev.USAGE_WINDOW, f.usage_window(usage_id=f"x{o}"), topic="u", partition=0, offset=o)
    with pytest.raises(SinkWriteError):
        sink.flush()
    assert sink.pending_rows() == 3 and sink.totals.rejected == 0
    assert store.query(f"SELECT count() AS n FROM {store.table('dead_letters')}") == [{"n": 0}]


@pytest.mark.parametrize(
    ("sql", "code"),
    [
        ("SELECT * FROM format(TSV, 'x Float64', 'abc')", 72),  # CANNOT_PARSE_NUMBER
        ("SELECT * FROM format(JSONEachRow, 'x Int32', '{\"x\": 1.5e}')", 27),  # ..._ASSERTION_FAILED
        ("SELECT toInt32('x')", 6),  # CANNOT_PARSE_TEXT
    ],
)
def test_a_value_chdb_cannot_parse_is_a_data_error_by_its_code(store: Store, sql: str, code: int) -> None:
    """The code comes from clickhouse-connect's exception (not the message text), and a value the
    engine cannot parse is a data error: the batch's rows are refused, never retried forever."""
    with pytest.raises(StoreError) as caught:
        store.query(sql)
    assert caught.value.fields["code"] == code
    assert is_data_error(caught.value)


def test_a_missing_table_is_no_data_error(store: Store) -> None:
    with pytest.raises(StoreError) as caught:
        store.query("SELECT * FROM no_such_table_here")
    assert caught.value.fields["code"] == 60  # UNKNOWN_TABLE: the store's, retried
    assert not is_data_error(caught.value)


def test_kv_memory_time_lands_and_old_rows_read_not_observed(store: Store) -> None:
    """Migration 012's columns: sums over the groups, byte-ms floored once; a record without
    kv_groups (written before, or request level) reads NULL, never 0."""
    groups = [f.kv_group(), f.kv_group(kind="sliding_window", bytes_per_block=1000, never_held_blocks=2)]
    now = time.time_ns()
    with_kv = rich(f"{f.EID}/kv", finished_ts_ns=now, kv_groups=groups, kv_peak_bytes=5 << 20)
    old = rich(f"{f.EID}/old", finished_ts_ns=now)
    write(ClickHouseSink(store), [(ev.REQUEST_ACCOUNTING, with_kv), (ev.REQUEST_ACCOUNTING, old)])
    rows = {r["request_uid"]: r for r in store.query(f"SELECT * FROM {store.database}.requests_v")}
    kv, before = rows[f"{f.EID}/kv"], rows[f"{f.EID}/old"]
    assert kv["kv_block_steps"] == 60 and kv["kv_block_ns"] == 6_000_000_000
    assert kv["kv_byte_ms"] == (3_000_000_000 * (1 << 20) + 3_000_000_000 * 1000) // 1_000_000
    assert kv["kv_byte_ms_amortized"] == (2_000_000_001 * ((1 << 20) + 1000)) // 1_000_000
    assert kv["kv_byte_ms_actual"] == (999_999 * ((1 << 20) + 1000)) // 1_000_000
    assert kv["kv_peak_bytes"] == 5 << 20 and kv["kv_never_held_blocks"] == 2
    assert (kv["kv_slot_steps_used"], kv["kv_slot_steps_allocated"]) == (800, 960)
    assert all(before[c] is None for c in KV_COLUMNS)


def test_query_cost_prices_kv_memory_time_per_gib_hour(store: Store) -> None:
    """``query cost``'s kv columns: the mode's byte-ms and its price (USD per GiB-hour, floored
    per request), beside the token cost; a request without memory-time is counted as not
    observed, and a model without a kv price as unpriced."""
    from decimal import Decimal

    from sparseety.queries.registry import Queries
    from sparseety.sinks.clickhouse.prices import Price, set_prices

    gib_ms_hour = (1 << 30) * 3_600_000  # one GiB held for one hour, in byte-ms
    # block_ns x bytes / 1e6 = byte-ms: 3.6e12 ns x 2^30 B = one GiB-hour held; actual half of it
    one = f.kv_group(bytes_per_block=1 << 30, block_ns=3_600_000_000_000)
    one.update(block_ns_actual=1_800_000_000_000, block_ns_amortized=2_700_000_000_000)
    now = time.time_ns()
    recs = [
        rich(
            f"{f.EID}/a", tenant="A", model="m1", finished_ts_ns=now, kv_groups=[one], kv_peak_bytes=1 << 30
        ),
        rich(f"{f.EID}/b", tenant="A", model="m1", finished_ts_ns=now),  # written before: not observed
    ]
    write(ClickHouseSink(store), [(ev.REQUEST_ACCOUNTING, r) for r in recs])
    set_prices(store, [Price("m1", "kv", Decimal("0.36"), 0)])
    q = Queries(store)
    actual = {r["tenant"]: r for r in q.cost(mode="actual", by=["tenant"])}["A"]
    assert actual["kv_byte_ms"] == gib_ms_hour // 2
    assert actual["kv_cost_usd"] == Decimal("0.18")
    assert (actual["kv_not_observed"], actual["kv_unpriced"]) == (1, 0)
    amortized = {r["tenant"]: r for r in q.cost(mode="amortized", by=["tenant"])}["A"]
    assert amortized["kv_byte_ms"] == gib_ms_hour * 3 // 4
    assert amortized["kv_cost_usd"] == Decimal("0.27")
