"""The query library against a small crafted data set with hand-computed answers.

Prices (USD per 1M tokens; GPU per hour):
  m1: input 10, cached_input 2.5, output 40, gpu_hour 3.6 ($0.001 per GPU-second)
  m2: input 20 (30 from T0+10min), cached_input 5, output 60, no GPU price
  m3: no price at all

Requests (P prompt, C cache reads, O output, S scheduled = computed positions, R recomputed
after preemption, E recomputed after eviction, A/J drafts accepted/rejected); blocks are 1000
tokens; lifetimes are (engine, block, seq):
  r1 A m1 e1: P4000 C0    O500 S4499             computes b1,b2,b3,b4 (lifetime 10..13)
  r2 B m1 e1: P3000 C2000 O200 S1229 A50 J30     reads b1@10, b2@11; computes b5
  r3 A m1 e1: P2000 C1000 O100 S1599 R500        reads b1@10; computes b6 (preempted once)
  r4 B m1 e2: P1000 C0    O10  S1009             computes b1 on engine e2 (fleet duplicate)
  r5 C m1 e1: P1000 C0    O10  S1009 E1000       recomputes b2 after eviction (new lifetime 50)
  r6 A m2 e3: P1000 C0    O100 S1099             before the m2 price change; experts
  r7 A m2 e3: P1000 C0    O100 S1099             after it; reads c1 with unknown lifetime
  r8 D m3 e4: P100  C0    O10  S109              no price
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from sparseety.queries.registry import ANOTHER_TENANT, Queries, QueryError, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import Price
from tests import factories as f
from tests.helpers import accounting_store

S = 1_000_000_000
T0 = 1_700_000_000 * S  # 2023-11-14 22:13:20 UTC
MIN = 60 * S
D = Decimal


def req(
    rid: str,
    tenant: str,
    model: str,
    engine: str,
    minute: int,
    *,
    gpu_s: float = 0.0,
    warmup_s: float = 0.0,
    blocks: list[dict[str, Any]] | None = None,
    experts: list[int] | None = None,
    **counts: int,
) -> dict[str, Any]:
    return f.counted(
        f"{engine}@1/{rid}",
        preemptions=1 if rid == "r3" else 0,
        tenant=tenant,
        model=model,
        finished_ts_ns=T0 + minute * MIN,
        gpu_time_ns=int(gpu_s * S),
        warmup_gpu_time_ns=int(warmup_s * S),
        block_uses=blocks or [],
        **f.experts(experts),
        **counts,
    )


uses = f.block_uses


def dataset() -> list[dict[str, Any]]:
    # fmt: off
    return [
        req("r1", "A", "m1", "e1", 1, P=4000, C=0, O=500, S=4499, gpu_s=2,
            blocks=uses("computed", "b1@10", "b2@11", "b3@12", "b4@13")),
        req("r2", "B", "m1", "e1", 2, P=3000, C=2000, O=200, S=1229, A=50, J=30, gpu_s=1,
            warmup_s=0.5,  # half of it in its engine's cold first step
            blocks=uses("cached", "b1@10", "b2@11") + uses("computed", "b5@20")),
        req("r3", "A", "m1", "e1", 3, P=2000, C=1000, O=100, S=1599, R=500, gpu_s=1.5,
            blocks=uses("cached", "b1@10") + uses("computed", "b6@30")),
        req("r4", "B", "m1", "e2", 4, P=1000, C=0, O=10, S=1009, gpu_s=0.5, blocks=uses("computed", "b1@5")),
        req("r5", "C", "m1", "e1", 6, P=1000, C=0, O=10, S=1009, E=1000, gpu_s=0.5,
            blocks=uses("recomputed", "b2@50")),
        req("r6", "A", "m2", "e3", 5, P=1000, C=0, O=100, S=1099, gpu_s=1, blocks=uses("computed", "c1@7"),
            experts=[10, 0, 5, 5, 0, 20, 0, 0]),
        req("r7", "A", "m2", "e3", 15, P=1000, C=0, O=100, S=1099, gpu_s=1, blocks=uses("cached", "c1@-1"),
            experts=[0, 10, 5, 5, 10, 0, 0, 10]),
        req("r8", "D", "m3", "e4", 20, P=100, C=0, O=10, S=109),
    ]
    # fmt: on


PRICES = [
    Price("m1", "input", D("10"), 0),
    Price("m1", "cached_input", D("2.5"), 0),
    Price("m1", "output", D("40"), 0),
    Price("m1", "gpu_hour", D("3.6"), 0),
    Price("m2", "input", D("20"), T0 - 86400 * S),
    Price("m2", "input", D("30"), T0 + 10 * MIN),
    Price("m2", "cached_input", D("5"), T0 - 86400 * S),
    Price("m2", "output", D("60"), T0 - 86400 * S),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One database for the module: the queries only read the crafted data set."""
    with accounting_store(tmp_path_factory, dataset(), PRICES, partitions=2) as s:
        yield s


