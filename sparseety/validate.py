"""Bounds of every count an engine event carries: the contract's one range check (issue 12).

The Avro schema says a count is an ``int`` (up to 2**31 - 1) and lets it be negative; neither is
something an engine can produce, and both reach billing (a negative output count is billed as a
credit; 2**31 - 1 tokens overflow every sum downstream). :func:`count_error` is the check, applied
once, by :func:`sparseety.events.validate_engine_event`, which the producers' emitter, the
request-log ingest and the worker all call on every event; a record out of range is a data error
and is dead-lettered with the reason and its raw bytes, never billed.

The bounds (also in docs/streams.md, "Bounds of the contract"):

* :data:`MAX_TOKENS` = 2**24 (16,777,216) tokens: any token count of one request or one step
  (prompt, output, cached, scheduled, computed-before, max_tokens, block and window sizes). No
  engine has a context near it (the largest are ~10**7), and 2**24 keeps every per-request sum and
  the products the worker computes (prompt x output attention pairs < 2**48) far inside 64 bits.
* :data:`MAX_STRUCTURE` = 2**16: layers, experts, heads, top-k and preemptions per request.
* Every count is >= 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Largest token count of one request (or one step) an engine can produce.
MAX_TOKENS = 2**24
#: Largest count of model structure (layers, experts, heads) or of preemptions per request.
MAX_STRUCTURE = 2**16

_T, _S = MAX_TOKENS, MAX_STRUCTURE

#: Payload record (short name) -> scalar count field -> upper bound (inclusive).
SCALAR_BOUNDS: dict[str, dict[str, int]] = {
    "RequestStarted": {"prompt_len": _T, "num_cached_tokens": _T, "max_tokens": _T},
    "RequestFinished": {
        "num_prompt_tokens": _T,
        "num_output_tokens": _T,
        "num_cached_tokens": _T,
        "num_preemptions": _S,
    },
    "KvBlocksStored": {"block_size": _T, "num_tokens": _T, "sliding_window": _T},
    "MoeRouting": {"num_layers": _S, "num_experts": _S},
    "EngineStarted": {
        "block_size": _T,
        "spec_num_tokens": _T,
        "moe_num_experts": _S,
        "moe_top_k": _S,
        "num_layers": _S,
        "num_attention_heads": _S,
        "num_kv_heads": _S,
        "max_num_batched_tokens": _T,
        "max_model_len": _T,
    },
}

#: Payload record (short name) -> array-of-counts field -> upper bound of each element.
ARRAY_BOUNDS: dict[str, dict[str, int]] = {
    "StepBatch": {
        "num_scheduled_tokens": _T,
        "num_computed_before": _T,
        "num_new_tokens": _T,
        "spec_proposed": _T,
        "spec_accepted": _T,
    },
    "MoeRouting": {"expert_counts": _T},
    "RequestFinished": {"reasoning_spans": _T},  # output positions (issue 23)
}


#: The same bounds as tuples per record, for the per-event loop (no dict views per call).
_SCALARS: dict[str, tuple[tuple[str, int], ...]] = {r: tuple(b.items()) for r, b in SCALAR_BOUNDS.items()}
_ARRAYS: dict[str, tuple[tuple[str, int], ...]] = {r: tuple(b.items()) for r, b in ARRAY_BOUNDS.items()}


def count_error(record: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first count of ``body`` (a payload of record ``record``, short name) out of bounds.

    Returns:
        ``(field, reason)``, or None when every count is within its bounds.
    """
    get = body.get
    for name, bound in _SCALARS.get(record, ()):
        value = get(name)
        if value is None:
            continue
        if not 0 <= value <= bound:
            return name, f"{record}.{name} = {value} is outside 0..{bound}"
    for name, bound in _ARRAYS.get(record, ()):
        values = get(name)
        # min/max run in C over a list or a packed array('i'); the per-entry loop only names
        # the offender (a per-row Python loop here cost as much as the fold at batch 256).
        if not values or (min(values) >= 0 and max(values) <= bound):
            continue
        for i, value in enumerate(values):
            if not 0 <= value <= bound:
                return name, f"{record}.{name}[{i}] = {value} is outside 0..{bound}"
    return None
