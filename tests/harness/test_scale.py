"""Long context and scale through vLLM's real engine core (async scheduling, Model Runner V2
shape, simulated executor), the plugin and the broker, then the fold (and for the fleet-sized
workload, a real Faust worker and the ClickHouse sink).

* single requests of 8K, 32K and 128K tokens, two of them sharing a 16K prefix, in chunked
  prefill of 8K: every class equals the truth, and the fold's state for the 128K request stays
  within its stated size (O(segments + prompt blocks), not O(tokens));
* 256 requests running in one batch;
* 10,000 requests from 200 tenants: none lost, none doubled, no seq gap or reorder, per-tenant
  totals equal the truth's; folded by a real worker and stored by the real sink.

After each run the plugin's own bookkeeping is empty: nothing it keeps per request or per step
outlives the request or the step (the engine side's memory is bounded by what is in flight).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config, to_env
from tests.e2e.conftest import environ, tiny_model
from tests.e2e.engine_events import engine_events
from tests.harness.engine import Harness, Mode, build, drive, long_context_model, request
from tests.harness.pipeline import ModeRun, engine_config, fold, mismatches

MODE = Mode(async_scheduling=True, v2=True, spec="eagle")


def run(
    broker: Config,
    workdir: Path,
    name: str,
    phases: list[list[Any]],
    *,
    model: Path | None = None,
    **engine: Any,
) -> ModeRun:
    cfg = engine_config(broker, workdir / name, name)
    with environ(to_env(cfg)):
        h = build(MODE, model or tiny_model("llama"), **engine)
        session = h.core.scheduler._sparseety
        try:
            drive(h, phases)
        finally:
            h.shutdown()
    assert_plugin_state_empty(session)
    n = len(h.finish)
    events = engine_events(
        cfg, lambda es: sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in es) >= n, timeout=180
    )
    out = ModeRun(mode=MODE, harness=h, events=events, accounts=fold(events))
    out.started = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)
    return out


def assert_plugin_state_empty(session: Any) -> None:
    """What the plugin keeps per step or per request is gone once the engine is idle."""
    assert session is not None
    assert not session._pending and not session._held and not session._kv_held and not session._live
    assert not session._deferred
    assert not session.builder._admitted_cached and not session.builder._reported_cached
    assert len(session.builder._rejections) <= 8
    assert session.emitter.queued == 0
    assert session.emitter.stats.dropped == 0


def assert_stream_whole(events: list[dict[str, Any]]) -> None:
    """Every stream's seqs are 0..n-1 once each, and the topic kept them in order."""
    by_stream: dict[str, list[int]] = {}
    for e in events:
        by_stream.setdefault(e["stream"], []).append(e["seq"])
    for stream, seqs in by_stream.items():
        assert seqs == list(range(len(seqs))), f"{stream}: gaps, duplicates or reorder"


@pytest.fixture(scope="module")
def workdir(session_dir: Path) -> Path:
    d = session_dir / "harness-scale"
    d.mkdir(exist_ok=True)
    return d


def test_long_context_requests_are_exact_and_their_state_is_bounded(broker: Config, workdir: Path) -> None:
    from sparseety.config import WorkerConfig
    from sparseety.streams.assembler import Assembler
    from sparseety.streams.state import MemoryStore

    rng = random.Random(3)
    shared = [rng.randrange(4, 500) for _ in range(16_384)]
    lengths = {"ctx8k": 8_192, "ctx32k": 32_768, "ctx128k": 131_072}
    prompts = {rid: [rng.randrange(4, 500) for _ in range(n)] for rid, n in lengths.items()}
    prompts["ctx32k-shared"] = shared + [rng.randrange(4, 500) for _ in range(32_768 - 16_384)]
    prompts["ctx32k"] = shared + prompts["ctx32k"][16_384:]
    phases = [
        [
            request(rid, prompts[rid], max_tokens=32, ignore_eos=True)
            for rid in ("ctx8k", "ctx32k", "ctx128k")
        ],
        [request("ctx32k-shared", prompts["ctx32k-shared"], max_tokens=32, ignore_eos=True)],
    ]
    r = run(
        broker,
        workdir,
        "long",
        phases,
        model=long_context_model(tiny_model("llama")),
        max_model_len=140_000,
        max_num_batched_tokens=8_192,
        num_gpu_blocks_override=20_000,
    )
    bad = mismatches(r)
    assert not bad, "\n".join(bad)
    assert r.accounts["ctx32k-shared"]["cache_read_tokens"] == 16_384
    assert_stream_whole(r.events)
    # The fold's state of the 128K request just before its finish: within the stated bound
    # (docs/streams.md). It grows with the prompt's blocks and, in the privacy modes that keep
    # token records (raw ids, hashed: keyed hashes), with its tokens; never with its steps.
    sizes = {}
    for rid in ("ctx8k", "ctx128k"):
        store = MemoryStore()
        asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), store)
        for e in sorted(r.events, key=lambda e: e["seq"]):
            if ev.payload_type(e) == ev.REQUEST_FINISHED and ev.payload(e)["request_id"] == rid:
                break
            asm.apply(e)
        key = next(k for k in store.keys("r|") if k.endswith(f"|{rid}"))
        sizes[rid] = store.size_bytes(key)
        # prompt runs, then at most two runs per output token (kept drafts alternate with samples)
        assert len(store.get(key).segments) <= 4 + 2 * 32, rid
    assert sizes["ctx128k"] <= 1024 * 1024, sizes
    assert sizes["ctx128k"] / 131_072 <= 8, f"{sizes}: more than 8 bytes a prompt token"