@pytest.fixture
def q(store: Store) -> Queries:
    return Queries(store)


def by_key(rows: list[dict[str, Any]], *dims: str) -> dict[Any, dict[str, Any]]:
    return {r[dims[0]] if len(dims) == 1 else tuple(r[d] for d in dims): r for r in rows}


# Per-request costs by hand (USD):
#   list   = (P - C) x input + C x cached + O x output
#   actual = (S - O) x input + C x cached + O x output
LIST = {
    "r1": D("0.04") + D("0.02"),  # 4000 x 10e-6 + 500 x 40e-6
    "r2": D("0.01") + D("0.005") + D("0.008"),  # 1000 x 10e-6 + 2000 x 2.5e-6 + 200 x 40e-6
    "r3": D("0.01") + D("0.0025") + D("0.004"),
    "r4": D("0.01") + D("0.0004"),
    "r5": D("0.01") + D("0.0004"),
    "r6": D("0.02") + D("0.006"),  # m2 at input 20
    "r7": D("0.03") + D("0.006"),  # m2 at input 30
}
ACTUAL = {
    "r1": D("0.03999") + D("0.02"),  # S - O = 3999
    "r2": D("0.01029") + D("0.005") + D("0.008"),  # S - O = 1029
    "r3": D("0.01499") + D("0.0025") + D("0.004"),  # S - O = 1499
    "r4": D("0.00999") + D("0.0004"),
    "r5": D("0.00999") + D("0.0004"),
    "r6": D("0.01998") + D("0.006"),
    "r7": D("0.02997") + D("0.006"),
}
# Amortized: lifetime (e1,b1,10) = r1's $0.01 shared by r1, r2, r3 -> 3333333334, 3333333333,
# 3333333333 picodollars (the remainder goes to the first request_uid); (e1,b2,11) = $0.01
# shared by r1, r2 -> 5e9 each. Every other lifetime has one user; r7's read has no lifetime.
PICO = D(10) ** 12
DELTA = {
    "r1": (D(3333333334) + D(5_000_000_000) - D(20_000_000_000)) / PICO,
    "r2": (D(3333333333) + D(5_000_000_000)) / PICO,
    "r3": D(3333333333) / PICO,
}
AMORTIZED = {k: v + DELTA.get(k, D(0)) for k, v in ACTUAL.items()}
TENANTS = {"A": ["r1", "r3", "r6", "r7"], "B": ["r2", "r4"], "C": ["r5"], "D": []}


