"""The plugin inside vLLM's OpenAI API server (front end, EngineCore and worker processes):
concurrent clients, usage equality, cache hits, tenant propagation; the proxy producer against
the same server; a Kafka outage in the middle of a run.

The server publishes to its own broker, which the last test stops and restarts.
"""

from __future__ import annotations

import json
import random
import re
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
from sparseety.stack.tiny_models import THINK_TOKENS, build_tiny_lora
from tests.e2e.conftest import EnginePool, ServerEngine, engine_config, environ, server_args, tiny_model
from tests.e2e.engine_events import engine_events, engine_rid, finished_ids
from tests.helpers import accounting_store, running_broker, serving
from tests.recorded import reconstruct, seq_gaps

SYSTEMS = [
    "You are a helpful assistant. " * 3,
    "You answer questions about invoices, tenants and token prices, in one short paragraph. " * 3,
    "The serving fleet runs many copies of the same model behind a router. " * 6,
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 appear in logs and tables. " * 5,
    "Translate every sentence into French, then explain each word. " * 9,
]
QUESTION = "Question {i}: " + "please explain the report in detail, " * 1
ADAPTER = "sql"  # the server's LoRA adapter (--lora-modules)
REPO = Path(__file__).resolve().parents[2]


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
    # The llama with <think> tokens, a LoRA adapter built here, vLLM's deepseek_r1 reasoning
    # parser and a logits processor that makes a request think on demand (issue 23): one server
    # for every test of the module, so no engine starts for them alone.
    model = tiny_model("llama-think")
    lora = build_tiny_lora(model, e2e_dir / "lora-sql")
    args = server_args(
        model,
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "null"}),
        "--middleware",
        "sparseety.producers.vllm.middleware.TenantHeaderMiddleware",
        "--shutdown-timeout",
        "10",
        "--enable-lora",
        "--lora-modules",
        f"{ADAPTER}={lora}",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "1",
        "--reasoning-parser",
        "deepseek_r1",
        "--logits-processors",
        "tests.e2e.think_logits:ThinkFirst",
    )
    with environ({"PYTHONPATH": str(REPO)}):  # the engine process imports the logits processor
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
    from sparseety.producers.proxy.app import ProxyProducer, create_app

    cfg = engine_config(broker, e2e_dir / "proxy", "proxy")
    # a trusted gateway: the tenant header counts (the streaming test sends one without a key)
    producer = ProxyProducer(
        cfg, server.url, api_keys={"key-a": "tenant-a"}, engine_name="e2e-proxy", trust_tenant_header=True
    )
    with serving(create_app(producer), "proxy") as url:
        yield url, cfg


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
        "service_tier": "flex",
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
    # issue 36: the tier the client asked for, read by the proxy; the server's cache-write count
    assert got["started"]["service_tier"] == "flex"
    created = usage["prompt_tokens_details"]["created_cache_tokens"]
    assert got["finished"]["num_cache_creation_tokens"] == created == 0  # the warm-up wrote it
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
    from sparseety.queries.registry import Queries, Scope
    from sparseety.sinks.clickhouse.prices import Price, set_prices
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

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
    with accounting_store(tmp_path_factory, ours) as store:
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
        assert (row["requests"], row["sequences"]) == (1, 2)  # one API request, two engine requests
        assert row["input_tokens"] + row["cached_tokens"] == usage["prompt_tokens"] == row["prompt_tokens"]
        assert row["cached_tokens"] == cached
        assert row["output_tokens"] == usage["completion_tokens"]
        want = (
            (usage["prompt_tokens"] - cached) * d("10")
            + cached * d("2.5")
            + usage["completion_tokens"] * d("40")
        ) / 1_000_000
        assert row["cost_usd"] == want


# --- issue 23: reasoning tokens, LoRA adapters, cost outliers -------------------------------------