def test_a_batch_of_256_running_requests(broker: Config, workdir: Path) -> None:
    rng = random.Random(5)
    system = [rng.randrange(4, 500) for _ in range(64)]
    phase = [
        request(
            f"b{i}",
            system + [rng.randrange(4, 500) for _ in range(rng.randrange(8, 64))],
            tenant=f"t{i % 7}",
            max_tokens=rng.randrange(16, 48),
            ignore_eos=True,
        )
        for i in range(256)
    ]
    r = run(broker, workdir, "b256", [phase], max_num_seqs=256, max_num_batched_tokens=16_384)
    widest = max(len(ev.payload(e)["req_ids"]) for e in r.events if ev.payload_type(e) == ev.STEP_BATCH)
    assert widest == 256
    bad = mismatches(r)
    assert not bad, "\n".join(bad[:20])
    assert_stream_whole(r.events)


def _fleet_workload(n: int, tenants: int) -> list[list[Any]]:
    rng = random.Random(9)
    systems = [[rng.randrange(4, 500) for _ in range(48)] for _ in range(8)]
    return [
        [
            request(
                f"q{i}",
                systems[i % 8][: rng.choice((0, 16, 32, 48))]
                + [rng.randrange(4, 500) for _ in range(rng.randrange(4, 40))],
                tenant=f"tenant-{i % tenants}",
                max_tokens=rng.randrange(2, 12),
                ignore_eos=True,
            )
            for i in range(start, start + n // 4)
        ]
        for start in range(0, n, n // 4)
    ]


def test_ten_thousand_requests_many_tenants_through_worker_and_sink(
    broker: Config, workdir: Path, tmp_path: Path
) -> None:
    """10,000 requests from 200 tenants: the plugin's events folded by a real Faust worker and
    stored by the real ClickHouse sink equal the truth, request by request and per tenant."""
    from sparseety.kafka import ensure_topics
    from sparseety.sinks.clickhouse.client import Store
    from tests.helpers import ComponentProcess, latest_by_key, read_topic, wait_for
    from tests.topology.test_sink_consumer import all_committed, last_offsets
    from tests.topology.test_worker import worker_cfg

    r = run(
        broker, workdir, "10k", _fleet_workload(10_000, 200), max_num_seqs=256, num_gpu_blocks_override=4096
    )
    h: Harness = r.harness
    assert len(h.finish) == 10_000
    assert_stream_whole(r.events)
    bad = mismatches(r)
    assert not bad, "\n".join(bad[:20])
    started = sum(1 for e in r.events if ev.payload_type(e) == ev.REQUEST_STARTED)
    finished = sum(1 for e in r.events if ev.payload_type(e) == ev.REQUEST_FINISHED)
    assert started == finished == 10_000

    # The same events through a real worker and the sink.
    cfg = worker_cfg(
        broker.replace(
            topics={
                "engine_events": f"{r.events[0]['engine_name']}-p.ee",
                "timelines": f"{r.events[0]['engine_name']}-p.tl",
                "usage": f"{r.events[0]['engine_name']}-p.us",
                "dlq": f"{r.events[0]['engine_name']}-p.dlq",
                "partitions": 2,
            },
            data_dir=str(tmp_path / "data"),
            sink={"group_id": "harness-10k", "batch_interval_s": 0.3},
            clickhouse={"dsn": f"chdb://{tmp_path / 'chdb'}", "database": "h10k"},
        ),
        "h10k",
    )
    ensure_topics(cfg)
    from tests.helpers import produce_events

    produce_events(cfg, sorted(r.events, key=lambda e: e["seq"]))
    worker = ComponentProcess(cfg, ["worker"], tmp_path / "worker.log").start()
    sink = ComponentProcess(cfg, ["sink", "--commit-interval", "0.5"], tmp_path / "sink.log").start()
    try:
        wait_for(
            lambda: (
                len(latest_by_key(read_topic(cfg, cfg.topics.timelines, quiet_s=0.5))) >= 10_000
                or not worker.alive()
            ),
            300,
            2,
            "10,000 accounting records",
        )
        assert worker.alive(), worker.tail()
        records = read_topic(cfg, cfg.topics.timelines)
        accounts = {a["request_id"]: a for a in latest_by_key(records).values()}
        assert accounts.keys() == h.finish.keys()
        for rid, a in accounts.items():
            assert a["output_tokens"] == len(h.outputs[rid]), rid
            assert a["cache_read_tokens"] == r.truth(rid)["cache_read_tokens"], rid
        last = last_offsets(cfg.topics.timelines, records)
        wait_for(lambda: all_committed(cfg, last) or not sink.alive(), 180, 1, "the sink's commit")
        assert sink.alive(), sink.tail()
    finally:
        worker.stop()
        sink.stop()
    store = Store.open(cfg)
    try:
        rows = store.query(
            f"SELECT tenant, count() AS n, sum(output_tokens) AS out, sum(cache_read_tokens) AS cr, "
            f"sum(uncached_computed_tokens) AS uc FROM {store.database}.requests FINAL GROUP BY tenant"
        )
        total = store.query(f"SELECT count() AS n FROM {store.database}.requests FINAL")[0]["n"]
    finally:
        store.close()
    assert int(total) == 10_000
    truth: dict[str, dict[str, int]] = {}
    for rid in h.finish:
        tenant = f"tenant-{int(rid[1:]) % 200}"
        t = truth.setdefault(tenant, {"n": 0, "out": 0, "cr": 0, "uc": 0})
        s = r.truth(rid)
        t["n"] += 1
        t["out"] += len(h.outputs[rid])
        t["cr"] += s["cache_read_tokens"]
        t["uc"] += s["uncached_computed_tokens"]
    got = {row["tenant"]: {k: int(row[k]) for k in ("n", "out", "cr", "uc")} for row in rows}
    assert got == truth


def test_data_parallel_ranks_are_two_engines(broker: Config, workdir: Path) -> None:
    """Two engine cores of one data-parallel deployment (ranks 0 and 1, the same configuration,
    a configured engine name): each publishes as its own engine and folds exactly."""
    from tests.harness.sim_executor import SimSettings

    cfg = engine_config(broker, workdir / "dp", "dp")
    harnesses = []
    with environ(to_env(cfg)):
        for rank in (0, 1):
            h = build(
                Mode(async_scheduling=True, v2=True, pressure=True),
                tiny_model("mixtral"),  # vLLM runs external-LB data parallelism for MoE models only
                SimSettings(),
                data_parallel_size=2,
                data_parallel_rank=rank,
                data_parallel_size_local=1,
            )
            harnesses.append(h)
        try:
            from tests.harness.pipeline import workload

            for rank, h in enumerate(harnesses):
                drive(h, workload(prefix=f"r{rank}-"))
        finally:
            for h in harnesses:
                h.shutdown()
    n = sum(len(h.finish) for h in harnesses)
    events = engine_events(cfg, lambda es: sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in es) >= n)
    names = {e["engine_name"] for e in events}
    assert names == {"harness-dp-dp0", "harness-dp-dp1"}
    for rank, h in enumerate(harnesses):
        mine = [e for e in events if e["engine_name"] == f"harness-dp-dp{rank}"]
        assert_stream_whole(mine)
        r = ModeRun(mode=h.mode, harness=h, events=mine, accounts=fold(mine))
        bad = mismatches(r)
        assert not bad, "\n".join(bad)
