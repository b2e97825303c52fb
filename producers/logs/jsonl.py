"""Request-level JSONL logs -> request-level engine events (pure logic).

One JSON object per line, one request per object (blank lines are ignored)::

    {"id": "chatcmpl-7", "tenant": "acme", "model": "llama-3-8b",
     "arrival": "2024-05-01T12:00:00.250Z", "finished": 1714564801.75,
     "finish_reason": "stop",
     "usage": {"prompt_tokens": 1200, "completion_tokens": 85,
               "prompt_tokens_details": {"cached_tokens": 1024}}}

Fields:

* ``id`` (or ``request_id``): string or integer, unique within the file. Required.
* ``usage.prompt_tokens``, ``usage.completion_tokens``: non-negative integers. Required.
  ``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache
  (at most ``prompt_tokens``); default 0. ``usage.prompt_tokens_details.multimodal_tokens``
  (vLLM: ``{"image": n, ...}``) or ``image_tokens`` / ``audio_tokens`` / ``video_tokens``: the
  prompt's tokens per modality (``producers/usage_details.py``); default none.
* ``tenant``, ``model``: strings; defaults come from the command line (``--tenant``,
  ``--model``). A line without a model and no default is invalid.
* ``arrival`` (or OpenAI's ``created``), ``first_token``, ``finished``: ISO-8601 text (naive =
  UTC) or a number of seconds since the Unix epoch; ``arrival_ts_ns``, ``first_token_ts_ns``,
  ``finished_ts_ns``: integer nanoseconds. ``arrival`` is required; ``finished`` defaults to it.
* ``finish_reason`` (or ``choices[0].finish_reason``): default ``stop``. ``max_tokens``: optional.

Limits (a line beyond them is a bad line, never an abort): a line holds at most
:data:`MAX_LINE_BYTES` bytes (1 MiB) and JSON nested at most :data:`MAX_DEPTH` levels (64);
counts are within the contract's bounds (:mod:`sparseety.validate`: 0..2**24 tokens, the same
check the worker applies) and times fit the events' ``long``.

Each request becomes a RequestStarted + RequestFinished pair on an engine epoch with
``engine_kind = trace``; the assembler derives the request's timeline from the totals (cached
prompt, computed prompt, computed output), as it does for the OpenAI proxy. Both events carry the
request's finish time as their event time: logs are usually written in completion order, so the
usage windows close in order; lines out of order beyond the worker's allowed lateness become
window corrections (never dropped).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sparseety import __version__
from sparseety import events as ev
from sparseety.tenants import shown, tenant_problem
from sparseety.validate import count_error

from ..usage_details import modality_tokens
from .errors import BadTraceLineError

ENGINE_KIND = "trace"
#: Default size limit of one line, in bytes (``ingest --max-line-bytes``).
MAX_LINE_BYTES = 1024 * 1024
#: Default nesting limit of one line's JSON (``ingest --max-depth``); a valid line nests 3 deep.
MAX_DEPTH = 64
#: Largest time in ns an event carries (Avro ``long``).
MAX_NS = 2**63 - 1


@dataclass(frozen=True)
class TraceRequest:
    """One request of a request-level log."""

    request_id: str
    tenant: str
    model: str
    arrival_ns: int
    first_token_ns: int
    finished_ns: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    max_tokens: int | None = None
    #: usage.prompt_tokens_details per modality (producers/usage_details.py)
    prompt_tokens_by_modality: Mapping[str, int] = field(default_factory=dict)


def _count(usage: dict[str, Any], key: str, line: int, *, required: bool) -> int:
    value = usage.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadTraceLineError(line, f"usage.{key} must be a non-negative integer, got {_kind(value)}")
    if value < 0:
        raise BadTraceLineError(line, f"usage.{key} must be a non-negative integer, got {_short(value)}")
    return value


def _short(value: int) -> str:
    text = str(value) if value.bit_length() < 200 else f"a {value.bit_length()}-bit integer"
    return text


def _ns(value: int, name: str, line: int) -> int:
    if value > MAX_NS:
        raise BadTraceLineError(line, f"{name} is out of range (after the year 2262)")
    return value


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _time(obj: dict[str, Any], names: tuple[str, ...], ns_name: str, line: int) -> int | None:
    """Wall-clock ns from ``<ns_name>`` (integer ns) or the first of ``names`` present."""
    if ns_name in obj:
        value = obj[ns_name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadTraceLineError(line, f"{ns_name} must be a non-negative integer (ns)")
        return _ns(value, ns_name, line)
    for name in names:
        if name not in obj or obj[name] is None:
            continue
        value = obj[name]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or value < 0:
                raise BadTraceLineError(line, f"{name} must be a non-negative number of seconds")
            if value > MAX_NS // 1_000_000_000:
                raise BadTraceLineError(line, f"{name} is out of range (after the year 2262)")
            return _ns(round(value * 1e9), name, line)
        if isinstance(value, str):
            try:
                t = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            except ValueError:
                raise BadTraceLineError(line, f"{name} is not an ISO-8601 time") from None
            if t.tzinfo is None:
                t = t.replace(tzinfo=UTC)
            return _ns(round(t.timestamp() * 1e6) * 1000, name, line)
        raise BadTraceLineError(line, f"{name} must be ISO-8601 text or seconds, got {_kind(value)}")
    return None


def _text(obj: dict[str, Any], key: str, default: str, line: int) -> str:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadTraceLineError(line, f"{key} must be a string, got {_kind(value)}")
    return value


def _tenant(value: str, line: int) -> str:
    rule = tenant_problem(value)
    if rule is not None:
        raise BadTraceLineError(line, f"tenant {shown(value)}: {rule}")
    return value


def _depth(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests deeper than ``limit`` (iterative: deep input must not recurse)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_line(
    text: str | bytes,
    line: int,
    *,
    default_tenant: str = "",
    default_model: str = "",
    max_line_bytes: int = MAX_LINE_BYTES,
    max_depth: int = MAX_DEPTH,
) -> TraceRequest | None:
    """One log line -> a request (None for a blank line).

    Raises:
        BadTraceLineError: too long, too deep, not JSON, not an object, or a field missing or
            invalid.
    """
    if not text.strip():
        return None
    raw = (text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text).rstrip(b"\r\n")
    if len(raw) > max_line_bytes:
        raise BadTraceLineError(line, f"line is {len(raw)} bytes, over the {max_line_bytes}-byte limit")
    opened = raw.count(b"[") + raw.count(b"{")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadTraceLineError(line, f"not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise BadTraceLineError(line, "not valid JSON (not UTF-8)") from None
    except RecursionError:  # the C decoder recurses per level
        raise BadTraceLineError(line, f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise BadTraceLineError(line, f"not valid JSON ({str(exc)[:200]})") from None
    # counting brackets is cheap; only a line that could be too deep is walked
    if opened > max_depth and _depth(obj, max_depth):
        raise BadTraceLineError(line, f"JSON nested deeper than {max_depth} levels")
    if not isinstance(obj, dict):
        raise BadTraceLineError(line, f"expected a JSON object, got {_kind(obj)}")
    rid = obj.get("id", obj.get("request_id"))
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise BadTraceLineError(line, "missing request id (id or request_id: a string or integer)")
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        raise BadTraceLineError(line, "missing usage object (usage.prompt_tokens, usage.completion_tokens)")
    prompt = _count(usage, "prompt_tokens", line, required=True)
    output = _count(usage, "completion_tokens", line, required=True)
    details = usage.get("prompt_tokens_details") or {}
    if not isinstance(details, dict):
        raise BadTraceLineError(line, "usage.prompt_tokens_details must be an object")
    cached = _count(details, "cached_tokens", line, required=False)
    if cached > prompt:
        raise BadTraceLineError(line, f"cached_tokens {cached} exceeds prompt_tokens {prompt}")
    by_modality, problem = modality_tokens(details, prompt)
    if problem is not None:
        raise BadTraceLineError(line, problem)
    model = _text(obj, "model", default_model, line)
    if not model:
        raise BadTraceLineError(line, "missing model (give the field, or a default model)")
    arrival = _time(obj, ("arrival", "created"), "arrival_ts_ns", line)
    if arrival is None:
        raise BadTraceLineError(line, "missing arrival time (arrival, created or arrival_ts_ns)")
    finished = _time(obj, ("finished",), "finished_ts_ns", line)
    finished = arrival if finished is None else finished
    if finished < arrival:
        raise BadTraceLineError(line, "finished is before arrival")
    first = _time(obj, ("first_token",), "first_token_ts_ns", line) or 0
    reason: Any = obj.get("finish_reason")
    choices = obj.get("choices")
    if reason is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
    max_tokens = obj.get("max_tokens")
    req = TraceRequest(
        request_id=str(rid),
        tenant=_tenant(_text(obj, "tenant", default_tenant, line), line),
        model=model,
        arrival_ns=arrival,
        first_token_ns=first,
        finished_ns=finished,
        prompt_tokens=prompt,
        completion_tokens=output,
        cached_tokens=cached,
        prompt_tokens_by_modality=by_modality,
        finish_reason=str(reason) if reason else "stop",
        max_tokens=max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None,
    )
    # the contract's bounds, checked here too so that the line number goes with the reason
    for kind, body in request_payloads(req):
        bad = count_error(kind.rsplit(".", 1)[-1], body)
        if bad is not None:
            raise BadTraceLineError(line, _short_reason(bad[1]))
    return req


def _short_reason(reason: str) -> str:
    """A reason that quotes a huge number keeps only its size."""
    return " ".join(
        w if len(w) < 40 or not w.lstrip("-").isdigit() else f"a {len(w)}-digit number"
        for w in reason.split(" ")
    )


def engine_started(source: str) -> dict[str, Any]:
    """The EngineStarted payload of a trace epoch (request level: no engine shape is known, the
    schema's defaults stand for it)."""
    return ev.with_defaults(
        ev.ENGINE_STARTED,
        {
            "model": source,
            "engine_kind": ENGINE_KIND,
            "sparseety_version": __version__,
            "kv_cache_dtype": "",
            "privacy_mode": "none",
        },
    )


def request_payloads(req: TraceRequest) -> list[tuple[str, dict[str, Any]]]:
    """RequestStarted + RequestFinished for one logged request."""
    return [
        (
            ev.REQUEST_STARTED,
            {
                "request_id": req.request_id,
                "arrival_ts_ns": req.arrival_ns,
                "prompt_len": req.prompt_tokens,
                "prompt_token_ids": [],
                "prompt_token_hashes": [],
                "num_cached_tokens": req.cached_tokens,
                "block_hashes": [],
                "max_tokens": req.max_tokens,
                "tenant": req.tenant,
                "model": req.model,
                "lora_name": None,
                "priority": 0,
            },
        ),
        (
            ev.REQUEST_FINISHED,
            {
                "request_id": req.request_id,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "num_prompt_tokens": req.prompt_tokens,
                "num_output_tokens": req.completion_tokens,
                "num_cached_tokens": req.cached_tokens,
                "num_preemptions": 0,
                "output_block_hashes": [],
                "first_token_ts_ns": req.first_token_ns,
                "chunk_arrival_ns": [],
                "prompt_tokens_by_modality": dict(req.prompt_tokens_by_modality),
            },
        ),
    ]


class TraceEpoch:
    """Envelopes of one trace epoch, with gap-free seqs (pure).

    Args:
        engine_name: Stable name of the trace "engine" (the Kafka key).
        epoch: Epoch id; deterministic per file, so ingesting the same file again produces the
            same event ids and request uids (the pipeline absorbs the repeat).
        source: What the epoch came from (the file name), recorded as the engine's model.
    """

    def __init__(self, engine_name: str, epoch: str, source: str) -> None:
        self.engine_name = engine_name
        self.engine_id = ev.engine_id(engine_name, epoch)
        self.source = source
        self.seq = 0
        self.started = False
        self.last_ts = 0

    def _wrap(self, ts_ns: int, payload_type: str, payload: dict[str, Any]) -> dict[str, Any]:
        out = ev.envelope(
            engine_name=self.engine_name,
            engine_id_=self.engine_id,
            stream=ev.CORE_STREAM,
            seq=self.seq,
            ts_ns=ts_ns,
            mono_ns=ts_ns,
            payload_type=payload_type,
            payload=payload,
        )
        self.seq += 1
        self.last_ts = max(self.last_ts, ts_ns)
        return out

    def request(self, req: TraceRequest) -> Iterator[dict[str, Any]]:
        """The request's envelopes, preceded by EngineStarted for the first request."""
        if not self.started:
            self.started = True
            # no later than the first event: an earlier watermark would make its window late
            yield self._wrap(req.finished_ns, ev.ENGINE_STARTED, engine_started(self.source))
        for payload_type, payload in request_payloads(req):
            yield self._wrap(req.finished_ns, payload_type, payload)

    def stop(self) -> Iterator[dict[str, Any]]:
        """EngineStopped (closes the epoch and flushes its usage windows), if anything started."""
        if self.started:
            yield self._wrap(self.last_ts, ev.ENGINE_STOPPED, {"reason": "trace_end"})