def test_reasoning_tokens_and_adapter_per_request_equal_vllms_own(
    server: ServerEngine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Requests made to think (a logits processor forces ``<think>``, K tokens, ``</think>``)
    on the base model and on a LoRA adapter: per request, the reasoning positions SparSEEty
    records (the engine's deepseek_r1 parser, read in the engine process) are as many as vLLM's
    own ``completion_tokens_details.reasoning_tokens`` and exactly the positions its front end
    parsed into the reasoning text (the answer decodes from the rest); a request cut inside the
    think section counts every position after ``<think>``, one never asked to think counts 0; the
    adapter is recorded beside the base model. Then in chDB: cost and usage group by adapter,
    reasoning is priced at its own price, token records carry kind reasoning, the OTel span the
    GenAI attribute, and the outliers query ranks the same requests, the length cut a reason
    exactly where vLLM said length."""
    from decimal import Decimal

    from transformers import AutoTokenizer

    from sparseety.config import WorkerConfig
    from sparseety.queries.registry import Queries, Scope
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.prices import Price, set_prices
    from sparseety.sinks.clickhouse.writer import ClickHouseSink
    from sparseety.sinks.otel.spans import span_spec
    from sparseety.streams.assembler import TIMELINES, USAGE, Assembler
    from sparseety.streams.state import MemoryStore
    from tests.helpers import chdb_config, throwaway_store

    tok = AutoTokenizer.from_pretrained(tiny_model("llama-think"))
    think_ids = tok.convert_tokens_to_ids(list(THINK_TOKENS))
    tag = f"r{random.randrange(1 << 30):x}"
    tenant = f"think-{tag}"
    # (model, think K or None, max_tokens)
    cases = {
        "base-k3": ("tiny", 3, 9),
        "base-k6": ("tiny", 6, 12),
        "lora-k4": (ADAPTER, 4, 10),
        "lora-cut": (ADAPTER, 10, 5),  # stops (length) inside the think section
        "lora-plain": (ADAPTER, None, 6),
    }
    responses: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, (model, k, max_tokens) in cases.items():
            xargs: dict[str, Any] = {"tenant": tenant}
            if k is not None:
                xargs |= {"think": k, "think_ids": think_ids}
            responses[name] = _chat(
                client,
                {
                    "model": model,
                    "messages": [{"role": "user", "content": SYSTEMS[0] + f"Think about {name}."}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "return_token_ids": True,
                    "vllm_xargs": xargs,
                },
                {"X-Request-Id": f"{tag}-{name}"},
            )
        # one more request, later than the windows of ours (1 s) close: its events pass the
        # watermark over them, so the fold emits their usage windows
        time.sleep(1.5)
        _chat(
            client,
            {"model": "tiny", "messages": [{"role": "user", "content": "later"}], "max_tokens": 1},
            {"X-Request-Id": f"{tag}-later"},
        )
    externals = {f"chatcmpl-{tag}-{n}": n for n in cases}

    def complete(events: list[dict[str, Any]]) -> bool:
        return {*externals, f"chatcmpl-{tag}-later"} <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}

    events = engine_events(server.cfg, complete, timeout=90)
    (started,) = [ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED][-1:]
    assert started["reasoning_parser"] == "deepseek_r1"
    asm = Assembler(WorkerConfig(window_s=1, allowed_lateness_s=0), MemoryStore())
    outputs = [o for e in events for o in asm.apply(e)]
    by_rid = {o.record["request_id"]: o.record for o in outputs if o.topic == TIMELINES}
    ours = {name: by_rid[engine_rid(events, ext)] for ext, name in externals.items()}
    assert len({r["request_uid"] for r in ours.values()}) == len(cases)

    for name, (model, k, max_tokens) in cases.items():
        rec, resp = ours[name], responses[name]
        ids = resp["choices"][0]["token_ids"]
        msg = resp["choices"][0]["message"]
        vllm_reasoning = msg.get("reasoning") or msg.get("reasoning_content")  # 0.32: reasoning
        assert rec["output_tokens"] == len(ids) == resp["usage"]["completion_tokens"], name
        assert (rec["model"], rec["lora_name"]) == ("tiny", ADAPTER if model == ADAPTER else None), name
        n = rec["reasoning_output_tokens"]
        # vLLM's own count (its front end's parser: the positions inside the delimiters)
        assert resp["usage"]["completion_tokens_details"]["reasoning_tokens"] == n, name
        if k is None:
            # never asked to think: no delimiter (the logits processor leaves the request alone,
            # and the random model did not pick one), so no reasoning position. vLLM's text
            # parse still files the whole output under reasoning (deepseek_r1 assumes R1's
            # template opened the think section in the prompt): its count and its text disagree.
            assert not set(think_ids) & set(ids), ids
            assert n == 0 and rec["reasoning_spans"] == [], name
        elif k + 2 <= max_tokens:
            assert ids[0] == think_ids[0] and ids[k + 1] == think_ids[1], (name, ids)
            assert n == k and rec["reasoning_spans"] == [1, k + 1], name
            # vLLM's text parse: the reasoning is those positions, the content what follows
            assert vllm_reasoning == tok.decode(ids[1 : k + 1]), name
            assert (msg.get("content") or "") == tok.decode(ids[k + 2 :]), name
        else:  # cut inside the think section: every position after <think> is reasoning
            assert resp["choices"][0]["finish_reason"] == "length"
            assert n == max_tokens - 1 and rec["reasoning_spans"] == [1, max_tokens], name
            assert vllm_reasoning == tok.decode(ids[1:]) and not msg.get("content"), name
        span = span_spec(rec)
        assert span.attributes["gen_ai.usage.reasoning.output_tokens"] == n
        assert span.attributes.get("sparseety.lora.name") == (ADAPTER if model == ADAPTER else None)

    windows = [o.record for o in outputs if o.topic == USAGE and o.record["tenant"] == tenant]
    assert {(w["model"], w["lora_name"]) for w in windows} == {("tiny", ""), ("tiny", ADAPTER)}
    assert sum(w["requests"] for w in windows if w["lora_name"] == ADAPTER) == 3
    assert sum(w["requests"] for w in windows if w["lora_name"] == "") == 2

    with throwaway_store(chdb_config(tmp_path_factory)) as store:
        migrate(store)
        sink = ClickHouseSink(store)
        for i, rec in enumerate(ours.values()):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
        for i, w in enumerate(windows):
            sink.add(ev.USAGE_WINDOW, w, topic="usage", partition=0, offset=i)
        sink.flush()
        d = Decimal
        set_prices(
            store,
            [
                Price("tiny", "input", d("10"), 0),
                Price("tiny", "output", d("40"), 0),
                Price("tiny", "reasoning_output", d("20"), 0),
            ],
        )
        q = Queries(store)
        scope = Scope(tenants=(tenant,))
        rows = {r["adapter"]: r for r in q.cost(by=["model", "adapter"], scope=scope)}
        assert set(rows) == {"", ADAPTER} and {r["model"] for r in rows.values()} == {"tiny"}
        assert rows[ADAPTER]["requests"] == 3 and rows[""]["requests"] == 2
        for adapter, names in (
            ("", ("base-k3", "base-k6")),
            (ADAPTER, ("lora-k4", "lora-cut", "lora-plain")),
        ):
            recs = [ours[n] for n in names]
            reasoning = sum(r["reasoning_output_tokens"] for r in recs)
            assert rows[adapter]["reasoning_output_tokens"] == reasoning
            want = (
                sum(  # no cached_input price: a cache read costs what input costs
                    (r["scheduled_tokens"] - r["output_tokens"]) * d("10")
                    + r["cache_read_tokens"] * d("10")
                    + (r["output_tokens"] - r["reasoning_output_tokens"]) * d("40")
                    + r["reasoning_output_tokens"] * d("20")
                    for r in recs
                )
                / 1_000_000
            )
            assert rows[adapter]["cost_usd"] == want, adapter
        usage = {r["adapter"]: r["requests"] for r in q.usage(by=["adapter"], scope=scope)}
        assert usage == {"": 2, ADAPTER: 3}

        uid = ours["lora-k4"]["request_uid"]
        found = q.token_records(uid, per_position=True)
        assert found is not None and found["reasoning_output_tokens"] == 4
        kinds = [r["kind"] for r in found["records"]]
        prompt = ours["lora-k4"]["prompt_tokens"]
        # <think>, 4 reasoning positions, </think> and the 4-token answer
        assert kinds == ["prompt"] * prompt + ["output"] + ["reasoning"] * 4 + ["output"] * 5

        outliers = q.outliers(limit=2, scope=scope)
        top = [r for r in outliers if r["side"] == "top"]
        per_token = {  # each request's own cost (the request lookup) over its output
            r["request_uid"]: (q.request(r["request_uid"]) or {})["cost"]["actual"] / r["output_tokens"]
            for r in ours.values()
        }
        top_uids = [r["request_uid"] for r in top]
        assert len(top_uids) == 2 and per_token[top_uids[0]] >= per_token[top_uids[1]]
        assert all(per_token[t] >= v for t in top_uids for u, v in per_token.items() if u not in top_uids)
        for r in outliers:  # the length cut is a reason exactly where vLLM said finish_reason length
            name = next(n for n, rec in ours.items() if rec["request_uid"] == r["request_uid"])
            length = responses[name]["choices"][0]["finish_reason"] == "length"
            assert ("cut_by_limit" in r["reasons"]) == length, (name, r["reasons"])
        summary = {r["feature"]: r for r in q.outliers(limit=2, summary=1, scope=scope)}
        assert summary["cut_by_limit"]["tail_with"] + summary["cut_by_limit"]["rest_with"] == sum(
            r["choices"][0]["finish_reason"] == "length" for r in responses.values()
        )


# --- the bill of 2026 (issue 36): cache writes, service tier, priority -----------------------


def _bill_2026_run(
    server: ServerEngine,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Any]]:
    """Chat requests on the real server, then the fold of their events: ``(responses, records,
    events)`` by case name. A cold prompt, its repeat, an extension of it, two copies of a new
    prompt sent together (they may be computed in one step), and the service tiers, cache
    retention and priorities the clients asked for."""
    from sparseety.config import WorkerConfig
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    tag = f"w{random.randrange(1 << 30):x}"
    tenant = f"bill-{tag}"
    base = f"Tag {tag}. " + SYSTEMS[4] + SYSTEMS[1]
    other = f"Other {tag}. " + SYSTEMS[3] + SYSTEMS[2]
    # (prompt, extra body)
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "cold": (base, {"service_tier": "flex"}),
        "repeat": (base, {"service_tier": "priority", "priority": 3}),
        "extend": (base + " Then summarise everything twice. " * 4, {"prompt_cache_retention": "24h"}),
        "twin-a": (other, {"priority": -2}),
        "twin-b": (other, {}),
    }

    def body(name: str) -> dict[str, Any]:
        prompt, extra = cases[name]
        return {
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 3,
            "temperature": 0,
            "vllm_xargs": {"tenant": tenant},
            **extra,
        }

    responses: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name in ("cold", "repeat", "extend"):  # one after the other: each sees the last's writes
            responses[name] = _chat(client, body(name), {"X-Request-Id": f"{tag}-{name}"})
        with ThreadPoolExecutor(2) as pool:  # together: both may compute the same new blocks
            twins = pool.map(
                lambda n: (n, _chat(client, body(n), {"X-Request-Id": f"{tag}-{n}"})), ("twin-a", "twin-b")
            )
            responses.update(twins)
    externals = {f"chatcmpl-{tag}-{n}": n for n in cases}

    def complete(events: list[dict[str, Any]]) -> bool:
        return set(externals) <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}

    events = engine_events(server.cfg, complete, timeout=90)
    asm = Assembler(WorkerConfig(window_s=1, allowed_lateness_s=0), MemoryStore())
    outputs = [o for e in events for o in asm.apply(e)]
    by_rid = {o.record["request_id"]: o.record for o in outputs if o.topic == TIMELINES}
    records = {name: by_rid[engine_rid(events, ext)] for ext, name in externals.items()}
    return responses, records, events


@pytest.fixture(scope="module")
def bill_2026(server: ServerEngine) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Any]]:
    return _bill_2026_run(server)


def test_cache_writes_per_request_equal_vllms_created_cache_tokens(
    bill_2026: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Any]],
) -> None:
    """Per request, ``cache_write_tokens`` (folded from the request's computed prompt blocks and
    the engine's KV events: the blocks whose cache entry it began) equals vLLM's own
    ``usage.prompt_tokens_details.created_cache_tokens``, and the engine's count travels as
    ``engine_cache_write_tokens``. Two copies of one prompt computed in the same step are the one
    documented difference: vLLM counts the duplicate block for both, SparSEEty one entry."""
    responses, records, _ = bill_2026
    bs = 32
    for name, resp in responses.items():
        details = resp["usage"]["prompt_tokens_details"]
        created, cached = details["created_cache_tokens"], details["cached_tokens"]
        rec = records[name]
        assert rec["engine_cache_write_tokens"] == created, name
        assert rec["cache_read_tokens"] == cached, name
        prompt = resp["usage"]["prompt_tokens"]
        # vLLM's rule, restated: the prompt's full blocks, less what was cached at admission
        assert created == prompt // bs * bs - cached, (name, prompt, cached)
        # every write is a computed position, never a read one
        assert (
            rec["cache_write_tokens"] <= rec["uncached_computed_tokens"] + rec["recomputed_eviction_tokens"]
        )
        if name.startswith("twin"):
            continue
        assert rec["cache_write_tokens"] == created, (name, rec["cache_write_tokens"], created)
    assert records["cold"]["cache_write_tokens"] > 0
    assert records["repeat"]["cache_write_tokens"] == 0 and records["repeat"]["cache_read_tokens"] > 0
    assert 0 < records["extend"]["cache_write_tokens"] < records["cold"]["cache_write_tokens"] + 4 * bs
    a, b = (responses[n]["usage"]["prompt_tokens_details"] for n in ("twin-a", "twin-b"))
    ours = records["twin-a"]["cache_write_tokens"] + records["twin-b"]["cache_write_tokens"]
    if a["cached_tokens"] == 0 and b["cached_tokens"] == 0:
        # computed together: vLLM says both created the blocks, the cache holds one entry each
        assert a["created_cache_tokens"] == b["created_cache_tokens"] > 0
        assert ours == a["created_cache_tokens"]
    else:  # one after the other: the second read the first's writes, both counts agree
        assert ours == a["created_cache_tokens"] + b["created_cache_tokens"]
        for n in ("twin-a", "twin-b"):
            created = responses[n]["usage"]["prompt_tokens_details"]["created_cache_tokens"]
            assert records[n]["cache_write_tokens"] == created, n


def test_service_tier_and_priority_per_request_from_the_api_edge_and_the_engine(
    bill_2026: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Any]],
) -> None:
    """``priority`` reaches the engine's request (vLLM's Request.priority), ``service_tier`` and
    ``prompt_cache_retention`` do not: the API server's middleware copies them into
    ``vllm_xargs``, and each record carries what its client asked for (vLLM 0.32's chat response
    does not echo the tier)."""
    _, records, events = bill_2026
    want = {
        "cold": ("flex", "", 0),
        "repeat": ("priority", "", 3),
        "extend": ("", "24h", 0),
        "twin-a": ("", "", -2),
        "twin-b": ("", "", 0),
    }
    for name, (tier, ttl, priority) in want.items():
        rec = records[name]
        assert (rec["service_tier"], rec["cache_ttl"], rec["priority"]) == (tier, ttl, priority), name
    started = [ev.payload(e) for e in events if ev.payload_type(e) == ev.REQUEST_STARTED]
    by_rid = {s["request_id"]: s for s in started}
    assert by_rid[records["repeat"]["request_id"]]["priority"] == 3
    assert by_rid[records["cold"]["request_id"]]["service_tier"] == "flex"


def test_cache_writes_and_service_tiers_priced_per_tier_in_the_store(
    bill_2026: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The real server's records in chDB, priced with a cache-write price, a TTL factor and
    service-tier factors: ``query cost --by service_tier`` is, per tier, the hand-computed bill
    of its requests (docs/cost-model.md, "The bill of 2026"), in list and actual mode."""
    from decimal import Decimal

    from sparseety.queries.registry import Queries, Scope
    from sparseety.sinks.clickhouse.migrate import migrate
    from sparseety.sinks.clickhouse.prices import Price, set_prices
    from sparseety.sinks.clickhouse.writer import ClickHouseSink
    from tests.helpers import chdb_config, throwaway_store

    _, records, _ = bill_2026
    d = Decimal
    factor = {"flex": 500_000, "priority": 2_000_000}  # micro
    ttl = {"24h": 2_000_000}
    p_in, p_cached, p_out, p_w = 10_000_000, 2_500_000, 40_000_000, 12_500_000  # micro-USD per 1M
    with throwaway_store(chdb_config(tmp_path_factory)) as store:
        migrate(store)
        sink = ClickHouseSink(store)
        for i, rec in enumerate(records.values()):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
        sink.flush()
        set_prices(
            store,
            [
                Price("tiny", "input", d("10"), 0),
                Price("tiny", "cached_input", d("2.5"), 0),
                Price("tiny", "output", d("40"), 0),
                Price("tiny", "cache_write", d("12.5"), 0),
                Price("tiny", "cache_write_ttl_multiplier", d("2"), 0, "", "24h"),
                Price("tiny", "service_tier_multiplier", d("0.5"), 0, "", "flex"),
                Price("tiny", "service_tier_multiplier", d("2"), 0, "", "priority"),
            ],
        )
        q = Queries(store)
        tenant = next(iter(records.values()))["tenant"]
        scope = Scope(tenants=(tenant,))
        for mode in ("actual", "list"):
            want: dict[str, int] = {}
            for rec in records.values():
                w = rec["cache_write_tokens"]
                premium = w * (p_w * ttl.get(rec["cache_ttl"], 1_000_000) // 1_000_000 - p_in)
                if mode == "actual":
                    base = (rec["scheduled_tokens"] - rec["output_tokens"]) * p_in + rec[
                        "cache_read_tokens"
                    ] * p_cached
                else:
                    hits = rec["engine_cached_tokens"]
                    base = (rec["prompt_tokens"] - hits) * p_in + hits * p_cached
                base += rec["output_tokens"] * p_out
                pico = (base + premium) * factor.get(rec["service_tier"], 1_000_000) // 1_000_000
                want[rec["service_tier"]] = want.get(rec["service_tier"], 0) + pico
            rows = {r["service_tier"]: r for r in q.cost(mode=mode, by=["service_tier"], scope=scope)}
            assert {t: int(r["cost_usd"] * 10**12) for t, r in rows.items()} == want, mode
            assert sum(r["cache_write_tokens"] for r in rows.values()) == sum(
                r["cache_write_tokens"] for r in records.values()
            )


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
