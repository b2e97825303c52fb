"""The recorded real-engine fixtures agree with vLLM's own ground truth recorded beside them
(and keep decoding with the current schemas)."""

from __future__ import annotations

from typing import Any

import pytest

from sparseety import events as ev
from tests.recorded import by_type, load_scenario, reconstruct, scenarios, seq_gaps

ALL = [
    "moe_routing",
    "preemption_eviction",
    "prefix_reuse",
    "prefix_reuse_again",
    "prefix_reuse_nocache",
    "sessions",
    "sliding_window",
    "sparsity_truth",
    "spec_ngram",
    "spec_ngram_again",
    "spec_ngram_off",
]


def test_every_scenario_is_recorded() -> None:
    # sglang_radix is SGLang's recording, checked against SGLang in tests/unit/test_sglang_recorded.py.
    assert scenarios() == sorted([*ALL, "sglang_radix"])


@pytest.mark.parametrize("name", ALL)
def test_events_equal_the_engine_ground_truth(name: str) -> None:
    events, truth = load_scenario(name)
    for e in events:
        ev.validate_engine_event(e)
    assert all(not gaps for gaps in seq_gaps(events).values())
    core = sorted((e for e in events if e["stream"] == ev.CORE_STREAM), key=lambda e: e["seq"])
    assert ev.payload_type(core[0]) == ev.ENGINE_STARTED
    assert ev.payload_type(core[-1]) == ev.ENGINE_STOPPED
    per_request = reconstruct(events)
    for want in truth["requests"]:
        got = per_request[want["engine_request_id"]]
        assert got["started"]["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["output"] == want["output_token_ids"]
        assert got["started"]["num_cached_tokens"] == want["num_cached_tokens"]
        assert got["finished"]["num_cached_tokens"] == want["num_cached_tokens"]
        assert got["finished"]["num_output_tokens"] == len(want["output_token_ids"])
        assert got["finished"]["finish_reason"] == want["finish_reason"]
        assert got["started"]["tenant"] == want["tenant"]
    cached = sum(r["num_cached_tokens"] for r in truth["requests"])
    assert cached == truth["metrics"]["vllm:prompt_tokens_by_source|source=local_cache_hit"]


def _metric(truth: dict[str, Any], name: str) -> Any:
    return truth["metrics"][name]


def test_spec_decoding_drafts_equal_vllm_counters() -> None:
    events, truth = load_scenario("spec_ngram")
    per_request = reconstruct(events)
    accepted = sum(r["accepted"] for r in per_request.values())
    proposed = sum(r["proposed"] for r in per_request.values())
    assert accepted == _metric(truth, "vllm:spec_decode_num_accepted_tokens") > 0
    assert proposed == _metric(truth, "vllm:spec_decode_num_draft_tokens") > accepted


def test_preemptions_and_evictions_recorded() -> None:
    events, truth = load_scenario("preemption_eviction")
    per_request = reconstruct(events)
    assert sum(r["preempted"] for r in per_request.values()) == _metric(truth, "vllm:num_preemptions") > 0
    assert sum(r["resumed"] for r in per_request.values()) == _metric(truth, "vllm:num_preemptions")
    assert by_type(events, ev.KV_REMOVED)


def test_sliding_window_groups_and_blocks() -> None:
    events, _ = load_scenario("sliding_window")
    started = by_type(events, ev.ENGINE_STARTED)[0]
    assert [(g["kind"], g["sliding_window"]) for g in started["kv_cache_groups"]] == [("sliding_window", 64)]
    stored = by_type(events, ev.KV_STORED)
    assert stored and {s["group_kind"] for s in stored} == {"sliding_window"}
    assert {s["sliding_window"] for s in stored} == {64}


def test_moe_routing_joins_every_step() -> None:
    events, _ = load_scenario("moe_routing")
    started = by_type(events, ev.ENGINE_STARTED)[0]
    top_k = started["moe_top_k"]
    routing = {r["step"]: r for r in by_type(events, ev.MOE_ROUTING)}
    steps = by_type(events, ev.STEP_BATCH)
    assert started["routing_capture"] and set(routing) == {s["step"] for s in steps}
    for step in steps:
        moe = routing[step["step"]]
        width = moe["num_layers"] * moe["num_experts"]
        for i, rid in enumerate(moe["req_ids"]):
            tokens = step["num_scheduled_tokens"][step["req_ids"].index(rid)]
            assert (
                sum(moe["expert_counts"][i * width : (i + 1) * width]) == tokens * top_k * moe["num_layers"]
            )
