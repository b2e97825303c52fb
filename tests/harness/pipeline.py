"""One harness mode through the plugin and the broker: run, read back, fold, compare.

The plugin publishes to a real broker from inside vLLM's engine core (the emitter thread,
librdkafka); the events are read back from the topic and folded by the assembler
(``streams/assembler.py``, the worker's pure core). ``tests/harness/test_pipeline.py`` takes one
mode's recorded events further, through a real Faust worker and the ClickHouse sink.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, WorkerConfig, to_env
from tests.e2e.conftest import environ
from tests.e2e.engine_events import engine_events
from tests.e2e.ground_truth import CLASSES as E2E_CLASSES
from tests.e2e.truth_workloads import phases
from tests.harness.engine import Harness, Mode, build, drive, request

#: The e2e classes, and the tokens a KV connector loaded (P/D decode side).
CLASSES = (*E2E_CLASSES, "external_kv_tokens")


def workload(prefix: str = "h") -> list[list[Any]]:
    """The e2e truth workload's four phases (prefix sharing, pressure, return, long decodes),
    plus stops inside accepted drafts: every third long decode stops at a token it samples."""
    from tests.harness.sim_executor import token_at

    out = []
    n = 0
    for phase in phases():
        reqs = []
        for item in phase:
            item = dict(item)
            prompt = item.pop("prompt")
            tenant = item.pop("tenant", "")
            item.pop("temperature", None)
            item["ignore_eos"] = True
            rid = f"{prefix}{n}"
            if item["max_tokens"] > 100 and n % 3 == 0:
                # the simulated model's 40th output token is a stop token for this request
                item["stop_token_ids"] = [token_at(rid, len(prompt) + 40)]
            reqs.append(request(rid, prompt, tenant=tenant, **item))
            n += 1
        out.append(reqs)
    return out


@dataclass
class ModeRun:
    """A mode's engine run: the harness (with its truth), the events, the fold's accounts."""

    mode: Mode
    harness: Harness
    events: list[dict[str, Any]]
    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: dict[str, Any] = field(default_factory=dict)

    def truth(self, rid: str) -> dict[str, int]:
        return self.harness.truth.summary(rid)


def engine_config(broker: Config, data_dir: Path, name: str) -> Config:
    from sparseety.kafka import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    cfg = broker.replace(
        data_dir=str(data_dir),
        topics={
            **broker.topics.model_dump(),
            "engine_events": f"harness-{name}-{suffix}.engine-events",
            "partitions": 1,
        },
        producer={"engine_name": f"harness-{name}", "heartbeat_interval_s": 2.0},
    )
    ensure_topics(cfg, [cfg.topics.engine_events])
    return cfg


def fold(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
    out = [o for e in sorted(events, key=lambda e: (e["stream"], e["seq"])) for o in asm.apply(e)]
    return {o.record["request_id"]: o.record for o in out if o.topic == TIMELINES}


def run_mode(mode: Mode, model: Path, broker: Config, workdir: Path) -> ModeRun:
    """Build ``mode`` with the plugin publishing to ``broker``, drive the workload, read back."""
    cfg = engine_config(broker, workdir / mode.name, mode.name)
    with environ(to_env(cfg)):
        h = build(mode, model)
        try:
            drive(h, workload())
        finally:
            h.shutdown()  # the plugin sends EngineStopped and flushes
    n = len(h.finish)

    def done(events: list[dict[str, Any]]) -> bool:
        return sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in events) >= n

    events = engine_events(cfg, done)
    run = ModeRun(mode=mode, harness=h, events=events, accounts=fold(events))
    run.started = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)
    return run


def mismatches(run: ModeRun) -> list[str]:
    """Every (request, class) where the fold differs from the truth."""
    out = []
    h = run.harness
    for rid, tokens in h.outputs.items():
        acc = run.accounts.get(rid)
        if acc is None:
            out.append(f"{rid}: no accounting")
            continue
        t = run.truth(rid)
        if acc["output_tokens"] != len(tokens):
            out.append(f"{rid} output_tokens: fold {acc['output_tokens']} != engine {len(tokens)}")
        if not acc["consistent"]:
            out.append(f"{rid}: not consistent")
        for k in CLASSES:
            if int(acc[k]) != int(t[k]):
                out.append(f"{rid} {k}: fold {acc[k]} != truth {t[k]}")
    return out
