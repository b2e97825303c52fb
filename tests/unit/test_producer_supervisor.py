"""The emitter's background thread built from its parts alone (no Emitter): a hand-off, a
ledger and a Kafka link over a scripted client, with the real Avro encoder. What the engine
thread hands over arrives encoded, in seq order, under the identity bound later."""

from __future__ import annotations

import functools
from pathlib import Path

from sparseety.kafka import make_decoder, make_encoder
from sparseety.producers.handoff import Handoff
from sparseety.producers.kafka_client import KafkaLink, WarnOnce, producer_settings
from sparseety.producers.ledger import Ledger
from sparseety.producers.supervisor import StreamIdentity, StreamSettings, Supervisor
from tests.unit.test_producer_emitter import World, _cfg, _payload, _wait


def _parts(tmp_path: Path, world: World) -> tuple[Handoff, Supervisor]:
    cfg = _cfg(tmp_path)
    pc = cfg.producer
    warn_once = WarnOnce("core")
    handoff = Handoff(pc.queue_max_events)
    link = KafkaLink(
        producer_settings(cfg, memory_limit_bytes=pc.memory_limit_bytes, stream="core"),
        topic=cfg.topics.engine_events,
        factory=world.factory,
        warn_once=warn_once,
    )
    ledger = Ledger(
        link,
        limit_bytes=pc.memory_limit_bytes,
        journal_dir=tmp_path / "unbound",
        journal_max_bytes=pc.spill_max_bytes,
        stream="core",
        warn_once=warn_once,
    )
    supervisor = Supervisor(
        StreamSettings(stream="core", producer=pc, stall_s=10.0),
        handoff=handoff,
        ledger=ledger,
        link=link,
        new_encoder=functools.partial(make_encoder, cfg, "EngineEvent", cfg.topics.engine_events),
        warn_once=warn_once,
    )
    return handoff, supervisor


def test_a_supervisor_runs_from_its_parts_without_an_emitter(tmp_path: Path) -> None:
    world = World()
    handoff, supervisor = _parts(tmp_path, world)
    supervisor.thread.start()
    _wait(lambda: supervisor.link.connected)  # the client connects before the stream is named
    assert world.clients == 1 and not world.delivered

    supervisor.bind(StreamIdentity("e", "e@1"), tmp_path / "journal")
    handoff.open()
    for i in range(5):
        handoff.emit(_payload, i)
    handoff.emit_many(3, lambda: [_payload(i) for i in (5, 6, 7)])
    _wait(lambda: len(world.delivered) == 8)
    handoff.close()
    supervisor.stop(timeout=2)
    assert supervisor.done.is_set()

    dec = make_decoder(_cfg(tmp_path))
    events = [dec.decode(v)[1] for v in world.delivered]
    assert [e["seq"] for e in events] == list(range(8))
    assert {(e["engine_name"], e["engine_id"], e["stream"]) for e in events} == {("e", "e@1", "core")}
    assert [e["payload"][1]["request_id"] for e in events] == [f"r{i}" for i in range(8)]
    assert supervisor.link.key == b"e" and supervisor.ledger.stats.produced == 8


def test_no_part_of_the_emitter_imports_it() -> None:
    """The parts get what they need from the emitter; none reaches back into it (its users, the
    engine-side producers, are the only importers of ``producers/emitter.py``)."""
    import ast

    import sparseety.producers as producers

    root = Path(producers.__file__).parent
    parts = ("handoff", "supervisor", "ledger", "kafka_client", "reporting", "journal", "metrics")
    importers = []
    for name in parts:
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "emitter":
                importers.append(name)
    assert importers == []
