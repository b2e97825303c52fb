"""The plugin inside vLLM's OpenAI API server (front end, EngineCore and worker processes):
concurrent clients, usage equality, cache hits, tenant propagation; the proxy producer against
the same server; a Kafka outage in the middle of a run.

The server publishes to its own broker, which the last test stops and restarts.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparseety import events as ev
from sparseety.broker import EmbeddedBroker
from sparseety.config import Config
from sparseety.kafka import ensure_topics
from tests.e2e.conftest import EnginePool, ServerEngine, engine_config, tiny_model
from tests.e2e.engine_events import engine_events, engine_rid, finished_ids
from tests.helpers import free_port, running_broker
from tests.recorded import reconstruct, seq_gaps

SYSTEMS = [
    "You are a helpful assistant. " * 3,
    "You answer questions about invoices, tenants and token prices, in one short paragraph. " * 3,
    "The serving fleet runs many copies of the same model behind a router. " * 6,
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 appear in logs and tables. " * 5,
    "Translate every sentence into French, then explain each word. " * 9,
]
QUESTION = "Question {i}: " + "please explain the report in detail, " * 1


@pytest.fixture(scope="module")
def server_broker(session_dir: Path) -> Iterator[EmbeddedBroker]:
    with running_broker(session_dir / "server-broker") as broker:
        yield broker


@pytest.fixture(scope="module")
def server(engine_pool: EnginePool, server_broker: EmbeddedBroker, e2e_dir: Path) -> Iterator[ServerEngine]:
    engine_pool.close_all()  # at most two engines at a time: this module runs the server alone
    cfg = engine_config(
        server_broker.client_config(),
        e2e_dir / "server",
        "server",
        partitions=4,  # what the broker gives a topic auto-created after its restart
        memory_limit_bytes=1024 * 1024,  # the smallest bound: the outage test must spill
        heartbeat_interval_s=3600,  # quiet when idle, so the outage starts with nothing in flight
        flush_timeout_s=10,
    )
    args = [
        "--model",
        str(tiny_model("llama")),
        "--served-model-name",
        "tiny",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "null"}),
        "--middleware",
        "sparseety.producers.vllm.middleware.TenantHeaderMiddleware",
        "--shutdown-timeout",
        "10",
    ]
    srv = ServerEngine(cfg, args, e2e_dir / "server.log")
    try:
        yield srv
    finally:
        srv.close()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.index("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _chat(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def test_concurrent_clients_each_request_attributed_and_equal_to_usage(server: ServerEngine) -> None:
    tag = f"c{random.randrange(1 << 30):x}"
    jobs = []
    for i in range(50):
        system = SYSTEMS[i % len(SYSTEMS)]
        question = QUESTION.format(i=i) + "and more, " * (i % 7) * 3
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4 + (i * 7) % 37,
            "temperature": 0,
            "return_token_ids": True,
        }
        headers = {"X-Request-Id": f"{tag}-{i}"}
        tenant = f"tenant-{i % 4}"
        if i % 5 == 0:
            headers["X-Sparseety-Tenant"] = tenant  # through the API-server middleware
        else:
            body["vllm_xargs"] = {"tenant": tenant}
        jobs.append((i, body, headers, tenant))
    random.Random(7).shuffle(jobs)
    before = httpx.get(f"{server.url}/metrics").text

    with httpx.Client(base_url=server.url) as client, ThreadPoolExecutor(5) as pool:
        responses = dict(
            zip(
                [j[0] for j in jobs],
                pool.map(lambda j: _chat(client, j[1], j[2]), jobs),
                strict=True,
            )
        )
    after = httpx.get(f"{server.url}/metrics").text
    externals = {f"chatcmpl-{tag}-{i}" for i in range(50)}

    def complete(events: list[dict[str, Any]]) -> bool:
        return externals <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}

    events = engine_events(server.cfg, complete, timeout=90)
    per_request = reconstruct(events)
    tenants = {i: t for i, _, _, t in jobs}
    ours = set()
    hits = 0
    for i, resp in responses.items():
        rid = engine_rid(events, f"chatcmpl-{tag}-{i}")
        ours.add(rid)
        got = per_request[rid]
        usage = resp["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert got["started"]["prompt_token_ids"] == resp["prompt_token_ids"]
        assert got["started"]["prompt_len"] == usage["prompt_tokens"]
        assert got["output"] == resp["choices"][0]["token_ids"]
        assert len(got["output"]) == usage["completion_tokens"]
        assert got["started"]["num_cached_tokens"] == cached
        assert got["finished"]["num_cached_tokens"] == cached
        assert got["finished"]["num_prompt_tokens"] == usage["prompt_tokens"]
        assert got["finished"]["num_output_tokens"] == usage["completion_tokens"]
        assert got["finished"]["finish_reason"] == resp["choices"][0]["finish_reason"]
        assert got["started"]["tenant"] == tenants[i]
        assert got["started"]["model"] == "tiny"
        hits += cached > 0
    # Shared system prompts: most requests after the first of each prefix hit the cache.
    assert hits >= 25
    total_cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses.values())
    name = "vllm:prompt_tokens_by_source_total"
    assert total_cached == _metric(after, name, source="local_cache_hit") - _metric(
        before, name, source="local_cache_hit"
    )
    # Every scheduled request of these steps is one of ours: nothing leaks between requests.
    for e in events:
        if ev.payload_type(e) == ev.STEP_BATCH and set(ev.payload(e)["req_ids"]) & ours:
            assert set(ev.payload(e)["req_ids"]) <= ours
    assert all(not gaps for gaps in seq_gaps(events).values())


# --- proxy producer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(server: ServerEngine, broker: Config, e2e_dir: Path) -> Iterator[tuple[str, Config]]:
    import uvicorn

    from sparseety.producers.proxy.app import ProxyProducer, create_app

    cfg = engine_config(broker, e2e_dir / "proxy", "proxy")
    # a trusted gateway: the tenant header counts (the streaming test sends one without a key)
    producer = ProxyProducer(
        cfg, server.url, api_keys={"key-a": "tenant-a"}, engine_name="e2e-proxy", trust_tenant_header=True
    )
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(create_app(producer), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "proxy did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", cfg
    finally:
        srv.should_exit = True
        thread.join(30)


def _sse(text: str) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for block in text.split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in block.splitlines() if line.startswith("data:"))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _strip(chunk: dict[str, Any] | str) -> Any:
    if isinstance(chunk, str):
        return chunk
    return {k: v for k, v in chunk.items() if k not in ("id", "created", "system_fingerprint")}


def _proxy_events(cfg: Config, n: int) -> dict[str, dict[str, Any]]:
    events = engine_events(cfg, lambda evs: len(finished_ids(evs)) >= n, timeout=30)
    return reconstruct(events)


def test_proxy_non_streaming(server: ServerEngine, proxy: tuple[str, Config]) -> None:
    url, cfg = proxy
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": SYSTEMS[2] + "What is a router?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).raise_for_status()  # warm
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    via = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60
    ).json()
    assert via["choices"] == direct["choices"]
    assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    got = _proxy_events(cfg, 1)[via["id"]]
    usage = via["usage"]
    assert got["started"]["prompt_len"] == usage["prompt_tokens"]
    assert got["started"]["num_cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert got["finished"]["num_output_tokens"] == usage["completion_tokens"] == 12
    assert got["finished"]["finish_reason"] == "length"
    assert got["started"]["tenant"] == "tenant-a"
    assert got["finished"]["first_token_ts_ns"] == 0 and got["finished"]["chunk_arrival_ns"] == []
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-a"}).json()
    assert models["data"][0]["id"] == "tiny"  # other routes pass through


def test_proxy_streaming_passes_chunks_through(server: ServerEngine, proxy: tuple[str, Config]) -> None:
    url, cfg = proxy
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": SYSTEMS[3] + "Count them."}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
    }
    with_usage = {**body, "stream_options": {"include_usage": True}}
    # Warm the prefix cache first: a cached prefix and a computed one may differ in the last bit
    # of bf16, and so in a greedy token; every call below then reads the same cached blocks.
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    direct = _sse(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).text)
    direct_usage = _sse(httpx.post(f"{server.url}/v1/chat/completions", json=with_usage, timeout=60).text)
    via = _sse(
        httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-Sparseety-Tenant": "gw"}, timeout=60
        ).text
    )
    # The client did not ask for usage: it sees exactly the upstream's chunks, no usage chunk.
    assert [_strip(c) for c in via] == [_strip(c) for c in direct]
    usage = next(c["usage"] for c in direct_usage if isinstance(c, dict) and c.get("usage"))
    stream_id = next(c["id"] for c in via if isinstance(c, dict))
    via_usage = _sse(
        httpx.post(
            f"{url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": SYSTEMS[1],
                "max_tokens": 5,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={"Authorization": "Bearer key-a"},
            timeout=60,
        ).text
    )
    # A client that asked for usage gets it.
    completion_usage = next(c["usage"] for c in via_usage if isinstance(c, dict) and c.get("usage"))
    completion_id = next(c["id"] for c in via_usage if isinstance(c, dict))

    events = _proxy_events(cfg, 3)
    got = events[stream_id]
    content_chunks = [
        c for c in via if isinstance(c, dict) and c["choices"] and "role" not in c["choices"][0]["delta"]
    ]
    assert got["finished"]["num_output_tokens"] == usage["completion_tokens"] == 10
    assert got["started"]["prompt_len"] == usage["prompt_tokens"]
    assert len(got["finished"]["chunk_arrival_ns"]) == len(content_chunks)
    assert got["finished"]["first_token_ts_ns"] == got["finished"]["chunk_arrival_ns"][0]
    assert got["finished"]["chunk_arrival_ns"] == sorted(got["finished"]["chunk_arrival_ns"])
    assert got["started"]["tenant"] == "gw"
    assert got["finished"]["finish_reason"] == "length"
    comp = events[completion_id]
    assert comp["started"]["prompt_len"] == completion_usage["prompt_tokens"]
    assert comp["finished"]["num_output_tokens"] == completion_usage["completion_tokens"] == 5
    started = engine_events(cfg)
    kinds = {ev.payload(e)["engine_kind"] for e in started if ev.payload_type(e) == ev.ENGINE_STARTED}
    assert kinds == {"proxy"}


# --- issue 21: the client's ids, and n > 1 billed as the response's usage -------------------


def test_found_by_response_id_and_n2_list_cost_equals_usage(
    server: ServerEngine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A chat completion is found in the store by the ``chatcmpl-...`` id its client got, a
    completion with ``n = 2`` by its ``cmpl-...`` id (both choices listed, never one guessed), and
    that request's ``list`` cost bills exactly the response's usage: the prompt once.

    The engine's events go through the fold (``Assembler``: the Faust worker runs this fold,
    tests/topology/test_worker.py checks they agree) into chDB with the real sink."""
    from decimal import Decimal

    from sparseety.config import WorkerConfig
    from sparseety.errors import AmbiguousIdError
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.prices import Price, set_prices
    from sparseety.sinks.clickhouse.queries import Queries, Scope
    from sparseety.sinks.clickhouse.writer import ClickHouseSink
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore
    from tests.helpers import chdb_config, throwaway_store

    tag = f"n{random.randrange(1 << 30):x}"
    tenant = f"ids-{tag}"
    with httpx.Client(base_url=server.url, timeout=120) as client:
        chat = _chat(
            client,
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": SYSTEMS[1] + "What is a tenant?"}],
                "max_tokens": 5,
                "temperature": 0,
                "vllm_xargs": {"tenant": tenant},
            },
            {},  # no X-Request-Id: the id is vLLM's random one, known to the client only
        )
        r = client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": SYSTEMS[3] + "Count:",
                "max_tokens": 7,
                "n": 2,
                "temperature": 1.0,
                "seed": 3,
                "vllm_xargs": {"tenant": tenant + "-n2"},
            },
            headers={"X-Request-Id": f"{tag}-n2"},
        )
        r.raise_for_status()
        n2 = r.json()
    assert chat["id"].startswith("chatcmpl-") and n2["id"] == f"cmpl-{tag}-n2"
    assert len(n2["choices"]) == 2

    def complete(events: list[dict[str, Any]]) -> bool:
        done = {r.rsplit("-", 1)[0] for r in finished_ids(events)}
        return chat["id"] in done and {f"0_cmpl-{tag}-n2-0", f"1_cmpl-{tag}-n2-0"} <= done

    events = engine_events(server.cfg, complete, timeout=90)
    asm = Assembler(WorkerConfig(), MemoryStore())
    records = [o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES]
    ours = [r for r in records if r["tenant"] in (tenant, tenant + "-n2")]
    assert len(ours) == 3, [r["request_id"] for r in ours]
    with throwaway_store(chdb_config(tmp_path_factory)) as store:
        migrate(store)
        sink = ClickHouseSink(store)
        for i, rec in enumerate(ours):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
        sink.flush()
        d = Decimal
        set_prices(store, [Price("tiny", "input", d("10"), 0), Price("tiny", "cached_input", d("2.5"), 0)])
        set_prices(store, [Price("tiny", "output", d("40"), 0)])
        q = Queries(store)

        found = q.request(chat["id"])
        assert found is not None and found["external_request_id"] == chat["id"]
        assert (found["prompt_tokens"], found["output_tokens"]) == (
            chat["usage"]["prompt_tokens"],
            chat["usage"]["completion_tokens"],
        )
        stats = q.tokens_statistics(chat["id"])
        assert stats is not None and stats["input_token_count"] == chat["usage"]["prompt_tokens"]

        with pytest.raises(AmbiguousIdError) as amb:
            q.request(n2["id"])
        assert sorted(c["choice_index"] for c in amb.value.candidates) == [0, 1]
        assert {c["parent_request_id"] for c in amb.value.candidates} == {
            c["request_id"].split("_", 1)[1] for c in amb.value.candidates
        }
        assert len(q.requests(client_id=f"{tag}-n2")) == 2

        (row,) = q.cost(mode="list", scope=Scope(tenants=(tenant + "-n2",)))
        usage = n2["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert row["requests"] == 2
        assert row["input_tokens"] + row["cached_tokens"] == usage["prompt_tokens"]
        assert row["cached_tokens"] == cached
        assert row["output_tokens"] == usage["completion_tokens"]
        want = (
            (usage["prompt_tokens"] - cached) * d("10")
            + cached * d("2.5")
            + usage["completion_tokens"] * d("40")
        ) / 1_000_000
        assert row["cost_usd"] == want


# --- Kafka outage (last: it restarts the server's broker) ------------------------------------


def test_kafka_outage_spills_then_delivers_everything(
    server: ServerEngine, server_broker: EmbeddedBroker
) -> None:
    cfg = server.cfg
    before = engine_events(cfg)
    engine_id = next(e["engine_id"] for e in before if ev.payload_type(e) == ev.ENGINE_STARTED)
    journal = cfg.spill_path / "e2e-server" / "core"

    server_broker.stop()
    tag = f"o{random.randrange(1 << 30):x}"

    def ask(i: int) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Outage request {i}. " + SYSTEMS[4] * 2}],
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=server.url) as client:
            return _chat(client, body, {"X-Request-Id": f"{tag}-{i}"})

    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(ask, range(60)))
    assert all(r["usage"]["completion_tokens"] == 64 for r in responses)  # the engine never stalled
    deadline = time.monotonic() + 30
    while not any(journal.glob("*.seg")):
        assert time.monotonic() < deadline, "nothing was spilled to the journal"
        time.sleep(0.5)

    EmbeddedBroker(server_broker.cfg).start(create_topics=False)  # memory storage: topics are gone
    ensure_topics(cfg, [cfg.topics.engine_events])
    externals = {f"chatcmpl-{tag}-{i}" for i in range(60)}

    def delivered(events: list[dict[str, Any]]) -> bool:
        return externals <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}

    after = engine_events(cfg, delivered, timeout=150)
    server.close()  # clean shutdown: EngineStopped, and the producer logs its totals
    after += [e for e in engine_events(cfg) if ev.payload_type(e) == ev.ENGINE_STOPPED]

    seqs = {e["seq"] for e in before + after if e["engine_id"] == engine_id and e["stream"] == "core"}
    assert seqs == set(range(max(seqs) + 1)), "events were lost"
    assert any(ev.payload_type(e) == ev.ENGINE_STOPPED for e in after)
    per_request = reconstruct(after)
    for i, resp in enumerate(responses):
        got = per_request[engine_rid(after, f"chatcmpl-{tag}-{i}")]
        assert got["finished"]["num_output_tokens"] == resp["usage"]["completion_tokens"]
        assert got["started"]["prompt_len"] == resp["usage"]["prompt_tokens"]
    totals = re.findall(r"produced=(\d+) dropped=(\d+) spilled=(\d+) drained=(\d+)", server.tail(400))
    assert totals, server.tail(40)
    produced, dropped, spilled, drained = map(int, totals[-1])
    assert dropped == 0 and spilled > 0 and drained == spilled
    assert produced >= len(seqs)
    assert not any(journal.glob("*.seg"))
