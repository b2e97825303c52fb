"""The vLLM plugin's logic without an engine: payload builders, the hot-path session with
stand-in scheduler objects, the KV tee, activation, privacy and the tenant middleware."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import PrivacyConfig
from sparseety.producers.privacy import PromptPolicy, token_hasher
from sparseety.producers.vllm import kv, plugin
from sparseety.producers.vllm.middleware import TenantHeaderMiddleware, with_tenant
from sparseety.producers.vllm.reasoning import ReasoningSplit, think_spans
from sparseety.producers.vllm.records import RecordBuilder, block_hash_bytes
from sparseety.producers.vllm.session import EngineSession
from sparseety.producers.vllm.stamp import STEP_STAMP


def _builder(**over: Any) -> RecordBuilder:
    kw: dict[str, Any] = {
        "policy": PromptPolicy(PrivacyConfig()),
        "served_model_name": "tiny",
        "block_size": 4,
        "hash_block_size": 4,
        "group_kinds": ["full_attention", "sliding_window"],
        "spec_enabled": True,
    }
    return RecordBuilder(**(kw | over))


def _req(rid: str, prompt: list[int], **over: Any) -> SimpleNamespace:
    sp = SimpleNamespace(max_tokens=8, extra_args=over.pop("extra_args", {"tenant": "acme"}))
    base = {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "num_prompt_tokens": len(prompt),
        "block_hashes": [bytes([i]) * 32 for i in range(len(prompt) // 4 + 2)],
        "sampling_params": sp,
        "lora_request": None,
        "priority": 0,
        "arrival_time": 1.5,
        "prefill_stats": SimpleNamespace(num_cached_tokens=4),
        "status": "RUNNING",
        "stop_reason": None,
        "num_output_tokens": 3,
        "num_preemptions": 0,
    }
    ns = SimpleNamespace(**(base | over))
    ns.is_finished = lambda: False
    ns.get_finished_reason = lambda: "FinishReason.LENGTH"
    return ns


def test_block_hash_bytes_is_vllms_int_form_written_out() -> None:
    h = bytes(range(32))
    as_int = int.from_bytes(h, "big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash
    assert block_hash_bytes(h) == block_hash_bytes(as_int) == as_int.to_bytes(8, "big") == h[-8:]
    assert block_hash_bytes(b"\x01") == b"\x00" * 7 + b"\x01"


def test_request_started_payload() -> None:
    b = _builder()
    kind, p = b.request_started(_req("r1-abc", list(range(10))), 4)
    assert kind == ev.REQUEST_STARTED
    assert p["prompt_token_ids"] == list(range(10)) and p["prompt_token_hashes"] == []
    assert p["block_hashes"] == [block_hash_bytes(bytes([i]) * 32) for i in range(2)]  # 10 // 4 full blocks
    assert (p["tenant"], p["model"], p["num_cached_tokens"], p["arrival_ts_ns"]) == (
        "acme",
        "tiny",
        4,
        1_500_000_000,
    )
    _, p = b.request_started(
        _req("r2", [1, 2], extra_args=None, lora_request=SimpleNamespace(lora_name="ad")), 0
    )
    assert (p["tenant"], p["model"], p["lora_name"], p["session_id"]) == (
        "",
        "tiny",
        "ad",
        "",
    )  # the base model; the adapter beside it
    _, p = b.request_started(_req("r3", [1, 2], extra_args={"tenant": "acme", "session": "conv-1"}), 0)
    assert (p["tenant"], p["session_id"]) == ("acme", "conv-1")
    # vLLM's own session id (body session_id, X-Session-ID header) comes first
    _, p = b.request_started(_req("r4", [1, 2], extra_args={"session": "ours"}, session_id="vllm"), 0)
    assert p["session_id"] == "vllm"


def test_privacy_modes() -> None:
    key = "k" * 16
    hashed = PromptPolicy(PrivacyConfig(mode="hashed", key=key)).fields([5, 6, 5])
    assert hashed[0] == [] and hashed[1][0] == hashed[1][2] != hashed[1][1]
    assert hashed[1] == token_hasher(key)([5, 6, 5]) != token_hasher("j" * 16)([5, 6, 5])
    assert PromptPolicy(PrivacyConfig(mode="none")).fields([5]) == ([], [])
    assert PromptPolicy(PrivacyConfig()).fields([5]) == ([5], [])


def _so(new: list[tuple[str, int]], cached: list[tuple[str, int]], nst: dict[str, int], **over: Any) -> Any:
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(nst.values()),
        num_scheduled_tokens=nst,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            num_computed_tokens=[c for _, c in cached],
            resumed_req_ids=over.pop("resumed", set()),
        ),
        scheduled_spec_decode_tokens=over.pop("spec", {}),
        preempted_req_ids=over.pop("preempted", None),
    )


class _Recorder:
    def __init__(self) -> None:
        self.items: list[tuple[Any, tuple[Any, ...]]] = []
        self.engine_name, self.epoch, self.engine_id = "e", "1", "e@1"

    def emit(self, build: Any, *args: Any) -> None:
        self.items.append((build, args))

    def emit_many(self, count: int, build: Any, *args: Any) -> None:
        built = build(*args)
        assert len(built) == count
        for item in built:
            self.items.append((lambda item=item: item, ()))

    def emit_record(self, payload_type: str, payload: dict[str, Any]) -> None:
        self.items.append((lambda: (payload_type, payload), ()))

    def close(self, timeout: float | None = None) -> None:
        pass

    def built(self) -> list[tuple[str, dict[str, Any]]]:
        return [build(*args) for build, args in self.items]


def _session(requests: dict[str, Any]) -> tuple[EngineSession, _Recorder]:
    rec = _Recorder()
    sched = SimpleNamespace(requests=requests)
    return EngineSession(None, sched, rec, _builder()), rec  # type: ignore[arg-type]


def _out(tokens: dict[str, list[int]], cached: dict[str, int] | None = None) -> dict[int, Any]:
    cached = cached or {}
    outs = [
        SimpleNamespace(
            request_id=r,
            new_token_ids=t,
            prefill_stats=SimpleNamespace(num_cached_tokens=cached[r]) if r in cached else None,
        )
        for r, t in tokens.items()
    ]
    return {0: SimpleNamespace(outputs=outs)}


def test_one_step_orders_admission_step_and_finish() -> None:
    a, b = _req("a", list(range(9))), _req("b", list(range(5)))
    s, rec = _session({"a": a, "b": b})
    so = _so([("a", 4)], [("b", 5)], {"a": 5, "b": 4}, spec={"b": [7, 8, 9]}, resumed={"b"})
    s.on_schedule(so, 100)
    assert getattr(so, STEP_STAMP) == ("e", "1", 0)
    s.on_free(b)  # never admitted in this session: nothing to report
    mro = SimpleNamespace(sampled_token_ids=[[1], [2, 3, 4]], req_id_to_index={"a": 0, "b": 1})
    spec = s.before_update(so, mro)
    assert spec == {"b": (3, 2)}
    s.on_free(a)  # finishes inside update_from_output wait for the StepBatch
    s.after_update(so, _out({"a": [1], "b": [2, 3]}, {"a": 4}), spec, 350)
    kinds = [k for k, _ in rec.built()]
    assert kinds == [ev.REQUEST_STARTED, ev.STEP_BATCH, ev.REQUEST_FINISHED]
    step = rec.built()[1][1]
    assert step["req_ids"] == ["a", "b"]
    assert step["num_scheduled_tokens"] == [5, 4] and step["num_computed_before"] == [4, 5]
    assert step["num_new_tokens"] == [1, 2] and step["new_token_ids"] == [1, 2, 3]
    assert step["spec_proposed"] == [0, 3] and step["spec_accepted"] == [0, 2]
    assert step["resumed_req_ids"] == ["b"] and (step["start_mono_ns"], step["duration_ns"]) == (100, 250)
    fin = rec.built()[2][1]
    assert (fin["request_id"], fin["finish_reason"], fin["num_cached_tokens"]) == ("a", "length", 4)
    assert fin["output_block_hashes"] == [block_hash_bytes(h) for h in a.block_hashes[2:]]
    ev.validate_engine_event(
        ev.envelope(
            engine_name="e",
            engine_id_="e@1",
            stream="core",
            seq=0,
            ts_ns=0,
            mono_ns=0,
            payload_type=ev.STEP_BATCH,
            payload=step,
        )
    )


@pytest.mark.parametrize("mode", ["hashed", "none"])
def test_output_ids_leave_the_engine_only_in_raw_mode(mode: str) -> None:
    policy = PromptPolicy(PrivacyConfig(mode=mode, key="k" * 16 if mode == "hashed" else None))
    so = _so([("a", 4)], [("b", 5)], {"a": 5, "b": 4})
    _, step = _builder(policy=policy, spec_enabled=False).step(
        so, _out({"a": [1], "b": [2, 3]}), None, 0, 100, 350, frozenset()
    )
    assert step["num_new_tokens"] == [1, 2] and step["new_token_ids"] == []


def test_empty_steps_carry_preemptions_and_aborts_go_out_at_once() -> None:
    a = _req("a", list(range(4)))
    s, rec = _session({"a": a})
    s.on_schedule(_so([], [], {}, preempted={"x"}), 1)  # nothing scheduled: no step number used
    so = _so([("a", 0)], [], {"a": 4})
    s.on_schedule(so, 2)
    s.after_update(
        so, _out({}), s.before_update(so, SimpleNamespace(sampled_token_ids=[], req_id_to_index={})), 3
    )
    assert rec.built()[1][1]["preempted_req_ids"] == ["x"] and rec.built()[1][1]["step"] == 0
    s.on_free(a)  # an abort between steps
    assert [k for k, _ in rec.built()][-1] == ev.REQUEST_FINISHED


def test_kv_tee_forwards_then_publishes_and_survives_errors() -> None:
    published: list[Any] = []
    inner = SimpleNamespace(publish=published.append, shutdown=lambda: None, marker=1)
    seen: list[Any] = []
    tee = kv.KvTee(inner, SimpleNamespace(on_kv_batch=seen.append))
    tee.publish("batch")
    assert seen == ["batch"] == published and tee.marker == 1

    def boom(_: Any) -> None:
        raise RuntimeError("x")

    tee = kv.KvTee(inner, SimpleNamespace(on_kv_batch=boom))
    tee.publish("b2")
    assert published[-1] == "b2"


def _kv(name: str, **fields: Any) -> Any:
    return type(name, (SimpleNamespace,), {})(**fields)


def test_kv_event_payloads() -> None:
    b = _builder()
    stored = _kv(
        "BlockStored",
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
        group_idx=1,
    )
    kind, p = b.kv_event(stored)
    assert kind == ev.KV_STORED and p["block_hashes"] == [block_hash_bytes(1), block_hash_bytes(2)]
    assert (p["num_tokens"], p["group_kind"], p["sliding_window"]) == (8, "sliding_window", 64)
    kind, p = b.kv_event(
        _kv("BlockRemoved", block_hashes=[b"\x00" * 24 + b"\x07" * 8], medium=None, group_idx=1)
    )
    assert (
        kind == ev.KV_REMOVED and p["group_kind"] == "sliding_window" and p["block_hashes"] == [b"\x07" * 8]
    )
    assert b.kv_event(_kv("AllBlocksCleared"))[0] == ev.KV_CLEARED


def test_register_is_inert_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    for var in ("SPARSEETY_CONFIG", "SPARSEETY_KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(var, raising=False)
    plugin.register()
    assert calls == []
    monkeypatch.setenv("SPARSEETY_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    plugin.register()
    assert calls == [1]


def test_register_never_raises_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "install", broken)
    monkeypatch.setenv("SPARSEETY_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="sparseety"):
        plugin.register()
    assert "vLLM plugin disabled" in caplog.text and "boom" in caplog.text


def test_a_missing_seam_is_one_log_line_and_nothing_is_patched(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "_version", lambda: "9.9")

    class Scheduler:  # an imagined vLLM without update_from_output
        def __init__(self) -> None: ...
        def schedule(self) -> None: ...
        def _free_request(self, r: Any) -> None: ...
        def shutdown(self) -> None: ...

    with caplog.at_level(logging.WARNING, logger="sparseety"):
        assert plugin._on_scheduler_module(SimpleNamespace(Scheduler=Scheduler)) == []
    assert "has no Scheduler.update_from_output" in caplog.text and "covers vLLM 0.32" in caplog.text
    assert not getattr(Scheduler.schedule, "_sparseety", False)


def test_modules_are_patched_when_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sparseety_fake_vllm_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []
    plugin.after_import("sparseety_fake_vllm_mod", lambda m: seen.append(m.VALUE))
    assert seen == []  # nothing is imported eagerly
    import sparseety_fake_vllm_mod

    assert seen == [1]
    plugin.after_import("sparseety_fake_vllm_mod", lambda m: seen.append(m.VALUE + 1))
    assert seen == [1, 2]  # already imported: at once
    del sys.modules["sparseety_fake_vllm_mod"]
    import sparseety_fake_vllm_mod  # noqa: F401, F811

    assert seen == [1, 2]  # each hook fired once, then stepped aside


def test_a_failing_hook_does_not_break_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "sparseety_fake_vllm_mod2.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin.after_import("sparseety_fake_vllm_mod2", lambda m: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="sparseety"):
        import sparseety_fake_vllm_mod2

    assert sparseety_fake_vllm_mod2.VALUE == 1
    assert "could not hook sparseety_fake_vllm_mod2" in caplog.text


def test_tenant_header_middleware_rewrites_the_body() -> None:
    assert json.loads(with_tenant(b'{"vllm_xargs": {"tenant": "x", "k": 1}}', "acme")) == {
        "vllm_xargs": {"tenant": "acme", "k": 1}
    }
    assert with_tenant(b"not json", "acme") == b"not json"
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["body"] = (await receive())["body"]
        seen["length"] = dict(scope["headers"])[b"content-length"]

    mw = TenantHeaderMiddleware(app)
    body = b'{"model": "m"}'
    chunks = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-length", b"14"), (b"x-sparseety-tenant", b"gw")],
    }
    asyncio.run(mw(scope, receive, None))
    assert json.loads(seen["body"]) == {"model": "m", "vllm_xargs": {"tenant": "gw"}}
    assert seen["length"] == str(len(seen["body"])).encode()


def test_session_header_middleware_sets_the_session_beside_the_tenant() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["body"] = (await receive())["body"]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"vllm_xargs": {"session": "old", "k": 1}}'}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"X-Sparseety-Session", b"conv-7"), (b"x-sparseety-tenant", b"gw")],
    }
    asyncio.run(TenantHeaderMiddleware(app)(scope, receive, None))
    assert json.loads(seen["body"]) == {"vllm_xargs": {"session": "conv-7", "k": 1, "tenant": "gw"}}


def test_middleware_copies_service_tier_and_cache_retention_from_the_body() -> None:
    """The engine never sees ``service_tier`` or ``prompt_cache_retention``: the middleware copies
    them into ``vllm_xargs`` (issue 36), without any header; a body without them is passed on
    byte for byte, unparsed."""
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])

    def run(body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body}

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers or []}
        asyncio.run(TenantHeaderMiddleware(app)(scope, receive, None))
        return seen[-1]

    got = json.loads(run(b'{"model": "m", "service_tier": "flex", "prompt_cache_retention": "24h"}'))
    assert got["vllm_xargs"] == {"service_tier": "flex", "cache_ttl": "24h"}
    assert got["service_tier"] == "flex"  # the API still gets its own field
    got = json.loads(
        run(b'{"service_tier": "priority", "vllm_xargs": {"k": 1}}', [(b"x-sparseety-tenant", b"gw")])
    )
    assert got["vllm_xargs"] == {"k": 1, "service_tier": "priority", "tenant": "gw"}
    plain = b'{"model":  "m", "priority": 2}'
    assert run(plain) == plain
    assert run(b'{"service_tier": 3}') == b'{"service_tier": 3}'  # not a tier name: left alone


def test_routing_counts_top_k_per_request_and_layer() -> None:
    import torch

    from sparseety.producers.vllm.routing import routing_counts

    # 3 tokens: request a owns rows 0-1, request b row 2; 4 experts, top-2, two layers.
    layer0 = torch.tensor([[9.0, 8.0, 0.0, 0.0], [0.0, 9.0, 8.0, 0.0], [0.0, 0.0, 8.0, 9.0]]).to(
        torch.bfloat16
    )
    layer1 = torch.tensor([[0.0, 0.0, 5.0, 9.0], [0.0, 0.0, 8.0, 9.0], [9.0, 8.0, 0.0, 0.0]])
    kind, p = routing_counts(7, ["a", "b"], [0, 2, 3, 3], [(1, layer1), (0, layer0)], 4, 2)
    assert kind == ev.MOE_ROUTING and (p["step"], p["num_layers"], p["num_experts"]) == (7, 2, 4)
    a0, a1, b0, b1 = (p["expert_counts"][i * 4 : (i + 1) * 4] for i in range(4))
    assert (a0, a1) == ([1, 2, 1, 0], [0, 0, 2, 2])
    assert sum(a1) == 2 * 2 and (b0, b1) == ([0, 0, 1, 1], [1, 1, 0, 0])


def _reference_columns(so: Any, outputs: Any, spec: dict[str, tuple[int, int]] | None) -> dict[str, Any]:
    """StepBatch's per-request columns by their definition, one request at a time."""
    rids = list(so.num_scheduled_tokens)
    before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    new_tokens = {}
    for core_outputs in outputs.values():
        for output in core_outputs.outputs:
            if output.new_token_ids:
                new_tokens[output.request_id] = output.new_token_ids
    num_new, token_ids = [], []
    for r in rids:
        tokens = new_tokens.get(r) or []
        num_new.append(len(tokens))
        token_ids.extend(tokens)
    spec = spec or {}
    return {
        "req_ids": rids,
        "num_scheduled_tokens": [so.num_scheduled_tokens[r] for r in rids],
        "num_computed_before": [before.get(r, 0) for r in rids],
        "num_new_tokens": num_new,
        "new_token_ids": token_ids,
        "spec_proposed": [spec[r][0] if r in spec else 0 for r in rids],
        "spec_accepted": [spec[r][1] if r in spec else 0 for r in rids],
    }


