"""The event model as Python sees it: Avro records as dicts, unions as ``(full_name, dict)``.

The fields themselves are defined only in ``schemas/``; this module names the payload types,
builds envelopes and ids the same way everywhere, and checks the invariants Avro cannot
express (columnar arrays of equal length).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from sparseety.deadletter_limits import cap_raw
from sparseety.errors import DecodeError, InvalidEventError, SchemaError
from sparseety.schema_store import full_name, read_schema_files, schema_dir
from sparseety.validate import ARRAY_BOUNDS, count_error

ENGINE_STARTED = full_name("EngineStarted")
ENGINE_STOPPED = full_name("EngineStopped")
HEARTBEAT = full_name("Heartbeat")
REQUEST_STARTED = full_name("RequestStarted")
STEP_BATCH = full_name("StepBatch")
REQUEST_FINISHED = full_name("RequestFinished")
KV_STORED = full_name("KvBlocksStored")
KV_REMOVED = full_name("KvBlocksRemoved")
KV_CLEARED = full_name("KvCleared")
MOE_ROUTING = full_name("MoeRouting")

ENGINE_EVENT = full_name("EngineEvent")
REQUEST_ACCOUNTING = full_name("RequestAccounting")
USAGE_WINDOW = full_name("UsageWindow")
DEAD_LETTER = full_name("DeadLetter")

CORE_STREAM = "core"

#: RequestAccounting's schema-v1 token counts (recomputed_tokens is both recompute senses), but
#: evicted_tokens, whose meaning moved to window_released_tokens (:data:`MOVED_FIELDS`).
TOKEN_COUNTS = (
    "cache_read_tokens",
    "uncached_computed_tokens",
    "recomputed_tokens",
    "draft_accepted_tokens",
    "draft_rejected_tokens",
    "skipped_tokens",
)

#: RequestAccounting's counts added with the two-axis position model (schema v2, docs/streams.md).
POSITION_COUNTS = (
    "recomputed_preemption_tokens",
    "recomputed_eviction_tokens",
    "draft_cut_tokens",
    "window_released_tokens",
    "evicted_blocks_recomputed",
    "waste_tokens",
)


#: Fields of the contract whose meaning moved to another field, by the field that counts them now.
#: 0 in whatever is written now, they stay in the schema so that records written before still
#: decode with their value (docs/streams.md, Deprecated fields). The store has
#: no column for them: the sink adds a record's value to its successor's column, as migration 016
#: did for the rows stored before.
MOVED_FIELDS: dict[str, str] = {"evicted_tokens": "window_released_tokens"}


@functools.cache
def _record(name: str) -> dict[str, Any]:
    """The raw current schema of record ``name`` (full name), read once per process."""
    for raw in read_schema_files(schema_dir()):
        if full_name(raw["name"]) == name:
            return raw
    raise SchemaError(f"no record {name} in schemas/", name=name)


@functools.cache
def _defaults(name: str) -> dict[str, Any]:
    return {f["name"]: f["default"] for f in _record(name)["fields"] if "default" in f}


def field_types(record_name: str) -> dict[str, Any]:
    """The fields of a record of ``schemas/`` (current version) and their Avro types, in schema
    order: the one list of a record's fields that tables, states and checks derive theirs from
    (at import time, never per event)."""
    return {f["name"]: f["type"] for f in _record(full_name(record_name))["fields"]}


def field_names(record_name: str) -> tuple[str, ...]:
    """The field names of a record of ``schemas/`` (current version), in schema order."""
    return tuple(field_types(record_name))


#: UsageWindow's counters, in schema order: its numeric fields but the window's bounds. The worker
#: keeps a window's counters as a list in this order (streams/state.py), so a counter is only ever
#: appended to UsageWindow (tests/unit/test_contract.py: every earlier version's are a prefix).
USAGE_COUNTERS = tuple(
    name
    for name, avro_type in field_types(USAGE_WINDOW).items()
    if avro_type in ("long", "double") and name not in ("window_start_ns", "window_ns")
)


def with_defaults(record_name: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` completed with the schema's defaults for the fields it leaves out.

    Producers that know only part of a record (a proxy knows no block size) state what they know;
    the defaults stay defined once, in ``schemas/``.
    """
    return {**_defaults(full_name(record_name)), **values}


def dead_letter_record(exc: DecodeError, key: bytes | None, component: str) -> dict[str, Any]:
    """A DeadLetter record for a payload that could not be used (its position taken from ``exc``)."""
    return dead_letter(
        type(exc).__name__,
        str(exc),
        component,
        topic=exc.topic or "",
        partition=exc.partition if exc.partition is not None else -1,
        offset=exc.offset if exc.offset is not None else -1,
        key=key,
        value=exc.raw,
    )


def dead_letter_key(exc: DecodeError, key: bytes | None) -> str:
    """The dlq key of a dead letter: the input's key, else its position ``topic/partition/offset``."""
    return key.decode(errors="replace") if key else f"{exc.topic}/{exc.partition}/{exc.offset}"


def dead_letter(
    error_type: str,
    reason: str,
    component: str,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
) -> dict[str, Any]:
    """A DeadLetter record (``partition``/``offset`` -1 where the input had none; the bytes capped
    by :func:`sparseety.deadletter_limits.cap_raw`)."""
    value, reason = cap_raw(value, reason)
    return {
        "error_type": error_type,
        "reason": reason,
        "component": component,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": key,
        "value": value,
        "ts_ns": time.time_ns(),
    }


