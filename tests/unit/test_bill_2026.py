"""The bill of 2026 (issue 36): a mixed workload's bill is the sum of its parts, and no token is
billed twice across the new classes.

Crafted RequestAccounting records, one per feature (a cache writer with a TTL, reads from every
cache tier, a P/D decode row, a multimodal prompt with encoder work, a service tier without a
multiplier), go through the ClickHouse sink into chDB; the cost queries' answers are checked
against the formulas of docs/cost-model.md ("The bill of 2026") computed here by hand, class by
class, in integer picodollars.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal as D
from typing import Any

import pytest

from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.prices import PRICE_CLASSES, Price, set_prices
from tests import factories as f
from tests.helpers import accounting_store

pytestmark = pytest.mark.unit

M = "m"
#: USD per 1M tokens, or the factor of a multiplier (qualifier after the colon)
PRICES: dict[str, str] = {
    "input": "10",
    "cached_input": "2.5",
    "output": "40",
    "cache_write": "12.5",
    "cache_write_ttl_multiplier:1h": "1.6",
    "cached_input_cpu_offload": "1",
    "cached_input_host": "0.5",
    "cached_input_storage": "0.25",
    "image_input": "20",
    "audio_input": "160",
    "encoder_compute": "5",
    "encoder_cache_read": "0.5",
    "service_tier_multiplier:flex": "0.5",
    "service_tier_multiplier:priority": "2",
}


def _prices(table: dict[str, str]) -> list[Price]:
    out = []
    for key, usd in table.items():
        cls, _, qualifier = key.partition(":")
        out.append(Price(M, cls, D(usd), 0, "", qualifier))
    return out


def _rec(uid: str, *, P: int, C: int, O: int, tiers: int = 0, **over: Any) -> dict[str, Any]:  # noqa: E741
    """A request in the cost model's counts: every prompt position computed once unless read
    (C: gpu tier; ``tiers``: the other tiers' total, which the engine counts in its hits)."""
    S = P - C - tiers + O - 1
    return f.counted(uid, P=P, C=C, O=O, S=S, model=M, engine_cached_tokens=C + tiers, **over)


RECORDS = [
    # a cold prompt written to the cache, with a one-hour retention, on the flex tier
    _rec("e@1/w", P=4000, C=0, O=100, cache_write_tokens=3000, cache_ttl="1h", service_tier="flex"),
    # reads from gpu, the CPU offload tier and storage; the rest computed and written
    _rec(
        "e@1/t",
        P=4000,
        C=1000,
        O=50,
        tiers=1500,
        cache_read_cpu_offload_tokens=1000,
        cache_read_storage_tokens=500,
        cache_write_tokens=1000,
        service_tier="priority",
        priority=-1,
    ),
    # the decode side of P/D: what the prefill engine computed was loaded (tier external)
    _rec("e@1/d", P=3000, C=0, O=200, tiers=2000, external_kv_tokens=2000, pd_role="decode", pd_join_id="x1"),
    # a multimodal prompt: image and audio positions, the encoder's work
    _rec(
        "e@1/v",
        P=2000,
        C=200,
        O=10,
        image_tokens=600,
        image_cached_tokens=200,
        audio_tokens=300,
        encoder_compute_tokens=400,
        encoder_cache_hit_tokens=200,
        service_tier="flex",
    ),
    # SGLang's host tier; a service tier with no multiplier in the table (x1)
    _rec("e@1/h", P=1000, C=100, O=5, tiers=300, cache_read_host_tokens=300, service_tier="batch"),
]


def _micro(usd: str) -> int:
    return int(D(usd) * 1_000_000)


def _expected(rec: dict[str, Any], table: dict[str, str], mode: str) -> dict[str, int]:
    """One request's bill by docs/cost-model.md, part by part, in picodollars (token x micro-USD
    per 1M tokens). ``mode``: actual or list."""

    def p(cls: str, fallback: int) -> int:
        return _micro(table[cls]) if cls in table else fallback

    p_in, p_out = p("input", 0), p("output", 0)
    p_cached = p("cached_input", p_in)
    ttl = p(f"cache_write_ttl_multiplier:{rec['cache_ttl']}", 1_000_000)
    p_w = p("cache_write", p_in) * ttl // 1_000_000
    tier_prices = {
        "cache_read_cpu_offload_tokens": p("cached_input_cpu_offload", p_cached),
        "cache_read_host_tokens": p("cached_input_host", p_cached),
        "cache_read_storage_tokens": p("cached_input_storage", p_cached),
        # nothing in actual (the prefill engine's request computed it), cached_input in list
        "external_kv_tokens": p("cached_input_external", 0 if mode == "actual" else p_cached),
    }
    tiers = sum(rec[k] for k in tier_prices)
    if mode == "actual":
        base = (rec["scheduled_tokens"] - rec["output_tokens"]) * p_in + rec["cache_read_tokens"] * p_cached
    else:  # the engine's own hits, of them the tiers beside gpu at their own prices below
        hits = rec["engine_cached_tokens"]
        base = (rec["prompt_tokens"] - hits) * p_in + (hits - tiers) * p_cached
    base += rec["output_tokens"] * p_out
    parts = {
        "base": base,
        "tier_read": sum(rec[k] * price for k, price in tier_prices.items()),
        "cache_write_premium": rec["cache_write_tokens"] * (p_w - p_in),
        "modality_premium": sum(
            (rec[f"{m}_tokens"] - rec[f"{m}_cached_tokens"]) * (p(f"{m}_input", p_in) - p_in)
            for m in ("image", "audio", "video")
        ),
        "encoder": rec["encoder_compute_tokens"] * p("encoder_compute", 0)
        + rec["encoder_cache_hit_tokens"] * p("encoder_cache_read", 0),
    }
    factor = p(f"service_tier_multiplier:{rec['service_tier']}", 1_000_000)
    parts["total"] = sum(parts.values()) * factor // 1_000_000
    return parts


@pytest.fixture(scope="module")
def q(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queries]:
    with accounting_store(tmp_path_factory, RECORDS, _prices(PRICES)) as store:
        yield Queries(store)


def _pico(usd: D) -> int:
    return int(usd * 10**12)


@pytest.mark.parametrize("mode", ["actual", "list"])
def test_the_bill_by_service_tier_is_the_sum_of_its_parts(q: Queries, mode: str) -> None:
    by_tier: dict[str, list[dict[str, int]]] = {}
    for rec in RECORDS:
        by_tier.setdefault(rec["service_tier"], []).append(_expected(rec, PRICES, mode))
    rows = {r["service_tier"]: r for r in q.cost(mode=mode, by=["service_tier"])}
    assert set(rows) == set(by_tier) == {"flex", "priority", "", "batch"}
    for tier, parts in by_tier.items():
        row = rows[tier]
        assert _pico(row["cost_usd"]) == sum(x["total"] for x in parts), (mode, tier)
        for part in ("tier_read", "cache_write_premium", "modality_premium", "encoder"):
            assert _pico(row[f"{part}_usd"]) == sum(x[part] for x in parts), (mode, tier, part)
    # the groups add up to the whole, and the whole to its requests
    (total,) = q.cost(mode=mode, by=[])
    assert _pico(total["cost_usd"]) == sum(_expected(r, PRICES, mode)["total"] for r in RECORDS)
    assert sum(_pico(r["cost_usd"]) for r in rows.values()) == _pico(total["cost_usd"])
    # the counts the bill reads, summed
    assert total["cache_write_tokens"] == 4000
    assert (total["cache_read_cpu_offload_tokens"], total["cache_read_host_tokens"]) == (1000, 300)
    assert (total["cache_read_storage_tokens"], total["external_kv_tokens"]) == (500, 2000)
    assert (total["image_tokens"], total["audio_tokens"], total["encoder_compute_tokens"]) == (600, 300, 400)


def test_grouped_by_priority_and_pd_role(q: Queries) -> None:
    rows = {
        (r["priority"], r["pd_role"]): r["sequences"]
        for r in q.cost(mode="actual", by=["priority", "pd_role"])
    }
    assert rows == {(-1, "none"): 1, (0, "decode"): 1, (0, "none"): 3}


def test_each_token_is_billed_in_one_class(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Raising one class's price by 1 USD per 1M tokens raises the bill by exactly the tokens of
    that class (before the service tier's factor, which is left out here): a position counted in
    two classes would move it twice. Every prompt position is in exactly one of computed, gpu,
    cpu_offload, host, storage or external; cache writes and modality positions are subsets of
    the computed ones (their price replaces input's), encoder tokens are the encoder's own."""
    plain = {k: v for k, v in PRICES.items() if not k.startswith("service_tier_multiplier")}
    plain["cached_input_external"] = "0.1"
    counts = {
        "output": sum(r["output_tokens"] for r in RECORDS),
        "cached_input": sum(r["cache_read_tokens"] for r in RECORDS),
        "cached_input_cpu_offload": 1000,
        "cached_input_host": 300,
        "cached_input_storage": 500,
        "cached_input_external": 2000,
        # written positions are priced at cache_write x the TTL's factor (1.6 for the 1h one)
        "cache_write": 3000 * 16 // 10 + 1000,
        "image_input": 400,
        "audio_input": 300,
        "encoder_compute": 400,
        "encoder_cache_read": 200,
        # input: every computed position that is neither written nor of a modality
        "input": sum(r["scheduled_tokens"] - r["output_tokens"] for r in RECORDS) - 4000 - 700,
    }
    for r in RECORDS:  # every prompt position in exactly one class
        tiers = sum(
            r[k]
            for k in (
                "cache_read_cpu_offload_tokens",
                "cache_read_host_tokens",
                "cache_read_storage_tokens",
                "external_kv_tokens",
            )
        )
        assert (
            r["prompt_tokens"]
            == r["scheduled_tokens"] - (r["output_tokens"] - 1) + r["cache_read_tokens"] + tiers
        )
    with accounting_store(tmp_path_factory, RECORDS, _prices(plain)) as store:
        q = Queries(store)

        def bill() -> int:
            (row,) = q.cost(mode="actual", by=[])
            return _pico(row["cost_usd"])

        start = bill()
        assert start == sum(_expected(r, plain, "actual")["total"] for r in RECORDS)
        for cls, n in counts.items():
            before = bill()
            set_prices(store, [Price(M, cls, D(plain[cls]) + 1, 0)])
            assert bill() - before == n * 1_000_000, cls
    assert set(counts) | {"gpu_hour", "kv", "reasoning_output", "video_input"} | {
        "service_tier_multiplier",
        "cache_write_ttl_multiplier",
    } == set(PRICE_CLASSES)


def test_without_the_new_prices_the_bill_is_what_it_was(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Only input, cached_input and output priced: premiums are 0 and factors 1, an external
    read (the P/D decode side) costs nothing in actual, as before; a read of the engine's own
    other tiers costs what a gpu read costs (cached_input). A row written before (every new count
    at its default) costs what it did."""
    old = {"input": "10", "cached_input": "2.5", "output": "40"}
    before = f.counted("e@1/old", P=100, C=20, O=5, S=84, model=M)
    with accounting_store(tmp_path_factory, [*RECORDS, before], _prices(old)) as store:
        q = Queries(store)
        for r in [*RECORDS, before]:
            row = q.request(r["request_uid"], scope=Scope())
            assert row is not None
            own = r.get("cache_read_cpu_offload_tokens", 0) + r.get("cache_read_host_tokens", 0)
            own += r.get("cache_read_storage_tokens", 0)
            reads = (r["cache_read_tokens"] + own) * D("2.5")
            want = (r["scheduled_tokens"] - r["output_tokens"]) * 10 + reads + r["output_tokens"] * 40
            assert row["cost"]["actual"] == want / 1_000_000, r["request_uid"]
        old_row = q.request("e@1/old", scope=Scope())
        assert old_row["cost"]["actual"] == D("0.00104")  # (79 x 10 + 20 x 2.5 + 5 x 40) per 1M


def test_no_cache_what_if_computes_every_own_tiers_reads(q: Queries) -> None:
    """The no-cache what-if (docs/cost-model.md): the reads of every cache tier of the engine's
    own (gpu, CPU offload, host, storage) are computed instead, at the input price instead of
    the tier's; what a connector loaded from outside (external) stays; the service tier's factor
    applies to the counterfactual charge as to the actual one."""
    (row,) = q.whatif(scenario="no-cache", by=[])
    reads = sum(
        r["cache_read_tokens"]
        + r.get("cache_read_cpu_offload_tokens", 0)
        + r.get("cache_read_host_tokens", 0)
        + r.get("cache_read_storage_tokens", 0)
        for r in RECORDS
    )
    assert row["delta_computed_tokens"] == reads == 100 + 1000 + 200 + 1000 + 500 + 300
    p_in = _micro(PRICES["input"])
    tier_price = {
        "cache_read_tokens": _micro(PRICES["cached_input"]),
        "cache_read_cpu_offload_tokens": _micro(PRICES["cached_input_cpu_offload"]),
        "cache_read_host_tokens": _micro(PRICES["cached_input_host"]),
        "cache_read_storage_tokens": _micro(PRICES["cached_input_storage"]),
    }
    want = 0
    for r in RECORDS:
        parts = _expected(r, PRICES, "actual")
        untiered = sum(v for k, v in parts.items() if k != "total")
        delta = sum(r.get(k, 0) * (p_in - price) for k, price in tier_price.items())
        factor = _micro(PRICES.get(f"service_tier_multiplier:{r['service_tier']}", "1"))
        want += (untiered + delta) * factor // 1_000_000 - parts["total"]
    assert _pico(row["delta_cost_usd"]) == want
