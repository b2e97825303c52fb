"""Freshness on the embedded stack: RequestFinished produced -> the request visible in SQL.

    .venv/bin/python benchmarks/bench_freshness.py [--requests 300] [--rate 20] [--workers 1]
    .venv/bin/python benchmarks/bench_freshness.py --load fleet      # 100 requests/s, 1500 requests
    .venv/bin/python benchmarks/bench_freshness.py --load fleet --quick   # 100 requests/s, 500 requests

Starts the embedded stack (broker, assembler worker, store process with sink + API) on a
temporary data dir, replays a simulated engine's events in real time (wall-clock timestamps
rewritten to now; ``--rate`` finished requests per second), and polls the store through the HTTP
API every 100 ms. Freshness of a request = first time the API lists it - time its RequestFinished
was handed to the producer. Reports p50 / p90 / p99 / max (target: p99 <= 5 s; at 100
requests/s, the ``fleet`` load, p99 <= 2 s). The last line::

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.kafka import make_encoder, make_producer
from sparseety.stack.supervisor import Stack
from tests.helpers import free_port
from tests.sim import SimEngine, workload

#: name -> (requests, finished requests per second)
LOADS = {"light": (300, 20.0), "fleet": (1500, 100.0)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
        done = threading.Event()

        def poll() -> None:
            import httpx

            client = httpx.Client(base_url=stack.api_url, timeout=10)
            while not done.is_set():
                rows = client.get("/api/v1/requests", params={"limit": 10000, "since": "1d"}).json()["rows"]
                now = time.monotonic()
                for r in rows:
                    seen.setdefault(r["request_uid"], now)
                time.sleep(0.1)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
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
        print(f"achieved rate: {len(emitted) / (produced - start):.1f} finished requests/s")
        print(f"bench_freshness: p99 {percentile(lat, 0.99):.2f} s at {args.rate:.0f} requests/s")
    finally:
        stack.down()


if __name__ == "__main__":
    main()