def engine_id(engine_name: str, epoch: str) -> str:
    """``engine_name@epoch``: one id per engine start."""
    return f"{engine_name}@{epoch}"


def event_id(engine_id_: str, stream: str, seq: int) -> str:
    """Deterministic event id: ``engine_id/stream/seq``."""
    return f"{engine_id_}/{stream}/{seq}"


def request_uid(engine_id_: str, request_id: str) -> str:
    """Global request id: ``engine_id/request_id``."""
    return f"{engine_id_}/{request_id}"


def envelope(
    *,
    engine_name: str,
    engine_id_: str,
    stream: str,
    seq: int,
    ts_ns: int,
    mono_ns: int,
    payload_type: str,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """An EngineEvent record ready for the encoder."""
    return {
        "engine_name": engine_name,
        "engine_id": engine_id_,
        "stream": stream,
        "seq": seq,
        "event_id": event_id(engine_id_, stream, seq),
        "ts_ns": ts_ns,
        "mono_ns": mono_ns,
        "payload": (payload_type, payload),
    }


def payload_type(event: dict[str, Any]) -> str:
    """Full name of the envelope's payload record."""
    return str(event["payload"][0])


def payload(event: dict[str, Any]) -> dict[str, Any]:
    """The envelope's payload record."""
    return event["payload"][1]  # type: ignore[no-any-return]


_STEP_COLUMNS = ("num_scheduled_tokens", "num_computed_before", "num_new_tokens")
#: Payload full name -> short name (validation runs once per event in the worker).
_SHORT_NAMES: dict[str, str] = {}
_SCHED_MAX, _BEFORE_MAX, _NEW_MAX = (ARRAY_BOUNDS["StepBatch"][c] for c in _STEP_COLUMNS)


def _plain_step(body: dict[str, Any]) -> bool:
    """A StepBatch with rows, no drafts, its three columns one entry per row within their bounds,
    and as many new token ids as new tokens: what passes every StepBatch check of
    :func:`validate_engine_event` (which checks anything else the long way, and names the field)."""
    n = len(body["req_ids"])
    sched, before, new = body["num_scheduled_tokens"], body["num_computed_before"], body["num_new_tokens"]
    return bool(
        n
        and len(sched) == n
        and len(before) == n
        and len(new) == n
        and not body["spec_proposed"]
        and not body["spec_accepted"]
        and min(sched) >= 0
        and min(before) >= 0
        and min(new) >= 0
        and max(sched) <= _SCHED_MAX
        and max(before) <= _BEFORE_MAX
        and max(new) <= _NEW_MAX
        and sum(new) == len(body["new_token_ids"])
    )


def validate_engine_event(event: dict[str, Any], raw: bytes | None = None) -> dict[str, Any]:
    """Check what the schema cannot: ids agree, columns line up, every count is in its bounds
    (:mod:`sparseety.validate`: non-negative and no larger than an engine can produce).

    Returns:
        The event, unchanged.

    Raises:
        InvalidEventError: carrying ``raw`` and the offending field.
    """
    eid = event["engine_id"]
    if not eid.startswith(event["engine_name"] + "@"):
        raise InvalidEventError(
            f"engine_id {eid!r} does not belong to engine {event['engine_name']!r}",
            raw=raw,
            field="engine_id",
        )
    if event["seq"] < 0:
        raise InvalidEventError(f"negative seq {event['seq']}", raw=raw, field="seq")
    kind, body = event["payload"]
    if kind == STEP_BATCH and _plain_step(body):
        return event  # every check below would pass (the worker's most common event)
    short = _SHORT_NAMES.get(kind)
    if short is None:
        short = _SHORT_NAMES[kind] = kind.rsplit(".", 1)[-1]
    bad = count_error(short, body)
    if bad is not None:
        raise InvalidEventError(bad[1], raw=raw, field=bad[0])
    if kind == STEP_BATCH:
        n = len(body["req_ids"])
        for col in _STEP_COLUMNS:
            if len(body[col]) != n:
                raise InvalidEventError(
                    f"StepBatch.{col} has {len(body[col])} entries for {n} requests",
                    raw=raw,
                    field=col,
                )
        for col in ("spec_proposed", "spec_accepted"):
            if body[col] and len(body[col]) != n:
                raise InvalidEventError(
                    f"StepBatch.{col} has {len(body[col])} entries for {n} requests",
                    raw=raw,
                    field=col,
                )
        if sum(body["num_new_tokens"]) != len(body["new_token_ids"]):
            raise InvalidEventError(
                "StepBatch.new_token_ids does not match num_new_tokens", raw=raw, field="new_token_ids"
            )
        # Negative counts were refused above: count_error checks every StepBatch column.
    elif kind == MOE_ROUTING:
        want = len(body["req_ids"]) * body["num_layers"] * body["num_experts"]
        if len(body["expert_counts"]) != want:
            raise InvalidEventError(
                f"MoeRouting.expert_counts has {len(body['expert_counts'])} entries, expected {want}",
                raw=raw,
                field="expert_counts",
            )
    elif kind == REQUEST_STARTED and (
        body["prompt_len"] < 0 or body["num_cached_tokens"] > body["prompt_len"]
    ):
        raise InvalidEventError(
            "RequestStarted.num_cached_tokens exceeds prompt_len", raw=raw, field="num_cached_tokens"
        )
    return event
