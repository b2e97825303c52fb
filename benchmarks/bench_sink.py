"""Sink throughput into embedded ClickHouse (chDB), per process.

Three measurements, each the median of ``--runs`` runs into a fresh database:

* ``write``: decoded RequestAccounting records -> ClickHouseSink.add + flush (rows to every table).
* ``decode+write``: Avro bytes as they sit in Kafka -> decode -> sink: the sink process's work per
  batch, without Kafka.
* ``replay`` (``--replay``): records produced to a topic of an embedded broker, then read back
  by ``sparseety.sinks.replay.Replay`` into the sink (aiokafka fetch included).

Records look like the assembler's output for a 2k-token prompt with a cached prefix: ``--segments``
timeline segments and ``--blocks`` block uses each, so one record is 1 + segments + blocks rows.

    .venv/bin/python benchmarks/bench_sink.py                 # write, decode+write
    .venv/bin/python benchmarks/bench_sink.py --replay        # and replay through the broker
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import signal
import statistics
import tempfile
import time
import uuid
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.kafka import make_decoder, make_encoder
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink

T0 = 1_700_000_000 * 10**9


def record(i: int, segments: int, blocks: int) -> dict[str, Any]:
    engine = f"engine-{i % 8}"
    eid = f"{engine}@e1"
    segs = []
    pos = 0
    for k in range(segments):
        kind = "prompt" if k < segments - 2 else "output"
        status = "cached" if k == 0 else ("recomputed" if k == 2 else "computed")
        segs.append(
            {
                "start": pos,
                "end": pos + 200,
                "kind": kind,
                "status": status,
                "draft_accepted": k == segments - 1,
                "source_request_uid": f"{eid}/r{i - 1}" if status == "cached" else None,
                "kv_fate": "kept",
            }
        )
        pos += 200
    uses = [
        {
            "block_hash": (b"%08d" % (k * 7919 + i % 50)) * 4,
            "lifetime_seq": k,
            "role": "cached" if k < blocks // 2 else "computed",
            "tokens": 16,
        }
        for k in range(blocks)
    ]
    return {
        "request_uid": f"{eid}/r{i}",
        "engine_name": engine,
        "engine_id": eid,
        "request_id": f"r{i}",
        "tenant": f"tenant-{i % 20}",
        "model": "llama-3-8b",
        "lora_name": None,
        "engine_kind": "vllm",
        "arrival_ts_ns": T0 + i * 1_000_000,
        "first_scheduled_ts_ns": T0 + i * 1_000_000 + 10,
        "first_token_ts_ns": T0 + i * 1_000_000 + 20,
        "finished_ts_ns": T0 + i * 1_000_000 + 30,
        "finish_reason": "length",
        "complete": True,
        "incomplete_reason": None,
        "seq_gap": False,
        "prompt_tokens": 2048,
        "output_tokens": 256,
        "cache_read_tokens": 512,
        "uncached_computed_tokens": 1700,
        "recomputed_tokens": 64,
        "draft_accepted_tokens": 30,
        "draft_rejected_tokens": 12,
        "skipped_tokens": 0,
        "evicted_tokens": 0,
        "scheduled_tokens": 1806,
        "preemptions": 0,
        "steps": 260,
        "attention_pairs": 4_000_000,
        "attention_pairs_skipped": 0,
        "gpu_time_ns": 35_000_000,
        "est_flops": 3.1e13,
        "engine_prompt_tokens": 2048,
        "engine_output_tokens": 256,
        "engine_cached_tokens": 512,
        "consistent": True,
        "expert_num_layers": 0,
        "expert_num_experts": 0,
        "expert_counts": [],
        "block_uses": uses,
        "timeline": {"segments": segs, "attention_window": None},
        "recomputed_preemption_tokens": 64,
        "recomputed_eviction_tokens": 0,
        "draft_cut_tokens": 0,
        "window_released_tokens": 0,
        "evicted_blocks_recomputed": 0,
        "waste_tokens": 76,
    }


def fresh(path: str) -> Store:
    cfg = load_config(clickhouse={"dsn": f"chdb://{path}", "database": f"bench_{uuid.uuid4().hex[:8]}"})
    store = Store.open(cfg)
    migrate(store)
    return store


def drop(store: Store) -> None:
    store.command(f"DROP DATABASE IF EXISTS {store.database}")
    store.close()


def bench_write(path: str, records: list[dict[str, Any]], batch: int) -> tuple[float, int]:
    store = fresh(path)
    try:
        sink = ClickHouseSink(store, batch_max_rows=10**9)
        started = time.perf_counter()
        rows = 0
        for start in range(0, len(records), batch):
            for i, rec in enumerate(records[start : start + batch], start):
                sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=i % 4, offset=i)
            rows += sink.flush().total_rows
        return time.perf_counter() - started, rows
    finally:
        drop(store)


def bench_decode_write(path: str, payloads: list[bytes], cfg: Config, batch: int) -> tuple[float, int]:
    store = fresh(path)
    decoder = make_decoder(cfg)
    try:
        sink = ClickHouseSink(store, batch_max_rows=10**9)
        started = time.perf_counter()
        rows = 0
        for start in range(0, len(payloads), batch):
            for i, raw in enumerate(payloads[start : start + batch], start):
                name, rec = decoder.decode(raw)
                sink.add(name, rec, topic="timelines", partition=i % 4, offset=i)
            rows += sink.flush().total_rows
        return time.perf_counter() - started, rows
    finally:
        drop(store)


def bench_replay(path: str, payloads: list[bytes], runs: int) -> list[tuple[float, int, int]]:
    from sparseety.broker import EmbeddedBroker
    from sparseety.kafka import ensure_topics, make_producer
    from sparseety.sinks.processors import identity
    from sparseety.sinks.replay import Bound, Replay
    from tests.helpers import free_port

    data = tempfile.mkdtemp(prefix="bench-broker-")
    broker = EmbeddedBroker(load_config(data_dir=data, broker={"port": free_port()}))
    broker.start(create_topics=False)
    try:
        cfg = broker.client_config().replace(topics={"timelines": "bench.timelines", "partitions": 4})
        ensure_topics(cfg, [cfg.topics.timelines])
        producer = make_producer(cfg)
        for i, raw in enumerate(payloads):
            producer.produce(cfg.topics.timelines, key=b"r%d" % i, value=raw)
            if i % 5000 == 0:
                producer.poll(0)
        assert producer.flush(60) == 0
        out = []
        for _ in range(runs):
            store = fresh(path)
            try:
                sink = ClickHouseSink(store, batch_max_rows=100_000)
                report = Replay(
                    cfg,
                    cfg.topics.timelines,
                    Bound("beginning"),
                    Bound("end", time.time_ns() + 60 * 10**9),
                    sink,
                    identity,
                    idle_s=0.3,
                ).run()
                # the idle wait that detects the end of each partition is not work: take it out
                out.append((report.seconds - 0.3, report.written.total_rows, report.records_in_range))
            finally:
                drop(store)
        return out
    finally:
        broker.stop()


def _produce(producer: Any, topic: str, values: list[bytes], last: dict[int, int]) -> None:
    def done(err: Any, msg: Any) -> None:
        last[msg.partition()] = max(last.get(msg.partition(), -1), msg.offset())

    for i, raw in enumerate(values):
        producer.produce(topic, key=b"r%d" % i, value=raw, on_delivery=done)
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def _caught_up(watcher: Any, topic: str, last: dict[int, int]) -> bool:
    from confluent_kafka import TopicPartition

    got = watcher.committed([TopicPartition(topic, p) for p in last], timeout=10)
    return all(tp.offset > last[tp.partition] for tp in got)


def bench_live(payloads: list[bytes], runs: int) -> list[tuple[float, int, int]]:
    """The real thing: ``sparseety sink`` (a Faust worker, its own process) consuming a topic of an
    embedded broker into chDB; time from producing N records until all their offsets are committed
    (which the sink does only after writing them)."""
    import subprocess
    import sys
    from pathlib import Path

    from confluent_kafka import Consumer

    from sparseety.broker import EmbeddedBroker
    from sparseety.config import to_env
    from sparseety.kafka import ensure_topics, make_producer
    from tests.helpers import free_port

    data = Path(tempfile.mkdtemp(prefix="bench-live-"))
    broker = EmbeddedBroker(load_config(data_dir=str(data / "broker"), broker={"port": free_port()}))
    broker.start(create_topics=False)
    out = []
    try:
        for run in range(runs):
            topics = {k: f"live{run}.{k}" for k in ("engine_events", "timelines", "usage", "dlq")}
            cfg = broker.client_config().replace(
                data_dir=str(data / f"run{run}"),
                topics={**topics, "partitions": 4},
                sink={"group_id": f"bench-sink-{run}", "batch_interval_s": 1.0, "batch_max_rows": 200_000},
            )
            ensure_topics(cfg)
            env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")} | to_env(cfg)
            log = open(data / f"sink-{run}.log", "wb")  # noqa: SIM115 - closed below
            sink = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "sparseety"),
                    "sink",
                    "--session-timeout",
                    "6",
                    "--commit-interval",
                    "1.0",
                    "--loglevel",
                    "warning",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            producer = make_producer(cfg)
            watcher = Consumer(
                cfg.kafka.librdkafka(**{"group.id": cfg.sink.group_id, "enable.auto.commit": False})
            )
            last: dict[int, int] = {}
            try:
                _produce(producer, cfg.topics.timelines, payloads[:4], last)  # warm-up: sink joined
                while not _caught_up(watcher, cfg.topics.timelines, last):
                    assert sink.poll() is None, (data / f"sink-{run}.log").read_text()[-2000:]
                    time.sleep(0.1)
                started = time.perf_counter()
                _produce(producer, cfg.topics.timelines, payloads, last)
                while not _caught_up(watcher, cfg.topics.timelines, last):
                    assert sink.poll() is None, (data / f"sink-{run}.log").read_text()[-2000:]
                    time.sleep(0.05)
                out.append((time.perf_counter() - started, 0, len(payloads)))
            finally:
                watcher.close()
                sink.terminate()
                sink.wait(30)
                log.close()
    finally:
        broker.stop()
    return out


def _faust_ceiling_child(bootstrap: str, topic: str, n: int, out: Any) -> None:
    """An agent shaped like the sink's (raw bytes, take_events) that does nothing but count."""
    import faust

    app = faust.App(
        "bench-faust-ceiling",
        broker=f"kafka://{bootstrap}",
        store="memory://",
        topic_allow_declare=False,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        broker_commit_interval=1.0,
        datadir=tempfile.mkdtemp(prefix="bench-faust-"),
    )
    source = app.topic(topic, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    seen = {"n": 0, "first": 0.0}

    @app.agent(source)
    async def count(stream: Any) -> None:
        async for events in stream.take_events(10_000, within=1.0):
            if not seen["n"]:
                seen["first"] = time.perf_counter()
            seen["n"] += len(events)
            if seen["n"] >= n:
                out.put(n / (time.perf_counter() - seen["first"]))
                os.kill(os.getpid(), signal.SIGTERM)

    from faust import Worker

    Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


def bench_faust_ceiling(payloads: list[bytes]) -> float:
    """Messages per second Faust delivers to a take_events agent that does no work (the ceiling
    of any Faust worker consuming one message per record on this machine)."""
    import multiprocessing

    from sparseety.broker import EmbeddedBroker
    from sparseety.kafka import ensure_topics, make_producer
    from tests.helpers import free_port

    broker = EmbeddedBroker(load_config(data_dir=tempfile.mkdtemp(), broker={"port": free_port()}))
    broker.start(create_topics=False)
    try:
        cfg = broker.client_config()
        ensure_topics(cfg, ["ceiling"], partitions=4)
        _produce(make_producer(cfg), "ceiling", payloads, {})
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(
            target=_faust_ceiling_child, args=(cfg.kafka.bootstrap, "ceiling", len(payloads), out)
        )
        child.start()
        rate = float(out.get(timeout=600))
        child.join(30)
        return rate
    finally:
        broker.stop()


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {cpu}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--segments", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=5_000, help="records per flush (one insert per table)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--replay", action="store_true", help="also replay through an embedded broker")
    ap.add_argument("--live", action="store_true", help="also run `sparseety sink` against a broker")
    args = ap.parse_args()

    cfg = load_config()
    records = [record(i, args.segments, args.blocks) for i in range(args.records)]
    enc = make_encoder(cfg, "RequestAccounting", "timelines")
    payloads = [enc.encode(r) for r in records]
    path = tempfile.mkdtemp(prefix="bench-chdb-")
    # The inputs stay alive for the whole benchmark; a sink process holds no such heap. Keep the
    # collector from rescanning them on every generation-2 pass.
    gc.collect()
    gc.freeze()
    rows_per_record = 1 + args.segments + args.blocks
    print(f"machine: {machine()}")
    print(
        f"{args.records} records x {rows_per_record} rows ({args.segments} segments, {args.blocks} blocks), "
        f"{args.batch} records per flush, median of {args.runs} runs"
    )
    bench_write(path, records[:2000], args.batch)  # warm-up: engine start, first parts

    results = []
    for name, fn in (
        ("write", lambda: bench_write(path, records, args.batch)),
        ("decode+write", lambda: bench_decode_write(path, payloads, cfg, args.batch)),
    ):
        runs = [fn() for _ in range(args.runs)]
        secs = [s for s, _ in runs]
        rows = runs[0][1]
        results.append((name, statistics.median(secs), rows, args.records, min(secs), max(secs)))
    if args.replay:
        runs3 = bench_replay(path, payloads, args.runs)
        secs = [s for s, _, _ in runs3]
        results.append(
            (
                "replay (broker -> chDB)",
                statistics.median(secs),
                runs3[0][1],
                runs3[0][2],
                min(secs),
                max(secs),
            )
        )

    ceiling = None
    if args.live:
        ceiling = bench_faust_ceiling(payloads)
        runs4 = bench_live(payloads, args.runs)
        secs = [s for s, _, _ in runs4]
        rows = args.records * rows_per_record
        results.append(
            (
                "sparseety sink (broker -> Faust -> chDB)",
                statistics.median(secs),
                rows,
                args.records,
                min(secs),
                max(secs),
            )
        )

    print()
    print("| stage | rows/s (median) | records/s | rows | runs: min-max s |")
    print("|---|---:|---:|---:|---|")
    for name, med, rows, recs, lo, hi in results:
        print(f"| {name} | {rows / med:,.0f} | {recs / med:,.0f} | {rows:,} | {lo:.2f}-{hi:.2f} |")
    if ceiling is not None:
        print(f"\nFaust alone (take_events agent that only counts): {ceiling:,.0f} messages/s")


if __name__ == "__main__":
    main()