@pytest.mark.parametrize(("mode", "expected"), [("list", LIST), ("actual", ACTUAL), ("amortized", AMORTIZED)])
def test_cost_by_tenant_in_each_mode(q: Queries, mode: str, expected: dict[str, Decimal]) -> None:
    rows = by_key(q.cost(mode=mode, by=["tenant"]), "tenant")
    assert set(rows) == set(TENANTS)
    for tenant, rids in TENANTS.items():
        assert rows[tenant]["cost_usd"] == sum((expected[r] for r in rids), D(0)), tenant
    assert rows["A"]["requests"] == 4
    assert rows["D"]["unpriced_requests"] == 1 and rows["D"]["cost_usd"] == 0
    assert rows["A"]["unpriced_requests"] == 0
    # to the cent, as an invoice shows them
    cents = {t: r["cost_usd"].quantize(D("0.01")) for t, r in rows.items()}
    assert (
        cents
        == {
            "list": {"A": D("0.14"), "B": D("0.03"), "C": D("0.01"), "D": D("0.00")},
            "actual": {"A": D("0.14"), "B": D("0.03"), "C": D("0.01"), "D": D("0.00")},
            "amortized": {"A": D("0.14"), "B": D("0.04"), "C": D("0.01"), "D": D("0.00")},
        }[mode]
    )


def test_cost_token_counts_per_mode(q: Queries) -> None:
    a_list = by_key(q.cost(mode="list"), "tenant")["A"]
    assert (a_list["input_tokens"], a_list["cached_tokens"], a_list["output_tokens"]) == (7000, 1000, 800)
    assert a_list["prompt_tokens"] == 4000 + 2000 + 1000 + 1000  # r1, r3, r6, r7: P, as usage says
    a_act = by_key(q.cost(mode="actual"), "tenant")["A"]
    assert (a_act["input_tokens"], a_act["cached_tokens"], a_act["output_tokens"]) == (
        3999 + 1499 + 999 + 999,
        1000,
        800,
    )


def test_amortized_conserves_the_total(q: Queries) -> None:
    actual = q.cost(mode="actual", by=[])
    amortized = q.cost(mode="amortized", by=[])
    assert amortized[0]["cost_usd"] == actual[0]["cost_usd"] == sum(ACTUAL.values(), D(0))
    assert amortized[0]["shared_delta_usd"] == 0
    per_request = by_key(q.cost(mode="amortized", by=["tenant", "engine"]), "tenant", "engine")
    assert sum(r["shared_delta_usd"] for r in per_request.values()) == 0
    assert per_request[("A", "e1")]["shared_delta_usd"] == DELTA["r1"] + DELTA["r3"]


def test_amortized_shares_add_up_to_the_block(q: Queries, store: Store) -> None:
    rows = store.query(f"SELECT request_uid, shared_pico FROM {store.database}.amortized_delta_v")
    shared = {r["request_uid"].rsplit("/", 1)[1]: int(r["shared_pico"]) for r in rows}
    block = 10_000_000_000  # one m1 block: 1000 tokens x 10 micro-USD = $0.01 in picodollars
    assert shared == {
        "r1": 3333333334 + block // 2 + 2 * block,  # b1 share, b2 share, its own b3 and b4
        "r2": 3333333333 + block // 2 + block,  # b1 share, b2 share, its own b5
        "r3": 3333333333 + block,  # b1 share, its own b6
        "r4": block,  # b1 on engine e2: another lifetime
        "r5": block,  # b2 recomputed: a new lifetime
        "r6": 2 * block,  # c1 at m2's input price; r7's read has no known lifetime
    }
    # every lifetime's pool is paid exactly once, to the picodollar
    assert sum(shared.values()) == 4 * block + block + block + block + block + 2 * block


def test_scoping_by_tenant_keeps_global_shares(q: Queries) -> None:
    scoped = q.cost(mode="amortized", scope=Scope(tenants=("A",)))
    assert [r["tenant"] for r in scoped] == ["A"]
    assert scoped[0]["cost_usd"] == sum((AMORTIZED[r] for r in TENANTS["A"]), D(0))
    assert q.cost(scope=Scope(tenants=())) == []


