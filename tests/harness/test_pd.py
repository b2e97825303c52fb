"""P/D disaggregation as one request (issue 36, part 3): a prefill engine core and a decode engine
core of vLLM (real schedulers, simulated executors) share vLLM's ``ExampleConnector``; both publish
through the plugin to one real topic (``tests/harness/pd.py``). Run with the plain scheduler and
with async scheduling on both engines.

* each engine's rows equal its own truth (recorded in its scheduler, KV manager and executor), and
  the truth equals what vLLM itself reported (``PrefillStats``: local and external hits);
* the two rows of one client request carry its X-Request-Id as ``pd_join_id`` and their roles;
* through a real Faust worker and the ClickHouse sink, the store's joined bill of each client
  request (``pd_bills_v``, the ``pd_bills`` query, ``cost``) equals what both engines' truths say:
  the prompt billed once (on the prefill side), the decode side's loaded KV not billed as a read
  (until the price table has a ``cached_input_external`` price), the output once (the decode's),
  and actual cost the sum of what each engine computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal as D
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import tiny_model
from tests.harness.pd import OUTPUTS, PROMPTS, PdRun, run_pd, tenant_of
from tests.harness.pipeline import CLASSES

PER_MILLION = {"input": D("10"), "cached_input": D("2.5"), "output": D("40")}
EXTERNAL = D("0.5")  # a cached_input_external price set later in the test


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def pd(request: pytest.FixtureRequest, broker: Config, session_dir: Path) -> PdRun:
    """Both engines with the plain scheduler, then both with async scheduling (the GPU default)."""
    workdir = session_dir / "harness-pd"
    workdir.mkdir(exist_ok=True)
    run = run_pd(tiny_model("llama"), broker, workdir, async_scheduling=request.param)
    assert (run.decode.core.step_fn.__name__ == "step_with_batch_queue") is request.param
    return run


def _truth(h: Any, rid: str) -> dict[str, int]:
    return {**h.truth.summary(rid), "output_tokens": len(h.outputs[rid])}


def test_each_engine_equals_its_truth_and_vllms_own(pd: PdRun) -> None:
    loaded = 0
    for p_rid, d_rid in pd.pairs.values():
        for h, rid in ((pd.prefill, p_rid), (pd.decode, d_rid)):
            t, acc, stats = _truth(h, rid), pd.accounts[rid], h.prefill[rid]
            assert h.truth.requests[rid].admission_hit == stats.num_local_cached_tokens, rid
            assert h.truth.external.get(rid, 0) == stats.num_external_cached_tokens, rid
            assert acc["output_tokens"] == t["output_tokens"], rid
            assert acc["consistent"], rid
            bad = {k: (acc[k], t[k]) for k in CLASSES if int(acc[k]) != int(t[k])}
            assert not bad, (rid, bad)
        assert pd.accounts[p_rid]["output_tokens"] == 1  # the proxy asks the prefill for one token
        assert pd.accounts[p_rid]["external_kv_tokens"] == 0
        loaded += pd.accounts[d_rid]["external_kv_tokens"]
    assert loaded > 0, "the decode engine loaded KV the prefill engine computed"


def test_both_rows_carry_the_routers_id_and_their_role(pd: PdRun) -> None:
    payloads = [ev.payload(e) for e in pd.events if ev.payload_type(e) == ev.REQUEST_STARTED]
    started = {p["request_id"]: p for p in payloads}
    for xid, (p_rid, d_rid) in pd.pairs.items():
        assert (started[p_rid]["pd_role"], started[p_rid]["pd_join_id"]) == ("prefill", xid)
        assert (started[d_rid]["pd_role"], started[d_rid]["pd_join_id"]) == ("decode", xid)
        assert (pd.accounts[p_rid]["pd_role"], pd.accounts[d_rid]["pd_role"]) == ("prefill", "decode")
        assert pd.accounts[p_rid]["pd_join_id"] == pd.accounts[d_rid]["pd_join_id"] == xid


@pytest.fixture(scope="module")
def stored(pd: PdRun, broker: Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Both engines' events through a real Faust worker and the ClickHouse sink; the store."""
    from sparseety.kafka import ensure_topics
    from sparseety.sinks.clickhouse.client import Store
    from sparseety.sinks.clickhouse.prices import Price, set_prices
    from tests.helpers import ComponentProcess, latest_by_key, produce_events, read_topic, wait_for
    from tests.topology.test_sink_consumer import all_committed, last_offsets
    from tests.topology.test_worker import worker_cfg

    tmp = tmp_path_factory.mktemp("pd-pipeline")
    name = f"hpd{tmp.name[-6:].replace('-', '')}"
    cfg = worker_cfg(
        broker.replace(
            topics={
                "engine_events": f"{name}.ee",
                "timelines": f"{name}.tl",
                "usage": f"{name}.us",
                "dlq": f"{name}.dlq",
                "partitions": 2,
            },
            data_dir=str(tmp / "data"),
            sink={"group_id": name, "batch_interval_s": 0.3},
            clickhouse={"dsn": f"chdb://{tmp / 'chdb'}", "database": name},
        ),
        name,
    )
    ensure_topics(cfg)
    produce_events(cfg, sorted(pd.events, key=lambda e: (e["engine_id"], e["seq"])))
    n = 2 * len(PROMPTS)
    worker = ComponentProcess(cfg, ["worker"], tmp / "worker.log").start()
    sink = ComponentProcess(cfg, ["sink", "--commit-interval", "0.5"], tmp / "sink.log").start()
    try:

        def folded() -> bool:
            return len(latest_by_key(read_topic(cfg, cfg.topics.timelines, quiet_s=0.5))) >= n

        wait_for(lambda: folded() or not worker.alive(), 180, 1, "both engines' accounting records")
        assert worker.alive(), worker.tail()
        records = read_topic(cfg, cfg.topics.timelines)
        last = last_offsets(cfg.topics.timelines, records)
        wait_for(lambda: all_committed(cfg, last) or not sink.alive(), 180, 1, "the sink's commit")
        assert sink.alive(), sink.tail()
    finally:
        worker.stop()
        sink.stop()
    store = Store.open(cfg)
    try:
        model = pd.accounts[next(iter(pd.pairs.values()))[0]]["model"]
        set_prices(store, [Price(model, k, v) for k, v in PER_MILLION.items()])
        yield store
    finally:
        store.close()


