"""Sparsity regressions (``/api/v1/regressions``): real vLLM reruns, and a crafted data set with
hand-computed rates for the signals the recordings do not exercise.

Real runs (tests/data, recorded by scripts/record_fixtures.py on one engine name each): the
baseline ``prefix_reuse`` / ``spec_ngram``, then the same workload with prefix caching off
(``prefix_reuse_nocache``) or speculation off (``spec_ngram_off``), or unchanged
(``prefix_reuse_again``, ``spec_ngram_again``: no finding may be reported).

Crafted (engine e9, model mx; baseline [T0, T0+60m), current [T0+60m, T0+70m)), five requests
per window and tenant, P100 O10 S109:
  tenant T baseline: A10 J10, skipped pairs 500 of 2000, experts [10,10,10,10]
  tenant T current : A2 J18,  skipped pairs 0 of 2000,   experts [40,0,0,0], V50
  tenant U, both windows: as T's baseline
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.queries.registry import Queries, QueryError, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store
from tests.recorded import load_scenario

S = 1_000_000_000
MIN = 60 * S
T0 = 1_700_000_000 * S


def _fold(names: tuple[str, ...]) -> tuple[list[dict[str, Any]], int]:
    """Accounting records of the recorded runs, and the last run's last finish."""
    records: list[dict[str, Any]] = []
    for name in names:
        events, _ = load_scenario(name)
        asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
        run = [o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES]
        records += run
    return records, max(r["finished_ts_ns"] for r in run)


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with throwaway_store(chdb_config(tmp_path_factory)) as s:
        migrate(s)
        yield s


def _write(store: Store, records: list[dict[str, Any]]) -> None:
    sink = ClickHouseSink(store)
    for i, rec in enumerate(records):
        sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
    sink.flush()