def test_time_filters_and_buckets(q: Queries) -> None:
    since = datetime.fromtimestamp((T0 + 10 * MIN) / S, UTC)
    rows = q.cost(mode="list", by=["model"], scope=Scope.of(since=since))
    assert by_key(rows, "model")["m2"]["cost_usd"] == LIST["r7"]
    assert set(by_key(rows, "model")) == {"m2", "m3"}
    until = q.cost(mode="list", by=[], scope=Scope.of(until=T0 + 3 * MIN))
    assert until[0]["cost_usd"] == LIST["r1"] + LIST["r2"] and until[0]["requests"] == 2
    buckets = q.cost(mode="list", by=[], bucket="10m")
    assert [(b["bucket"].strftime("%H:%M"), b["requests"]) for b in buckets] == [
        ("22:10", 6),
        ("22:20", 1),
        ("22:30", 1),
    ]
    assert buckets[0]["bucket"].tzinfo is not None


def test_price_effective_dates_apply_at_finish_time(q: Queries) -> None:
    r6, r7 = (q.request(f"e3@1/{r}") for r in ("r6", "r7"))
    assert r6 is not None and r7 is not None
    assert r6["cost"]["list"] == D("0.026") and r7["cost"]["list"] == D("0.036")


def test_gpu_time_attribution(q: Queries) -> None:
    rows = by_key(q.gpu_time(by=["tenant"]), "tenant")
    assert rows["A"]["gpu_time_ns"] == int(5.5 * S)
    assert rows["A"]["gpu_share"] == pytest.approx(5.5 / 7.5)
    assert rows["A"]["cost_usd"] == D("0.0035")  # r1 2 s + r3 1.5 s at $3.60/h; m2 has no GPU price
    assert rows["A"]["unpriced_requests"] == 2
    # issue 31: the cold first step is engine overhead, beside the bill and never in it
    b = rows["B"]
    assert (b["gpu_time_ns"], b["billed_gpu_time_ns"], b["warmup_gpu_time_ns"]) == (int(1.5 * S), S, S // 2)
    assert (b["cost_usd"], b["warmup_cost_usd"]) == (D("0.001"), D("0.0005"))
    gpu_mode = by_key(q.cost(mode="gpu"), "tenant")
    assert gpu_mode["B"]["cost_usd"] == D("0.001") and gpu_mode["B"]["warmup_cost_usd"] == D("0.0005")
    assert gpu_mode["B"]["billed_gpu_time_ns"] + gpu_mode["B"]["warmup_gpu_time_ns"] == int(1.5 * S)


def test_savings(q: Queries) -> None:
    rows = by_key(q.savings(by=["tenant"]), "tenant")
    assert rows["B"]["saved_usd"] == D("0.015")  # 2000 reads x (10 - 2.5) / 1M
    assert rows["A"]["saved_usd"] == D("0.0075")  # 1000 reads x 7.5 / 1M
    assert rows["A"]["hit_rate"] == pytest.approx(1000 / 8000)
    assert rows["B"]["hit_rate"] == pytest.approx(2000 / 4000)
    assert rows["C"]["saved_usd"] == 0


def test_waste(q: Queries) -> None:
    rows = by_key(q.waste(by=["tenant"]), "tenant")
    assert (
        rows["A"]["recomputed_preemption_tokens"],
        rows["A"]["draft_rejected_tokens"],
        rows["A"]["waste_tokens"],
    ) == (500, 0, 500)
    assert rows["A"]["scheduled_tokens"] == 4499 + 1599 + 1099 + 1099
    assert rows["A"]["computed_tokens"] == 4499 + 1099 + 1099 + 1099  # first-time only
    assert rows["A"]["waste_share"] == pytest.approx(500 / 8296)
    assert rows["A"]["waste_usd"] == D("0.005")
    assert rows["B"]["waste_tokens"] == 30 and rows["B"]["waste_usd"] == D("0.0003")
    # r5's recompute after eviction is not waste: it is what a larger KV cache would have saved.
    assert (rows["C"]["waste_tokens"], rows["C"]["waste_usd"]) == (0, 0)
    assert (rows["C"]["evictable_tokens"], rows["C"]["evictable_usd"]) == (1000, D("0.01"))
    assert rows["C"]["evicted_blocks_recomputed"] == 1
    assert rows["A"]["preemptions"] == 1


def test_prefix_evictions(q: Queries) -> None:
    rows = by_key(q.prefix_evictions(by=["tenant"]), "tenant")
    # r1 computed b2 in lifetime 11; it was evicted and r5 computed it again (lifetime 50).
    assert (rows["A"]["blocks_evicted_later"], rows["A"]["tokens_evicted_later"]) == (1, 1000)
    assert (rows["C"]["evicted_blocks_recomputed"], rows["C"]["recomputed_eviction_tokens"]) == (1, 1000)
    assert rows["C"]["evictable_usd"] == D("0.01") and rows["B"]["blocks_evicted_later"] == 0


def test_legacy_rows_count_their_recompute_as_preemption(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A schema-v1 row has recomputed_tokens but no split: read in its old meaning (waste).
    legacy = f.accounting("e9@1/old", tenant="L", model="m1", recomputed_tokens=7, finished_ts_ns=T0 + MIN)
    with accounting_store(tmp_path_factory, [legacy]) as s:
        (row,) = Queries(s).waste(by=["tenant"])
    assert (row["recomputed_preemption_tokens"], row["evictable_tokens"], row["waste_tokens"]) == (7, 0, 7)


def test_spec_efficiency(q: Queries) -> None:
    m1 = by_key(q.spec_efficiency(by=["model"]), "model")["m1"]
    assert (m1["draft_accepted_tokens"], m1["draft_rejected_tokens"], m1["requests_with_drafts"]) == (
        50,
        30,
        1,
    )
    assert m1["acceptance_rate"] == pytest.approx(50 / 80)
    # no draft was cut: vLLM's rate (accepted / verified) equals ours (accepted / computed)
    assert m1["draft_verified_tokens"] == m1["draft_tokens"] == 80
    assert m1["vllm_acceptance_rate"] == pytest.approx(50 / 80)
    assert m1["rejected_compute_share"] == pytest.approx(30 / (4499 + 1229 + 1599 + 1009 + 1009))
    assert m1["output_from_drafts"] == pytest.approx(50 / (500 + 200 + 100 + 10 + 10))


def test_fleet_prefix_duplication(q: Queries) -> None:
    rows = by_key(q.duplication(), "model")
    # m1: b1 computed on e1 and e2 (duplicate); b2 twice on e1 only (eviction, not duplication)
    assert rows["m1"]["blocks"] == 6 and rows["m1"]["duplicated_blocks"] == 1
    assert rows["m1"]["computed_block_tokens"] == 8000 and rows["m1"]["duplicated_tokens"] == 1000
    assert rows["m1"]["duplicated_share"] == pytest.approx(0.125)
    assert rows["m2"]["duplicated_blocks"] == 0
    (top,) = q.duplicated_blocks()
    assert (top["block_hash"], top["engines"], top["engine_names"]) == (b"b1".hex(), 2, ["e1", "e2"])
    with pytest.raises(QueryError):
        q.duplication(by=["tenant"])


def test_expert_load(q: Queries) -> None:
    rows = q.expert_load(model="m2")
    grid = {(r["layer"], r["expert"]): (r["tokens"], r["layer_share"]) for r in rows}
    assert grid[(0, 0)] == (10, 0.25) and grid[(0, 3)] == (10, 0.25)
    assert grid[(1, 1)] == (20, 0.5) and grid[(1, 2)] == (0, 0.0)
    assert len(rows) == 8
    assert q.expert_load(model="m1") == []


def test_request_and_token_statistics(q: Queries) -> None:
    r2 = q.request("e1@1/r2")
    assert r2 is not None
    assert (r2["tenant"], r2["prompt_tokens"], r2["cache_read_tokens"]) == ("B", 3000, 2000)
    assert r2["cost"] == {
        "list": LIST["r2"],
        "actual": ACTUAL["r2"],
        "amortized": AMORTIZED["r2"],
        "gpu": D("0.0005"),  # 1 s of GPU time, 0.5 s of it its engine's warm-up (not billed)
        "priced": True,
    }
    assert [(s["start"], s["end"], s["status"]) for s in r2["segments"]] == [
        (0, 4, "cached"),
        (4, 10, "computed"),
        (10, 13, "computed"),
    ]
    assert q.tokens_statistics("e1@1/r2") == {
        "input_token_count": 3000,
        "output_token_count": 200,
        "computed_token_count": 1229 - 50 - 30,
        "cached_token_count": 2000,
        "skipped_token_count": 0,
        "kv_cache_evicted_count": 0,
        "draft_token_count": 80,
        "draft_rejected_count": 30,
        "recomputed_preemption_count": 0,
        "recomputed_eviction_count": 0,
        "draft_cut_count": 0,
    }
    # outside the caller's tenants: indistinguishable from absent
    assert q.request("e1@1/r2", scope=Scope(tenants=("A",))) is None
    assert q.tokens_statistics("e1@1/r2", scope=Scope(tenants=("A",))) is None
    assert q.tokens_statistics("nope") is None


def test_bad_arguments_are_typed_errors(q: Queries) -> None:
    with pytest.raises(QueryError, match="mode"):
        q.cost(mode="fair")
    with pytest.raises(QueryError, match="group by"):
        q.cost(by=["color"])
    with pytest.raises(QueryError, match="duration"):
        q.cost(bucket="soon")


def test_another_tenants_source_request_is_hidden(tmp_path_factory: pytest.TempPathFactory) -> None:
    def rec(uid: str, tenant: str, source: str | None) -> dict[str, Any]:
        r = f.accounting(uid, tenant=tenant, finished_ts_ns=T0)
        r["timeline"]["segments"][0]["source_request_uid"] = source
        return r

    records = [
        rec("e1@1/a1", "A", None),
        rec("e1@1/b1", "B", "e1@1/a1"),  # B's prefix was computed by A's request
        rec("e1@1/a2", "A", "e1@1/a1"),
        rec("e1@1/b2", "B", "e1@1/gone"),  # a source not stored: not shown to a scoped reader
    ]
    with accounting_store(tmp_path_factory, records) as s:
        q = Queries(s)

        def source(uid: str, scope: Scope) -> Any:
            found = q.request(uid, scope=scope)
            assert found is not None
            return found["segments"][0]["source_request_uid"]

        assert source("e1@1/b1", Scope(tenants=("B",))) == ANOTHER_TENANT
        assert source("e1@1/b2", Scope(tenants=("B",))) == ANOTHER_TENANT
        assert source("e1@1/a2", Scope(tenants=("A",))) == "e1@1/a1"
        assert source("e1@1/b1", Scope(tenants=("A", "B"))) == "e1@1/a1"
        assert source("e1@1/b1", Scope()) == "e1@1/a1"  # the admin sees every uid
        assert q.request("e1@1/a1", scope=Scope(tenants=("A",)))["segments"][0]["source_request_uid"] is None  # type: ignore[index]


def test_list_mode_does_not_charge_an_aborted_request_for_prompt_it_never_computed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # 1000-token prompt, aborted after computing 300 of it (700 not_computed), nothing cached.
    aborted = f.counted(
        "e1@1/ab", P=1000, C=0, O=0, S=300, skipped_tokens=700, finish_reason="abort", tenant="A", model="m1"
    )
    aborted["finished_ts_ns"] = T0 + MIN
    with accounting_store(tmp_path_factory, [aborted], PRICES) as s:
        (row,) = Queries(s).cost(mode="list", by=["tenant"])
    assert row["cost_usd"] == D("0.003")  # 300 input tokens x $10 / 1M, not 1000
