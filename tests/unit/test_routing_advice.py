"""Prefix-routing advice (``/api/v1/routing``) on two engines sharing a system prompt (real chDB).

Model m1 at input $10 per 1M tokens; blocks of 1000 tokens. Tenant A's system prompt is the
chain s1 -> s2 (s1 is the root); each request adds one question block of its own:
  r1 e1: computes s1 s2 q1     r2 e1: reads s1 s2, computes q2
  r3 e2: computes s1 s2 q3     r4 e2: reads s1 s2, computes q4     r5 e2: reads s1 s2, computes q5
  r6 (tenant B) e1: computes t1 t2   (one engine: nothing to advise)
s1 and s2 were computed on 2 engines: 2 blocks x 1000 tokens x (2 - 1) = 2000 duplicated tokens,
$0.02; over a one-hour scope that is $0.02 per hour. e2 used the prefix's blocks 9 times, e1 6.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.prices import Price
from tests import factories as f
from tests.helpers import accounting_store

S = 1_000_000_000
T0 = 1_700_000_000 * S
HOUR = 3600 * S


def blk(name: str, role: str) -> dict[str, Any]:
    return {"block_hash": name.encode(), "lifetime_seq": 1, "role": role, "tokens": 1000}


def req(rid: str, engine: str, tenant: str, blocks: list[dict[str, Any]], at: int) -> dict[str, Any]:
    return f.accounting(
        f"{engine}@1/{rid}",
        engine_name=engine,
        engine_id=f"{engine}@1",
        tenant=tenant,
        model="m1",
        finished_ts_ns=T0 + at * S,
        block_uses=blocks,
    )


def dataset() -> list[dict[str, Any]]:
    fresh = [blk("s1", "computed"), blk("s2", "computed")]
    warm = [blk("s1", "cached"), blk("s2", "cached")]
    return [
        req("r1", "e1", "A", [*fresh, blk("q1", "computed")], 10),
        req("r2", "e1", "A", [*warm, blk("q2", "computed")], 20),
        req("r3", "e2", "A", [*fresh, blk("q3", "computed")], 30),
        req("r4", "e2", "A", [*warm, blk("q4", "computed")], 40),
        req("r5", "e2", "A", [*warm, blk("q5", "computed")], 50),
        req("r6", "e1", "B", [blk("t1", "computed"), blk("t2", "computed")], 60),
    ]


@pytest.fixture(scope="module")
def q(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queries]:
    prices = [Price("m1", c, Decimal(p), 0) for c, p in (("input", "10"), ("output", "40"))]
    with accounting_store(tmp_path_factory, dataset(), prices) as s:
        yield Queries(s)


HOUR_SCOPE = Scope(since_ns=T0, until_ns=T0 + HOUR)


def test_advice_names_the_prefix_the_engines_and_saves_the_duplicated_compute(q: Queries) -> None:
    (a,) = q.routing_advice(scope=HOUR_SCOPE)
    assert (a["model"], a["tenant"]) == ("m1", "A")
    assert a["prefix_hash"] == b"s1".hex() and a["block_hashes"] == [b"s1".hex(), b"s2".hex()]
    assert a["engines"] == ["e1", "e2"] and a["affinity_engine"] == "e2"
    assert a["duplicated_blocks"] == 2 and a["block_tokens"] == 1000 and a["computations"] == 4
    # the saving is exactly the duplicated compute, the same number `query duplication` reports
    (dup,) = q.duplication(scope=HOUR_SCOPE)
    assert a["saving_tokens"] == a["duplicated_tokens"] == dup["duplicated_tokens"] == 2000
    assert a["duplicated_cost_usd"] == Decimal("0.02")
    assert a["window_ns"] == HOUR
    assert a["cost_per_hour_usd"] == a["saving_per_hour_usd"] == Decimal("0.02")


def test_without_a_time_range_the_cost_per_hour_uses_the_stored_span(q: Queries) -> None:
    (a,) = q.routing_advice()
    assert a["window_ns"] == 50 * S  # finishes from T0+10 s to T0+60 s
    assert a["cost_per_hour_usd"] == Decimal("0.02") * 3600 / 50


def test_advice_is_tenant_scoped(q: Queries) -> None:
    assert q.routing_advice(scope=Scope(tenants=("B",))) == []
    assert [a["tenant"] for a in q.routing_advice(scope=Scope(tenants=("A",)))] == ["A"]


def test_the_json_export_is_the_documented_format(q: Queries) -> None:
    from sparseety.api.encode import jsonable

    doc = json.loads(json.dumps(jsonable(q.routing_advice(scope=HOUR_SCOPE))))
    assert set(doc[0]) == {
        "model",
        "tenant",
        "prefix_hash",
        "block_hashes",
        "duplicated_blocks",
        "block_tokens",
        "engines",
        "affinity_engine",
        "computations",
        "duplicated_tokens",
        "duplicated_cost_usd",
        "window_ns",
        "cost_per_hour_usd",
        "saving_tokens",
        "saving_per_hour_usd",
    }
    assert doc[0]["saving_per_hour_usd"] == "0.02"
