"""The fold's caveats end to end through the real chDB store (streams/caveats.py, issue 21):
the epoch's cold first step is reported apart from GPU attribution, and a cached prefix whose
source was lost with the engine's history says so in the request's answer and in amortized."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from sparseety.config import WorkerConfig
from sparseety.queries.caveats import SOURCE_LOST
from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.prices import Price
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import accounting_store

T0 = 1_700_000_000 * 1_000_000_000  # 2023-11-14 22:13:20 UTC
COLD_NS = 2_600_000_000  # the cold first step a real GPU server showed (issue 21)
CFG = WorkerConfig(reorder_max_events=1, closed_retention_s=0)


def fold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    asm = Assembler(CFG, MemoryStore())
    return [o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES]


@pytest.fixture
def q(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Queries]:
    events = f.history_loss(T0, cold_step_ns=COLD_NS)
    if request.param == "lost":
        events = [e for e in events if e["seq"] != 3]  # the KvBlocksStored never arrives
    prices = [
        Price("tiny", c, Decimal(p)) for c, p in (("input", "10"), ("cached_input", "1"), ("output", "40"))
    ]
    with accounting_store(tmp_path_factory, fold(events), prices) as s:
        yield Queries(s)


@pytest.mark.parametrize("q", ["lost"], indirect=True)
def test_a_source_lost_with_the_history_is_named_and_amortized_says_it_fell_back(q: Queries) -> None:
    r2 = q.request(f"{f.EID}/r2")
    assert r2 is not None
    lost_at = "2023-11-14T22:13:20.000Z"  # T0 + 5 µs, the first event after the gap, in ms
    assert r2["source_history_lost_ts_ns"] == T0 + 5000
    cached = [s for s in r2["segments"] if s["status"] == "cached"]
    assert [s["source_request_uid"] for s in cached] == [SOURCE_LOST.format(at=lost_at)]
    assert (
        r2["amortized_note"] == f"fell back to actual for 8 cached tokens: {SOURCE_LOST.format(at=lost_at)}"
    )
    assert r2["cost"]["amortized"] == r2["cost"]["actual"]  # no lifetime to share: as read
    rows = {r["tenant"]: r for r in q.cost(mode="amortized")}
    assert rows["acme"]["fallback_requests"] == 1 and rows["acme"]["requests"] == 2
    # a tenant-scoped reader sees the same note: its own request, no other tenant's uid in it
    scoped = q.request(f"{f.EID}/r2", scope=Scope(tenants=("acme",)))
    assert (
        scoped is not None and scoped["segments"][0]["source_request_uid"] == cached[0]["source_request_uid"]
    )


@pytest.mark.parametrize("q", ["lost"], indirect=True)
def test_the_dashboards_timeline_hover_names_the_lost_source(q: Queries) -> None:
    from sparseety.api.dashboard import build_figures, collect
    from sparseety.api.queries import ApiQueries

    data = collect(ApiQueries(q.store), request_uids=[f"{f.EID}/r2"])
    timeline = build_figures(data)["timeline"]
    hovers = {str(c[3]) for trace in timeline["data"] for c in trace.get("customdata") or ()}
    assert SOURCE_LOST.format(at="2023-11-14T22:13:20.000Z") in hovers


@pytest.mark.parametrize("q", ["whole"], indirect=True)
def test_with_the_history_whole_the_source_is_named_and_amortized_shares(q: Queries) -> None:
    r2 = q.request(f"{f.EID}/r2")
    assert r2 is not None and r2["source_history_lost_ts_ns"] == 0 and "amortized_note" not in r2
    assert [s["source_request_uid"] for s in r2["segments"] if s["status"] == "cached"] == [f"{f.EID}/r1"]
    assert r2["cost"]["amortized"] != r2["cost"]["actual"]  # it pays its share of r1's blocks
    assert q.cost(mode="amortized")[0]["fallback_requests"] == 0


@pytest.mark.parametrize("q", ["whole"], indirect=True)
def test_the_cold_first_step_is_reported_apart_from_gpu_attribution(q: Queries) -> None:
    r1, r2 = q.request(f"{f.EID}/r1"), q.request(f"{f.EID}/r2")
    assert r1 is not None and r2 is not None
    # r1 ran alone in the cold step 0 and r2 alone in step 1 (1 ms): r1's 2.6 s is flagged
    assert (r1["gpu_time_ns"], r1["warmup_gpu_time_ns"]) == (COLD_NS, COLD_NS)
    assert (r2["gpu_time_ns"], r2["warmup_gpu_time_ns"]) == (1_000_000, 0)
    (row,) = q.gpu_time()
    assert (row["gpu_time_ns"], row["warmup_gpu_time_ns"]) == (COLD_NS + 1_000_000, COLD_NS)
