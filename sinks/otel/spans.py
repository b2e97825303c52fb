"""RequestAccounting -> one span description (pure: no OpenTelemetry SDK needed).

The span follows the OpenTelemetry GenAI semantic conventions where they have a name for a
fact, and uses ``sparseety.*`` attributes for what they lack:

=====================================================  ================================================
``gen_ai.operation.name``                              ``text_completion`` (the engine completes token
                                                       sequences; chat templating happened before)
``gen_ai.provider.name``                               ``otel.provider_name``, else the engine kind
``gen_ai.request.model`` / ``gen_ai.response.model``   the request's model
``gen_ai.response.id``                                 the engine's request id
``gen_ai.response.finish_reasons``                     ``[finish_reason]``
``gen_ai.usage.input_tokens``                          prompt positions, cached ones included
``gen_ai.usage.cache_read.input_tokens``               prompt positions served from the prefix cache
                                                       (a subset of input_tokens)
``gen_ai.usage.cache_creation.input_tokens``           prompt positions written to the prefix cache
                                                       (``cache_write_tokens``; a subset of input_tokens)
``gen_ai.usage.output_tokens``                         output positions
``gen_ai.token.modality``                              the prompt's modalities when it had any beside
                                                       text (``["text", "image", ...]``); the counts
                                                       per modality are ``sparseety.usage.<m>_tokens``
``sparseety.usage.cache_read.<tier>``                  cache reads per tier (sparseety/billing.py);
                                                       gen_ai.usage.cache_read.input_tokens is their
                                                       sum over the engine's own tiers (not external)
``sparseety.request.*``                                priority, service tier, cache TTL, P/D role and
                                                       join id, when set
``sparseety.usage.*``                                  the disjoint counts: uncached computed, recomputed,
                                                       draft accepted / rejected, skipped, evicted, ...
``sparseety.experts.*``                                MoE expert-load summary
=====================================================  ================================================

``gen_ai.system`` is not written: current conventions replaced it by ``gen_ai.provider.name``.

Ids are derived from ``request_uid`` (SHA-256), so a replay or a re-sent record produces the same
trace and span ids: a backend that keys spans by id sees one span per request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparseety import events as ev
from sparseety.billing import CACHE_TIERS, EXTERNAL, MODALITIES, TIER_COLUMN

OPERATION = "text_completion"
SCOPE = "sparseety.sinks.otel"

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


@dataclass(frozen=True)
class SpanSpec:
    """Everything needed to emit one request's span."""

    name: str
    trace_id: int
    span_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    events: list[tuple[str, int]] = field(default_factory=list)
    error: str | None = None  # set: the span's status is ERROR with this description


def _id(kind: bytes, request_uid: str, nbytes: int) -> int:
    digest = hashlib.sha256(b"sparseety/" + kind + b"\0" + request_uid.encode()).digest()
    value = int.from_bytes(digest[:nbytes], "big")
    return value or 1  # an all-zero id is invalid in OpenTelemetry


def trace_id(request_uid: str) -> int:
    """128-bit trace id of a request (deterministic)."""
    return _id(b"trace", request_uid, 16)


def span_id(request_uid: str) -> int:
    """64-bit span id of a request's span (deterministic)."""
    return _id(b"span", request_uid, 8)


