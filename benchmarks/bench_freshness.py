"""Freshness on the embedded stack: RequestFinished produced -> the request visible in SQL.

    .venv/bin/python benchmarks/bench_freshness.py [--requests 300] [--rate 20] [--workers 1]
    .venv/bin/python benchmarks/bench_freshness.py --load fleet      # 100 requests/s, 1500 requests
    .venv/bin/python benchmarks/bench_freshness.py --load fleet --quick   # 100 requests/s, 500 requests

Starts the embedded stack (broker, assembler worker, store process with sink + API) on a
temporary data dir, replays a simulated engine's events in real time (wall-clock timestamps
rewritten to now; ``--rate`` finished requests per second), and polls the store through the HTTP
API every 250 ms (requests of the last minute). Freshness of a request = first time the API
lists it - time its RequestFinished was handed to the producer. Reports p50 / p90 / p99 / max
(target: p99 <= 5 s; at 100 requests/s, the ``fleet`` load, p99 <= 2 s). The last line::

    bench_freshness: p99 N.NN s at R requests/s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.kafka import make_encoder, make_producer
from sparseety.stack.supervisor import Stack
from tests.helpers import free_port
from tests.sim import SimEngine, workload

#: seconds between polls of the API (added to what is measured: at most this much)
POLL_S = 0.25
#: name -> (requests, finished requests per second)
LOADS = {"light": (300, 20.0), "fleet": (1500, 100.0)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timelines_ts(cfg: Any, uids: set[str]) -> dict[str, float]:
    """Wall-clock time (s) each request's RequestAccounting was produced to the timelines topic."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from sparseety.kafka import make_decoder

    dec = make_decoder(cfg)
    consumer = Consumer(
        cfg.kafka.librdkafka(**{"group.id": "bench-freshness-ts", "enable.auto.commit": False})
    )
    topic = cfg.topics.timelines
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out: dict[str, float] = {}
    while True:
        msg = consumer.poll(2.0)
        if msg is None:
            break
        if msg.error():
            continue
        _, rec = dec.decode(msg.value())
        if rec.get("request_uid") in uids:
            out.setdefault(rec["request_uid"], msg.timestamp()[1] / 1000)
    consumer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=20.0, help="finished requests per second")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--load",
        choices=sorted(LOADS),
        help="a preset: " + "; ".join(f"{k}: {n} requests at {r}/s" for k, (n, r) in LOADS.items()),
    )
    ap.add_argument("--quick", action="store_true", help="a third of the requests (under 2 minutes)")
    args = ap.parse_args()
    if args.load:
        args.requests, args.rate = LOADS[args.load]
    if args.quick:
        args.requests = max(100, args.requests // 3)

    data = Path(tempfile.mkdtemp(prefix="bench-fresh-"))
    cfg = load_config(data_dir=str(data), broker={"port": free_port()}, api={"port": free_port()})
    stack = Stack(cfg, workers=args.workers)
    print(f"starting the embedded stack in {data} ...", flush=True)
    stack.up()
    try:
        scfg = stack.cfg
        events = SimEngine(engine="fresh", seed=1, cache_blocks=64, max_batch=16).run(
            workload(args.requests, seed=1, max_tokens=24)
        )
        finishes = sum(1 for e in events if ev.payload_type(e) == ev.REQUEST_FINISHED)
        gap = finishes / (len(events) * args.rate)  # seconds between events for the target rate
        enc = make_encoder(scfg, "EngineEvent", scfg.topics.engine_events)
        producer = make_producer(scfg, **{"linger.ms": 5})
        emitted: dict[str, float] = {}
        seen: dict[str, float] = {}
        seen_wall: dict[str, float] = {}
        polls: list[float] = []  # how long each poll took: a visible row is seen at most this late
        done = threading.Event()

        def poll() -> None:
            import httpx

            client = httpx.Client(base_url=stack.api_url, timeout=10)
            while not done.is_set():
                asked = time.monotonic()
                # only the last minute: the poll shares the store's one chDB thread with the sink's
                # inserts, so a poll that lists every request ever stored would slow what it measures
                rows = client.get("/api/v1/requests", params={"limit": 10000, "since": "1m"}).json()["rows"]
                now = time.monotonic()
                polls.append(now - asked)
                for r in rows:
                    seen.setdefault(r["request_uid"], now)
                    seen_wall.setdefault(r["request_uid"], time.time())
                time.sleep(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        # warm-up, not counted: every process joined its group and wrote once (a stack that is
        # "up" may still be recovering its assembler state or joining the sink's group)
        warm = SimEngine(engine="warm", seed=2, cache_blocks=64, max_batch=16).run(workload(20, seed=2))
        for e in warm:
            e = {**e, "ts_ns": time.time_ns()}
            producer.produce(scfg.topics.engine_events, key=e["engine_name"].encode(), value=enc.encode(e))
        producer.flush(10)
        warm_uids = {
            f"{e['engine_id']}/{ev.payload(e)['request_id']}"
            for e in warm
            if ev.payload_type(e) == ev.REQUEST_FINISHED
        }
        deadline = time.monotonic() + 120
        while not warm_uids <= set(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        start = time.monotonic()
        for i, e in enumerate(events):
            target = start + i * gap
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            e = {**e, "ts_ns": time.time_ns()}
            producer.produce(scfg.topics.engine_events, key=e["engine_name"].encode(), value=enc.encode(e))
            producer.poll(0)
            if ev.payload_type(e) == ev.REQUEST_FINISHED:
                producer.flush(5)
                emitted[f"{e['engine_id']}/{ev.payload(e)['request_id']}"] = time.monotonic()
        producer.flush(10)
        produced = time.monotonic()
        deadline = time.monotonic() + 60
        while len(set(emitted) & set(seen)) < len(emitted) and time.monotonic() < deadline:
            time.sleep(0.2)
        done.set()
        lat = [seen[k] - t for k, t in emitted.items() if k in seen]
        missing = len(emitted) - len(lat)
        print(
            f"machine: 2 cores, 24 GiB (shared); {len(emitted)} requests at {args.rate}/s, "
            f"{args.workers} worker(s); missing after 60 s: {missing}"
        )
        print(
            f"freshness s: p50 {statistics.median(lat):.2f}  p90 {percentile(lat, 0.9):.2f}  "
            f"p99 {percentile(lat, 0.99):.2f}  max {max(lat):.2f}"
        )
        print(
            f"poll (the measuring query) s: p50 {statistics.median(polls):.2f}  "
            f"p99 {percentile(polls, 0.99):.2f}  max {max(polls):.2f}"
        )
        # where the time went: the worker's part ends when its RequestAccounting reached the
        # timelines topic (the record's timestamp), the sink's part when the API listed it
        written = timelines_ts(scfg, set(emitted))
        sink_part = [seen_wall[k] - written[k] for k in emitted if k in seen_wall and k in written]
        if sink_part:
            print(
                f"of which the sink (timelines record -> listed) s: p50 {statistics.median(sink_part):.2f}  "
                f"p99 {percentile(sink_part, 0.99):.2f}  max {max(sink_part):.2f}"
            )
        print(f"achieved rate: {len(emitted) / (produced - start):.1f} finished requests/s")
        print(f"bench_freshness: p99 {percentile(lat, 0.99):.2f} s at {args.rate:.0f} requests/s")
    finally:
        stack.down()


if __name__ == "__main__":
    main()
