"""A fleet of simulated engines against the embedded stack: does one worker keep up?

1. **Record.** vLLM's real ``EngineCore`` (async scheduling, Model Runner V2 shape) runs the
   simulated executor of ``tests/harness`` at ``--batch`` running requests, with the plugin
   publishing to the stack's broker: every event on the topic afterwards is what the plugin
   wrote for a real scheduler's steps, admissions, finishes and KV events.
2. **Replay as a fleet.** ``--engines`` copies of that stream, each under its own engine name
   and epoch (so each is an engine of its own to the worker), are produced to the engine-events
   topic in real time at ``--steps-per-s`` steps per engine, wall clocks rewritten to now. (Running
   N real engine cores here would measure this 2-core machine's Python, not the pipeline.)
3. **Measure**, against the embedded stack (Tansu broker, ``--workers`` Faust assemblers, the store
   process with the ClickHouse sink and the API):
   * request-steps/s sustained (produced) and the worker group's lag, sampled every 2 s;
   * freshness: RequestFinished produced -> the request listed by the API (``since=10m``);
   * lost (finished, never stored) and doubled (stored rows beyond one per request, and the sum
     of output tokens against the replayed RequestFinished totals);
   * ``--kill-at`` seconds in, worker-0 is SIGKILLed and started again (``Stack.up``); the
     failover time is, per engine, from the kill to the first request of that engine finished
     after it being listed by the API, and the largest over the engines: when the killed
     worker's partitions were served again (the restarted worker started, joined the group and
     recovered its table; with more workers, whoever took the partitions over first).

The last line::

    bench_fleet_sim: N request-steps/s sustained, W worker(s), freshness p99 N.NN s, failover N.N s,
    lost N, doubled N

(one line; "failover" is nan in a run without a kill).

    .venv/bin/python benchmarks/bench_fleet_sim.py          # 16 engines x batch 256 x 30 steps/s, 10 min
    .venv/bin/python benchmarks/bench_fleet_sim.py --quick  # 4 engines x batch 64 x 10 steps/s, 60 s
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparseety import events as ev  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def record(stack_cfg: Any, batch: int, requests: int, tmp: Path) -> list[dict[str, Any]]:
    """One harness engine's events: ``requests`` requests, ``batch`` at a time."""
    import random

    from sparseety.config import to_env
    from tests.e2e.conftest import MODEL_CACHE, environ, tiny_model
    from tests.harness.engine import Mode, build, drive, request
    from tests.harness.pipeline import engine_config
    from tests.helpers import read_topic

    del MODEL_CACHE
    cfg = engine_config(stack_cfg, tmp / "rec", "fleet-rec")
    rng = random.Random(7)
    system = [rng.randrange(4, 500) for _ in range(64)]
    mode = Mode(async_scheduling=True, v2=True)
    with environ(to_env(cfg)):
        h = build(
            mode, tiny_model("llama"), max_num_seqs=batch, max_model_len=1024, max_num_batched_tokens=8192
        )
        try:
            phase = [
                request(
                    f"f{i}",
                    system[: rng.choice((0, 32, 64))]
                    + [rng.randrange(4, 500) for _ in range(rng.randrange(16, 96))],
                    tenant=f"tenant-{i % 12}",
                    max_tokens=rng.randrange(24, 96),
                    ignore_eos=True,
                )
                for i in range(requests)
            ]
            drive(h, [phase])
        finally:
            h.shutdown()
    deadline = time.monotonic() + 120
    while True:
        events = [r[3] for r in read_topic(cfg, cfg.topics.engine_events, quiet_s=1.0)]
        if (
            sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in events) >= requests
            or time.monotonic() > deadline
        ):
            return sorted(events, key=lambda e: (e["stream"], e["seq"]))


def reconcile(cfg: Any, emitted: dict[str, float], expected_out: dict[str, int]) -> tuple[int, int]:
    """``(lost, doubled)`` from the store itself (the stack is down, so its chDB path is free):
    lost = finished requests with no row; doubled = requests whose stored output tokens exceed
    what the engine finished with (a replayed or re-folded request counted twice)."""
    from sparseety.sinks.clickhouse.client import Store

    store = Store.open(cfg)
    try:
        rows = store.query(f"SELECT request_uid, output_tokens FROM {store.database}.requests FINAL")
    finally:
        store.close()
    stored = {r["request_uid"]: int(r["output_tokens"]) for r in rows}
    lost = len(set(emitted) - set(stored))
    doubled = sum(1 for uid, out in stored.items() if uid in expected_out and out > expected_out[uid])
    return lost, doubled


