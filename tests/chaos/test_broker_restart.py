"""The embedded broker restarts under load (issue 12): its in-memory topics, offsets and the worker's
changelog are gone, yet ``sparseety up`` brings the stack back within a bounded time and every
request reaches the store exactly once. A store that outlives a restart it did not see coming
(``broker stop`` + ``broker start``) reads the new log from its start.

Real parts throughout: the stack's own broker, worker and store processes (started by the CLI, or
as processes of their own where the test restarts the broker behind their back), an
engine-side ``Emitter`` publishing a simulated engine's events before, during and after the outage
(it spills to its journal while the broker is away), and the store's SQL afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.broker import EmbeddedBroker
from sparseety.config import Config, load_config
from sparseety.kafka import ensure_topics
from sparseety.lifecycle import ready_file
from sparseety.producers.emitter import Emitter
from sparseety.sinks.clickhouse.client import Store
from sparseety.streams.app import EXIT_LOG_LOST
from tests.helpers import (
    VENV_BIN,
    ComponentProcess,
    finished_uids,
    free_port,
    produce_events,
    read_topic,
    running_broker,
    stack_env,
    stored_uids,
    wait_for,
)
from tests.sim import SimEngine, workload

UP_BOUND_S = 120.0  # `up` after the restart: the broker, topics and a fresh worker, on a loaded box


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "sparseety"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def emit(em: Emitter, events: list[dict[str, Any]]) -> None:
    for e in events:
        kind, payload = e["payload"]
        if kind == ev.ENGINE_STARTED:
            em.announce(kind, payload)  # as the plugins do: it is announced again after an outage
        else:
            em.emit_record(kind, payload)


def test_requests_before_during_and_after_a_broker_restart_are_stored_exactly_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    # the fresh worker meets the engine mid-stream (what it folded before died with the broker);
    # it declares the seqs below the journal's lost after this much event time
    env = stack_env(data, port, worker_allowed_lateness_s="5")
    cfg = load_config(
        data_dir=str(data),
        kafka={"bootstrap": f"127.0.0.1:{port}"},
        producer={"memory_limit_bytes": 1024 * 1024, "heartbeat_interval_s": 3600, "flush_timeout_s": 5},
    )
    sim = SimEngine(engine="restart", epoch="e1", spec_k=2, preempt_prob=0.1, cache_blocks=24, seed=5)
    events = sim.run(workload(1500, seed=5, max_prompt=120))  # 2.7 MB of events
    expected = {
        f"{e['engine_id']}/{e['payload'][1]['request_id']}"
        for e in events
        if e["payload"][0] == ev.REQUEST_FINISHED
    }
    # the outage's share is past the client's 1 MiB bound, so part of it goes to the journal
    cut1, cut2 = len(events) // 5, len(events) * 4 // 5
    started_before = {
        f"{e['engine_id']}/{e['payload'][1]['request_id']}"
        for e in events[:cut1]
        if e["payload"][0] == ev.REQUEST_STARTED
    }
    finished_before = {
        f"{e['engine_id']}/{e['payload'][1]['request_id']}"
        for e in events[:cut1]
        if e["payload"][0] == ev.REQUEST_FINISHED
    }
    spanning = started_before - finished_before
    em: Emitter | None = None
    try:
        up = cli(env, "up")
        assert up.returncode == 0, up.stderr[-3000:]
        em = Emitter(cfg, engine_name="restart", epoch="e1", stall_s=2.0)
        emit(em, events[:cut1])
        assert em.wait_idle(60), em.counters()
        # What only the old broker holds dies with it (its storage is memory): the requests the
        # first part finished are let through to the store before it goes away.
        wait_for(lambda: set(stored_uids(cfg)) >= finished_before, 180, 1.0, "the first requests stored")

        assert cli(env, "broker", "stop").returncode == 0
        emit(em, events[cut1:cut2])  # Kafka away: held, then spilled to the journal
        journal = cfg.spill_path / "restart" / "core"
        wait_for(lambda: any(journal.glob("*.seg")), 60, 0.5, "a spilled journal segment")
        time.sleep(10)

        started = time.monotonic()
        again = cli(env, "up", timeout=UP_BOUND_S + 60)
        took = time.monotonic() - started
        assert again.returncode == 0, again.stderr[-3000:]
        assert took < UP_BOUND_S, f"`up` took {took:.0f} s"
        print(f"up after the broker restart took {took:.1f} s")
        assert "restarting worker-0, store so they start on the new broker's log" in again.stderr

        time.sleep(6)  # the engine goes on serving: event time moves past the allowed lateness
        emit(em, events[cut2:])
        assert em.wait_idle(120), em.counters()
        counters = em.counters()
        assert counters["dropped"] == 0 and counters["drained"] == counters["spilled"] > 0, counters

        def all_stored() -> bool:
            return set(stored_uids(cfg)) >= expected

        try:
            wait_for(all_stored, 180, 2.0, "every request in the store")
        finally:
            uids = stored_uids(cfg)
            print(f"stored {len(set(uids) & expected)} of {len(expected)} requests")
        assert len(uids) == len(set(uids)) == len(expected), "a request is stored twice or a stray one"
        # The new broker's log: the journal's events, then the configuration announced again
        # once Kafka took events (the old log, with the epoch's first EngineStarted, is gone).
        new_log = [r[3] for r in read_topic(cfg, cfg.topics.engine_events, quiet_s=1.0)]
        announced = min(e["seq"] for e in new_log if ev.payload_type(e) == ev.ENGINE_STARTED)
        before_config = {
            f"{e['engine_id']}/{ev.payload(e)['request_id']}"
            for e in new_log
            if ev.payload_type(e) == ev.REQUEST_STARTED and e["seq"] < announced
        }
        assert cli(env, "down").returncode == 0
        with Store.open(cfg) as store:  # the rows themselves, not the deduplicating view
            rows = store.query(f"SELECT request_uid, seq_gap, consistent FROM {store.database}.requests")
        print(f"requests table: {len(rows)} rows, {len({r['request_uid'] for r in rows})} uids")
        assert len(rows) == len({r["request_uid"] for r in rows}) == len(expected)
        # Flagged are the requests in flight at the restart (they lost the events the old broker
        # held) and those the fresh worker admitted before the configuration came back (issue
        # 31: they were silently degraded before); every request admitted after it is whole.
        flagged = {r["request_uid"] for r in rows if r["seq_gap"] or not r["consistent"]}
        print(
            f"flagged: {len(flagged)}, in flight at the restart: {len(spanning)}, "
            f"admitted before the configuration was announced again: {len(before_config)}"
        )
        assert flagged <= spanning | before_config
        assert before_config <= flagged
        assert expected - spanning - before_config, "no request was admitted after the announcement"
    finally:
        if em is not None:
            em.close(5)
        down = cli(env, "down")
        for name in ("worker-0", "store", f"broker-{port}"):
            log = data / "logs" / f"{name}.log"
            if log.exists():
                print(f"--- {name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    assert down.returncode == 0, down.stderr


@pytest.mark.parametrize(
    "frozen", [False, True], ids=["changelog-gone", "frozen-while-the-new-log-outgrew-it"]
)
def test_a_worker_whose_broker_lost_its_log_ends_at_once(tmp_path: Path, frozen: bool) -> None:
    """Restarted behind the worker's back (``broker stop`` + ``broker start``), the in-memory broker
    comes back with the configured topics but without the worker's changelog: the worker says so
    in one line and exits (status 3) instead of waiting on the lost changelog forever, and writes
    nothing into the new log.

    ``frozen``: the worker is stopped (SIGSTOP) across the restart; before it wakes, its changelog
    is there again, empty (Tansu creates a missing topic for any client whose metadata request
    names it, the worker's own producer among them), and the new log has outgrown the worker's
    positions (an engine's journal drained into it). A CI run's worker, watching only for the
    changelog's name, waited out 180 s; another folded the new log's records from its old
    positions and wrote their state where no later worker could read it back."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    with running_broker(tmp_path / "broker") as broker:
        cfg = broker.client_config().replace(
            data_dir=str(tmp_path / "data"),
            worker={"session_timeout_s": 6.0, "tick_interval_s": 1.0, "take_within_s": 0.1},
        )
        changelog = f"{cfg.worker.app_id}-state-changelog"  # Faust's name for the table's changelog
        ensure_topics(cfg)
        worker = ComponentProcess(cfg, ["worker"], tmp_path / "worker.log").start()
        try:
            assert worker.proc is not None
            pid = worker.proc.pid
            wait_for(lambda: ready_file(cfg.data_path, "worker", pid).exists(), 120, 0.5, "the worker")
            old = SimEngine(engine="lost", epoch="e1", seed=3).run(workload(20, seed=3))
            produce_events(cfg, old)
            wait_for(lambda: read_topic(cfg, cfg.topics.timelines, quiet_s=1.0), 60, 1.0, "timelines")
            assert changelog in AdminClient(cfg.kafka.librdkafka()).list_topics(timeout=10).topics
            time.sleep(2 * cfg.worker.tick_interval_s)  # the watch has seen it

            if frozen:
                os.kill(pid, signal.SIGSTOP)
            broker.stop()
            time.sleep(2)
            started = time.monotonic()
            EmbeddedBroker(broker.cfg).start()  # the configured topics again, empty; no changelog
            if frozen:
                admin = AdminClient(cfg.kafka.librdkafka())
                admin.create_topics([NewTopic(changelog, cfg.topics.partitions, 1)])[changelog].result(10)
                # the same engine, so the same partition, twice as far
                new = SimEngine(engine="lost", epoch="e2", seed=4).run(workload(40, seed=4))
                assert len(new) > len(old)
                produce_events(cfg, new)
                os.kill(pid, signal.SIGCONT)
            assert worker.proc.wait(180) == EXIT_LOG_LOST, worker.tail()
            print(f"the worker ended {time.monotonic() - started:.1f} s after the broker restarted")
            assert worker.tail().count("the broker lost this worker's topics and offsets") == 1
            assert not ready_file(cfg.data_path, "worker", pid).exists()

            # nothing of the old worker in the new log: no output, no state
            assert read_topic(cfg, cfg.topics.timelines, quiet_s=1.0) == []
            reader = Consumer(cfg.kafka.librdkafka(**{"group.id": "check"}))
            try:
                topics = reader.list_topics(timeout=10).topics
                if changelog in topics:
                    ends = [
                        reader.get_watermark_offsets(TopicPartition(changelog, p), timeout=10)[1]
                        for p in topics[changelog].partitions
                    ]
                    assert ends == [0] * len(ends), ends
            finally:
                reader.close()
        finally:
            if frozen and worker.proc is not None and worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGCONT)  # never leave it frozen
            worker.stop()


def stale_commit(cfg: Config, offset: int) -> None:
    """Commit ``offset`` for every partition of the sink's topics, from outside its group (what
    an offsets tool does; Tansu accepts it for a group without members)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(cfg.kafka.librdkafka(**{"group.id": cfg.sink.group_id, "enable.auto.commit": False}))
    try:
        topics = [cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq]
        tps = [TopicPartition(t, p, offset) for t in topics for p in range(cfg.topics.partitions)]
        c.commit(offsets=tps, asynchronous=False)
        got = c.committed([TopicPartition(t.topic, t.partition) for t in tps], timeout=10)
        assert {t.offset for t in got} == {offset}, got
    finally:
        c.close()


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "frozen-with-stale-offsets"])
def test_a_store_that_outlived_a_broker_restart_stores_the_new_log_exactly_once(
    tmp_path: Path, frozen: bool
) -> None:
    """``broker stop`` + ``broker start`` behind the running store's back (what ``up`` leaves
    running when the broker is already back): the store's sink held committed offsets and fetch
    positions far beyond the new, empty topics' ends. It keeps running, says in one line that the
    broker lost its log, and every request of the new log (an engine's journal drained into it,
    then live events, through a fresh worker) is stored exactly once.

    ``frozen``: the store is stopped (SIGSTOP) across the restart and the new broker is given
    committed offsets of the old log's size for the sink's group before it wakes; Tansu answers
    fetches there with nothing, so a sink that started at those offsets would store nothing."""
    with running_broker(tmp_path / "broker") as broker:
        cfg = broker.client_config().replace(
            data_dir=str(tmp_path / "data"),
            api={"port": free_port()},
            worker={"session_timeout_s": 6.0, "tick_interval_s": 1.0, "take_within_s": 0.1},
            producer={"memory_limit_bytes": 1024 * 1024, "heartbeat_interval_s": 3600, "flush_timeout_s": 5},
        )
        ensure_topics(cfg)
        store_args = ["store", "--session-timeout", "6", "--commit-interval", "0.5", "--loglevel", "info"]
        store = ComponentProcess(cfg, store_args, tmp_path / "store.log").start()
        worker = ComponentProcess(cfg, ["worker"], tmp_path / "worker-0.log").start()
        fresh = ComponentProcess(cfg, ["worker"], tmp_path / "worker-1.log")
        # more records before the restart than the new log gets at first, so the sink's old
        # positions lie past every new partition's end
        before = SimEngine(engine="old", epoch="e1", seed=7).run(workload(300, seed=7))
        # an engine serving through the outage: past the client's 1 MiB, part of it is spilled
        during = SimEngine(engine="new", epoch="e1", seed=8).run(workload(800, seed=8, max_prompt=120))
        cut = len(during) * 4 // 5
        expected = finished_uids(before) | finished_uids(during)
        em: Emitter | None = None
        try:
            assert store.proc is not None and worker.proc is not None
            ready = cfg.data_path
            wait_for(lambda: ready_file(ready, "store", store.proc.pid).exists(), 120, 0.5, "store")
            wait_for(lambda: ready_file(ready, "worker", worker.proc.pid).exists(), 120, 0.5, "worker")
            produce_events(cfg, before)
            wait_for(lambda: set(stored_uids(cfg)) >= finished_uids(before), 120, 1.0, "the first requests")

            broker.stop()
            em = Emitter(cfg, engine_name="new", epoch="e1", stall_s=2.0)
            emit(em, during[:cut])  # Kafka away: held, then spilled to the journal
            journal = cfg.spill_path / "new" / "core"
            wait_for(lambda: any(journal.glob("*.seg")), 60, 0.5, "a spilled journal segment")
            if frozen:
                os.killpg(store.proc.pid, signal.SIGSTOP)
            EmbeddedBroker(broker.cfg).start()  # the configured topics again, empty
            if frozen:
                stale_commit(cfg, 10_000)
                os.killpg(store.proc.pid, signal.SIGCONT)
            assert worker.proc.wait(180) == EXIT_LOG_LOST, worker.tail()
            fresh.start()
            assert fresh.proc is not None
            wait_for(lambda: ready_file(ready, "worker", fresh.proc.pid).exists(), 120, 0.5, "worker")
            started = time.monotonic()
            emit(em, during[cut:])
            assert em.wait_idle(120), em.counters()
            counters = em.counters()
            assert counters["dropped"] == 0 and counters["drained"] == counters["spilled"] > 0, counters
            try:
                wait_for(lambda: set(stored_uids(cfg)) >= expected, 180, 1.0, "the new requests")
            finally:
                print(
                    f"stored {len(set(stored_uids(cfg)) & finished_uids(during))} of "
                    f"{len(finished_uids(during))} requests of the new log, "
                    f"{time.monotonic() - started:.1f} s after the last was emitted; {counters}"
                )
                print("--- store\n" + store.tail(30))
            assert store.alive()
            assert store.tail(400).count("sink: the broker lost its log") == 1
        finally:
            if em is not None:
                em.close(5)
            fresh.stop()
            worker.stop()
            store.stop()
        with Store.open(cfg) as db:  # the rows themselves, not the deduplicating view
            rows = db.query(f"SELECT request_uid FROM {db.database}.requests")
        uids = [r["request_uid"] for r in rows]
        print(f"requests table: {len(uids)} rows, {len(set(uids))} uids, {len(expected)} expected")
        assert len(uids) == len(set(uids)) and set(uids) == expected
