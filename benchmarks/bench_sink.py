"""Sink throughput into embedded ClickHouse (chDB), per process.

Measurements, each the median of ``--rounds`` rounds (write paths into a fresh database each):

* ``write``: decoded RequestAccounting records -> ClickHouseSink.add + flush (rows to every table).
* ``decode+write``: Avro bytes as they sit in Kafka -> decode -> sink: the Python path's work per
  batch, without Kafka.
* ``undecoded write``: the same bytes through the fast path (header read, bodies handed to chDB as
  one Avro container, ``sinks/clickhouse/avro_batch.py``): what the sink process does per batch
  of current-schema RequestAccounting into an embedded store, without Kafka.
* ``sparseety sink``: the real process (its batch consumer loop) reading a topic of an embedded
  broker into its own chDB path: time from producing a round's records until all their offsets
  are committed (which the sink does only after writing them).
* ``replay`` (``--replay``): records produced to a topic of an embedded broker, then read back
  by ``sparseety.sinks.replay.Replay`` into the sink (aiokafka fetch included).

The rounds interleave write, decode+write and the process on new records of the same shape, so
the ratio process/write (per round, then the median) holds on a noisy shared machine.

Records look like the assembler's output for a 2k-token prompt with a cached prefix: ``--segments``
timeline segments and ``--blocks`` block uses each, so one record is 1 + segments + blocks rows.

    .venv/bin/python benchmarks/bench_sink.py --quick         # under 2 minutes
    .venv/bin/python benchmarks/bench_sink.py                 # write, decode+write, the process
    .venv/bin/python benchmarks/bench_sink.py --replay        # and replay through the broker

The last line: ``bench_sink: process/write ratio 0.NN; NNN rows/s`` (the process's rows/s).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.kafka import make_decoder, make_encoder
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink

T0 = 1_700_000_000 * 10**9


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def record(i: int, segments: int, blocks: int, privacy: str = "none") -> dict[str, Any]:
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
        "session_id": "",
        # token records (schema v3): none in mode none; in mode raw the 2,048 prompt and 256
        # output ids, which the sink stores as one request_tokens row
        "token_privacy": privacy,
        "prompt_token_ids": [(i * 31 + k) % 128_000 for k in range(2048)] if privacy == "raw" else [],
        "prompt_token_hashes": [],
        "output_token_ids": [(i * 17 + k) % 128_000 for k in range(256)] if privacy == "raw" else [],
    }


def fresh(path: str) -> Store:
    cfg = load_config(clickhouse={"dsn": f"chdb://{path}", "database": f"bench_{uuid.uuid4().hex[:8]}"})
    store = Store.open(cfg)
    migrate(store)
    return store


def drop(store: Store) -> None:
    store.command(f"DROP DATABASE IF EXISTS {store.database}")
    store.close()


def timed_writes(
    path: str,
    items: list[Any],
    batch: int,
    add: Callable[[ClickHouseSink, int, Any], None],
    ready: Callable[[ClickHouseSink], bool] | None = None,
    **sink_kw: Any,
) -> tuple[float, int]:
    """Seconds and rows to write ``items`` to a fresh store through one sink, a flush every
    ``batch``: ``add(sink, i, item)`` hands it the i-th; ``ready(sink)`` must hold before."""
    store = fresh(path)
    try:
        sink = ClickHouseSink(store, batch_max_rows=10**9, **sink_kw)
        assert ready is None or ready(sink)
        started = time.perf_counter()
        rows = 0
        for start in range(0, len(items), batch):
            for i, item in enumerate(items[start : start + batch], start):
                add(sink, i, item)
            rows += sink.flush().total_rows
        return time.perf_counter() - started, rows
    finally:
        drop(store)


def bench_write(path: str, records: list[dict[str, Any]], batch: int) -> tuple[float, int]:
    def add(sink: ClickHouseSink, i: int, rec: dict[str, Any]) -> None:
        sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=i % 4, offset=i)

    return timed_writes(path, records, batch, add)


def bench_decode_write(path: str, payloads: list[bytes], cfg: Config, batch: int) -> tuple[float, int]:
    decoder = make_decoder(cfg)

    def add(sink: ClickHouseSink, i: int, raw: bytes) -> None:
        name, rec = decoder.decode(raw)
        sink.add(name, rec, topic="timelines", partition=i % 4, offset=i)

    return timed_writes(path, payloads, batch, add)


def bench_undecoded_write(path: str, payloads: list[bytes], cfg: Config, batch: int) -> tuple[float, int]:
    """The sink process's fast path without Kafka: header read, bodies handed to chDB as Avro."""
    decoder = make_decoder(cfg)

    def ready(sink: ClickHouseSink) -> bool:
        return sink.takes_encoded(decoder.store.wire("RequestAccounting"), decoder.store)

    def add(sink: ClickHouseSink, i: int, raw: bytes) -> None:
        writer = decoder.header(raw)
        assert writer is not None  # the consumer asks takes_encoded once per writer schema
        sink.add_encoded(writer, raw, key=None, topic="timelines", partition=i % 4, offset=i)

    return timed_writes(path, payloads, batch, add, ready, encoded=True)


