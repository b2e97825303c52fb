"""Issue 14 part 3 in the store: a request accounted by the plugin and by the vLLM server log is
counted once by every view, whatever the arrival order (migration 008_log_dedup.sql).

The fixtures are one real ``vllm serve`` run: its plugin recording and its server log. Both are
folded as the worker folds them and every record (accounting, segments, usage windows) goes
through the real ClickHouseSink into chDB, the log's copy first or the plugin's first, with no
dedup on the writing side (as ``sparseety ingest --format vllm-log`` publishes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparseety.config import load_config
from sparseety.offline.analyze import InputResult, Options, analyze, fold_input, plan
from sparseety.queries.registry import Queries
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests.helpers import chdb_config, throwaway_store
from tests.recorded import DATA

RECORDING = DATA / "vllm_log" / "plugin-events.bin"
LOG = DATA / "vllm_log" / "server.log"


def _fold() -> tuple[InputResult, InputResult]:
    cfg = load_config()
    rec, log = plan([RECORDING, LOG])
    return fold_input(cfg, rec, Options(model="tiny")), fold_input(cfg, log, Options(model="tiny"))


def _write(store: Store, result: InputResult) -> None:
    sink = ClickHouseSink(store)
    for offset, (name, record) in enumerate(result.records):
        if sink.accepts(name):
            sink.add(name, record, topic=f"test:{result.name}", partition=0, offset=offset)
    sink.flush()


def _totals(q: Queries) -> dict[str, Any]:
    (cost,) = q.cost(mode="actual", by=[])
    usage = q.usage(by=[])
    uids = [r["request_uid"] for r in q.requests(limit=1000)]
    return {
        "requests": sorted(uids),
        "cost": {k: cost[k] for k in ("requests", "input_tokens", "cached_tokens", "output_tokens")},
        "usage": [(u["requests"], u["prompt_tokens"], u["output_tokens"]) for u in usage],
    }


@pytest.mark.parametrize("order", ["log_first", "plugin_first"])
def test_a_request_in_the_plugin_and_the_log_is_counted_once_and_the_plugin_wins(
    order: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rec, log = _fold()
    plugin_ids = {r["request_id"]: r for r in rec.rows}
    log_ids = {r["request_id"] for r in log.rows}
    assert log_ids and log_ids <= set(plugin_ids)  # every log request is one of the plugin's
    assert {r["request_uid"] for r in log.rows}.isdisjoint(r["request_uid"] for r in rec.rows)
    with (
        throwaway_store(chdb_config(tmp_path_factory)) as plugin_only,
        throwaway_store(chdb_config(tmp_path_factory)) as both,
    ):
        migrate(plugin_only)
        migrate(both)
        _write(plugin_only, rec)
        expected = _totals(Queries(plugin_only))
        assert expected["requests"] == sorted(r["request_uid"] for r in rec.rows)
        assert expected["cost"]["requests"] == len(rec.rows)
        assert expected["cost"]["output_tokens"] == sum(r["output_tokens"] for r in rec.rows)
        first, second = (log, rec) if order == "log_first" else (rec, log)
        _write(both, first)
        if first is log:  # alone, the log's copies are counted (an engine without the plugin)
            alone = _totals(Queries(both))
            assert len(alone["requests"]) == len(log.rows)
            assert sum(u[0] for u in alone["usage"]) == len(log.rows)
        _write(both, second)
        _write(both, log)  # a replay of the log changes nothing
        raw = both.query(
            f"SELECT engine_kind, count() AS n FROM {both.table('requests')} FINAL GROUP BY engine_kind"
        )
        assert {r["engine_kind"]: r["n"] for r in raw} == {"vllm": len(rec.rows), "vllm_log": len(log.rows)}
        q = Queries(both)
        got = _totals(q)
        assert got["requests"] == expected["requests"]  # the plugin's uids only
        assert got["cost"] == expected["cost"]  # the plugin's numbers (the log's cached tokens are 0)
        # usage: the log engine's windows net to zero requests and tokens; the plugin's are unchanged
        assert sum(u[0] for u in got["usage"]) == sum(u[0] for u in expected["usage"]) == len(rec.rows)
        assert sum(u[1] for u in got["usage"]) == sum(u[1] for u in expected["usage"])
        assert sum(u[2] for u in got["usage"]) == sum(u[2] for u in expected["usage"])
        # per request: the stored row of each engine request id is the plugin's
        rows = q.requests_by_uid([r["request_uid"] for r in log.rows])
        assert not rows  # the log copies are hidden from the per-request answers
        for rid in log_ids:
            (row,) = both.query(
                f"SELECT engine_kind, prompt_tokens, output_tokens FROM {both.database}.requests_v "
                "WHERE request_id = {rid:String}",
                {"rid": rid},
            )
            p = plugin_ids[rid]
            assert (row["engine_kind"], row["prompt_tokens"], row["output_tokens"]) == (
                "vllm",
                p["prompt_tokens"],
                p["output_tokens"],
            )


def test_analyze_writing_both_sources_stores_what_the_plugin_alone_gives(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``analyze --clickhouse`` writes the log's copies too (its usage window includes them); the
    store's answers equal those of the recording alone."""
    rec, _ = _fold()
    cfg = chdb_config(tmp_path_factory)
    with throwaway_store(chdb_config(tmp_path_factory)) as plugin_only, throwaway_store(cfg) as both:
        migrate(plugin_only)
        _write(plugin_only, rec)
        analyze(
            cfg,
            [LOG, RECORDING],
            tmp_path / "out",
            opts=Options(model="tiny"),
            clickhouse_dsn=cfg.clickhouse_dsn,
            clickhouse_database=cfg.clickhouse.database,
        )
        assert _totals(Queries(both)) == _totals(Queries(plugin_only))
        n = both.query(f"SELECT count() AS n FROM {both.table('requests')} FINAL")[0]["n"]
        assert n == len(rec.rows) + 8  # both sources' rows are kept
