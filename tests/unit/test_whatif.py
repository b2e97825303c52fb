"""Counterfactual cost (``sparseety query whatif``) on a crafted data set with hand-computed
answers (real chDB), and the no-cache scenario against a real second run without prefix caching.

Prices: m1 input $10, cached input $2.50, output $40 per 1M tokens, GPU $3.60 per hour; msw has
no price. Blocks hold 1000 tokens; engine e1@1; times are seconds after T0.

  w1 A m1: P4000 C0    O500 S4499 G2s          computes b1@10, b2@11; admitted 0, finished 10
  w2 B m1: P3000 C2000 O200 S1239 G1s A50 J30 K10 steps 150; reads b1@10, b2@11; finished 20
  w3 A m1: P1000 C0 O10 S1009 G1s E1000        recomputes b1@20; admitted 40 (gap 40-20 = 20 s), finished 45
  w4 C m1: P1000 C0 O10 S1009 G1s E1000        recomputes b2@21; admitted 45 (gap 45-20 = 25 s)
  w5 C m1: P1000 C0 O10 S1009 G1s E1000        recomputes b1@30; admitted 115 (gap 115-45 = 70 s)
  w6 A msw: window 64, P100 O21, no cache: 120 queries [0, 120)

The engine's cache time T_hat = the shortest gap = 20 s. K = 1.5 avoids gaps < 30 s (w3, w4),
K = 2 (< 40 s) the same, K = 4 (< 80 s) all three.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.queries.registry import Queries, QueryError, Scope
from sparseety.queries.whatif import parse_scenario
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price, set_prices
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import accounting_store, chdb_config, throwaway_store
from tests.recorded import load_scenario

S = 1_000_000_000
T0 = 1_700_000_000 * S
D = Decimal
PICO = D(10**12)


def req(rid: str, tenant: str, *, admitted: int, finished: int, **over: Any) -> dict[str, Any]:
    at = T0 + admitted * S
    defaults = {"model": "m1", "steps": 10, "gpu_time_ns": S, "block_uses": []}
    return f.counted(
        f"e1@1/{rid}",
        tenant=tenant,
        arrival_ts_ns=at,
        first_scheduled_ts_ns=at,
        first_token_ts_ns=at,
        finished_ts_ns=T0 + finished * S,
        **{**defaults, **over},
    )


def dataset() -> list[dict[str, Any]]:
    sw = f.accounting()["timeline"]
    sw = {"segments": sw["segments"], "attention_window": 64}
    # fmt: off
    return [
        req("w1", "A", admitted=0, finished=10, P=4000, C=0, O=500, S=4499, gpu_time_ns=2 * S,
            block_uses=f.block_uses("computed", "b1@10", "b2@11")),
        req("w2", "B", admitted=5, finished=20, P=3000, C=2000, O=200, S=1239, A=50, J=30, K=10, steps=150,
            block_uses=f.block_uses("cached", "b1@10", "b2@11")),
        req("w3", "A", admitted=40, finished=45, P=1000, C=0, O=10, S=1009, E=1000,
            block_uses=f.block_uses("recomputed", "b1@20")),
        req("w4", "C", admitted=45, finished=50, P=1000, C=0, O=10, S=1009, E=1000,
            block_uses=f.block_uses("recomputed", "b2@21")),
        req("w5", "C", admitted=115, finished=120, P=1000, C=0, O=10, S=1009, E=1000,
            block_uses=f.block_uses("recomputed", "b1@30")),
        req("w6", "A", admitted=130, finished=140, P=100, C=0, O=21, S=120, model="msw",
            # full causal pairs over [0, 120) = 7260; a 64 window attends 2080 + 56 * 64 = 5664
            attention_pairs=5664, attention_pairs_skipped=1596, window_released_tokens=32,
            skipped_tokens=24, timeline=sw),
    ]
    # fmt: on


PRICES = [
    Price("m1", "input", D("10"), T0 - 86400 * S),
    Price("m1", "cached_input", D("2.5"), T0 - 86400 * S),
    Price("m1", "output", D("40"), T0 - 86400 * S),
    Price("m1", "gpu_hour", D("3.6"), T0 - 86400 * S),
]


@pytest.fixture(scope="module")
def q(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queries]:
    with accounting_store(tmp_path_factory, dataset(), PRICES) as s:
        yield Queries(s)


def rows(q: Queries, scenario: str, **kw: Any) -> dict[Any, dict[str, Any]]:
    out = q.whatif(scenario=scenario, **kw)
    assert all(r["basis"] == "modelled" for r in out)
    keys = kw.get("by", ("tenant",))
    return {(r["scenario"], *(r[k] for k in keys)): r for r in out}


def test_no_cache_computes_every_cache_read_at_the_input_price(q: Queries) -> None:
    r = rows(q, "no-cache")
    b = r[("no-cache", "B")]
    assert b["cache_read_tokens"] == 2000
    assert (b["computed_tokens"], b["cf_computed_tokens"], b["delta_computed_tokens"]) == (1239, 3239, 2000)
    # GPU at w2's own rate: floor(2000 * 1 s / 1239)
    assert b["delta_gpu_time_ns"] == 2000 * S // 1239 == 1_614_205_004
    # 2000 tokens x ($10 - $2.50) / 1M
    assert b["delta_cost_usd"] == D("0.015")
    assert b["cf_cost_usd"] == b["cost_usd"] + D("0.015")
    # GPU cost: floor(ns x 3.6e6 micro-USD per hour / 3.6e6) = ns picodollars ($0.001 per s)
    assert b["cf_gpu_cost_usd"] == D(1_000_000_000 + 1_614_205_004) / PICO
    assert r[("no-cache", "A")]["delta_computed_tokens"] == 0


def test_no_spec_drops_rejected_and_cut_drafts_and_adds_a_step_per_accepted_draft(q: Queries) -> None:
    b = rows(q, "no-spec")[("no-spec", "B")]
    assert b["draft_wasted_tokens"] == 40 and b["draft_accepted_tokens"] == 50
    assert b["delta_computed_tokens"] == -40
    assert b["delta_gpu_time_ns"] == -(40 * S // 1239)
    assert b["delta_cost_usd"] == D("-0.0004")  # 40 x $10 / 1M
    assert (b["steps"], b["cf_steps"]) == (150, 200)
    assert b["cf_step_bound_gpu_time_ns"] == S + 50 * S // 150


def test_kv_curve_avoids_the_misses_a_larger_cache_would_have_bridged(q: Queries) -> None:
    r = rows(q, "kv-curve", by=())
    per_k = {k[0]: v for k, v in r.items()}
    assert {k: v["avoided_tokens"] for k, v in per_k.items()} == {
        "kv-x1.5": 2000,
        "kv-x2": 2000,
        "kv-x4": 3000,
    }
    for v in per_k.values():
        assert v["recomputed_eviction_tokens"] == v["modelled_eviction_tokens"] == 3000
        assert v["cache_time_ns"] == 20 * S
    x4 = per_k["kv-x4"]
    assert x4["remaining_eviction_tokens"] == 0
    assert x4["delta_computed_tokens"] == -3000
    assert x4["delta_gpu_time_ns"] == -3 * (1000 * S // 1009)
    assert x4["delta_cost_usd"] == D("-0.0225")  # 3000 x ($10 - $2.50) / 1M
    # kv-x2 alone gives the curve's K = 2 row
    assert rows(q, "kv-x2", by=())[("kv-x2",)]["avoided_tokens"] == 2000


def test_kv_scope_filters_the_rows_not_the_engine_cache_time(q: Queries) -> None:
    r = rows(q, "kv-curve", scope=Scope(tenants=("C",)))
    assert {k: v["avoided_tokens"] for k, v in r.items()} == {
        ("kv-x1.5", "C"): 1000,
        ("kv-x2", "C"): 1000,
        ("kv-x4", "C"): 2000,
    }
    assert all(v["cache_time_ns"] == 20 * S for v in r.values())


def test_window_recomputes_pairs_and_unattended_positions(q: Queries) -> None:
    same = rows(q, "window=64", by=("model",))[("window=64", "msw")]
    assert (same["attention_pairs"], same["cf_attention_pairs"]) == (5664, 5664)
    assert (same["unattended_tokens"], same["cf_unattended_tokens"]) == (56, 56)
    w32 = rows(q, "window=32", by=("model",))[("window=32", "msw")]
    assert w32["cf_attention_pairs"] == 528 + 88 * 32  # causal(0, 32) + 88 capped queries
    assert w32["cf_unattended_tokens"] == 120 - 32
    assert w32["gpu_modelled"] is False and w32["delta_cost_usd"] == 0
    full = rows(q, "window=4096", by=("model",))[("window=4096", "msw")]
    assert (full["cf_attention_pairs"], full["cf_unattended_tokens"]) == (7260, 0)
    # models without a window are untouched
    m1 = rows(q, "window=32", by=("model",))[("window=32", "m1")]
    assert m1["windowed_requests"] == 0 and m1["delta_attention_pairs"] == 0


@pytest.mark.parametrize("bad", ["no-caching", "kv-x1", "kv-x0.5", "window=0", "window=abc", ""])
def test_bad_scenarios_are_refused(q: Queries, bad: str) -> None:
    with pytest.raises(QueryError):
        q.whatif(scenario=bad)


def test_scenario_parsing() -> None:
    assert parse_scenario("kv-x1.5").ks == (1.5,)
    assert parse_scenario("KV-CURVE").ks == (1.5, 2.0, 4.0)
    assert parse_scenario("window=4096").window == 4096


# --- against real vLLM: the modelled no-cache run vs a real run with prefix caching off ------------

#: Tolerances (docs/cost-model.md): tokens and token cost must agree exactly when both runs
#: generate the same tokens (greedy decoding, checked below); GPU time only within a factor
#: GPU_TOLERANCE, since the CPU engine's step times are noisy and the model prices a cached
#: position at its request's average (prefill and decode alike).
GPU_TOLERANCE = 0.5


def _store_runs(q_store: Store, *names: str) -> None:
    sink = ClickHouseSink(q_store)
    i = 0
    for name in names:
        events, _ = load_scenario(name)
        asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
        for e in events:
            for o in asm.apply(e):
                if o.topic == TIMELINES:
                    sink.add(ev.REQUEST_ACCOUNTING, o.record, topic="timelines", partition=0, offset=i)
                    i += 1
    sink.flush()


def test_no_cache_agrees_with_a_real_run_without_prefix_caching(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _, on = load_scenario("prefix_reuse_again")
    _, off = load_scenario("prefix_reuse_nocache")
    assert off["engine_args"]["enable_prefix_caching"] is False
    assert [r["output_token_ids"] for r in on["requests"]] == [r["output_token_ids"] for r in off["requests"]]
    assert sum(r["num_cached_tokens"] for r in on["requests"]) > 0
    assert all(r["num_cached_tokens"] == 0 for r in off["requests"])
    prices = (("input", D("10")), ("cached_input", D("2.5")), ("output", D("40")))
    with (
        throwaway_store(chdb_config(tmp_path_factory)) as cached,
        throwaway_store(chdb_config(tmp_path_factory)) as plain,
    ):
        for s, name in ((cached, "prefix_reuse_again"), (plain, "prefix_reuse_nocache")):
            migrate(s)
            _store_runs(s, name)
            model = s.query(f"SELECT any(model) AS m FROM {s.database}.requests_v")[0]["m"]
            set_prices(s, [Price(model, c, usd) for c, usd in prices])
        modelled = Queries(cached).whatif(scenario="no-cache", by=())[0]
        real = Queries(plain).whatif(scenario="no-cache", by=())[0]
        assert modelled["requests"] == real["requests"] == len(on["requests"])
        assert real["delta_computed_tokens"] == 0  # nothing cached in the real no-cache run
        assert modelled["delta_computed_tokens"] > 0
        assert modelled["cf_computed_tokens"] == real["computed_tokens"]
        assert modelled["cf_cost_usd"] == real["cost_usd"]
        ratio = modelled["cf_gpu_time_ns"] / real["gpu_time_ns"]
        assert 1 - GPU_TOLERANCE <= ratio <= 1 + GPU_TOLERANCE, ratio


def test_kv_curve_on_a_real_run_that_evicted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """sparsity_truth (real vLLM, a tiny cache that evicts): every eviction recompute has a stored
    previous lifetime, so all are modelled, and the curve never falls as K grows."""
    with throwaway_store(chdb_config(tmp_path_factory)) as s:
        migrate(s)
        _store_runs(s, "sparsity_truth")
        curve = {r["scenario"]: r for r in Queries(s).whatif(scenario="kv-curve", by=())}
    assert list(curve) == ["kv-x1.5", "kv-x2", "kv-x4"]
    evicted = curve["kv-x2"]["recomputed_eviction_tokens"]
    assert evicted > 0 and all(r["modelled_eviction_tokens"] == evicted for r in curve.values())
    avoided = [curve[k]["avoided_tokens"] for k in ("kv-x1.5", "kv-x2", "kv-x4")]
    assert 0 < avoided[0] <= avoided[1] <= avoided[2] <= evicted
    assert all(r["delta_computed_tokens"] == -r["avoided_tokens"] for r in curve.values())
