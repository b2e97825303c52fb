"""Replay against the real broker and chDB: replaying a range twice leaves every table (FINAL) and
every aggregate unchanged; dry runs say what would change; offset and time ranges are exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from sparseety.cli import main
from sparseety.config import Config, to_env
from sparseety.kafka import make_encoder, make_producer
from sparseety.queries.registry import Queries
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.dryrun import DryRunSink
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price, set_prices
from sparseety.sinks.clickhouse.tables import SINK_TABLES
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.sinks.processors import identity
from sparseety.sinks.replay import Bound, Replay, ReplayReport
from tests import factories as f
from tests.helpers import free_port

S = 10**9
T0 = 1_700_000_000 * S


def record(i: int) -> dict[str, Any]:
    """A request of tenant t{i%4} that read one block computed by request 0 (amortized sharing)."""
    uses = [
        {"block_hash": b"shared", "lifetime_seq": 1, "role": "computed" if i == 0 else "cached", "tokens": 16}
    ]
    return f.accounting(
        f"{f.EID}/r{i}",
        tenant=f"t{i % 4}",
        prompt_tokens=100 + i,
        output_tokens=10 + i % 7,
        cache_read_tokens=0 if i == 0 else 16,
        scheduled_tokens=100 + i + 9,
        draft_rejected_tokens=i % 3,
        recomputed_tokens=i % 5,
        finished_ts_ns=T0 + i * S,
        block_uses=uses,
    )


def produce(cfg: Config, records: list[dict[str, Any]], timestamps_ms: list[int] | None = None) -> None:
    enc = make_encoder(cfg, "RequestAccounting", cfg.topics.timelines)
    usage = make_encoder(cfg, "UsageWindow", cfg.topics.usage)
    producer = make_producer(cfg)
    for i, rec in enumerate(records):
        extra = {"timestamp": timestamps_ms[i]} if timestamps_ms else {}
        producer.produce(
            cfg.topics.timelines, key=rec["request_uid"].encode(), value=enc.encode(rec), **extra
        )
        if i % 10 == 0:
            w = f.usage_window(usage_id=f"w{i}", tenant=rec["tenant"], window_start_ns=T0 + i * S)
            producer.produce(cfg.topics.usage, key=w["usage_id"].encode(), value=usage.encode(w))
    assert producer.flush(30) == 0


@pytest.fixture
def store(kafka_cfg: Config) -> Iterator[Store]:
    s = Store.open(kafka_cfg)
    try:
        migrate(s)
        set_prices(s, [Price("tiny", c, p) for c, p in (("input", 1), ("cached_input", 0.25), ("output", 4))])
        yield s
    finally:
        s.close()


def replay(
    cfg: Config, store: Store, topic: str, start: Bound, stop: Bound, *, dry: bool = False
) -> ReplayReport:
    sink = (DryRunSink if dry else ClickHouseSink)(store, batch_max_rows=500)
    try:
        report = Replay(cfg, topic, start, stop, sink, identity, idle_s=0.5, dry_run=dry).run()
        if isinstance(sink, DryRunSink):
            report.diff = sink.diff()
        return report
    finally:
        sink.close()


def snapshot(store: Store) -> dict[str, Any]:
    """Every table under FINAL plus the aggregates the queries answer."""
    out: dict[str, Any] = {}
    for t in SINK_TABLES:
        _, rows = store.query_rows(
            f"SELECT {', '.join(t.columns)} FROM {store.table(t.name)} FINAL ORDER BY {', '.join(t.key)}"
        )
        out[t.name] = rows
    q = Queries(store)
    for mode in ("actual", "amortized", "list"):
        out[f"cost-{mode}"] = q.cost(mode=mode, by=["tenant"])
    out["savings"] = q.savings()
    out["waste"] = q.waste()
    out["usage"] = q.usage()
    return out


def test_replaying_a_range_twice_changes_nothing(kafka_cfg: Config, store: Store) -> None:
    cfg = kafka_cfg
    produce(cfg, [record(i) for i in range(200)])
    start, stop = Bound("beginning"), Bound("end", time.time_ns() + 60 * S)

    first = replay(cfg, store, cfg.topics.timelines, start, stop)
    replay(cfg, store, cfg.topics.usage, start, stop)
    assert first.records_in_range == 200 and first.written.rows["requests"] == 200
    assert first.records_per_s > 0 and first.rows_per_s > 0
    print(f"\nreplay: {first.records_per_s:,.0f} records/s, {first.rows_per_s:,.0f} rows/s")
    before = snapshot(store)
    assert len(before["requests"]) == 200 and len(before["usage_1m"]) == 20
    assert sum(r["requests"] for r in before["cost-amortized"]) == 200

    dry = replay(cfg, store, cfg.topics.timelines, start, stop, dry=True)
    assert dry.diff["requests"] == {"new": 0, "changed": 0, "unchanged": 200, "superseded": 0}
    assert dry.diff["token_segments"]["unchanged"] == 600 and dry.diff["kv_blocks"]["new"] == 0

    second = replay(cfg, store, cfg.topics.timelines, start, stop)
    replay(cfg, store, cfg.topics.usage, start, stop)
    assert second.records_in_range == 200
    assert snapshot(store) == before
    store.command(f"OPTIMIZE TABLE {store.table('requests')} FINAL")
    assert store.query(f"SELECT count() AS n FROM {store.table('requests')}") == [{"n": 200}]


def test_dry_run_reports_new_changed_and_superseded(kafka_cfg: Config, store: Store) -> None:
    cfg = kafka_cfg
    produce(cfg, [record(i) for i in range(10)])
    start, stop = Bound("beginning"), Bound("end", time.time_ns() + 60 * S)
    assert replay(cfg, store, cfg.topics.timelines, start, stop, dry=True).diff["requests"]["new"] == 10
    assert store.query(f"SELECT count() AS n FROM {store.table('requests')}") == [{"n": 0}]
    # store a newer version of r1 and different content for r2, then ask again
    sink = ClickHouseSink(store)
    sink.add(
        "io.sparseety.v1.RequestAccounting",
        {**record(1), "finished_ts_ns": T0 + 10**6 * S},
        topic="x",
        partition=0,
        offset=0,
    )
    sink.add(
        "io.sparseety.v1.RequestAccounting", {**record(2), "steps": 99}, topic="x", partition=0, offset=1
    )
    sink.add("io.sparseety.v1.RequestAccounting", record(3), topic="x", partition=0, offset=2)
    sink.flush()
    diff = replay(cfg, store, cfg.topics.timelines, start, stop, dry=True).diff["requests"]
    assert diff == {"new": 7, "changed": 1, "unchanged": 1, "superseded": 1}


def test_offset_and_time_ranges(kafka_cfg: Config, store: Store) -> None:
    cfg = kafka_cfg
    # One producer batch whose records carry explicit timestamps 1 s apart: a time lookup on this
    # broker lands on the batch, so the replay itself must skip the records before the start.
    base_ms = int(time.time() * 1000) - 100_000
    produce(cfg, [record(i) for i in range(40)], timestamps_ms=[base_ms + i * 1000 for i in range(40)])

    by_offset = replay(cfg, store, cfg.topics.timelines, Bound("offset", 3), Bound("offset", 8))
    assert by_offset.records_in_range == 10  # offsets 3..7 of each of the 2 partitions
    assert all((p.start, p.kept) == (3, 5) for p in by_offset.plans)

    store.command(f"TRUNCATE TABLE {store.table('requests')}")
    by_time = replay(
        cfg,
        store,
        cfg.topics.timelines,
        Bound("time", (base_ms + 20_000) * 10**6),
        Bound("time", (base_ms + 30_000) * 10**6),
    )
    got = sorted(
        int(r["request_id"][1:]) for r in store.query(f"SELECT request_id FROM {store.database}.requests_v")
    )
    assert got == list(range(20, 30))
    assert by_time.records_in_range == 10


def test_replay_cli_reports_throughput_and_rows(kafka_cfg: Config, store: Store) -> None:
    cfg = kafka_cfg
    produce(cfg, [record(i) for i in range(30)])
    store.close()  # the CLI opens the store itself
    env = to_env(cfg)
    runner = CliRunner()
    result = runner.invoke(
        main, ["replay", "--topic", "timelines", "--idle", "0.5", "--format", "csv"], env=env
    )
    assert result.exit_code == 0, result.output
    assert "table,rows_written" in result.stdout and "requests,30" in result.stdout
    assert "30 records in range" in result.stderr and "records/s" in result.stderr
    dry = runner.invoke(
        main, ["replay", "--topic", "timelines", "--dry-run", "--idle", "0.5", "--format", "json"], env=env
    )
    assert dry.exit_code == 0, dry.output
    assert '"unchanged": 30' in dry.stdout
    folded = runner.invoke(main, ["replay", "--topic", "engine-events", "--idle", "0.5"], env=env)
    assert folded.exit_code == 0 and "epochs folded" in folded.stderr
    bad = runner.invoke(main, ["replay", "--topic", "not-a-topic"], env=env)
    assert bad.exit_code == 2 and "not a SparSEEty topic" in bad.output


def test_replay_cli_without_kafka_says_so(kafka_cfg: Config, tmp_path: Any) -> None:
    cfg = kafka_cfg.replace(kafka={"bootstrap": f"127.0.0.1:{free_port()}"}, data_dir=str(tmp_path))
    result = CliRunner().invoke(main, ["replay", "--topic", "timelines", "--idle", "0.5"], env=to_env(cfg))
    assert result.exit_code == 2, result.output
    assert "Kafka at 127.0.0.1:" in result.output and "does not answer" in result.output


#: Run in a fresh interpreter: replay a topic range through the CLI (timelines through the sink,
#: engine events through the worker's fold), then report which modules that loaded.
_REPLAY_PROBE = """
import json, sys
from sparseety.cli import main
for topic in ("timelines", "engine-events"):
    try:
        main(["replay", "--topic", topic, "--idle", "0.5"], standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, exc.code
print(json.dumps(sorted(sys.modules)))
"""


def test_a_replay_run_loads_no_faust(kafka_cfg: Config, store: Store) -> None:
    """Replay runs the fold in memory on aiokafka alone: after a real replay of a topic range
    (client settings translated, records read, rows written), no Faust module was ever loaded."""
    import json
    import os
    import subprocess
    import sys

    cfg = kafka_cfg
    produce(cfg, [record(i) for i in range(10)])
    store.close()  # the replay opens the store itself
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY_PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, **to_env(cfg)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "10 records in range" in done.stderr, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "sparseety.sinks.replay" in loaded and "aiokafka" in loaded  # it did run a replay
    assert [m for m in loaded if m == "faust" or m.startswith(("faust.", "mode."))] == []
    # issue 34: not even the worker's Faust workarounds (the broker's is sparseety/broker_compat.py)
    assert "sparseety.streams.runtime" not in loaded and "sparseety.streams.compat" not in loaded
    assert "sparseety.broker_compat" in loaded