def _micro(cls: str) -> int:
    return int(PER_MILLION[cls] * 1_000_000)


def _expected(pd: PdRun, xid: str, external_micro: int = 0) -> dict[str, int]:
    """One client request's bill from both engines' truths (and vLLM's own hit counts)."""
    p_rid, d_rid = pd.pairs[xid]
    tp, td = _truth(pd.prefill, p_rid), _truth(pd.decode, d_rid)
    prompt = pd.prefill.truth.requests[p_rid].prompt_len
    p_hit = pd.prefill.prefill[p_rid].num_cached_tokens  # vLLM's own: the list's cached tokens
    transferred = pd.decode.prefill[d_rid].num_external_cached_tokens
    p_in, p_c, p_out = _micro("input"), _micro("cached_input"), _micro("output")

    def actual(t: dict[str, int]) -> int:  # request_costs_v's actual mode, on one engine's truth
        computed = max(t["scheduled_tokens"] - t["output_tokens"], 0)
        return computed * p_in + t["cache_read_tokens"] * p_c + t["output_tokens"] * p_out

    prompt_bill = (prompt - p_hit) * p_in + p_hit * p_c  # once, as the prefill engine served it

    return {
        "prompt_tokens": prompt,
        "output_tokens": td["output_tokens"],
        "prefill_computed_tokens": tp["uncached_computed_tokens"],
        "prefill_cached_tokens": tp["cache_read_tokens"],
        "transferred_kv_tokens": transferred,
        "decode_prompt_cached_tokens": td["cache_read_tokens"],
        "decode_prompt_computed_tokens": prompt - td["cache_read_tokens"] - transferred,
        "discarded_output_tokens": tp["output_tokens"],
        "list_pico": prompt_bill + td["output_tokens"] * p_out + transferred * external_micro,
        "actual_pico": actual(tp) + actual(td),
        "joined": 1,
    }