@pytest.mark.parametrize("seed", range(40))
def test_step_columns_match_their_definition(seed: int) -> None:
    # The builder takes shortcuts (the steady decode state, C-level map calls); whatever the
    # shape of the step (admissions, reordered or missing outputs, several clients, partial
    # drafts), its columns are the ones the definition gives.
    import random

    rng = random.Random(seed)
    rids = [f"r{i}" for i in range(rng.randint(0, 12))]
    new = [(r, rng.randint(0, 50)) for r in rids if rng.random() < 0.3]
    cached = [(r, rng.randint(0, 500)) for r in rids if r not in dict(new)]
    if rng.random() < 0.3:
        rng.shuffle(cached)
    if cached and rng.random() < 0.2:
        cached.append(("gone", 7))  # a cached entry not scheduled any more
    so = _so(new, cached, {r: rng.randint(1, 9) for r in rids})
    clients: dict[int, Any] = {}
    for r in rids:
        if rng.random() < 0.8:
            tokens = [rng.randint(0, 99) for _ in range(rng.randint(0, 3))]
            out = SimpleNamespace(request_id=r, new_token_ids=tokens, prefill_stats=None)
            clients.setdefault(rng.randint(0, 1), SimpleNamespace(outputs=[])).outputs.append(out)
    for c in clients.values():
        if rng.random() < 0.3:
            rng.shuffle(c.outputs)
    spec = {r: (3, rng.randint(0, 3)) for r in rids if rng.random() < 0.5} if seed % 2 else None
    _, step = _builder().step(so, clients, spec, 0, 0, 1, frozenset())
    want = _reference_columns(so, clients, spec)
    assert {k: step[k] for k in want} == want
    steady = SimpleNamespace(**vars(so))
    steady.scheduled_new_reqs = []
    steady.scheduled_cached_reqs = SimpleNamespace(
        req_ids=list(rids), num_computed_tokens=[rng.randint(0, 500) for _ in rids], resumed_req_ids=set()
    )
    _, step = _builder().step(steady, clients, spec, 0, 0, 1, frozenset())
    want = _reference_columns(steady, clients, spec)
    assert {k: step[k] for k in want} == want


