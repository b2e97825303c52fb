"""The relay against a real broker (issue 32): the engine side only builds and hands over, a
relay process encodes and produces. Its faults never reach the engine: a SIGKILLed relay is
replaced and what follows arrives once; a relay that stops reading fills the pipe, the
engine's hand-off refuses and counts, and the topic shows exactly that gap; a sidecar relay
(``sparseety relay --socket``) serves the same streams."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.broker import EmbeddedBroker
from sparseety.config import Config, to_env
from sparseety.kafka import ensure_topics
from sparseety.producers.emitter import Emitter
from sparseety.producers.shipper import ChildRelay, heartbeat_marker
from tests import factories as f
from tests.helpers import VENV_BIN, read_topic, running_broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    with running_broker(tmp_path_factory.mktemp("relay-broker")) as b:
        yield b


def _cfg(broker: EmbeddedBroker, tmp_path: Path, topic: str, **producer: Any) -> Config:
    cfg = broker.client_config().replace(
        data_dir=str(tmp_path / "data"),
        topics={"engine_events": topic, "partitions": 1},
        producer={"heartbeat_interval_s": 3600, "flush_timeout_s": 5, **producer},
    )
    ensure_topics(cfg, [cfg.topics.engine_events])
    return cfg


def _finished(i: int) -> tuple[str, dict[str, Any]]:
    return ev.REQUEST_FINISHED, f.request_finished(f"request-{i}", prompt=i, output=1, finish_reason="stop")


def _events(cfg: Config) -> list[dict[str, Any]]:
    return [r[3] for r in read_topic(cfg, cfg.topics.engine_events, quiet_s=1.0)]


def _relay_pid(em: Emitter) -> int:
    relay = em._shipper._relay if em._shipper is not None else None
    assert isinstance(relay, ChildRelay), relay
    return relay.proc.pid


def _emit_for(em: Emitter, start: int, seconds: float) -> tuple[int, float]:
    """Emit at ~5,000 events/s for ``seconds``; the next index and the slowest emit call."""
    i, worst = start, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            t0 = time.perf_counter()
            em.emit(_finished, i)
            worst = max(worst, time.perf_counter() - t0)
            i += 1
        time.sleep(0.01)
    return i, worst


def test_a_sigkilled_relay_is_replaced_and_nothing_after_it_is_lost_or_doubled(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    cfg = _cfg(broker, tmp_path, "relay-kill.engine-events")
    em = Emitter(cfg, engine_name="relay-kill", epoch="1")
    try:
        assert em.mode == "process"
        n, worst_before = _emit_for(em, 0, 1.5)
        first = _relay_pid(em)
        os.kill(first, signal.SIGKILL)  # under load
        n, worst_during = _emit_for(em, n, 3.0)
        assert em.wait_idle(60), em.counters()
        second = _relay_pid(em)
        assert second != first and em._shipper is not None and em._shipper.relays_started == 2
        # the engine's side never waited: an emit stays a lock and an append
        assert max(worst_before, worst_during) < 0.05
    finally:
        stats = em.close()
    seqs = [e["seq"] for e in _events(cfg) if ev.payload_type(e) == ev.REQUEST_FINISHED]
    assert len(seqs) == len(set(seqs)), "an event was produced twice"
    # what the killed relay held unacknowledged is a seq gap (the fold marks it lost); every
    # event handed over after the new relay started arrived
    assert max(seqs) == n - 1
    lost = n - len(seqs)
    assert 0 <= lost < n // 2
    assert stats.produced >= len(seqs) - stats.produced  # the new relay counted from the old one's totals
    assert not any((cfg.spill_path / "relay-kill" / "core").glob("*.seg"))


def test_a_relay_that_stops_reading_costs_counted_drops_and_the_gap_says_so(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """SIGSTOP the relay: its inbox and the pipe fill, the engine's bounded hand-off refuses
    (``queue_full``), the engine never blocks; after SIGCONT every event not counted as dropped
    arrives, and the Heartbeat says how many were."""
    cfg = _cfg(broker, tmp_path, "relay-stop.engine-events", queue_max_events=2_000)
    em = Emitter(cfg, engine_name="relay-stop", epoch="1")
    try:
        n, _ = _emit_for(em, 0, 0.5)
        assert em.wait_idle(30), em.counters()
        pid = _relay_pid(em)
        os.kill(pid, signal.SIGSTOP)
        try:
            n, worst = _emit_for(em, n, 6.0)  # ~30,000 events against a 2,000-event hand-off
        finally:
            os.kill(pid, signal.SIGCONT)
        assert worst < 0.05
        assert em.wait_idle(60), em.counters()
        dropped = em.counters()["dropped"]
        assert dropped > 0 and em.stats.dropped_by.get("queue_full") == dropped
        em.handoff.emit(heartbeat_marker)  # one heartbeat now: the relay fills in its counters
        assert em.wait_idle(30)
    finally:
        em.close()
    events = _events(cfg)
    seqs = {e["seq"] for e in events}
    assert len(seqs) == len(events)
    assert len(set(range(max(seqs) + 1)) - seqs) == dropped  # the gap is exactly what was counted
    (beat,) = [e for e in events if ev.payload_type(e) == ev.HEARTBEAT]
    assert ev.payload(beat)["dropped"] == dropped
    assert ev.payload(beat)["produced"] > 0


def test_a_sidecar_relay_serves_engines_on_a_unix_socket(broker: EmbeddedBroker, tmp_path: Path) -> None:
    socket_path = tmp_path / "relay.sock"
    side_cfg = _cfg(broker, tmp_path, "relay-side.engine-events")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update(to_env(side_cfg))
    sidecar = subprocess.Popen(
        [str(VENV_BIN / "sparseety"), "relay", "--socket", str(socket_path)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert sidecar.poll() is None, sidecar.stderr.read() if sidecar.stderr else ""
            assert time.monotonic() < deadline, "the sidecar never listened"
            time.sleep(0.1)
        engine_cfg = side_cfg.replace(producer={"relay": f"unix:{socket_path}"})
        emitters = [Emitter(engine_cfg, engine_name=f"side-{k}", epoch="1") for k in range(2)]
        for em in emitters:
            for i in range(300):
                em.emit(_finished, i)
        for em in emitters:
            assert em.wait_idle(30), em.counters()
            assert em.close().produced == 300
    finally:
        sidecar.send_signal(signal.SIGTERM)
        _, err = sidecar.communicate(timeout=30)
    assert sidecar.returncode == 0, err
    by_engine: dict[str, list[int]] = {}
    for e in _events(side_cfg):
        by_engine.setdefault(e["engine_name"], []).append(e["seq"])
    assert by_engine == {"side-0": list(range(300)), "side-1": list(range(300))}


def test_the_configuration_is_announced_again_after_a_broker_lost_its_log(tmp_path: Path) -> None:
    """Issue 31: the broker restarts with memory storage (the topic and the epoch's EngineStarted
    are gone); once Kafka takes events again the relay reports the recovery and the engine side
    announces EngineStarted again, so a fresh worker gets the configuration back."""
    with running_broker(tmp_path / "broker") as own:
        cfg = _cfg(own, tmp_path, "relay-announce.engine-events", announce_interval_s=3600)
        em = Emitter(cfg, engine_name="relay-announce", epoch="1", stall_s=2.0)
        try:
            em.announce(ev.ENGINE_STARTED, f.engine_started(served_model_name="announced"))
            for i in range(20):
                em.emit(_finished, i)
            assert em.wait_idle(30), em.counters()
            kinds = [ev.payload_type(e) for e in _events(cfg)]
            assert kinds.count(ev.ENGINE_STARTED) == 1  # once, while nothing went wrong
            own.stop()
            for i in range(20, 40):
                em.emit(_finished, i)
            time.sleep(3)
            EmbeddedBroker(own.cfg).start(create_topics=False)
            ensure_topics(cfg, [cfg.topics.engine_events])
            deadline = time.monotonic() + 60
            while True:
                after = _events(cfg)
                if any(ev.payload_type(e) == ev.ENGINE_STARTED for e in after):
                    break
                assert time.monotonic() < deadline, [ev.payload_type(e) for e in after]
                for i in range(40, 45):
                    em.emit(_finished, i)
        finally:
            em.close()
    (again,) = [e for e in after if ev.payload_type(e) == ev.ENGINE_STARTED]
    assert ev.payload(again)["served_model_name"] == "announced" and again["seq"] > 20
