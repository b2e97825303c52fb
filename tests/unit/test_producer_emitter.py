"""The emitter against a scripted Kafka client: order, memory bound, spill and drain, drops,
stalled clients, shutdown into the journal and recovery from it on the next start."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.kafka import make_decoder
from sparseety.producers.emitter import Emitter
from tests import factories as f


class _Err:
    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name

    def fatal(self) -> bool:
        return False


class _Msg:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def value(self) -> bytes:
        return self._value


class World:
    """A pretend Kafka cluster: ``up`` delivers, ``down`` keeps messages queued in the client,
    ``stuck`` accepts connections but never acknowledges (a broker that forgot the producer)."""

    def __init__(self) -> None:
        self.state = "up"
        self.delivered: list[bytes] = []
        self.clients = 0
        self.lock = threading.Lock()

    def factory(self, conf: dict[str, Any]) -> FakeProducer:
        self.clients += 1
        return FakeProducer(self, conf, self.clients)


class FakeProducer:
    def __init__(self, world: World, conf: dict[str, Any], generation: int) -> None:
        self.world = world
        self.conf = conf
        self.generation = generation
        self.queue: list[tuple[bytes, Any]] = []
        self.purged: list[tuple[bytes, Any]] = []
        self.cap_bytes = conf["queue.buffering.max.kbytes"] * 1024

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any) -> None:
        if sum(len(v) for v, _ in self.queue) + len(value) > self.cap_bytes:
            raise BufferError("Local: Queue full")
        self.queue.append((value, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        purged, self.purged = self.purged, []
        for value, cb in purged:
            cb(_Err("_PURGE_QUEUE"), _Msg(value))
        stuck = self.world.state == "stuck" and self.generation == self.world.clients
        if self.world.state == "up" or (self.world.state == "stuck" and not stuck):
            queue, self.queue = self.queue, []
            for value, cb in queue:
                with self.world.lock:
                    self.world.delivered.append(value)
                cb(None, _Msg(value))
            return len(queue) + len(purged)
        time.sleep(timeout)
        return len(purged)

    def purge(self, *args: Any) -> None:
        self.purged += self.queue
        self.queue = []

    def flush(self, timeout: float = 0) -> int:
        self.poll(0)
        return len(self.queue)

    def __len__(self) -> int:
        return len(self.queue) + len(self.purged)


def _cfg(tmp_path: Path, **producer: Any) -> Config:
    base = {"heartbeat_interval_s": 3600, "memory_limit_bytes": 1024 * 1024, "flush_timeout_s": 5}
    return load_config(data_dir=str(tmp_path), producer={**base, **producer})


def _emitter(tmp_path: Path, **producer: Any) -> tuple[Config, World, Emitter]:
    """An emitter of engine "e" (epoch 1) producing through a fresh :class:`World`."""
    cfg = _cfg(tmp_path, **producer)
    world = World()
    return cfg, world, Emitter(cfg, engine_name="e", epoch="1", producer_factory=world.factory)


def _payload(i: int, pad: int = 0) -> tuple[str, dict[str, Any]]:
    return ev.REQUEST_FINISHED, f.request_finished(
        f"r{i}" + "x" * pad, prompt=1, output=1, finish_reason="stop"
    )


def _seqs(cfg: Config, values: list[bytes]) -> list[int]:
    dec = make_decoder(cfg)
    return [dec.decode(v)[1]["seq"] for v in values]


def _wait(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_events_arrive_in_seq_order(tmp_path: Path) -> None:
    cfg, world, em = _emitter(tmp_path)
    for i in range(500):
        em.emit(_payload, i)
    stats = em.close()
    assert _seqs(cfg, world.delivered) == list(range(500))
    assert stats.produced == 500 and stats.dropped == 0 and stats.spilled == 0


def test_outage_spills_past_the_memory_bound_then_drains_in_order(tmp_path: Path) -> None:
    cfg, world, em = _emitter(tmp_path)
    for i in range(50):
        em.emit(_payload, i)
    _wait(lambda: len(world.delivered) == 50)
    world.state = "down"
    for i in range(50, 6000):
        em.emit(_payload, i, 300)  # ~350 B each: ~2 MB, twice the memory bound
    _wait(lambda: em.queued == 0 and em.counters()["spilled"] > 0)
    spilled = em.counters()["spilled"]
    assert len(list((tmp_path / "spill" / "e" / "core").glob("*.seg"))) >= 1
    for i in range(6000, 6100):  # arriving while the journal holds events: go behind them
        em.emit(_payload, i)
    world.state = "up"
    _wait(em.idle)
    stats = em.close()
    assert _seqs(cfg, world.delivered) == list(range(6100))
    assert stats.dropped == 0
    assert stats.spilled >= spilled > 1000
    assert stats.drained == stats.spilled
    assert not list((tmp_path / "spill" / "e" / "core").glob("*.seg"))


def test_full_queue_drops_and_leaves_a_gap(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, queue_max_events=16)
    world = World()
    gate = threading.Event()

    def slow(i: int) -> tuple[str, dict[str, Any]]:
        gate.wait(10)
        return _payload(i)

    em = Emitter(cfg, engine_name="e", epoch="1", producer_factory=world.factory)
    for i in range(40):
        em.emit(slow, i)
    gate.set()
    _wait(em.idle)
    em.emit(_payload, 40)
    stats = em.close()
    seqs = _seqs(cfg, world.delivered)
    assert em.counters()["dropped"] == 41 - len(seqs) > 0
    assert seqs == sorted(seqs) and seqs[-1] == 40  # a gap before 40, never reordering
    assert stats.produced == len(seqs)


def test_unbuildable_event_is_dropped_not_fatal(tmp_path: Path) -> None:
    cfg, world, em = _emitter(tmp_path)
    em.emit(_payload, 0)
    em.emit(lambda: (ev.STEP_BATCH, {"bad": 1}))
    em.emit(_payload, 2)
    stats = em.close()
    assert _seqs(cfg, world.delivered) == [0, 2]
    assert stats.dropped_by == {"unencodable": 1}


def test_journal_full_drops(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, spill_max_bytes=1024 * 1024)
    world = World()
    world.state = "down"
    em = Emitter(cfg, engine_name="e", epoch="1", producer_factory=world.factory)
    for i in range(12000):
        em.emit(_payload, i, 300)
    _wait(lambda: em.queued == 0 and em.counters()["dropped"] > 0)
    world.state = "up"
    _wait(em.idle)
    stats = em.close()
    seqs = _seqs(cfg, world.delivered)
    assert stats.dropped_by.get("journal_full", 0) == 12000 - len(seqs)
    assert seqs == sorted(seqs)


def test_stuck_client_is_recreated_and_nothing_is_lost(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    world = World()
    em = Emitter(cfg, engine_name="e", epoch="1", producer_factory=world.factory, stall_s=0.3)
    world.state = "stuck"
    for i in range(300):
        em.emit(_payload, i)
    _wait(lambda: world.clients >= 2)
    world.state = "up"
    _wait(em.idle)
    stats = em.close()
    assert stats.restarts >= 1
    assert sorted(set(_seqs(cfg, world.delivered))) == list(range(300))
    assert stats.dropped == 0


def test_shutdown_while_kafka_is_away_journals_and_next_start_drains_first(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, flush_timeout_s=1)
    world = World()
    world.state = "down"
    em = Emitter(cfg, engine_name="e", epoch="1", producer_factory=world.factory)
    for i in range(200):
        em.emit(_payload, i)
    t0 = time.monotonic()
    stats = em.close()
    assert time.monotonic() - t0 < 8
    assert stats.spilled == 200 and stats.produced == 0
    world.state = "up"
    em2 = Emitter(cfg, engine_name="e", epoch="2", producer_factory=world.factory)
    em2.emit(_payload, 0)
    em2.close()
    dec = make_decoder(cfg)
    got = [dec.decode(v)[1] for v in world.delivered]
    assert [(e["engine_id"], e["seq"]) for e in got] == [("e@1", i) for i in range(200)] + [("e@2", 0)]


def test_heartbeats_carry_the_counters(tmp_path: Path) -> None:
    cfg, world, em = _emitter(tmp_path, heartbeat_interval_s=0.1)
    for i in range(10):
        em.emit(_payload, i)
    time.sleep(0.5)
    em.close()
    dec = make_decoder(cfg)
    beats = [dec.decode(v)[1] for v in world.delivered]
    beats = [e["payload"][1] for e in beats if e["payload"][0] == ev.HEARTBEAT]
    assert beats and beats[-1]["produced"] >= 10
    assert set(beats[-1]) == {"queued", "produced", "dropped", "spilled", "drained"}


@pytest.mark.parametrize("n", [1, 3])
def test_emit_never_raises_after_close(tmp_path: Path, n: int) -> None:
    _, _, em = _emitter(tmp_path)
    em.close()
    for i in range(n):
        em.emit(_payload, i)
    assert em.counters()["dropped"] == n


def test_unbound_emitter_connects_first_and_names_its_stream_later(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    world = World()
    em = Emitter(cfg, engine_name=None, epoch=None, stream="worker-0", producer_factory=world.factory)
    _wait(lambda: world.clients == 1)  # the Kafka client exists before the stream has a name
    em.emit(_payload, 0)  # too early: dropped, and counted
    em.bind("e", "7")
    em.emit(_payload, 1)
    em.close()
    dec = make_decoder(cfg)
    got = [dec.decode(v)[1] for v in world.delivered]
    assert [(e["engine_id"], e["stream"], e["seq"]) for e in got] == [("e@7", "worker-0", 1)]
    assert em.counters()["dropped"] == 1


def test_emit_many_takes_consecutive_seqs_and_a_short_builder_leaves_gaps(tmp_path: Path) -> None:
    cfg, world, em = _emitter(tmp_path)
    em.emit(_payload, 0)
    em.emit_many(3, lambda: [_payload(i) for i in (1, 2, 3)])
    em.emit_many(3, lambda: [_payload(4)])  # announced 3, built 1: seqs 5 and 6 are lost
    em.emit_many(1, lambda: [_payload(7)])
    em.emit(_payload, 8)
    stats = em.close()
    assert _seqs(cfg, world.delivered) == [0, 1, 2, 3, 4, 7, 8]
    assert stats.dropped_by == {"unencodable": 2}


def test_the_emitter_yields_the_gil_between_back_to_back_events_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A yield costs ~20 µs of CPU (time.sleep(0)); it was paid after every event and again after
    # every hand-off. Now only an event that follows another without an idle wait pays one.
    from sparseety.producers import supervisor

    yields: list[int] = []
    monkeypatch.setattr(supervisor, "_yield_gil", lambda: yields.append(1))
    cfg, world, em = _emitter(tmp_path)
    em.close()  # the thread is gone; drive its loop body by hand
    sup = em._supervisor
    sup._service(idle=True)
    sup._handle_batch([(0, 0, 0, 0, _payload, (0,))])
    assert yields == []  # a step's one event after an idle wait: nothing to yield for
    sup._handle_batch(
        [(1, 0, 0, 0, _payload, (1,)), (2, 3, 0, 0, lambda: [_payload(i) for i in (2, 3, 4)], ())]
    )
    assert len(yields) == 4  # before each of the four that followed another
    sup._service(idle=True)
    sup._handle_batch([(5, 0, 0, 0, _payload, (5,))])
    sup._service(idle=False)
    assert len(yields) == 4
    sup.link.poll(0)
    assert _seqs(cfg, world.delivered) == list(range(6))


def test_a_busy_emitter_hands_the_gil_to_a_waiting_engine_thread(tmp_path: Path) -> None:
    # Without a yield between events the engine thread waits out the 5 ms switch interval each
    # time it wants the GIL back while the emitter works through a backlog.
    def slow_payload(i: int) -> tuple[str, dict[str, Any]]:
        deadline = time.perf_counter() + 0.0002  # ~200 µs of pure Python, holding the GIL
        while time.perf_counter() < deadline:
            pass
        return _payload(i)

    _, _, em = _emitter(tmp_path, queue_max_events=100_000)
    for i in range(5000):
        em.emit(slow_payload, i)
    waits = []
    for _ in range(100):
        t0 = time.perf_counter()
        time.sleep(0.0001)  # releases the GIL, as vLLM's I/O and torch calls do
        waits.append(time.perf_counter() - t0)
    assert em.queued > 0, (
        "the emitter finished its backlog before the measurement ended",
        sorted(waits)[::10],
    )
    em.close(timeout=1)
    waits.sort()
    assert waits[len(waits) // 2] < 0.0025, waits[len(waits) // 2]
