"""The demo's engine checks (sparseety/stack/engine_checks.py): stored counts against what vLLM
returned and counted. Pure logic over hand-made rows here; the real comparison runs in
tests/e2e/test_demo.py against a real engine."""

from __future__ import annotations

from typing import Any

from sparseety.stack.engine_checks import check_engine_counters, same_text

STORED = [
    {"tenant": "acme", "prompt_tokens": 10, "output_tokens": 4, "engine_cached_tokens": 2,
     "draft_accepted_tokens": 3, "draft_rejected_tokens": 2, "draft_cut_tokens": 2,
     "draft_unverified_tokens": 1, "preemptions": 1},
    {"tenant": "acme", "prompt_tokens": 6, "output_tokens": 2, "engine_cached_tokens": 0,
     "draft_accepted_tokens": 0, "draft_cut_tokens": 0, "preemptions": 0},
]  # fmt: skip
ENGINE: dict[str, Any] = {
    "requests": [  # vLLM's answers (RequestOutput); no reasoning parser
        {
            "tenant": "acme",
            "prompt_tokens": 10,
            "output_tokens": 4,
            "num_cached_tokens": 2,
            "reasoning_tokens": None,
        },
        {
            "tenant": "acme",
            "prompt_tokens": 6,
            "output_tokens": 2,
            "num_cached_tokens": 0,
            "reasoning_tokens": None,
        },
    ],
    "metrics": {
        # 3 accepted + the stop-cut one: vLLM counts it as accepted, the unverified one nowhere
        "vllm:spec_decode_num_accepted_tokens": 4,
        "vllm:spec_decode_num_draft_tokens": 6,  # 3 + 2 rejected + the stop-cut one
        "vllm:num_preemptions": 1,
        "vllm:prompt_tokens_by_source|source=local_cache_hit": 2,
    },
}


def test_agreeing_counts_pass() -> None:
    assert check_engine_counters(STORED, ENGINE) == []


def test_each_disagreement_is_named() -> None:
    engine = {**ENGINE, "metrics": {**ENGINE["metrics"], "vllm:num_preemptions": 3}}
    del engine["metrics"]["vllm:spec_decode_num_accepted_tokens"]
    engine["requests"] = [{**ENGINE["requests"][0], "prompt_tokens": 11}, ENGINE["requests"][1]]
    assert check_engine_counters(STORED, engine) == [
        "tenant acme: prompt_tokens 16 stored, 17 from the engine",
        "accepted drafts: the engine did not report vllm:spec_decode_num_accepted_tokens",
        "preemptions: 1 stored, 3 counted by vLLM (vllm:num_preemptions)",
    ]


def test_reasoning_is_compared_with_the_parsers_count() -> None:
    stored = [{**STORED[0], "reasoning_output_tokens": 5}, STORED[1]]
    engine = {**ENGINE, "requests": [{**ENGINE["requests"][0], "reasoning_tokens": 4}, ENGINE["requests"][1]]}
    assert check_engine_counters(stored, engine) == [
        "tenant acme: reasoning 5 stored, 4 counted by vLLM's parser"
    ]


def test_a_withheld_incomplete_utf8_tail_is_the_same_text() -> None:
    assert same_text("héllo\ufffd", "héllo")
    assert not same_text("hello!", "hello")


def test_cache_writes_and_tiers_are_compared_with_vllms_own() -> None:
    """Issue 36: per tenant the engine's cache-write count the plugin carried = vLLM's
    RequestOutput.num_cache_creation_tokens, SparSEEty's own at most that; engine-wide the gpu
    tier's admission hits (engine_cached_tokens less the other tiers) and the CPU offload tier =
    vllm:prompt_tokens_cached_by_source{device, host}."""
    stored = [
        {
            **STORED[0],
            "cache_write_tokens": 0,
            "engine_cache_write_tokens": 0,
            "cache_read_cpu_offload_tokens": 0,
        },
        {**STORED[1], "engine_cached_tokens": 4, "cache_read_cpu_offload_tokens": 4, "cache_write_tokens": 2},
    ]
    stored[1]["engine_cache_write_tokens"] = 2
    engine = {
        "requests": [
            {**ENGINE["requests"][0], "num_cache_creation_tokens": 0},
            {**ENGINE["requests"][1], "num_cached_tokens": 4, "num_cache_creation_tokens": 2},
        ],
        "metrics": {
            **ENGINE["metrics"],
            "vllm:prompt_tokens_by_source|source=local_cache_hit": 2,  # the offloaded 4 are not local
            "vllm:prompt_tokens_cached_by_source|source=device": 2,
            "vllm:prompt_tokens_cached_by_source|source=host": 4,
        },
    }
    assert check_engine_counters(stored, engine) == []
    stored[1]["cache_write_tokens"] = 3
    stored[1]["engine_cache_write_tokens"] = 1
    engine["metrics"]["vllm:prompt_tokens_cached_by_source|source=host"] = 5
    assert check_engine_counters(stored, engine) == [
        "tenant acme: cache writes 1 carried, 2 counted by vLLM",
        "tenant acme: cache writes 3 folded, more than vLLM's 2",
        "cached (host): 4 stored, 5 counted by vLLM (vllm:prompt_tokens_cached_by_source|source=host)",
    ]


def test_a_whole_prompt_loaded_from_the_cpu_tier_gives_its_last_token_back() -> None:
    """A 6-token prompt the CPU tier loaded whole: vLLM counts 6 cached (num_cached_tokens, host
    6), then computes the last token again; the fold counts it computed, the CPU tier 5
    (docs/streams.md, "Hits the engine gives back"). The checks add it back to vLLM's side:
    device = cached less the tiers less 1, host = the CPU tier + 1."""
    stored = [
        {**STORED[0], "cache_write_tokens": 0, "engine_cache_write_tokens": 0},
        {
            **STORED[1],
            "engine_cached_tokens": 6,
            "cache_read_cpu_offload_tokens": 5,
            "engine_cache_write_tokens": 0,
        },
    ]
    engine = {
        "requests": [
            {**ENGINE["requests"][0], "num_cache_creation_tokens": 0},
            {**ENGINE["requests"][1], "num_cached_tokens": 6, "num_cache_creation_tokens": 0},
        ],
        "metrics": {
            **ENGINE["metrics"],
            "vllm:prompt_tokens_by_source|source=local_cache_hit": 2,
            "vllm:prompt_tokens_cached_by_source|source=device": 2,
            "vllm:prompt_tokens_cached_by_source|source=host": 6,
        },
    }
    assert check_engine_counters(stored, engine) == []
    # the position counted twice (in the tier and computed), as the fold did before
    stored[1]["cache_read_cpu_offload_tokens"] = 6
    assert check_engine_counters(stored, engine) == [
        "cached (device): 1 stored, 2 counted by vLLM (vllm:prompt_tokens_cached_by_source|source=device)",
        "cached (host): 7 stored, 6 counted by vLLM (vllm:prompt_tokens_cached_by_source|source=host)",
        "cached: 1 stored, 2 counted by vLLM (vllm:prompt_tokens_by_source{source=local_cache_hit})",
    ]
