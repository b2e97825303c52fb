"""A crafted store for the API and dashboard tests: every token status, MoE routing, prefix
sharing, a fleet duplicate, three tenants, prices, usage windows and a dead letter.

Requests (P prompt, C cache reads, O output, U uncached computed, R recomputed, A/J drafts
accepted/rejected, Sk skipped, Ev evicted); finish times T0 + n minutes:

  e1/r1 acme    tiny-moe   P96  C0  O32 U119 A8 J4     computes b1 b2; experts       T0+1m
  e1/r2 acme    tiny-moe   P96  C64 O16 U47            reads b1 b2 (from r1)         T0+2m
  e1/r3 globex  tiny-moe   P128 C64 O32 R32 U63        reads b1 b2; recomputes b3    T0+3m
  e3/r4 globex  tiny-llama P200 C0  O40 U239 Sk56 Ev64 sliding window                T0+4m
  e3/r5 initech tiny-llama P50  C0  O10 U59            incomplete (idle timeout)     T0+5m
  e2/r6 initech tiny-moe   P64  C0  O8  U71            computes b1 on another engine T0+6m
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sparseety import events as ev
from sparseety.queries.registry import Queries
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price, set_prices
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f

S = 1_000_000_000
T0 = 1_700_000_000 * S
MIN = 60 * S
D = Decimal

PRICES = [
    Price("tiny-moe", "input", D("10"), 0),
    Price("tiny-moe", "cached_input", D("2.5"), 0),
    Price("tiny-moe", "output", D("40"), 0),
    Price("tiny-moe", "gpu_hour", D("3.6"), 0),
    Price("tiny-llama", "input", D("1"), 0),
    Price("tiny-llama", "cached_input", D("0.25"), 0),
    Price("tiny-llama", "output", D("4"), 0),
]


def seg(
    start: int, end: int, status: str, kind: str = "prompt", *, draft: bool = False, source: str | None = None
) -> dict[str, Any]:
    return f.segment(start, end, kind, status, draft_accepted=draft, source_request_uid=source)


def block(name: str, lifetime: int, role: str) -> dict[str, Any]:
    return {"block_hash": name.encode(), "lifetime_seq": lifetime, "role": role, "tokens": 32}


def uid(engine: str, rid: str) -> str:
    return f"{engine}@1/{rid}"


def req(
    engine: str,
    rid: str,
    tenant: str,
    model: str,
    minute: int,
    *,
    segments: list[dict[str, Any]],
    blocks: list[dict[str, Any]] | None = None,
    experts: list[int] | None = None,
    **counts: Any,
) -> dict[str, Any]:
    """``counts``: f.counted's P, C, O, R, A, J, U (uncached computed) and any field."""
    scheduled = sum(counts.get(k, 0) for k in ("U", "R", "A", "J"))
    return f.counted(
        uid(engine, rid),
        tenant=tenant,
        model=model,
        finished_ts_ns=T0 + minute * MIN,
        arrival_ts_ns=T0 + minute * MIN - 2 * S,
        S=scheduled,
        gpu_time_ns=scheduled * 1_000_000,
        # as this data set always had them: recomputed_tokens not split by cause, no waste
        recomputed_preemption_tokens=0,
        waste_tokens=0,
        block_uses=blocks or [],
        **f.experts(experts),
        timeline={"segments": segments, "attention_window": None},
        **{k: v for k, v in counts.items() if k != "U"},
    )


def dataset() -> list[dict[str, Any]]:
    # fmt: off
    return [
        req("e1", "r1", "acme", "tiny-moe", 1, P=96, C=0, O=32, U=119, A=8, J=4,
            segments=[
                seg(0, 96, "computed"),
                seg(96, 112, "computed", "output"),
                seg(112, 120, "computed", "output", draft=True),
                seg(120, 128, "computed", "output"),
            ],
            blocks=[block("b1", 1, "computed"), block("b2", 2, "computed")],
            experts=[10, 0, 5, 5, 0, 20, 0, 0]),
        req("e1", "r2", "acme", "tiny-moe", 2, P=96, C=64, O=16, U=47,
            segments=[
                seg(0, 64, "cached", source=uid("e1", "r1")),
                seg(64, 96, "computed"),
                seg(96, 112, "computed", "output"),
            ],
            blocks=[block("b1", 1, "cached"), block("b2", 2, "cached")],
            experts=[4, 4, 0, 0, 2, 2, 2, 2]),
        req("e1", "r3", "globex", "tiny-moe", 3, P=128, C=64, O=32, R=32, U=63,
            segments=[
                seg(0, 64, "cached", source=uid("e1", "r1")),
                seg(64, 96, "recomputed"),
                seg(96, 128, "computed"),
                seg(128, 160, "computed", "output"),
            ],
            blocks=[block("b1", 1, "cached"), block("b2", 2, "cached"), block("b3", 9, "recomputed")],
            experts=[0, 10, 10, 0, 5, 5, 5, 5]),
        req("e3", "r4", "globex", "tiny-llama", 4, P=200, C=0, O=40, U=239, skipped_tokens=56,
            evicted_tokens=64,
            segments=[
                seg(0, 64, "evicted"),
                seg(64, 120, "skipped"),
                seg(120, 200, "computed"),
                seg(200, 240, "computed", "output"),
            ]),
        req("e3", "r5", "initech", "tiny-llama", 5, P=50, C=0, O=10, U=59,
            segments=[seg(0, 50, "computed"), seg(50, 60, "computed", "output")],
            complete=False, incomplete_reason="idle_timeout", finish_reason="incomplete", consistent=False),
        req("e2", "r6", "initech", "tiny-moe", 6, P=64, C=0, O=8, U=71,
            segments=[seg(0, 64, "computed"), seg(64, 72, "computed", "output")],
            blocks=[block("b1", 1, "computed")]),
    ]
    # fmt: on


def seed(store: Store) -> None:
    """Migrate ``store`` and write the data set, prices, two usage windows and a dead letter."""
    migrate(store)
    sink = ClickHouseSink(store)
    for i, rec in enumerate(dataset()):
        sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
    for i, tenant in enumerate(("acme", "globex")):
        w = f.usage_window(usage_id=f"w{i}", tenant=tenant, model="tiny-moe", window_start_ns=T0 + i * MIN)
        sink.add(ev.USAGE_WINDOW, w, topic="usage", partition=0, offset=i)
    sink.add(ev.DEAD_LETTER, f.dead_letter(), topic="dlq", partition=0, offset=0)
    sink.flush()
    sink.close()
    set_prices(store, PRICES)


def test_the_data_set_is_what_the_docstring_says(tmp_path_factory: Any, unique: str) -> None:
    from tests.helpers import chdb_config, throwaway_store

    with throwaway_store(chdb_config(tmp_path_factory, f"t{unique}")) as store:
        seed(store)
        q = Queries(store)
        by_tenant = {r["tenant"]: r["requests"] for r in q.cost(by=("tenant",))}
        assert by_tenant == {"acme": 2, "globex": 2, "initech": 2}
        for rec in dataset():
            stats = q.tokens_statistics(rec["request_uid"])
            assert stats is not None
            segments = rec["timeline"]["segments"]
            assert sum(s["end"] - s["start"] for s in segments) == rec["prompt_tokens"] + rec["output_tokens"]
            assert stats["skipped_token_count"] == sum(
                s["end"] - s["start"] for s in segments if s["status"] == "skipped"
            )
        assert {r["layer"] for r in q.expert_load()} == {0, 1}
        assert q.duplication()[0]["duplicated_blocks"] == 1
