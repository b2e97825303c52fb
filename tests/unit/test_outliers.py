"""Issue 23 in the store: cost outliers, reasoning tokens priced, adapters as a grouping, and
migration 013 rewriting rows whose ``model`` held the adapter (written before the issue).

Prices (USD per 1M tokens): m1 input 10, cached_input 2.5, output 40; m2 the same plus
reasoning_output 10. Requests of tenant A (P prompt, C cache hits, O output, S scheduled; actual
cost = (S - O) x input + C x cached + O x output):

  a1: P4000 C0    O10   S4010         cut by the length limit  -> $0.0404,  4.04e9 pico/output token
  a2: P1000 C900  O100  S200                                   -> $0.00725, 7.25e7
  a3: P1000 C0    O100  S1300 R200    recomputed after preemption -> $0.016, 1.6e8
  a4: P500  C0    O40   S640  J100    rejected drafts          -> $0.0076,  1.9e8
  a5: P1000 C1000 O1000 S1000                                  -> $0.0425,  4.25e7

so from the top a1, a4, a3, a2, a5; the tenant's median prompt is 1000.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.queries.registry import Queries, QueryError, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import accounting_store, chdb_config, throwaway_store

S = 1_000_000_000
T0 = 1_700_000_000 * S
D = Decimal


def req(rid: str, tenant: str, **over: Any) -> dict[str, Any]:
    defaults = {"model": "m1", "finish_reason": "stop"}
    return f.counted(f"e1@1/{rid}", tenant=tenant, finished_ts_ns=T0 + S, **{**defaults, **over})


def dataset() -> list[dict[str, Any]]:
    return [
        req("a1", "A", P=4000, C=0, O=10, S=4010, finish_reason="length"),
        req("a2", "A", P=1000, C=900, O=100, S=200),
        req("a3", "A", P=1000, C=0, O=100, S=1300, R=200),
        req("a4", "A", P=500, C=0, O=40, S=640, J=100),
        req("a5", "A", P=1000, C=1000, O=1000, S=1000),
        req("b1", "B", P=100, C=0, O=10, S=110),
        req("b2", "B", P=100, C=0, O=0, S=100),  # no output: no cost per output token
        # reasoning: 60 of 100 output positions in the think section, m2 prices them at 10
        req("r1", "R", P=100, C=0, O=100, S=200, model="m2", reasoning_output_tokens=60),
        req("r2", "R", P=100, C=0, O=100, S=200, reasoning_output_tokens=None),  # not observed
        req("r3", "R2", P=100, C=0, O=100, S=200, reasoning_output_tokens=60),  # m1: as output
        # adapters: one base model, two adapters
        req("l1", "L", P=100, C=0, O=10, S=110, lora_name="sql"),
        req("l2", "L", P=100, C=0, O=10, S=110, lora_name="sql"),
        req("l3", "L", P=100, C=0, O=10, S=110, lora_name="chat"),
        req("l4", "L", P=100, C=0, O=10, S=110),
        # KV memory-time: k1 held 8x what k2 and k3 did; k4 has none observed (NULL, never a driver)
        req("k1", "K", P=100, C=0, O=10, S=110, kv_groups=[kv_group(8_000_000_000)]),
        req("k2", "K", P=100, C=0, O=10, S=110, kv_groups=[kv_group(1_000_000_000)]),
        req("k3", "K", P=100, C=0, O=10, S=110, kv_groups=[kv_group(1_000_000_000)]),
        req("k4", "K", P=100, C=0, O=10, S=110),
    ]


def kv_group(block_ns: int) -> dict[str, Any]:
    """One full-attention group's memory-time (1 KiB blocks), shared with no one."""
    return {
        "kind": "full_attention", "block_size": 16, "bytes_per_block": 1024, "peak_blocks": 1,
        "never_held_blocks": 0, "block_steps": 10, "block_ns": block_ns,
        "block_steps_amortized": 10, "block_ns_amortized": block_ns,
        "block_steps_actual": 10, "block_ns_actual": block_ns,
        "slot_steps_used": 100, "slot_steps_allocated": 160,
    }  # fmt: skip