def test_one_bill_per_client_request_equals_both_engines_truth(pd: PdRun, stored: Any) -> None:
    from sparseety.queries.registry import Queries
    from sparseety.sinks.clickhouse.prices import Price, set_prices

    db = stored.database
    rows = {r["pd_join_id"]: r for r in stored.query(f"SELECT * FROM {db}.pd_bills_v")}
    assert rows.keys() == pd.pairs.keys()
    for xid, (p_rid, d_rid) in pd.pairs.items():
        want = _expected(pd, xid)
        got = {k: int(rows[xid][k]) for k in want}
        assert got == want, xid
        assert rows[xid]["prefill_request_uid"].endswith(p_rid)
        assert rows[xid]["decode_request_uid"].endswith(d_rid)
    # The cost query bills each client request once: one request, its prompt and its output.
    q = Queries(stored)
    (bill,) = q.cost(by=("model",), mode="list")
    assert bill["requests"] == len(PROMPTS) and bill["sequences"] == 2 * len(PROMPTS)
    assert bill["output_tokens"] == sum(OUTPUTS)
    assert bill["prompt_tokens"] == sum(PROMPTS)
    assert D(bill["cost_usd"]) * 10**12 == sum(_expected(pd, x)["list_pico"] for x in pd.pairs)
    (actual,) = q.cost(by=("model",), mode="actual")
    assert D(actual["cost_usd"]) * 10**12 == sum(_expected(pd, x)["actual_pico"] for x in pd.pairs)
    # per tenant (the router passed each client request's tenant to both engines)
    by_tenant = {r["tenant"]: r for r in q.cost(by=("tenant",), mode="list")}
    tenants = {x: tenant_of(i) for i, x in enumerate(pd.pairs)}
    for tenant in set(tenants.values()):
        mine = [x for x, t in tenants.items() if t == tenant]
        assert by_tenant[tenant]["requests"] == len(mine)
        want = sum(_expected(pd, x)["list_pico"] for x in mine)
        assert D(by_tenant[tenant]["cost_usd"]) * 10**12 == want, tenant
    listed = {r["pd_join_id"]: r for r in q.pd_bills(limit=100)}
    assert {x: r["tenant"] for x, r in listed.items()} == tenants
    assert listed.keys() == pd.pairs.keys()
    assert all(D(listed[x]["list_cost_usd"]) * 10**12 == _expected(pd, x)["list_pico"] for x in pd.pairs)
    # With a price for KV loaded from elsewhere, list bills the transfer at it.
    model = bill["model"]
    set_prices(stored, [Price(model, "cached_input_external", EXTERNAL)])
    ext = int(EXTERNAL * 1_000_000)
    rows = {r["pd_join_id"]: r for r in stored.query(f"SELECT * FROM {db}.pd_bills_v")}
    for xid in pd.pairs:
        assert int(rows[xid]["list_pico"]) == _expected(pd, xid, ext)["list_pico"], xid


def test_a_tenant_sees_only_its_own_pd_bills(pd: PdRun, stored: Any) -> None:
    """The joined bill is tenant-scoped like every other read: through the ``pd_bills`` query (the
    API's and CLI's path) and through a tenant's own SQL over ``pd_bills_v`` (whose filters apply to
    the ``requests`` rows the view joins)."""
    from sparseety.queries.base import Scope
    from sparseety.queries.registry import Queries
    from sparseety.queries.sql import Access, run_sql

    tenants = {x: tenant_of(i) for i, x in enumerate(pd.pairs)}
    q = Queries(stored)
    for tenant in sorted(set(tenants.values())):
        mine = {x for x, t in tenants.items() if t == tenant}
        assert mine and mine != tenants.keys()
        listed = q.pd_bills(limit=100, scope=Scope(tenants=(tenant,)))
        assert {r["pd_join_id"] for r in listed} == mine, tenant
        with stored.readers(1) as readers:
            cols, rows = run_sql(
                readers.store(),
                f"SELECT pd_join_id, tenant, joined FROM {stored.database}.pd_bills_v",
                access=Access((tenant,), token_ids=False),
            )
        assert cols == ["pd_join_id", "tenant", "joined"]
        assert {r[0] for r in rows} == mine and {r[1] for r in rows} == {tenant}, tenant
        assert all(r[2] == 1 for r in rows), rows  # both halves visible to their own tenant
    assert q.pd_bills(limit=100, scope=Scope(tenants=("nobody",))) == []