def test_request_finished_carries_the_reasoning_positions() -> None:
    """The positions inside the parser's think delimiters (vLLM's count rule), checked against the
    parser's own count; without a parser, or when it counts otherwise, None: not observed."""

    class Parser:  # what the split reads of vLLM's BaseThinkingReasoningParser
        start_token_id, end_token_id = 8, 9

        def count_reasoning_tokens(self, ids: list[int]) -> int:  # vLLM's depth-counter rule
            count = depth = 0
            for t in ids:
                if t in (8, 9):
                    depth = depth + 1 if t == 8 else max(0, depth - 1)
                else:
                    count += depth > 0
            return count

    b = _builder(reasoning=ReasoningSplit("think", Parser()))
    _, p = b.request_finished(_req("r1", [1, 2], output_token_ids=[8, 5, 5, 9, 4, 4]))
    assert p["reasoning_spans"] == [1, 3]  # <think> 5 5 </think>, then a 2-token answer
    _, p = b.request_finished(_req("r2", [1, 2], output_token_ids=[8, 5, 5]))
    assert p["reasoning_spans"] == [1, 3]  # cut inside the think section
    _, p = b.request_finished(_req("r2b", [1, 2], output_token_ids=[4, 4]))
    assert p["reasoning_spans"] == []  # observed: no reasoning
    _, p = _builder().request_finished(_req("r3", [1, 2], output_token_ids=[8, 9, 4]))
    assert p["reasoning_spans"] is None

    class Other(Parser):
        def count_reasoning_tokens(self, ids: list[int]) -> int:
            return len(ids)

    _, p = _builder(reasoning=ReasoningSplit("x", Other())).request_finished(
        _req("r4", [1], output_token_ids=[8, 1, 9, 2])
    )
    assert p["reasoning_spans"] is None
    assert ReasoningSplit("y", object()).name is None  # no think tokens: not observed
    assert ReasoningSplit.of_scheduler(SimpleNamespace()).name is None  # no parser configured
    assert think_spans([8, 1, 8, 2, 9, 3, 9, 4, 8, 5], 8, 9) == [1, 2, 3, 4, 5, 6, 9, 10]


def test_hit_sources_split_an_admission_by_the_connectors_tiers() -> None:
    """RequestStarted.cached_tokens_by_source: the local hit as device, then the connector's own
    split of its tokens (vLLM's CacheHitSource values); a part it leaves out is
    external_unspecified; a connector that fails or has no such method reports nothing."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from sparseety.producers.vllm.session import hit_sources

    class Connector:
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        def get_external_cache_hit_sources(self, req: Any, n: int) -> Any:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    req = object()
    assert hit_sources(None, req, 64, 0) == {"device": 64}
    assert hit_sources(Connector({CacheHitSource.HOST: 96}), req, 160, 96) == {"device": 64, "host": 96}
    assert hit_sources(Connector({CacheHitSource.HOST: 32}), req, 96, 64) == {
        "device": 32,
        "host": 32,
        "external_unspecified": 32,
    }
    assert hit_sources(Connector(RuntimeError("bug")), req, 96, 64) is None
    assert hit_sources(Connector({CacheHitSource.HOST: 99}), req, 96, 64) is None  # more than loaded
    assert hit_sources(object(), req, 96, 64) is None
