"""Replay speed against real time: the recorded vLLM runs (tests/data) replayed from Kafka through
the assembler's fold into chDB, compared with how long the engines took to produce them.

    .venv/bin/python benchmarks/bench_replay.py [--copies 20] [--runs 3]

``--copies`` publishes each recording that many times under distinct engine names (a fleet of
identical engines), so the replay is long enough to time. The recordings' real time is the span
of their event timestamps (the scenarios ran one after another). Printed: the serial ratio (one
engine's traffic, replayed) and the fleet ratio (all copies as engines running side by side).
Target: >= 20x real time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseety.broker import EmbeddedBroker
from sparseety.config import load_config
from sparseety.kafka import ensure_topics
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.sinks.processors import processor_for_topic
from sparseety.sinks.replay import Bound, Replay
from tests.helpers import free_port, produce_events
from tests.recorded import load_scenario, scenarios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    cfg = load_config(data_dir=str(tmp), broker={"port": free_port()})
    broker = EmbeddedBroker(cfg)
    broker.start(create_topics=False)
    try:
        cfg = broker.client_config().replace(topics={"partitions": 4})
        ensure_topics(cfg)
        events, span_s, requests = [], 0.0, 0
        for name in scenarios():
            evs, truth = load_scenario(name)
            span_s += (max(e["ts_ns"] for e in evs) - min(e["ts_ns"] for e in evs)) / 1e9
            requests += len(truth["requests"])
            for c in range(args.copies):
                for e in evs:
                    name_c = f"{e['engine_name']}-{c}"
                    events.append(
                        {
                            **e,
                            "engine_name": name_c,
                            "engine_id": e["engine_id"].replace(e["engine_name"], name_c, 1),
                            "event_id": e["event_id"].replace(e["engine_name"], name_c, 1),
                        }
                    )
        produce_events(cfg, events)
        print(
            f"traffic: {len(events):,} events, {requests * args.copies:,} requests; recorded span "
            f"{span_s:.1f} s per copy ({span_s * args.copies:.0f} s serial for {args.copies} copies)"
        )
        times = []
        for run in range(args.runs):
            store = Store.open(cfg.replace(data_dir=str(tmp / f"store-{run}")))
            try:
                migrate(store)
                sink = ClickHouseSink(store)
                processor = processor_for_topic(cfg, cfg.topics.engine_events)
                t0 = time.monotonic()
                report = Replay(
                    cfg,
                    cfg.topics.engine_events,
                    Bound("beginning"),
                    Bound("end", time.time_ns() + 10**12),
                    sink,
                    processor,
                    idle_s=0.5,
                ).run()
                times.append(time.monotonic() - t0 - 0.5)  # minus the idle wait that ends the range
                sink.close()
                stored = store.query(f"SELECT count() AS n FROM {store.table('requests')} FINAL")[0]["n"]
                print(
                    f"run {run}: {report.records_in_range:,} events in {times[-1]:.1f} s, "
                    f"{stored:,} requests stored"
                )
            finally:
                store.close()
        t = statistics.median(times)
        print(
            f"replay: median {t:.1f} s = {len(events) / t:,.0f} events/s; "
            f"{span_s / t * args.copies:.0f}x the serial real time, {span_s / t:.1f}x one fleet-parallel span"
        )
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
