"""The vLLM plugin in a real engine (tiny Llama, multiprocess layout): tokens, cached tokens and
drafts equal vLLM's own numbers; KV events equal vLLM's ZMQ publisher's; seqs are gap-free."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import EnginePool, OfflineEngine, engine_config, start_offline, tiny_model
from tests.e2e.engine_events import ZmqKvSubscriber, engine_events, engine_rid, finished_ids, kv_view
from tests.helpers import accounting_store, free_port
from tests.recorded import reconstruct, seq_gaps

SYSTEM = [
    "You are a careful assistant for the serving fleet. Answer briefly and cite the report. " * 4,
    "The scheduler decides at every step which requests run and which blocks are freed. " * 4,
]
QUESTIONS = ["What is two plus two?", "Name three colours.", "Summarise the report, please.", "Why?"]


@pytest.fixture(scope="module")
def llama(engine_pool: EnginePool, broker: Config, e2e_dir: Path) -> OfflineEngine:
    def start() -> OfflineEngine:
        from vllm.config import KVEventsConfig

        cfg = engine_config(broker, e2e_dir / "llama", "llama")
        port = free_port()
        # vLLM binds wildcard endpoints and connects to others: bind, and subscribe over loopback.
        kv = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv"
        )
        llm = start_offline(
            cfg,
            tiny_model("llama"),
            enable_prefix_caching=True,
            block_size=32,
            max_model_len=512,
            num_gpu_blocks_override=64,
            max_num_seqs=16,
            enforce_eager=True,
            kv_events_config=kv,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
        )
        zmq = ZmqKvSubscriber(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)  # let the subscription reach the publisher before the first KV event
        return OfflineEngine(cfg, llm, zmq=zmq, on_close=zmq.close)

    return engine_pool.get("llama", start)  # type: ignore[no-any-return]


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            key = m.name + "".join(f"|{k}={v}" for k, v in sorted(m.labels.items()) if k == "source")
            out[key] = out.get(key, 0) + value
    return out


def _generate(
    engine: OfflineEngine, prompts: list[str], params: list[Any]
) -> tuple[list[Any], list[dict[str, Any]]]:
    outs = engine.llm.generate(prompts, params, use_tqdm=False)
    ids = {o.request_id for o in outs}

    def done(events: list[dict[str, Any]]) -> bool:
        ours = {r.rsplit("-", 1)[0] for r in finished_ids(events)}
        return ids <= ours

    return outs, engine_events(engine.cfg, done)


def test_tokens_and_cached_tokens_equal_request_output(llama: OfflineEngine) -> None:
    from vllm import SamplingParams

    prompts = [s + q for s in SYSTEM for q in QUESTIONS]
    params = [
        SamplingParams(max_tokens=8 + 5 * i, temperature=0, extra_args={"tenant": f"tenant-{i % 3}"})
        for i in range(len(prompts))
    ]
    first, _ = _generate(llama, prompts, params)
    # A second turn of each conversation: the first turn (prompt + answer) is its prefix.
    turn2 = [p + o.outputs[0].text + " And then?" for p, o in zip(prompts, first, strict=True)]
    second, events = _generate(llama, turn2, params)
    steps = reconstruct(events)
    cached_hits = 0
    for i, out in enumerate(first + second):
        rid = engine_rid(events, out.request_id)
        got = steps[rid]
        started, finished = got["started"], got["finished"]
        assert started["prompt_token_ids"] == list(out.prompt_token_ids)
        assert started["prompt_len"] == len(out.prompt_token_ids)
        assert got["output"] == list(out.outputs[0].token_ids)
        assert started["num_cached_tokens"] == out.num_cached_tokens
        assert finished["num_cached_tokens"] == out.num_cached_tokens
        assert finished["num_prompt_tokens"] == len(out.prompt_token_ids)
        assert finished["num_output_tokens"] == len(out.outputs[0].token_ids)
        assert finished["finish_reason"] == out.outputs[0].finish_reason
        assert started["tenant"] == f"tenant-{i % len(prompts) % 3}"
        assert len(started["block_hashes"]) == len(out.prompt_token_ids) // 32
        cached_hits += out.num_cached_tokens > 0
    assert cached_hits >= len(prompts)  # shared system prompts and second turns hit the cache


def test_accepted_drafts_equal_vllm_spec_decode_counter(llama: OfflineEngine) -> None:
    from vllm import SamplingParams

    before = _metrics(llama.llm)
    prompts = [("one two three four " * 6) + f"five {i}" for i in range(6)]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True) for _ in prompts]
    outs, events = _generate(llama, prompts, params)
    after = _metrics(llama.llm)
    steps = reconstruct(events)
    rids = [engine_rid(events, o.request_id) for o in outs]
    accepted = sum(steps[r]["accepted"] for r in rids)
    proposed = sum(steps[r]["proposed"] for r in rids)
    assert accepted > 0
    assert (
        accepted
        == after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    )
    assert (
        proposed == after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"]
    )
    for o, r in zip(outs, rids, strict=True):
        assert steps[r]["output"] == list(o.outputs[0].token_ids)
    started = [ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED]
    assert started[0]["spec_method"] == "ngram" and started[0]["spec_num_tokens"] == 3


def test_kv_events_equal_vllm_zmq_publisher_and_seqs_are_gap_free(llama: OfflineEngine) -> None:
    from vllm import SamplingParams

    # Distinct prompts of ~6 blocks each overflow the 64-block cache: blocks are evicted.
    prompts = [
        f"Request number {i}. " + ("The quick brown fox jumps over the lazy dog. " * 14) for i in range(30)
    ]
    _, events = _generate(llama, prompts, [SamplingParams(max_tokens=4, temperature=0) for _ in prompts])
    ours = kv_view(events)
    zmq = llama.extra["zmq"]
    deadline = time.monotonic() + 10
    while len(zmq.view()) < len(ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    theirs = zmq.view()
    assert any(k[0] == "removed" for k in ours), "the workload should evict blocks"
    assert ours == theirs
    stored = {h for k in ours if k[0] == "stored" for h in k[1]}
    started = [ev.payload(e) for e in events if ev.payload_type(e) == ev.REQUEST_STARTED]
    # RequestStarted carries the same byte form of block hashes as the KV events.
    assert {h for s in started for h in s["block_hashes"]} <= stored
    assert all(not gaps for gaps in seq_gaps(events).values())
    first = min(events, key=lambda e: e["seq"])
    assert ev.payload_type(first) == ev.ENGINE_STARTED
    assert {e["engine_id"] for e in events} == {first["engine_id"]}


# --- sessions (issue 14 part 2) -------------------------------------------------------------------

#: Every conversation opens with the same system prompt (3 blocks): sharing it must link nothing.
SESSION_SYSTEM = "You are the assistant of the serving fleet; answer each question from the report. " * 5


def _conversations(
    engine: OfflineEngine, tenant: str, openers: list[str], explicit: bool
) -> list[list[tuple[Any, list[int]]]]:
    """Three turns of each conversation, turn by turn: turn N's prompt is turn N-1's prompt and
    output token ids (as a client sends the exact transcript back) plus a new user message.
    Returns, per conversation, (vLLM's output, prompt ids) per turn."""
    from vllm import SamplingParams

    tok = engine.llm.get_tokenizer()
    prompts = [tok.encode(SESSION_SYSTEM + o, add_special_tokens=False) for o in openers]
    convs: list[list[tuple[Any, list[int]]]] = [[] for _ in openers]
    for n in range(3):
        # max_tokens >= the block size: the last full block of every turn holds output
        params = [
            SamplingParams(
                max_tokens=32,
                temperature=0,
                ignore_eos=True,
                extra_args={"tenant": tenant, **({"session": f"{tenant}-{i}"} if explicit else {})},
            )
            for i in range(len(openers))
        ]
        outs, _ = _generate(engine, [{"prompt_token_ids": p} for p in prompts], params)
        for i, out in enumerate(outs):
            convs[i].append((out, prompts[i]))
        follow = f" Thanks. Now question {n + 2}, please: why is that so?"
        prompts = [
            p + list(o.outputs[0].token_ids) + tok.encode(follow, add_special_tokens=False)
            for p, o in zip(prompts, outs, strict=True)
        ]
    return convs


def test_inferred_sessions_equal_the_explicit_ids_on_a_multi_turn_workload(
    llama: OfflineEngine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from sparseety.config import WorkerConfig
    from sparseety.queries.registry import Queries, Scope
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    with_ids = _conversations(llama, "sessions-a", ["Who runs it?", "What is a block?", "Name a GPU."], True)
    without = _conversations(llama, "sessions-b", ["Why cache?", "How big is it?", "Is it fast?"], False)
    events = engine_events(llama.cfg)
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    out = [o for e in sorted(events, key=lambda e: (e["stream"], e["seq"])) for o in asm.apply(e)]
    records = [o.record for o in out if o.topic == TIMELINES]

    def uids(convs: list[list[tuple[Any, list[int]]]]) -> set[tuple[str, ...]]:
        return {
            tuple(f"{records[0]['engine_id']}/{engine_rid(events, o.request_id)}" for o, _ in c)
            for c in convs
        }

    with accounting_store(tmp_path_factory, records) as store:
        q = Queries(store)

        def partition(tenant: str, source: str) -> set[tuple[str, ...]]:
            scope = Scope(tenants=(tenant,))
            found = set()
            for row in q.sessions(source=source, scope=scope):
                turns = q.sessions(source=source, session=row["session_id"], scope=scope)
                assert [t["turn"] for t in turns] == list(range(1, row["turns"] + 1))
                found.add(tuple(t["request_uid"] for t in turns))
            return found

        truth_a, truth_b = uids(with_ids), uids(without)
        assert all(len(c) == 3 for c in truth_a | truth_b)
        explicit = partition("sessions-a", "explicit")
        assert explicit == truth_a
        assert partition("sessions-a", "inferred") == explicit  # same workload, ids ignored
        assert partition("sessions-b", "inferred") == truth_b  # no ids sent at all
        assert partition("sessions-b", "explicit") == {(u,) for c in truth_b for u in c}

        # Cache reuse across turns, against vLLM's own num_cached_tokens per turn: turn N read
        # what turn N-1 computed (cached_N - cached_N-1) and, before that, what the earlier
        # turns computed (cached_N-1 - cached_1; turn 1 read the system prompt another
        # conversation computed, if any).
        for convs, tenant, source in (
            (with_ids, "sessions-a", "explicit"),
            (without, "sessions-b", "inferred"),
        ):
            for i, conv in enumerate(convs):
                cached = [o.num_cached_tokens for o, _ in conv]
                key = (
                    f"{tenant}-{i}" if source == "explicit" else next(u for c in uids([conv]) for u in c[:1])
                )
                turns = q.sessions(source=source, session=key, scope=Scope(tenants=(tenant,)))
                assert [t["cache_read_tokens"] for t in turns] == cached
                assert [t["prompt_tokens"] for t in turns] == [len(p) for _, p in conv]
                assert [t["output_tokens"] for t in turns] == [len(o.outputs[0].token_ids) for o, _ in conv]
                for n in (1, 2):
                    assert cached[n] > cached[n - 1]
                    assert turns[n]["cache_from_previous_turn_tokens"] == cached[n] - cached[n - 1], (
                        tenant,
                        i,
                        n,
                    )
                    assert turns[n]["cache_from_earlier_turns_tokens"] == cached[n - 1] - cached[0], (
                        tenant,
                        i,
                        n,
                    )
                (row,) = (
                    r
                    for r in q.sessions(source=source, scope=Scope(tenants=(tenant,)))
                    if r["session_id"] == key
                )
                assert row["explicit"] == (source == "explicit")
                assert row["cache_read_tokens"] == sum(cached)
                assert row["cache_from_previous_turn_tokens"] == cached[2] - cached[0]


def test_token_records_restore_vllm_ids_and_text(
    llama: OfflineEngine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 14 part 1: events -> the fold -> the store -> token records equal what vLLM returned.

    The draft workload (ngram speculation accepts drafts) runs twice, so the second run reads its
    prompts from the prefix cache: records show drafts and cached positions."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from sparseety.config import WorkerConfig
    from sparseety.queries.registry import Queries
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    prompts = [("one two three four " * 6) + f"five {i}" for i in range(6)]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True) for _ in prompts]
    first, _ = _generate(llama, prompts, params)
    second, events = _generate(llama, prompts, params)
    asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
    out = [o for e in sorted(events, key=lambda e: (e["stream"], e["seq"])) for o in asm.apply(e)]
    accounts = [o.record for o in out if o.topic == TIMELINES]
    model = str(tiny_model("llama"))
    tok = AutoTokenizer.from_pretrained(model)
    with accounting_store(tmp_path_factory, accounts) as store:
        q = Queries(store)
        drafts = cached = 0
        for o in first + second:
            uid = f"{events[0]['engine_id']}/{engine_rid(events, o.request_id)}"
            got = q.token_records(uid)
            assert got is not None and got["privacy"] == "raw" and got["content"] == "ids", uid
            assert got["prompt_token_ids"] == list(o.prompt_token_ids)
            assert got["output_token_ids"] == list(o.outputs[0].token_ids)
            # vLLM's incremental detokenizer withholds a trailing incomplete UTF-8 sequence (the
            # random-weight model emits byte tokens), which a whole decode shows as U+FFFD: the
            # texts are equal but for such a tail, and equal to a whole decode of vLLM's own ids.
            ours, theirs = got["output_text"], o.outputs[0].text
            assert ours == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
            assert ours.startswith(theirs) and set(ours[len(theirs) :]) <= {"\ufffd"}, (ours, theirs)
            assert got["prompt_text"] == tok.decode(o.prompt_token_ids, skip_special_tokens=True)
            assert got["prompt_text"].strip() == o.prompt.strip()
            each = q.token_records(uid, per_position=True)["records"]
            assert [r["token_id"] for r in each] == list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            assert [r["position"] for r in each] == list(range(len(each)))
            assert sum(r["is_input"] for r in each) == len(o.prompt_token_ids)
            assert sum(r["is_cached"] for r in each) >= (o.num_cached_tokens or 0)
            drafts += sum(r["is_draft"] for r in each)
            cached += sum(r["is_cached"] for r in each)
        assert drafts > 0 and cached > 0
