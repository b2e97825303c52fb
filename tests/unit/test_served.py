"""Issue 23 in the fold: reasoning tokens from RequestFinished.reasoning_spans, and the base model
beside the LoRA adapter (old events, whose model held the adapter, fold the same way), per
request and per usage window."""

from __future__ import annotations

from typing import Any

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.streams.assembler import TIMELINES, USAGE, Assembler, Output
from sparseety.streams.served import base_model, reasoning
from sparseety.streams.state import MemoryStore
from tests import factories as f

CFG = WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0)


def fold(requests: list[tuple[dict[str, Any], dict[str, Any]]], **engine: Any) -> list[Output]:
    """EngineStarted, then each (RequestStarted, RequestFinished) with one prefill and two
    decode steps (3 output tokens), then EngineStopped (which flushes the windows)."""
    payloads: list[tuple[str, dict[str, Any]]] = [
        (ev.ENGINE_STARTED, f.engine_started(served_model_name="base-7b", **engine))
    ]
    step = 0
    for started, finished in requests:
        rid = started["request_id"]
        payloads += [
            (ev.REQUEST_STARTED, started),
            (ev.STEP_BATCH, f.step_batch(step, [(rid, 10, 0, [1])])),
            (ev.STEP_BATCH, f.step_batch(step + 1, [(rid, 1, 10, [2])])),
            (ev.STEP_BATCH, f.step_batch(step + 2, [(rid, 1, 11, [3])])),
            (ev.REQUEST_FINISHED, finished),
        ]
        step += 3
    payloads.append((ev.ENGINE_STOPPED, {"reason": "shutdown"}))
    asm = Assembler(CFG, MemoryStore())
    out: list[Output] = []
    for i, (kind, body) in enumerate(payloads):
        out.extend(asm.apply(f.wrap(i, kind, body)))
    return out


def test_reasoning_not_observed_without_a_parser_and_cut_at_the_output() -> None:
    assert reasoning({"reasoning_spans": None}, 5) == (None, [])
    assert reasoning({}, 5) == (None, [])  # a RequestFinished written before the field
    assert reasoning({"reasoning_spans": []}, 5) == (0, [])  # observed: no reasoning
    assert reasoning({"reasoning_spans": [1, 3]}, 5) == (2, [1, 3])
    assert reasoning({"reasoning_spans": [1, 2, 3, 9]}, 5) == (3, [1, 2, 3, 5])
    assert reasoning({"reasoning_spans": [6, 9]}, 5) == (0, [])


def test_base_model_of_old_and_new_events() -> None:
    cfg = {"served_model_name": "base-7b"}
    assert base_model({"model": "base-7b", "lora_name": "sql"}, cfg) == "base-7b"  # issue 23 on
    assert base_model({"model": "sql", "lora_name": "sql"}, cfg) == "base-7b"  # before: the adapter
    assert base_model({"model": "base-7b", "lora_name": None}, cfg) == "base-7b"
    assert base_model({"model": "", "lora_name": None}, cfg) == "base-7b"
    assert base_model({"model": "sql", "lora_name": "sql"}, {}) == "sql"  # no base known


def test_fold_carries_reasoning_and_adapter_into_records_and_windows() -> None:
    out = fold(
        [
            (
                f.request_started("r1", model="base-7b", lora_name="sql"),
                f.request_finished("r1", reasoning_spans=[1, 2]),
            ),
            (
                f.request_started("r2", model="sql", lora_name="sql"),
                f.request_finished("r2", reasoning_spans=[]),
            ),
            (f.request_started("r3", model="base-7b"), f.request_finished("r3")),  # no parser
        ],
        reasoning_parser="deepseek_r1",
    )
    acc = {o.record["request_id"]: o.record for o in out if o.topic == TIMELINES}
    got = {
        k: (a["model"], a["lora_name"], a["reasoning_output_tokens"], a["reasoning_spans"])
        for k, a in acc.items()
    }
    assert got == {
        "r1": ("base-7b", "sql", 1, [1, 2]),
        "r2": ("base-7b", "sql", 0, []),  # an old event: its model was the adapter
        "r3": ("base-7b", None, None, []),
    }
    assert all(a["consistent"] for a in acc.values())
    wins = {(w.record["model"], w.record["lora_name"]): w.record for w in out if w.topic == USAGE}
    assert {k: w["requests"] for k, w in wins.items()} == {("base-7b", "sql"): 2, ("base-7b", ""): 1}
    # an adapter's window keeps the id producers before issue 23 gave it (a replay overwrites it)
    assert wins[("base-7b", "sql")]["usage_id"].startswith(f"{f.EID}/sql/acme/")
    assert wins[("base-7b", "")]["usage_id"].startswith(f"{f.EID}/base-7b/acme/")


def test_otel_span_carries_reasoning_only_when_observed() -> None:
    from sparseety.sinks.otel.spans import span_spec

    key = "gen_ai.usage.reasoning.output_tokens"
    assert span_spec(f.accounting(reasoning_output_tokens=5)).attributes[key] == 5
    assert span_spec(f.accounting(reasoning_output_tokens=0)).attributes[key] == 0
    assert key not in span_spec(f.accounting()).attributes  # not observed: absent, never 0