def bench_replay(path: str, payloads: list[bytes], runs: int) -> list[tuple[float, int, int]]:
    from sparseety.broker import EmbeddedBroker
    from sparseety.kafka import ensure_topics, make_producer
    from sparseety.sinks.processors import identity
    from sparseety.sinks.replay import Bound, Replay

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


def _produce(producer: Any, topic: str, values: list[bytes], last: dict[int, int], base: int = 0) -> None:
    def done(err: Any, msg: Any) -> None:
        last[msg.partition()] = max(last.get(msg.partition(), -1), msg.offset())

    for i, raw in enumerate(values):
        producer.produce(topic, key=b"r%d" % (base + i), value=raw, on_delivery=done)
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def _caught_up(watcher: Any, topic: str, last: dict[int, int]) -> bool:
    from confluent_kafka import TopicPartition

    got = watcher.committed([TopicPartition(topic, p) for p in last], timeout=10)
    return all(tp.offset > last[tp.partition] for tp in got)


class LiveSink:
    """``sparseety sink`` in its own process, consuming a topic of an embedded broker into its own
    chDB path; :meth:`round` times producing records until all their offsets are committed (which
    the sink does only after writing them)."""

    def __init__(self, batch_records: int, rows_per_record: int) -> None:
        import subprocess
        import sys
        from pathlib import Path

        from confluent_kafka import Consumer

        from sparseety.broker import EmbeddedBroker
        from sparseety.config import to_env
        from sparseety.kafka import ensure_topics, make_producer

        self.data = Path(tempfile.mkdtemp(prefix="bench-live-"))
        self.broker = EmbeddedBroker(
            load_config(data_dir=str(self.data / "broker"), broker={"port": free_port()})
        )
        self.broker.start(create_topics=False)
        topics = {k: f"live.{k}" for k in ("engine_events", "timelines", "usage", "dlq")}
        self.cfg = self.broker.client_config().replace(
            data_dir=str(self.data / "sink"),
            topics={**topics, "partitions": 4},
            # one flush per `batch_records` records, as the write path below
            sink={"group_id": "bench-sink", "batch_max_rows": batch_records * rows_per_record},
        )
        ensure_topics(self.cfg)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")} | to_env(self.cfg)
        self.log_path = self.data / "sink.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "sparseety"),
                "sink",
                "--session-timeout",
                "6",
                "--commit-interval",
                "0.1",
                "--loglevel",
                "warning",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.producer = make_producer(self.cfg)
        self.watcher = Consumer(
            self.cfg.kafka.librdkafka(**{"group.id": self.cfg.sink.group_id, "enable.auto.commit": False})
        )
        self.sent = 0

    def _wait(self, last: dict[int, int], interval: float) -> None:
        while not _caught_up(self.watcher, self.cfg.topics.timelines, last):
            assert self.proc.poll() is None, self.log_path.read_text()[-2000:]
            time.sleep(interval)

    def warm_up(self, payloads: list[bytes]) -> None:
        last: dict[int, int] = {}
        _produce(self.producer, self.cfg.topics.timelines, payloads, last, self.sent)
        self.sent += len(payloads)
        self._wait(last, 0.2)

    def round(self, payloads: list[bytes]) -> float:
        last: dict[int, int] = {}
        started = time.perf_counter()
        _produce(self.producer, self.cfg.topics.timelines, payloads, last, self.sent)
        self.sent += len(payloads)
        self._wait(last, 0.02)
        return time.perf_counter() - started

    def close(self) -> None:
        self.watcher.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        self.broker.stop()


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {cpu}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000, help="records per round")
    ap.add_argument("--segments", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=5_000, help="records per flush (one insert per table)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each measurement")
    ap.add_argument("--replay", action="store_true", help="also replay through an embedded broker")
    ap.add_argument("--quick", action="store_true", help="fewer records and rounds (under 2 minutes)")
    ap.add_argument(
        "--privacy",
        choices=("none", "raw"),
        default="none",
        help="token records: none (an empty request_tokens row) or raw (2,304 token ids per request)",
    )
    args = ap.parse_args()
    if args.quick:
        args.records, args.rounds = 10_000, 3

    cfg = load_config()
    enc = make_encoder(cfg, "RequestAccounting", "timelines")
    n = args.records
    # every round stores new requests (distinct uids), the same shape
    rounds = [
        [record(r * n + i, args.segments, args.blocks, args.privacy) for i in range(n)]
        for r in range(args.rounds + 1)
    ]
    payloads = [[enc.encode(x) for x in recs] for recs in rounds]
    path = tempfile.mkdtemp(prefix="bench-chdb-")
    # The inputs stay alive for the whole benchmark; a sink process holds no such heap. Keep the
    # collector from rescanning them on every generation-2 pass.
    gc.collect()
    gc.freeze()
    # request_tokens gets a row in mode none too (schema v3: answers can say nothing was stored)
    rows_per_record = 1 + args.segments + args.blocks + 1
    rows = n * rows_per_record
    print(f"machine: {machine()}")
    print(
        f"{n} records x {rows_per_record} rows ({args.segments} segments, {args.blocks} blocks, "
        f"token records {args.privacy}) per round, "
        f"{args.batch} records per flush, {args.rounds} interleaved rounds"
    )
    live = LiveSink(args.batch, rows_per_record)
    try:
        bench_write(path, rounds[0][:2000], args.batch)  # warm-up: engine start, first parts
        live.warm_up(payloads[0][:2000])
        write_s, decode_s, undecoded_s, process_s, ratios = [], [], [], [], []
        for r in range(1, args.rounds + 1):
            w, _ = bench_write(path, rounds[r], args.batch)
            d, _ = bench_decode_write(path, payloads[r], cfg, args.batch)
            u, got = bench_undecoded_write(path, payloads[r], cfg, args.batch)
            assert got == rows, (got, rows)  # ClickHouse's row counts: the fast path wrote every row
            p = live.round(payloads[r])
            write_s.append(w)
            decode_s.append(d)
            undecoded_s.append(u)
            process_s.append(p)
            ratios.append(w / p)
            print(
                f"round {r}: write {rows / w:,.0f} rows/s, decode+write {rows / d:,.0f}, "
                f"undecoded write {rows / u:,.0f}, sink process {rows / p:,.0f}; process/write {w / p:.2f}",
                flush=True,
            )
    finally:
        live.close()

    results = [
        ("write", write_s),
        ("decode+write", decode_s),
        ("undecoded write (header only, chDB decodes)", undecoded_s),
        ("sparseety sink (broker -> consumer -> chDB)", process_s),
    ]
    if args.replay:
        runs3 = bench_replay(path, payloads[1], args.rounds)
        results.append(("replay (broker -> chDB)", [s for s, _, _ in runs3]))

    print()
    print("| stage | rows/s (median) | records/s | rows | rounds: min-max s |")
    print("|---|---:|---:|---:|---|")
    for name, secs in results:
        med = statistics.median(secs)
        print(f"| {name} | {rows / med:,.0f} | {n / med:,.0f} | {rows:,} | {min(secs):.2f}-{max(secs):.2f} |")
    print(f"per-round process/write: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(
        f"bench_sink: process/write ratio {statistics.median(ratios):.2f}; "
        f"{rows / statistics.median(process_s):.0f} rows/s"
    )


if __name__ == "__main__":
    main()