def group_lag(cfg: Any, group: str) -> int:
    """Records the group has not committed, over the engine-events partitions (watermarks)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(cfg.kafka.librdkafka(**{"group.id": group, "enable.auto.commit": False}))
    try:
        topic = cfg.topics.engine_events
        parts = [TopicPartition(topic, p) for p in c.list_topics(topic, timeout=10).topics[topic].partitions]
        lag = 0
        for tp in c.committed(parts, timeout=10):
            low, high = c.get_watermark_offsets(tp, timeout=10)
            if tp.offset < 0:  # nothing committed yet: everything since the start is behind
                lag += high - low
            else:
                lag += max(0, high - tp.offset)
        return lag
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps-per-s", type=float, default=30.0)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--kill-at", type=float, default=None, help="SIGKILL worker-0 this many seconds in (< 0: never)"
    )
    ap.add_argument(
        "--session-timeout-s",
        type=float,
        default=None,
        help="worker.session_timeout_s (default: the embedded broker's, 2 s)",
    )
    ap.add_argument(
        "--standby-replicas",
        type=int,
        default=None,
        help="worker.standby_replicas (Faust's table_standby_replicas; default: the config's)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="4 engines x batch 64 x 10 steps/s for 60 s, kill at 25 s"
    )
    args = ap.parse_args()
    if args.quick:
        args.engines, args.batch, args.steps_per_s, args.duration_s = 4, 64, 10.0, 60.0
    if args.kill_at is None:
        args.kill_at = args.duration_s * 0.4

    import logging

    import httpx

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from sparseety.config import load_config
    from sparseety.kafka import make_encoder, make_producer
    from sparseety.stack.supervisor import Stack
    from tests.helpers import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    cfg = load_config(
        data_dir=str(tmp),
        broker={"port": free_port()},
        api={"port": free_port()},
        topics={"partitions": max(4, args.workers * 2)},
        worker={
            k: v
            for k, v in (
                ("session_timeout_s", args.session_timeout_s),
                ("standby_replicas", args.standby_replicas),
            )
            if v is not None
        },
    )
    stack = Stack(cfg, workers=args.workers)
    print(
        f"bench_fleet_sim: {args.engines} engines x batch {args.batch} x {args.steps_per_s:g} steps/s "
        f"({args.engines * args.batch * args.steps_per_s:,.0f} request-steps/s offered) for "
        f"{args.duration_s:g} s, {args.workers} worker(s), "
        f"session timeout {stack.cfg.worker.session_timeout:g} s, "
        f"standby replicas {cfg.worker.standby_replicas}; "
        f"{os.cpu_count()} cores; data {tmp}",
        flush=True,
    )
    stack.up()
    try:
        scfg = stack.cfg
        per_engine_requests = max(args.batch * 2, 64)
        t0 = time.monotonic()
        recorded = record(scfg, args.batch, per_engine_requests, tmp)
        steps = [e for e in recorded if ev.payload_type(e) == ev.STEP_BATCH]
        rs = sum(len(ev.payload(e)["req_ids"]) for e in steps)
        print(
            f"recorded {len(recorded)} events ({len(steps)} steps, {rs / max(1, len(steps)):.0f} requests "
            f"a step on average) in {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        # One replay unit per StepBatch: the events up to and including it.
        units: list[list[dict[str, Any]]] = [[]]
        for e in recorded:
            units[-1].append(e)
            if ev.payload_type(e) == ev.STEP_BATCH:
                units.append([])
        enc = make_encoder(scfg, "EngineEvent", scfg.topics.engine_events)
        producer = make_producer(scfg, **{"linger.ms": 5})
        emitted: dict[str, float] = {}
        expected_out: dict[str, int] = {}
        engine_of: dict[str, str] = {}
        seen: dict[str, float] = {}
        lags: list[tuple[float, int]] = []
        done = threading.Event()
        client = httpx.Client(base_url=stack.api_url, timeout=30)

        def poll() -> None:
            while not done.is_set():
                try:
                    rows = client.get("/api/v1/requests", params={"limit": 10000, "since": "1m"}).json()[
                        "rows"
                    ]
                except Exception:
                    time.sleep(1)
                    continue
                now = time.monotonic()
                for r in rows:
                    seen.setdefault(r["request_uid"], now)
                time.sleep(0.5)

        def sample_lag() -> None:
            while not done.is_set():
                with contextlib.suppress(Exception):
                    lags.append((time.monotonic() - start, group_lag(scfg, scfg.worker.app_id)))
                time.sleep(2)

        start = time.monotonic()
        threading.Thread(target=poll, daemon=True).start()
        threading.Thread(target=sample_lag, daemon=True).start()
        epochs = [f"{i:04x}-fleet" for i in range(args.engines)]
        produced_steps = produced_rs = 0
        killed = False
        kill_t = float("nan")
        restarted_t = float("nan")

        def restart() -> None:
            nonlocal restarted_t
            stack.up()
            restarted_t = time.monotonic()

        gap = 1.0 / args.steps_per_s
        i = 0
        while time.monotonic() - start < args.duration_s:
            unit = units[i % len(units)]
            lap = i // len(units)
            tick = start + i * gap
            delay = tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now_ns = time.time_ns()
            for n in range(args.engines):
                name = f"fleet-{n}"
                engine_id = ev.engine_id(name, f"{epochs[n]}{lap}")
                for e in unit:
                    e2 = {
                        **e,
                        "engine_name": name,
                        "engine_id": engine_id,
                        "event_id": f"{engine_id}/{e['stream']}/{e['seq']}",
                        "ts_ns": now_ns,
                    }
                    producer.produce(scfg.topics.engine_events, key=name.encode(), value=enc.encode(e2))
                    kind = ev.payload_type(e)
                    if kind == ev.STEP_BATCH:
                        produced_steps += 1
                        produced_rs += len(ev.payload(e)["req_ids"])
                    elif kind == ev.REQUEST_FINISHED:
                        uid = f"{engine_id}/{ev.payload(e)['request_id']}"
                        emitted[uid] = time.monotonic()
                        engine_of[uid] = name
                        expected_out[uid] = int(ev.payload(e)["num_output_tokens"])
            producer.poll(0)
            i += 1
            if not killed and 0 <= args.kill_at <= time.monotonic() - start:
                pid = stack._pid("worker-0")
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    # Stack spawned it from this process: reap it, or its pid stays "alive" (a
                    # zombie) and Stack.up() would not start it again.
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
                    kill_t = time.monotonic()
                    print(
                        f"{kill_t - start:.0f} s: SIGKILLed worker-0 (pid {pid}); restarting",
                        flush=True,
                    )
                    threading.Thread(target=restart, daemon=True).start()
                killed = True
        producer.flush(30)
        elapsed = time.monotonic() - start
        # Requests whose later laps were cut by the end of the run have no RequestFinished: they
        # were never "finished", so they are not counted lost.
        deadline = time.monotonic() + 180
        while len(set(emitted) & set(seen)) < len(emitted) and time.monotonic() < deadline:
            time.sleep(1)
        done.set()
        fresh = [seen[u] - t for u, t in emitted.items() if u in seen]
        # Served again: per engine, the first request finished after the kill that the API
        # listed; the killed worker's engines are the last to come back.
        back: dict[str, float] = {}
        for u, t in emitted.items():
            if t >= kill_t and u in seen:
                name = engine_of[u]
                back[name] = min(back.get(name, seen[u]), seen[u])
        failover = max(back.values()) - kill_t if back else float("nan")
        stack.down()
        lost, doubled = reconcile(stack.cfg, emitted, expected_out)
        max_lag = max((lag for _, lag in lags), default=0)
        tail = [lag for t, lag in lags if t > elapsed * 0.8]
        print(
            f"produced {produced_steps} steps, {produced_rs:,} request-steps in {elapsed:.0f} s = "
            f"{produced_rs / elapsed:,.0f} request-steps/s; {len(emitted)} finished requests",
            flush=True,
        )
        tail_lag = statistics.median(tail) if tail else 0
        print(f"worker lag (records): max {max_lag}, median over the last fifth {tail_lag:.0f}")
        print(
            f"freshness s: p50 {percentile(fresh, 0.5):.2f} p90 {percentile(fresh, 0.9):.2f} "
            f"p99 {percentile(fresh, 0.99):.2f} max {max(fresh) if fresh else float('nan'):.2f}"
        )
        if killed:
            print(
                f"failover: worker-0 restarted and ready {restarted_t - kill_t:.1f} s after the kill; "
                f"its partitions served again after {failover:.1f} s"
            )
        print(
            f"bench_fleet_sim: {produced_rs / elapsed:,.0f} request-steps/s sustained, "
            f"{args.workers} worker(s), "
            f"freshness p99 {percentile(fresh, 0.99):.2f} s, failover {failover:.1f} s, "
            f"lost {lost}, doubled {doubled}"
        )
    finally:
        stack.down()


if __name__ == "__main__":
    main()