def bill_2026_attributes(record: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """Issue 36's classes on the span: reads per cache tier, modality counts, encoder work, and
    what the client asked for (only when set: a text request of the default tier adds nothing
    but zeros for the tiers)."""
    attrs: dict[str, AttributeValue] = {
        f"sparseety.usage.cache_read.{tier}": int(record.get(TIER_COLUMN[tier], 0)) for tier in CACHE_TIERS
    }
    modalities = [m for m in MODALITIES if int(record.get(f"{m}_tokens", 0)) > 0]
    if modalities:
        attrs["gen_ai.token.modality"] = ["text", *modalities]
        for m in modalities:
            attrs[f"sparseety.usage.{m}_tokens"] = int(record[f"{m}_tokens"])
            attrs[f"sparseety.usage.{m}_cached_tokens"] = int(record.get(f"{m}_cached_tokens", 0))
    for name in ("encoder_compute_tokens", "encoder_cache_hit_tokens"):
        if int(record.get(name, 0)):
            attrs[f"sparseety.usage.{name}"] = int(record[name])
    if int(record.get("engine_cache_write_tokens", -1)) >= 0:
        attrs["sparseety.engine_reported.cache_write_tokens"] = int(record["engine_cache_write_tokens"])
    if int(record.get("priority", 0)):
        attrs["sparseety.request.priority"] = int(record["priority"])
    for name in ("service_tier", "cache_ttl", "pd_join_id"):
        if record.get(name):
            attrs[f"sparseety.request.{name}"] = str(record[name])
    if record.get("pd_role", "none") != "none":
        attrs["sparseety.request.pd_role"] = str(record["pd_role"])
    return attrs


def expert_summary(num_layers: int, num_experts: int, counts: Sequence[int]) -> dict[str, AttributeValue]:
    """``sparseety.experts.*``: size, total assignments, the hottest expert of each layer and its share.

    ``counts`` is layer-major (``counts[layer * num_experts + expert]``), as in RequestAccounting.
    Empty when routing was not captured.
    """
    if num_layers <= 0 or num_experts <= 0 or len(counts) != num_layers * num_experts:
        return {}
    hottest: list[int] = []
    shares: list[float] = []
    for layer in range(num_layers):
        row = counts[layer * num_experts : (layer + 1) * num_experts]
        total = sum(row)
        top = max(range(num_experts), key=lambda e: row[e])
        hottest.append(top)
        shares.append(row[top] / total if total else 0.0)
    return {
        "sparseety.experts.layers": num_layers,
        "sparseety.experts.per_layer": num_experts,
        "sparseety.experts.assignments": int(sum(counts)),
        "sparseety.experts.hottest": hottest,
        "sparseety.experts.hottest_share": shares,
        "sparseety.experts.max_share": max(shares),
    }


def span_spec(record: Mapping[str, Any], *, provider_name: str = "") -> SpanSpec:
    """The span of one RequestAccounting record.

    Raises:
        KeyError, TypeError, ValueError: the record lacks a field or has one of the wrong type
            (the sink consumer dead-letters such records).
    """
    uid = str(record["request_uid"])
    model = str(record["model"])
    prompt = int(record["prompt_tokens"])
    # the engine's own caches, every tier; KV loaded from outside (external) is no cache read
    cache_read = sum(int(record.get(TIER_COLUMN[tier], 0)) for tier in CACHE_TIERS if tier != EXTERNAL)
    finished = int(record["finished_ts_ns"])
    arrival = int(record["arrival_ts_ns"])
    start = next((t for t in (arrival, int(record["first_scheduled_ts_ns"])) if t > 0), finished)
    end = max(finished, start)
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": provider_name or str(record["engine_kind"]),
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": str(record["request_id"]),
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.cache_read.input_tokens": min(cache_read, prompt),
        "gen_ai.usage.output_tokens": int(record["output_tokens"]),
        "gen_ai.usage.cache_creation.input_tokens": int(record.get("cache_write_tokens", 0)),
        "sparseety.request.uid": uid,
        "sparseety.tenant": str(record["tenant"]),
        "sparseety.engine.name": str(record["engine_name"]),
        "sparseety.engine.id": str(record["engine_id"]),
        "sparseety.engine.kind": str(record["engine_kind"]),
        "sparseety.complete": bool(record["complete"]),
        "sparseety.seq_gap": bool(record["seq_gap"]),
        "sparseety.consistent": bool(record["consistent"]),
        "sparseety.preemptions": int(record["preemptions"]),
        "sparseety.steps": int(record["steps"]),
        "sparseety.gpu_time_ns": int(record["gpu_time_ns"]),
        "sparseety.est_flops": float(record["est_flops"]),
        "sparseety.attention.pairs": int(record["attention_pairs"]),
        "sparseety.attention.pairs_skipped": int(record["attention_pairs_skipped"]),
    }
    usage = {
        name: int(record.get(name, 0))
        for name in (*ev.TOKEN_COUNTS, *ev.POSITION_COUNTS, "draft_unverified_tokens", "scheduled_tokens")
    }
    for moved, into in ev.MOVED_FIELDS.items():  # window release in a schema-v1 record's evicted_tokens
        usage[into] += int(record.get(moved, 0))
    attrs.update({f"sparseety.usage.{name}": value for name, value in usage.items()})
    for name in ("prompt_tokens", "output_tokens", "cached_tokens"):
        value = int(record[f"engine_{name}"])
        if value >= 0:  # -1: the engine did not report it
            attrs[f"sparseety.engine_reported.{name}"] = value
    attrs.update(bill_2026_attributes(record))
    if record["finish_reason"]:
        attrs["gen_ai.response.finish_reasons"] = [str(record["finish_reason"])]
    if record.get("lora_name"):
        attrs["sparseety.lora.name"] = str(record["lora_name"])
    if record.get("reasoning_output_tokens") is not None:  # absent: not observed, never 0
        attrs["gen_ai.usage.reasoning.output_tokens"] = int(record["reasoning_output_tokens"])
    window = (record.get("timeline") or {}).get("attention_window")
    if window is not None:
        attrs["sparseety.attention.window"] = int(window)
    attrs.update(
        expert_summary(
            int(record["expert_num_layers"]), int(record["expert_num_experts"]), record["expert_counts"]
        )
    )
    events = [
        (name, int(record[key]))
        for name, key in (
            ("sparseety.first_scheduled", "first_scheduled_ts_ns"),
            ("sparseety.first_token", "first_token_ts_ns"),
        )
        if int(record[key]) > 0
    ]
    error = None
    if not record["complete"]:
        reason = record.get("incomplete_reason") or "incomplete"
        attrs["error.type"] = str(reason)
        error = f"request closed without RequestFinished: {reason}"
    return SpanSpec(
        name=f"{OPERATION} {model}" if model else OPERATION,
        trace_id=trace_id(uid),
        span_id=span_id(uid),
        start_ns=start,
        end_ns=end,
        attributes=attrs,
        events=events,
        error=error,
    )
