"""Replay of the engine-events topic through the assembler's fold (the `engine-events`
processor) into the real chDB store: same answers as the live fold, idempotent, and epochs that
started before the range are skipped rather than half-rebuilt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.sinks.processors import processor_for_topic
from sparseety.sinks.replay import Bound, Replay, ReplayReport
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests.helpers import produce_events, table_rows
from tests.sim import SimEngine, workload


@pytest.fixture
def store(kafka_cfg: Config) -> Iterator[Store]:
    s = Store.open(kafka_cfg)
    try:
        migrate(s)
        yield s
    finally:
        s.close()


def replay(cfg: Config, store: Store, start: Bound) -> tuple[ReplayReport, Any]:
    processor = processor_for_topic(cfg, cfg.topics.engine_events)
    sink = ClickHouseSink(store, batch_max_rows=2000)
    try:
        stop = Bound("end", time.time_ns() + 60 * 10**9)
        return Replay(
            cfg, cfg.topics.engine_events, start, stop, sink, processor, idle_s=0.5
        ).run(), processor
    finally:
        sink.close()


def test_replay_rebuilds_what_the_fold_produces_and_twice_changes_nothing(
    kafka_cfg: Config, store: Store
) -> None:
    cfg = kafka_cfg
    events = []
    for i in range(2):
        events += SimEngine(engine=f"engine-{i}", seed=i, spec_k=2, preempt_prob=0.1, cache_blocks=16).run(
            workload(60, seed=i)
        )
    produce_events(cfg, events)
    asm = Assembler(cfg.worker, MemoryStore())
    want = {o.key: o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES}

    report, processor = replay(cfg, store, Bound("beginning"))
    assert report.records_in_range == len(events)
    print(f"\nengine-events replay: {report.records_per_s:,.0f} events/s ({processor.summary()})")
    got = store.query(
        f"SELECT request_uid, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, "
        f"recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, consistent "
        f"FROM {store.table('requests')} FINAL"
    )
    assert len(got) == len(want) == 120
    for row in got:
        acc = want[row["request_uid"]]
        assert all(row[k] == acc[k] for k in row if k != "request_uid"), row
    before = table_rows(store)
    replay(cfg, store, Bound("beginning"))
    assert table_rows(store) == before


def test_epochs_that_began_before_the_range_are_skipped(kafka_cfg: Config, store: Store) -> None:
    cfg = kafka_cfg.replace(topics={**kafka_cfg.topics.model_dump(), "partitions": 2})
    events = SimEngine(seed=3).run(workload(10, seed=3))
    produce_events(cfg, events)
    report, processor = replay(cfg, store, Bound("offset", 5))
    assert report.records_in_range > 0
    assert store.query(f"SELECT count() AS n FROM {store.table('requests')}") == [{"n": 0}]
    assert "skipped" in processor.summary()
