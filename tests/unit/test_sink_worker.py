"""SinkFeeder (formerly SinkWorker), the Kafka-independent part of ``sparseety sink``: dead letters for
bad input, and a partition whose write keeps failing held unacked and paused until its data is written."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.errors import SinkWriteError
from sparseety.kafka import make_decoder, make_encoder
from sparseety.sinks import consumer
from sparseety.sinks.base import Batch, FlushResult, Sink
from sparseety.sinks.consumer import SinkFeeder
from tests import factories as f

CFG = load_config()
DLQ = "dlq"


@dataclass
class Msg:
    topic: str
    partition: int
    offset: int
    value: bytes
    key: bytes | None = b"k"


@dataclass
class Controls:
    paused: set[tuple[str, int]] = field(default_factory=set)
    acked: list[Msg] = field(default_factory=list)

    def pause(self, tps: set[tuple[str, int]]) -> None:
        self.paused |= tps

    def resume(self, tps: set[tuple[str, int]]) -> None:
        self.paused -= tps

    def ack(self, message: Msg) -> None:
        self.acked.append(message)


class MemorySink(Sink):
    """Keeps what it is given; partitions in ``broken`` cannot be written."""

    records = frozenset({ev.REQUEST_ACCOUNTING, ev.USAGE_WINDOW, ev.DEAD_LETTER})

    def __init__(self) -> None:
        self.stored: list[tuple[str, dict[str, Any], str, int, int]] = []
        self.buffer: list[tuple[str, dict[str, Any], str, int, int]] = []
        self.broken: set[tuple[str, int]] = set()

    @classmethod
    def from_config(cls, cfg: Any, **options: Any) -> MemorySink:
        return cls()

    def add(self, record_name: str, record: Any, *, topic: str, partition: int, offset: int) -> None:
        self.buffer.append((record_name, record, topic, partition, offset))

    def pending_rows(self) -> int:
        return len(self.buffer)

    def pending_batches(self) -> list[Batch]:
        tps = sorted({(b[2], b[3]) for b in self.buffer})
        return [Batch(t, p, 0, 0) for t, p in tps]

    def flush(self) -> FlushResult:
        ok = [b for b in self.buffer if (b[2], b[3]) not in self.broken]
        self.stored += ok
        self.buffer = [b for b in self.buffer if (b[2], b[3]) in self.broken]
        result = FlushResult(rows={"rows": len(ok)} if ok else {})
        if self.buffer:
            failed = [b.as_tuple() for b in self.pending_batches()]
            raise SinkWriteError("broken", failed=failed, result=result)
        return result

    def discard(self, topic: str, partition: int) -> int:
        before = len(self.buffer)
        self.buffer = [b for b in self.buffer if (b[2], b[3]) != (topic, partition)]
        return before - len(self.buffer)

    def close(self) -> None:
        pass


def make_worker(sink: MemorySink) -> tuple[SinkFeeder, Controls, list[tuple[bytes | None, dict[str, Any]]]]:
    sent: list[tuple[bytes | None, dict[str, Any]]] = []

    async def send(items: list[tuple[bytes | None, dict[str, Any]]]) -> None:
        sent.extend(items)

    controls = Controls()
    return SinkFeeder(sink, make_decoder(CFG), DLQ, send, controls), controls, sent


def accounting(i: int, partition: int = 0) -> Msg:
    enc = make_encoder(CFG, "RequestAccounting", "timelines")
    return Msg("timelines", partition, i, enc.encode(f.accounting(f"{f.EID}/r{i}")))


def test_bad_input_is_dead_lettered_with_its_position() -> None:
    sink = MemorySink()
    worker, controls, sent = make_worker(sink)
    engine_event = make_encoder(CFG, "EngineEvent", "x").encode(f.one_of_each()[0])
    msgs = [
        accounting(0),
        Msg("timelines", 0, 1, b"\x00junk", key=b"bad"),
        Msg("usage", 1, 7, engine_event, key=None),
        Msg(DLQ, 0, 3, b"\xc3\x01short"),  # an unreadable dead letter is stored, not re-sent
    ]
    asyncio.run(worker.process(msgs))
    assert [(k, d["error_type"], d["topic"], d["partition"], d["offset"]) for k, d in sent] == [
        (b"bad", "BadMagicError", "timelines", 0, 1),
        (None, "InvalidEventError", "usage", 1, 7),
    ]
    assert sent[0][1]["value"] == b"\x00junk" and sent[0][1]["component"] == "sink"
    names = [(s[0], s[2], s[3], s[4]) for s in sink.stored]
    assert names == [(ev.REQUEST_ACCOUNTING, "timelines", 0, 0), (ev.DEAD_LETTER, DLQ, 0, 3)]
    assert sink.stored[1][1]["error_type"] == "TruncatedPayloadError"
    assert sink.stored[1][1]["value"] == b"\xc3\x01short"
    assert worker.dead_letters == 2 and worker.records == 1
    assert controls.paused == set() and worker.held == {}  # nothing held


def test_a_failing_partition_is_held_and_paused_until_written() -> None:
    sink = MemorySink()
    sink.broken = {("timelines", 1)}
    worker, controls, _ = make_worker(sink)
    msgs = [accounting(0, 0), accounting(1, 1), accounting(2, 1)]
    asyncio.run(worker.process(msgs))
    # partition 0 written; partition 1 kept in the sink, its messages held (the loop does not
    # commit their offsets) and the partition paused
    assert [s[4] for s in sink.stored] == [0]
    assert worker.held == {("timelines", 1): msgs[1:]}
    assert controls.paused == {("timelines", 1)}
    asyncio.run(worker.retry())
    assert controls.paused == {("timelines", 1)} and controls.acked == []
    sink.broken.clear()
    asyncio.run(worker.retry())
    assert [s[4] for s in sink.stored] == [0, 1, 2]
    assert controls.paused == set()
    assert controls.acked == msgs[1:] and worker.held == {}


def test_revoked_partitions_drop_their_buffer_and_held_messages() -> None:
    sink = MemorySink()
    sink.broken = {("timelines", 1)}
    worker, controls, _ = make_worker(sink)
    asyncio.run(worker.process([accounting(1, 1)]))
    worker.revoked({("timelines", 1)})
    assert sink.pending_rows() == 0 and worker.held == {}
    asyncio.run(worker.retry())
    assert controls.acked == []  # never acked: the new owner re-reads from the last commit


def test_an_unexpected_error_exits_without_acknowledging(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(consumer.os, "_exit", fake_exit)
    sink = MemorySink()
    worker, controls, _ = make_worker(sink)

    def broken_flush() -> FlushResult:
        raise RuntimeError("bug")

    monkeypatch.setattr(sink, "flush", broken_flush)
    with pytest.raises(Exited) as info:
        asyncio.run(worker.process([accounting(0)]))
    assert info.value.args == (70,)
    assert controls.acked == []


def test_a_large_batch_is_written_in_parts_before_its_end() -> None:
    sink = MemorySink()
    worker, controls, _ = make_worker(sink)
    worker.max_rows = 2
    writes = []
    flush = sink.flush

    def counting_flush() -> FlushResult:
        writes.append(len(sink.buffer))
        return flush()

    sink.flush = counting_flush  # type: ignore[method-assign]
    msgs = [accounting(i) for i in range(5)]
    asyncio.run(worker.process(msgs))
    assert writes == [2, 2, 1] and len(sink.stored) == 5
    assert worker.held == {} and controls.paused == set()  # nothing held
