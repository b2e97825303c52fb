"""Workloads the project never saw, for the engine-truth checks and the ``sparsity_truth`` fixture.

Prompts are token ids drawn from a seeded generator (exact lengths, no tokenizer dependence, not
the English text of the other workloads). Every engine runs the same four phases on a KV cache of
24 blocks of 32 tokens:

1. prefix sharing: four requests (two tenants) share a 128-token document and differ in their tail;
2. pressure: ten distinct 200-token prompts (60 blocks through the cache) evict phase 1;
3. return: phase 1's prompts again: blocks still cached are hits, evicted ones are recomputed;
4. preemption: six long decodes that together need far more blocks than the cache holds.

Phase 4's prompts repeat a short pattern so the ngram drafter (llama engine) has proposals.
An engine with ``second_turns`` runs, right after phase 1, each of its prompts again with a new
tail: a sliding-window-only model holds so few blocks per request that phase 3 finds nothing
left, and these second turns are its prefix-cache hits.
"""

from __future__ import annotations

import random
from typing import Any

BLOCK = 32  # the CPU attention backend needs a multiple of 32
CACHE_BLOCKS = 24

#: Engine kinds: tiny model kind and LLM arguments.
ENGINES: dict[str, dict[str, Any]] = {
    "llama": {
        "model": "llama",
        "engine": {
            "enable_prefix_caching": True,
            "block_size": BLOCK,
            "max_model_len": 256,
            "num_gpu_blocks_override": CACHE_BLOCKS,
            "max_num_seqs": 6,
            "enforce_eager": True,
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
        },
    },
    "hybrid": {
        "model": "gemma3-hybrid",
        "engine": {
            "enable_prefix_caching": True,
            "block_size": BLOCK,
            "max_model_len": 256,
            "num_gpu_blocks_override": CACHE_BLOCKS * 3,  # three groups share the pool
            "max_num_seqs": 6,
            "enforce_eager": True,
        },
    },
    # Sliding-window groups only (the demo's model family): vLLM caches only the blocks a later
    # hit can reach and counts the others in the hit without caching them.
    "sliding": {
        "model": "mistral-sw",
        "second_turns": True,
        # A request holds its window's blocks only, so phase 4's decodes fit in the cache.
        "preempts": False,
        "engine": {
            "enable_prefix_caching": True,
            "block_size": BLOCK,
            "max_model_len": 256,
            "num_gpu_blocks_override": CACHE_BLOCKS,
            "max_num_seqs": 6,
            "enforce_eager": True,
        },
    },
    "chunked": {
        "model": "llama4-chunked",
        "engine": {
            "enable_prefix_caching": True,
            "block_size": BLOCK,
            "max_model_len": 256,
            "num_gpu_blocks_override": CACHE_BLOCKS * 2 + 16,  # four groups share the pool
            "max_num_seqs": 6,
            "enforce_eager": True,
        },
    },
}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]  # 0-3 are special tokens


def phases(seed: int = 11, *, second_turns: bool = False) -> list[list[dict[str, Any]]]:
    """The four phases as ``{"prompt": token ids, "tenant", **SamplingParams}`` dicts (five with
    ``second_turns``)."""
    rng = random.Random(seed)
    doc = _tokens(rng, 128)
    shared = [
        {"prompt": doc + _tokens(rng, 40 + i), "tenant": f"tenant-{i % 2}", "max_tokens": 16}
        for i in range(4)
    ]
    pressure = [{"prompt": _tokens(rng, 200), "tenant": "tenant-2", "max_tokens": 4} for _ in range(10)]
    pattern = _tokens(rng, 6)
    long_decodes = [
        {
            "prompt": _tokens(rng, 12) + pattern * 6,
            "tenant": f"tenant-{i % 3}",
            "max_tokens": 120 + 7 * i,
            "ignore_eos": True,
        }
        for i in range(6)
    ]
    for p in (*shared, *pressure, *long_decodes):
        p["temperature"] = 0.0
    turns = [{**p, "prompt": p["prompt"] + _tokens(rng, 24)} for p in shared] if second_turns else []
    return [shared, *([turns] if turns else []), pressure, [dict(p) for p in shared], long_decodes]
