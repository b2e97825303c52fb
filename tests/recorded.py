"""Recorded real-engine events (``tests/data/<scenario>/``) and helpers to read engine events back.

Each scenario directory holds, written by ``scripts/record_fixtures.py``:

* ``events.bin`` — the Kafka message values exactly as the producers sent them (Avro
  single-object encoding), each prefixed with its length (4 bytes, big-endian), in topic order;
* ``truth.json`` — what vLLM itself reported for the same run: per request the external and
  engine request ids, prompt and output token ids, ``num_cached_tokens``, finish reason, tenant;
  the engine's metric counters (prefix cache, spec decode, preemptions, prompt tokens by
  source); the engine arguments and versions.

``load_scenario(name) -> (events, truth)`` decodes the events with the project's decoder.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

from sparseety import events as ev

DATA = Path(__file__).parent / "data"


def scenarios() -> list[str]:
    """Names of the recorded scenarios."""
    return sorted(p.name for p in DATA.iterdir() if (p / "events.bin").is_file()) if DATA.is_dir() else []


def pack(values: list[bytes]) -> bytes:
    """Length-prefixed concatenation (the ``events.bin`` format)."""
    return b"".join(struct.pack(">I", len(v)) + v for v in values)


def unpack(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack`."""
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from(">I", data, i)
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def raw_events(name: str) -> list[bytes]:
    """The scenario's Kafka values, as produced."""
    return unpack((DATA / name / "events.bin").read_bytes())


def load_scenario(name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Decoded EngineEvents (topic order) and the engine's ground truth for one scenario."""
    from sparseety.config import load_config
    from sparseety.kafka import make_decoder

    dec = make_decoder(load_config())
    events = [dec.decode(v)[1] for v in raw_events(name)]
    truth = json.loads((DATA / name / "truth.json").read_text())
    return events, truth


# --- reading engine events back (tests of the producers, and fixture checks) ----------------------


def by_type(events: list[dict[str, Any]], payload_type: str) -> list[dict[str, Any]]:
    """Payloads of one type, in seq order per stream."""
    return [
        ev.payload(e)
        for e in sorted(events, key=lambda e: (e["stream"], e["seq"]))
        if ev.payload_type(e) == payload_type
    ]


def reconstruct(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per engine request id: what the event stream says about it.

    Keys: ``started`` (RequestStarted payload), ``finished`` (RequestFinished), ``output``
    (output token ids from StepBatches), ``scheduled``, ``accepted``, ``proposed``, ``steps``,
    ``preempted``, ``resumed``.
    """
    out: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "started": None,
            "finished": None,
            "output": [],
            "scheduled": 0,
            "accepted": 0,
            "proposed": 0,
            "steps": 0,
            "preempted": 0,
            "resumed": 0,
        }
    )
    core = sorted((e for e in events if e["stream"] == ev.CORE_STREAM), key=lambda e: e["seq"])
    for e in core:
        kind, p = e["payload"]
        if kind == ev.REQUEST_STARTED:
            out[p["request_id"]]["started"] = p
        elif kind == ev.REQUEST_FINISHED:
            out[p["request_id"]]["finished"] = p
        elif kind == ev.STEP_BATCH:
            off = 0
            for i, rid in enumerate(p["req_ids"]):
                n = p["num_new_tokens"][i]
                r = out[rid]
                r["output"].extend(p["new_token_ids"][off : off + n])
                off += n
                r["scheduled"] += p["num_scheduled_tokens"][i]
                r["steps"] += 1
                if p["spec_accepted"]:
                    r["accepted"] += p["spec_accepted"][i]
                    r["proposed"] += p["spec_proposed"][i]
            for rid in p["preempted_req_ids"]:
                out[rid]["preempted"] += 1
            for rid in p["resumed_req_ids"]:
                out[rid]["resumed"] += 1
    return dict(out)


def seq_gaps(events: list[dict[str, Any]]) -> dict[tuple[str, str], list[int]]:
    """Missing seqs per (engine_id, stream): empty lists mean gap-free streams."""
    seqs: dict[tuple[str, str], set[int]] = defaultdict(set)
    for e in events:
        seqs[(e["engine_id"], e["stream"])].add(e["seq"])
    return {k: sorted(set(range(max(v) + 1)) - v) for k, v in seqs.items()}
