"""The caveats the fold attaches to a request's accounting (pure; issues 21 and 22).

**Warm-up.** An engine's first step (StepBatch ``step`` 0 of its epoch) may carry the cold start:
lazy initialisation, kernel autotuning and compilation the engine's own warm-up did not cover
(2.6 s of GPU time on the first request of a vLLM server, 20x its tokens' share). It also carries
real work: the first batch's prefills. The fold cannot tell the two apart as the step arrives, so
the step stays in ``gpu_time_ns`` (excluding it charged no one for a whole first batch's
prefill) and is *flagged*: the part of each request's ``gpu_time_ns`` that came from its epoch's
first step is reported apart as ``warmup_gpu_time_ns`` (a subset, never added to it), so a
reader sees the cold start and can subtract it.

**Source history lost.** A cached prompt block names the request that computed it from the
epoch's prefix index, which the KV events build. When the fold declares events of the core
stream lost (a seq gap: the broker lost its log, or a fresh worker met the engine mid-stream),
the index has no history before that point, and a block cached then reads as cached with no
source. The epoch remembers when (``history_lost_ts_ns``: the event time of the first event after
the gap); a request admitted later with such a block carries it as ``source_history_lost_ts_ns``,
which the API and the dashboard show as "source unknown (history lost at ...)", and amortized
cost says it fell back to the cache-read price for those positions (no lifetime to share).

**No KV history at all.** An engine whose producer cannot see its prefix cache's inserts and
evictions says so in EngineStarted (``kv_events_observed`` false: SGLang's Rust radix-tree core,
docs/sglang.md). Its epoch has no history from the start: ``history_lost_ts_ns`` is the
EngineStarted event time, a request with cached positions carries it as
``source_history_lost_ts_ns`` (sources unknown, amortized falls back to the read price), and its
prompt is laid out without blocks: cached ``[0, cached)`` and computed after, never
``recomputed_eviction`` (an eviction the fold cannot see cannot be told from a first
computation). The 0 that ``recomputed_eviction_tokens`` then holds is "not observed"; the
epoch's EngineStarted says so (docs/sglang.md, docs/streams.md).
"""

from __future__ import annotations

from typing import Any

from sparseety.events import CORE_STREAM

#: The step number whose wall time is warm-up (an epoch's first).
WARMUP_STEP = 0


def is_warmup_step(step: int) -> bool:
    """Whether a StepBatch's wall time is the engine's cold start (reported apart)."""
    return step == WARMUP_STEP


def history_lost_at(stream: str, missing: int, first_after_ns: int, known_ns: int) -> int:
    """The epoch's ``history_lost_ts_ns`` after a declared gap of ``missing`` events on ``stream``
    (``first_after_ns``: event time of the first event after it; ``known_ns``: the value so far).

    Only the core stream carries the KV events the prefix index is built from; a gap elsewhere
    (a worker's routing stream) loses no prefix history.
    """
    if stream != CORE_STREAM or missing <= 0:
        return known_ns
    return max(known_ns, first_after_ns)


def kv_events_observed(config: dict[str, Any] | None) -> bool:
    """Whether an epoch's producer sees the prefix cache's inserts and evictions (EngineStarted
    ``kv_events_observed``; true for producers older than the field, which always did)."""
    return bool((config or {}).get("kv_events_observed", True))


def kv_history_lost_at(started: dict[str, Any], ts_ns: int, known_ns: int) -> int:
    """The epoch's ``history_lost_ts_ns`` after its EngineStarted (event time ``ts_ns``): the
    start itself when the producer sees no KV events, else unchanged."""
    return known_ns if kv_events_observed(started) else max(known_ns, ts_ns)
