"""The assembler as a real Faust worker against the real broker: same answers as the pure fold,
dead letters for bad input, and identical results after a SIGKILL mid-stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiokafka.partitioner import murmur2

from sparseety import events as ev
from sparseety.config import Config
from sparseety.kafka import make_encoder
from sparseety.schema_store import SchemaStore
from sparseety.serde import Decoder, Encoder
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import ComponentProcess, latest_by_key, produce_events, produce_raw, read_topic, wait_for
from tests.sim import SimEngine, workload


def worker_cfg(cfg: Config, unique: str) -> Config:
    return cfg.replace(
        worker={
            **cfg.worker.model_dump(),
            "app_id": f"asm-{unique}",
            "session_timeout_s": 6.0,
            "commit_interval_s": 0.5,
            "take_within_s": 0.1,
            "take_max": 200,
            "closed_retention_s": 5.0,
        }
    )


def expected_outputs(cfg: Config, events: list[dict[str, Any]]) -> tuple[dict[bytes, Any], dict[bytes, Any]]:
    """The pure fold's outputs as a reader of the topics sees them (through the wire codec, so
    fields the fold leaves to their schema default read as that default)."""
    asm = Assembler(cfg.worker, MemoryStore())
    store = SchemaStore.load()
    dec = Decoder(store)
    encoders: dict[str, Encoder] = {}
    timelines, usage = {}, {}
    for e in events:
        for o in asm.apply(e):
            enc = encoders.setdefault(o.record_name, Encoder(store, o.record_name))
            record = dec.decode(enc.encode(o.record))[1]
            (timelines if o.topic == TIMELINES else usage)[o.key.encode()] = record
    return timelines, usage


def fields_apart(got: dict[bytes, Any], want: dict[bytes, Any]) -> list[tuple[Any, ...]]:
    """(key, field, got, want) where two sets of records differ (readable where == is not)."""
    apart: list[tuple[Any, ...]] = [(k, "missing", None, None) for k in want.keys() - got.keys()]
    for k in want.keys() & got.keys():
        for name in want[k].keys() | got[k].keys():
            g, w = got[k].get(name), want[k].get(name)
            if g != w and isinstance(g, list) and isinstance(w, list) and len(g) == len(w):
                for i, (gi, wi) in enumerate(zip(g, w, strict=True)):
                    if isinstance(gi, dict) and isinstance(wi, dict):
                        apart += [
                            (k, f"{name}[{i}].{n}", gi.get(n), wi.get(n))
                            for n in wi
                            if gi.get(n) != wi.get(n)
                        ]
                    elif gi != wi:
                        apart.append((k, f"{name}[{i}]", gi, wi))
            elif g != w:
                apart.append((k, name, g, w))
    return sorted(apart, key=str)


def sim_events(n: int, seed: int, engines: int = 2) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(engines):
        out += SimEngine(
            engine=f"engine-{i}", seed=seed + i, spec_k=2, preempt_prob=0.1, cache_blocks=24
        ).run(workload(n, seed=seed + i))
    return out


@pytest.fixture
def worker_factory(kafka_cfg: Config, unique: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    procs: list[ComponentProcess] = []
    cfg = worker_cfg(kafka_cfg, unique)

    def start(name: str = "w") -> ComponentProcess:
        p = ComponentProcess(
            cfg, ["worker", "--loglevel", "info"], tmp_path / f"{name}-{len(procs)}.log"
        ).start()
        procs.append(p)
        return p

    yield cfg, start
    for p in procs:
        p.stop()


def test_worker_matches_the_pure_fold_and_dead_letters_bad_input(worker_factory: Any) -> None:
    cfg, start = worker_factory
    events = sim_events(20, seed=11)
    produce_events(cfg, events)
    truncated = make_encoder(cfg, "EngineEvent", cfg.topics.engine_events).encode(events[-1])[:-4]
    # issue 12: schema-valid but negative counts are dead-lettered, never billed
    negative = make_encoder(cfg, "EngineEvent", cfg.topics.engine_events).encode(
        f.wrap(0, ev.REQUEST_FINISHED, f.request_finished("neg", output=-5, cached=-3))
    )
    produce_raw(
        cfg,
        cfg.topics.engine_events,
        [(b"engine-0", b"\x00garbage"), (b"engine-0", truncated), (b"engine-0", negative)],
    )
    want_t, want_u = expected_outputs(cfg, events)
    worker = start()

    def done() -> bool:
        assert worker.alive(), worker.tail()
        return len(latest_by_key(read_topic(cfg, cfg.topics.timelines))) >= len(want_t)

    wait_for(done, 180, 2, "timelines")
    records = read_topic(cfg, cfg.topics.timelines)
    got_t = latest_by_key(records)
    assert fields_apart(got_t, want_t) == []
    # Outputs go as record batches (compat.send_batches): each in the partition Kafka's default
    # partitioner (murmur2 of the key, as Java's and aiokafka's) gives its key, as Topic.send did.
    assert {p for p, _, _, _ in records} == {0, 1}
    assert all(p == (murmur2(key) & 0x7FFFFFFF) % 2 for p, _, key, _ in records)
    assert all(acc["consistent"] for acc in got_t.values())
    wait_for(lambda: len(latest_by_key(read_topic(cfg, cfg.topics.usage))) >= len(want_u), 60, 1, "usage")
    assert latest_by_key(read_topic(cfg, cfg.topics.usage)) == want_u
    dead = [r[3] for r in read_topic(cfg, cfg.topics.dlq)]
    assert sorted(d["error_type"] for d in dead) == [
        "BadMagicError",
        "InvalidEventError",
        "TruncatedPayloadError",
    ]
    assert {d["value"] for d in dead} == {b"\x00garbage", truncated, negative}
    assert any("num_output_tokens = -5" in d["reason"] for d in dead)
    assert all(
        d["topic"] == cfg.topics.engine_events and d["offset"] >= 0 and d["key"] == b"engine-0" for d in dead
    )


def test_sigkill_mid_stream_gives_identical_results(worker_factory: Any) -> None:
    cfg, start = worker_factory
    events = sim_events(150, seed=5)
    want_t, want_u = expected_outputs(cfg, events)
    half = len(events) // 2
    produce_events(cfg, events[:half])
    worker = start("first")
    # Kill it while it is busy: as soon as some outputs exist, not all.
    wait_for(
        lambda: len(read_topic(cfg, cfg.topics.timelines)) > 20 or not worker.alive(), 180, 0.5, "progress"
    )
    assert worker.alive(), worker.tail()
    produce_events(cfg, events[half:])
    worker.kill()
    partial = len(latest_by_key(read_topic(cfg, cfg.topics.timelines)))
    assert partial < len(want_t)
    second = start("second")
    wait_for(
        lambda: (
            len(latest_by_key(read_topic(cfg, cfg.topics.timelines))) >= len(want_t) or not second.alive()
        ),
        300,
        2,
        "all timelines after restart",
    )
    assert second.alive(), second.tail()
    wait_for(lambda: len(latest_by_key(read_topic(cfg, cfg.topics.usage))) >= len(want_u), 60, 1, "usage")
    assert latest_by_key(read_topic(cfg, cfg.topics.timelines)) == want_t
    assert latest_by_key(read_topic(cfg, cfg.topics.usage)) == want_u