def _findings(store: Store, names: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(findings, every evaluated signal) with the current window = the last run."""
    records, last = _fold(names)
    _write(store, records)
    q = Queries(store)
    # the last run took seconds; its baseline run was recorded within the month before
    kw: dict[str, Any] = {"window": "10m", "baseline": "30d", "scope": Scope(until_ns=last + 1)}
    return q.regressions(**kw), q.regressions(all_signals=1, **kw)


def test_prefix_caching_turned_off_is_reported_with_evidence(store: Store) -> None:
    found, every = _findings(store, ("prefix_reuse", "prefix_reuse_nocache"))
    assert [r["signal"] for r in found] == ["prefix_hit_rate"]
    (r,) = found
    assert r["engine"] == "fixture-prefix_reuse" and r["firing"]
    _, on = load_scenario("prefix_reuse")
    _, off = load_scenario("prefix_reuse_nocache")
    hits = sum(x["num_cached_tokens"] for x in on["requests"])
    prompt = sum(len(x["prompt_token_ids"]) for x in on["requests"])
    assert r["baseline"] == pytest.approx(hits / prompt) and r["current"] == 0
    assert r["baseline_requests"] == len(on["requests"]) and r["current_requests"] == len(off["requests"])
    off_ids = {x["engine_request_id"] for x in off["requests"]}
    assert len(r["evidence_request_uids"]) == 5
    assert all(uid.rsplit("/", 1)[1] in off_ids for uid in r["evidence_request_uids"])
    assert r["window_start"] < r["window_end"] and r["baseline_start"] < r["window_start"]
    assert {x["signal"] for x in every} >= {"prefix_hit_rate", "eviction_recompute_share"}


def test_the_unchanged_prefix_workload_raises_no_false_alarm(store: Store) -> None:
    found, every = _findings(store, ("prefix_reuse", "prefix_reuse_again"))
    assert found == []
    hit = next(r for r in every if r["signal"] == "prefix_hit_rate")
    assert hit["baseline"] > 0.05 and hit["current"] == pytest.approx(hit["baseline"], rel=0.05)


def test_speculation_turned_off_is_reported_as_drafts_stopped(store: Store) -> None:
    found, _ = _findings(store, ("spec_ngram", "spec_ngram_off"))
    assert [(r["signal"], r["current"]) for r in found] == [("spec_drafts_per_output", 0.0)]
    _, on = load_scenario("spec_ngram")
    m = on["metrics"]
    outputs = sum(len(x["output_token_ids"]) for x in on["requests"])
    # drafts the verifier scored = vLLM's draft counter (accepted + rejected + cut)
    assert found[0]["baseline"] == pytest.approx(m["vllm:spec_decode_num_draft_tokens"] / outputs)


def test_the_unchanged_spec_workload_raises_no_false_alarm(store: Store) -> None:
    found, every = _findings(store, ("spec_ngram", "spec_ngram_again"))
    assert found == []
    assert {"spec_acceptance_rate", "spec_drafts_per_output"} <= {r["signal"] for r in every}


# --- crafted: window skipping, expert balance, acceptance drop, eviction jump -----------------------


def _req(i: int, tenant: str, at: int, *, broken: bool) -> dict[str, Any]:
    a, j, v = (2, 18, 50) if broken else (10, 10, 0)
    return f.accounting(
        f"e9@1/{tenant}{i}-{at}",
        engine_name="e9",
        engine_id="e9@1",
        tenant=tenant,
        model="mx",
        finished_ts_ns=T0 + at * MIN + i * S,
        prompt_tokens=100,
        output_tokens=10,
        cache_read_tokens=0,
        engine_cached_tokens=0,
        engine_prompt_tokens=100,
        engine_output_tokens=10,
        scheduled_tokens=109,
        uncached_computed_tokens=109 - a - j - v,
        recomputed_tokens=v,
        recomputed_eviction_tokens=v,
        draft_accepted_tokens=a,
        draft_rejected_tokens=j,
        waste_tokens=j,
        attention_pairs=2000 if broken else 1500,
        attention_pairs_skipped=0 if broken else 500,
        expert_num_layers=1,
        expert_num_experts=4,
        expert_counts=[40, 0, 0, 0] if broken else [10, 10, 10, 10],
        block_uses=[],
    )


@pytest.fixture
def crafted(store: Store) -> Queries:
    recs = []
    for i in range(5):
        recs += [_req(i, "T", 10, broken=False), _req(i, "T", 62, broken=True)]
        recs += [_req(i, "U", 10, broken=False), _req(i, "U", 62, broken=False)]
    _write(store, recs)
    return Queries(store)


WINDOW = {"window": "10m", "baseline": "1h"}


def test_crafted_signals_have_the_hand_computed_values(crafted: Queries) -> None:
    rows = crafted.regressions(scope=Scope(until_ns=T0 + 70 * MIN, tenants=("T",)), all_signals=1, **WINDOW)
    got = {r["signal"]: (r["baseline"], r["current"], r["firing"]) for r in rows}
    assert got == {
        "spec_acceptance_rate": (0.5, 0.1, True),  # 50 / 100 -> 10 / 100
        "spec_drafts_per_output": (2.0, 2.0, False),  # 100 drafts / 50 outputs in both
        "window_skip_share": (0.25, 0.0, True),  # 2500 / 10000 -> 0
        "expert_load_entropy": (1.0, 0.0, True),  # even over 4 experts -> all on one
        "eviction_recompute_share": (0.0, pytest.approx(250 / 545), True),
    }  # prefix_hit_rate is not judged: the baseline never hit the cache
    ev_uids = {u for r in rows if r["signal"] == "spec_acceptance_rate" for u in r["evidence_request_uids"]}
    assert ev_uids == {f"e9@1/T{i}-62" for i in range(5)}
    assert all(r["baseline_requests"] == r["current_requests"] == 5 for r in rows)


def test_findings_are_tenant_scoped(crafted: Queries) -> None:
    until = Scope(until_ns=T0 + 70 * MIN, tenants=("U",))
    assert crafted.regressions(scope=until, **WINDOW) == []
    # over both tenants the acceptance drops only to (10 + 50) / 200 = 0.3 (not < 0.25) and the
    # skip share to 2500 / 20000 = 0.125 (not < 0.125); the expert entropy of [250, 50, 50, 50]
    # is 0.774 (a drop of 0.226 > 0.2) and the eviction share 250 / 1090 = 0.229
    both = crafted.regressions(scope=Scope(until_ns=T0 + 70 * MIN), **WINDOW)
    assert [r["signal"] for r in both] == ["eviction_recompute_share", "expert_load_entropy"]


def test_too_few_requests_are_not_judged(crafted: Queries) -> None:
    scope = Scope(until_ns=T0 + 70 * MIN, tenants=("T",))
    assert crafted.regressions(scope=scope, min_requests=6, all_signals=1, **WINDOW) == []


def test_bad_windows_are_refused(crafted: Queries) -> None:
    with pytest.raises(QueryError, match="bad window"):
        crafted.regressions(window="soon")
    with pytest.raises(QueryError, match="empty current window"):
        crafted.regressions(scope=Scope(since_ns=T0 + 5, until_ns=T0))


def test_prometheus_gauges_carry_every_judged_signal(crafted: Queries) -> None:
    from sparseety.api.metrics import ApiMetrics

    m = ApiMetrics()
    scope = Scope(until_ns=T0 + 70 * MIN)
    m.set_regressions(crafted.regressions(scope=scope, all_signals=1, **WINDOW))
    text = m.render().decode()
    labels = 'engine="e9",model="mx",signal="expert_load_entropy"'
    assert f"sparseety:sparsity_regression_findings{{{labels}}} 1.0" in text
    assert (
        'sparseety:sparsity_regression_findings{engine="e9",model="mx",signal="spec_acceptance_rate"} 0.0'
        in text
    )
    assert f'sparseety:sparsity_signal_ratio{{{labels},window="baseline"}} 1.0' in text
    m.set_regressions([])  # signals no longer judged disappear
    assert "sparsity_regression_findings{" not in m.render().decode()