PRICES = [
    *(
        Price(m, c, D(u), 0)
        for m in ("m1", "m2")
        for c, u in (("input", "10"), ("cached_input", "2.5"), ("output", "40"))
    ),
    Price("m2", "reasoning_output", D("10"), 0),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with accounting_store(tmp_path_factory, dataset(), PRICES) as s:
        yield s


@pytest.fixture
def q(store: Store) -> Queries:
    return Queries(store)


def test_outliers_top_and_bottom_per_tenant_with_their_drivers(q: Queries) -> None:
    rows = q.outliers(limit=2, scope=Scope(tenants=("A", "B")))
    got = [(r["tenant"], r["side"], r["rank"], r["request_uid"].split("/")[-1]) for r in rows]
    assert got == [
        ("A", "top", 1, "a1"),
        ("A", "top", 2, "a4"),
        ("A", "bottom", 1, "a5"),
        ("A", "bottom", 2, "a2"),
        ("B", "top", 1, "b1"),  # b2 has no output; b1 is both top and bottom: listed once
    ]
    by = {r["request_uid"].split("/")[-1]: r for r in rows}
    assert by["a1"]["cost_usd"] == D("0.0404")
    assert by["a1"]["cost_per_output_token_usd"] == D("0.00404")
    assert by["a4"]["cost_per_output_token_usd"] == D("0.00019")
    assert by["a5"]["cost_per_output_token_usd"] == D("0.0000425")
    assert by["a1"]["reasons"] == ["long_prompt", "cache_miss", "cut_by_limit"]
    assert by["a4"]["reasons"] == ["cache_miss", "rejected_drafts"]
    assert by["a4"]["rejected_draft_tokens"] == 100 and by["a4"]["scheduled_tokens"] == 640
    assert by["a2"]["reasons"] == [] and by["a2"]["cache_miss_share"] == pytest.approx(0.1)
    assert by["a5"]["reasons"] == []
    assert by["a1"]["tenant_median_prompt_tokens"] == 1000
    assert by["a1"]["cut_by_limit"] and not by["a2"]["cut_by_limit"]


def test_outliers_recompute_reason_and_amortized_mode(q: Queries) -> None:
    rows = q.outliers(limit=3, mode="amortized", scope=Scope(tenants=("A",)))
    a3 = next(r for r in rows if r["request_uid"].endswith("/a3"))
    assert a3["side"] == "top" and a3["rank"] == 3
    assert a3["reasons"] == ["cache_miss", "recompute"] and a3["recomputed_tokens"] == 200


def test_outliers_summary_says_which_features_the_costly_tail_shares(q: Queries) -> None:
    rows = q.outliers(limit=2, summary=1, scope=Scope(tenants=("A", "B")))
    a = {r["feature"]: r for r in rows if r["tenant"] == "A"}
    assert list(a) == [
        "long_prompt",
        "cache_miss",
        "recompute",
        "rejected_drafts",
        "kv_memory",
        "cut_by_limit",
    ]
    assert (a["cache_miss"]["tail_with"], a["cache_miss"]["tail_requests"]) == (2, 2)
    assert (a["cache_miss"]["rest_with"], a["cache_miss"]["rest_requests"]) == (1, 3)
    assert a["cache_miss"]["lift"] == pytest.approx(1 - 1 / 3)
    assert a["long_prompt"]["shared_by_tail"] and a["rejected_drafts"]["shared_by_tail"]
    assert a["cut_by_limit"]["shared_by_tail"]
    assert not a["recompute"]["shared_by_tail"] and a["recompute"]["rest_with"] == 1
    assert a["cache_miss"]["tail_cost_usd"] == D("0.0404") + D("0.0076")
    b = {r["feature"]: r for r in rows if r["tenant"] == "B"}
    assert b["cache_miss"]["rest_share"] is None  # B has no request outside its tail


def test_outliers_bad_arguments(q: Queries) -> None:
    with pytest.raises(QueryError, match="attribution mode"):
        q.outliers(mode="nope")
    with pytest.raises(QueryError, match="at least 1"):
        q.outliers(limit=0)


def test_reasoning_priced_as_output_unless_a_reasoning_price(q: Queries) -> None:
    rows = {r["tenant"]: r for r in q.cost(scope=Scope(tenants=("R", "R2", "A")))}
    # r1 (m2): 100 input x 10 + 40 answer x 40 + 60 reasoning x 10; r2: 100 x 10 + 100 x 40
    assert rows["R"]["cost_usd"] == D("0.001") + D("0.0016") + D("0.0006") + D("0.001") + D("0.004")
    assert rows["R"]["reasoning_output_tokens"] == 60 and rows["R"]["reasoning_observed_requests"] == 1
    # m1 has no reasoning price: the think section costs what output costs
    assert rows["R2"]["cost_usd"] == D("0.001") + D("0.004")
    assert rows["R2"]["reasoning_output_tokens"] == 60
    assert rows["A"]["reasoning_output_tokens"] is None  # not observed, never 0
    assert rows["A"]["reasoning_observed_requests"] == 0


def test_adapter_is_a_grouping_beside_the_base_model(q: Queries) -> None:
    rows = q.cost(by=["model", "adapter"], scope=Scope(tenants=("L",)))
    assert {(r["model"], r["adapter"]): r["requests"] for r in rows} == {
        ("m1", ""): 1,
        ("m1", "chat"): 1,
        ("m1", "sql"): 2,
    }
    assert [r["requests"] for r in q.cost(by=["model"], scope=Scope(tenants=("L",)))] == [4]


def test_migration_013_rewrites_rows_whose_model_held_the_adapter(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Rows written before issue 23 (model = the adapter; after migration 013 added its columns
    they hold NULL and '') read with the base model once 013 ran, usage windows too; an engine
    that served no base-model request keeps its rows as they were. 013 runs again unchanged."""
    with throwaway_store(chdb_config(tmp_path_factory)) as s:
        migrate(s)
        old = [
            f.accounting("e1@1/x1", engine_name="e1", engine_id="e1@1", model="sql", lora_name="sql"),
            f.accounting("e1@1/x2", engine_name="e1", engine_id="e1@1", model="base-7b", lora_name=None),
            f.accounting("e9@1/y1", engine_name="e9", engine_id="e9@1", model="solo", lora_name="solo"),
        ]
        windows = [  # the adapter in model, lora_name '' (the column's default)
            f.usage_window(usage_id="e1@1/sql/t/0/final", engine_name="e1", model="sql", requests=1),
            f.usage_window(usage_id="e1@1/base-7b/t/0/final", engine_name="e1", model="base-7b", requests=1),
        ]
        sink = ClickHouseSink(s)
        for i, rec in enumerate(old):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
        for i, w in enumerate(windows):
            sink.add(ev.USAGE_WINDOW, w, topic="usage", partition=0, offset=i)
        sink.flush()
        for _ in range(2):  # as the store did when 013 first ran on it, and once more (idempotent)
            # a store before 016 still had evicted_tokens, which 013 copies (016 drops it again)
            for table in ("requests", "usage_1m"):
                s.command(f"ALTER TABLE {s.database}.{table} ADD COLUMN IF NOT EXISTS evicted_tokens Int64")
            s.command(
                f"ALTER TABLE {s.database}.schema_migrations DELETE WHERE version IN (13, 16) "
                "SETTINGS mutations_sync = 2"
            )
            # 013 (and 016), then the views again (they are applied after any numbered migration)
            assert [m.version for m in migrate(s)] == [13, 16, 0]
            got = {
                r["request_uid"]: (r["model"], r["lora_name"])
                for r in s.query(f"SELECT request_uid, model, lora_name FROM {s.database}.requests_v")
            }
            assert got == {
                "e1@1/x1": ("base-7b", "sql"),
                "e1@1/x2": ("base-7b", None),
                "e9@1/y1": ("solo", "solo"),  # no base known on e9: as it was
            }
            usage = {
                (r["model"], r["adapter"]): r["requests"]
                for r in Queries(s).usage(by=["model", "adapter"], scope=Scope())
            }
            assert usage == {("base-7b", "sql"): 1, ("base-7b", ""): 1}


@pytest.mark.parametrize("mode", ["actual", "amortized"])
def test_kv_memory_time_is_a_driver_when_observed(q: Queries, mode: str) -> None:
    rows = q.outliers(limit=4, mode=mode, scope=Scope(tenants=("K",)))
    by = {r["request_uid"].split("/")[-1]: r for r in rows}
    # block-ns x 1 KiB per block / 1e6 = byte-ms; the tenant's median of the observed is k2's
    kv = [by[k]["kv_byte_ms"] for k in ("k1", "k2", "k3", "k4")]
    assert kv == [8_192_000, 1_024_000, 1_024_000, None]
    assert "kv_memory" in by["k1"]["reasons"]
    assert not any("kv_memory" in by[k]["reasons"] for k in ("k2", "k3", "k4"))
