"""``sparseety analyze`` equals the streaming pipeline: the recorded real-vLLM events go through
the real broker, a real Faust worker and the real sink into chDB; ``analyze --clickhouse`` folds
the same recordings offline into another database of the same store; every stored row of both
(requests, token segments, block uses, expert load, usage windows) is the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparseety.config import Config
from sparseety.kafka import ensure_topics
from sparseety.offline.analyze import analyze
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import ComponentProcess, produce_raw, read_topic, wait_folded, wait_for
from tests.recorded import DATA, load_scenario, raw_events, scenarios
from tests.topology.test_sink_consumer import all_committed, committed
from tests.topology.test_worker import worker_cfg

#: Columns that say when or from where a row was written, not what it holds.
TABLES = {
    "requests": "request_uid",
    "token_segments": "request_uid, idx",
    "kv_blocks": "request_uid, idx",
    "expert_load": "request_uid",
    "usage_1m": "usage_id",
}


def _rows(store: Store, table: str, order: str) -> list[dict[str, Any]]:
    return store.query(f"SELECT * FROM {store.table(table)} FINAL ORDER BY {order}")


def test_analyze_stores_what_the_streaming_pipeline_stores(
    kafka_cfg: Config, unique: str, tmp_path: Path
) -> None:
    cfg = worker_cfg(kafka_cfg, unique).replace(
        sink={**kafka_cfg.sink.model_dump(), "group_id": f"sink-{unique}", "batch_interval_s": 0.3},
        clickhouse={**kafka_cfg.clickhouse.model_dump(), "database": "streamed"},
    )
    ensure_topics(cfg)
    files = [DATA / name / "events.bin" for name in scenarios()]
    expected = 0
    for name in scenarios():
        events, truth = load_scenario(name)
        produce_raw(
            cfg,
            cfg.topics.engine_events,
            [(e["engine_name"].encode(), v) for e, v in zip(events, raw_events(name), strict=True)],
        )
        expected += len(truth["requests"])
    worker = ComponentProcess(cfg, ["worker"], tmp_path / "worker.log").start()
    sink = ComponentProcess(
        cfg, ["sink", "--commit-interval", "0.5", "--loglevel", "info"], tmp_path / "sink.log"
    ).start()
    try:
        wait_folded(cfg, worker, expected, 300, "every recorded request folded")
        worker.stop()  # nothing more will be produced: the topics' ends are final
        last: dict[tuple[str, int], int] = {}
        for topic in (cfg.topics.timelines, cfg.topics.usage):
            for partition, offset, _, _ in read_topic(cfg, topic, decode=False):
                last[(topic, partition)] = max(last.get((topic, partition), -1), offset)
        wait_for(lambda: all_committed(cfg, last) or not sink.alive(), 120, 1, "the sink stored everything")
        assert sink.alive(), sink.tail()
    finally:
        worker.stop()
        sink.stop()
    assert committed(cfg, list(last))

    summary = analyze(
        cfg, files, tmp_path / "out", clickhouse_dsn=cfg.clickhouse_dsn, clickhouse_database="analyzed"
    )
    assert summary.failed == 0 and summary.totals["requests"] == expected
    streamed = Store.open(cfg, database="streamed")
    analyzed = Store.open(cfg, database="analyzed")
    try:
        for table, order in TABLES.items():
            want, got = _rows(streamed, table, order), _rows(analyzed, table, order)
            assert want, table
            assert got == want, table
        assert _rows(analyzed, "dead_letters", "dlq_offset") == []
    finally:
        analyzed.close()
        streamed.close()
