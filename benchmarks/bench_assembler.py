"""Assembler throughput and state size.

    .venv/bin/python benchmarks/bench_assembler.py [--batch 256] [--steps 2000] [--runs 5] [--worker]

Synthetic engine: ``--batch`` requests decode together; every step one request finishes and a new
one is admitted (prompt 512 tokens, 4 cached blocks), so the stream carries RequestStarted,
StepBatch, RequestFinished and KV events in realistic proportions. Reported (medians of --runs):

* fold: ``Assembler.apply`` alone on decoded events (the pure logic);
* decode+fold: Avro single-object decoding + validation + fold (what a worker core does per event),
  for the same events written twice: by a schema-v2 producer (StepBatch integer columns as Avro
  arrays, ``schemas/history/EngineEvent.v2.avsc``) and by the current v3 producer (packed int32
  ``bytes`` columns, ``sparseety/packed.py``); the runs interleave, so both see the same load;
* with --worker: the real Faust worker against the embedded broker, events produced up front,
  timed from the first output to the last (request-steps/s through the whole worker);
* with --by-kind: the fold's CPU per event kind (µs per event, and per engine step), with the
  steady columns (streams/columnar.py) and without (every row on the general path), in one run
  (``--columns-only``: with the columns only);
  with ``--streams DIR`` the fold is another copy of ``streams/`` (``git archive REV streams |
  tar -x -C DIR``, then ``--streams DIR/streams``): alternate runs of both for a paired A/B.

Also the serialized state of one 128k-token request (chunked prefill, half the prompt cached).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--streams" in sys.argv[:-1]:
    # Fold with another copy of streams/ (``git archive REV streams | tar -x -C DIR``): a paired
    # comparison against older code in alternating runs. Before any sparseety.streams module loads.
    import sparseety.streams

    sparseety.streams.__path__[:] = [sys.argv[sys.argv.index("--streams") + 1]]

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.schema_store import SchemaStore, schema_dir
from sparseety.serde import Decoder, Encoder
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f

BS = 16


def synthetic(
    batch: int, steps: int, prompt: int = 512, finish_every: int = 1
) -> tuple[list[dict[str, Any]], int]:
    """Events of a steady decode batch where one request finishes and one is admitted every
    ``finish_every`` steps; returns (events, request-steps)."""
    events: list[dict[str, Any]] = []
    seq = 0
    t = 1_700_000_000_000_000_000

    def add(kind: str, body: dict[str, Any]) -> None:
        nonlocal seq
        events.append(f.wrap(seq, kind, body, ts_ns=t))
        seq += 1

    groups = [{"kind": "full_attention", "sliding_window": None, "block_size": BS, "num_layers": 32}]
    add(
        ev.ENGINE_STARTED,
        f.engine_started(
            block_size=BS,
            kv_cache_groups=groups,
            num_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
        ),
    )
    shared = [i.to_bytes(8, "big") for i in range(4)]
    add(ev.KV_STORED, f.kv_stored(shared, block_size=BS))
    live: dict[str, int] = {}
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        rid = f"req-{next_id}"
        next_id += 1
        hashes = shared + [(10_000 * next_id + i).to_bytes(8, "big") for i in range(prompt // BS - 4)]
        add(
            ev.REQUEST_STARTED,
            f.request_started(
                rid, [], hashes=hashes, prompt_len=prompt, num_cached_tokens=4 * BS, prompt_token_ids=[]
            ),
        )
        add(
            ev.KV_STORED,
            {
                "block_hashes": hashes[4:],
                "parent_block_hash": hashes[3],
                "block_size": BS,
                "num_tokens": prompt - 4 * BS,
                "lora_id": None,
                "medium": "GPU",
                "group_kind": "full_attention",
                "sliding_window": None,
            },
        )
        live[rid] = 4 * BS

    for _ in range(batch):
        admit()
    request_steps = 0
    for step in range(steps):
        t += 20_000_000
        rows = []
        for rid, computed in live.items():
            n = prompt - computed if computed < prompt else 1
            rows.append((rid, n, computed, [7]))
            live[rid] = computed + n
        request_steps += len(rows)
        add(ev.STEP_BATCH, f.step_batch(step, rows, duration_ns=20_000_000))
        if step % finish_every:
            continue
        done = next(iter(live))
        out = live.pop(done) - prompt + 1
        add(ev.REQUEST_FINISHED, f.request_finished(done, prompt=prompt, output=out, cached=4 * BS))
        admit()
    return events, request_steps


def fold(events: list[dict[str, Any]]) -> float:
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    start = time.perf_counter()
    for e in events:
        asm.apply(e)
    return time.perf_counter() - start


def by_kind(events: list[dict[str, Any]], runs: int, modes: tuple[bool, ...] = (False, True)) -> None:
    """The fold's CPU per event kind, columns on and off (medians over ``runs``, interleaved);
    ``modes``: which of them (``(True,)``: the columns only)."""
    from collections import defaultdict

    from sparseety.lifecycle import tune_gc

    tune_gc()
    steps = sum(1 for e in events if ev.payload_type(e) == ev.STEP_BATCH)
    per: dict[tuple[bool, str], list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        counts[ev.payload_type(e)] += 1
    clock = time.process_time
    for _ in range(runs):
        for columnar in modes:
            asm = Assembler(WorkerConfig(), MemoryStore(), columnar=columnar)
            spent: dict[str, float] = defaultdict(float)
            for e in events:
                t = clock()
                asm.apply(e)
                spent[ev.payload_type(e)] += clock() - t
            for k, v in spent.items():
                per[(columnar, k)].append(v)
    for columnar in modes:
        label = "columns" if columnar else "general"
        parts = []
        for k in sorted(counts, key=lambda k: -statistics.median(per[(columnar, k)])):
            s = statistics.median(per[(columnar, k)])
            parts.append(
                f"{k.rsplit('.', 1)[-1]} {s / counts[k] * 1e6:,.0f} us/event ({s / steps * 1e6:,.0f}/step)"
            )
        total = statistics.median(sum(per[(columnar, k)][i] for k in counts) for i in range(runs))
        rate = (
            sum(len(e["payload"][1]["req_ids"]) for e in events if ev.payload_type(e) == ev.STEP_BATCH)
            / total
        )
        print(f"by kind, {label}: " + "; ".join(parts) + f"; {rate:,.0f} request-steps/CPU-s")


def decode_fold(blobs: list[bytes]) -> float:
    dec = Decoder(SchemaStore.load())
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    start = time.perf_counter()
    for b in blobs:
        _, e = dec.decode(b)
        ev.validate_engine_event(e)
        asm.apply(e)
    return time.perf_counter() - start


def encodings(events: list[dict[str, Any]]) -> dict[str, list[bytes]]:
    """The events as a v2 producer and as the current (v3, packed) producer write them."""
    store = SchemaStore.load()
    v2 = json.loads((schema_dir() / "history" / "EngineEvent.v2.avsc").read_text())
    old = Encoder(store.with_current(v2), "EngineEvent")
    new = Encoder(store, "EngineEvent")
    return {"v2 arrays": [old.encode(e) for e in events], "v3 packed": [new.encode(e) for e in events]}


def long_request_state() -> tuple[int, int]:
    events = f.long_request(1000, prompt=131_072, block_size=BS, hash_bytes=8)
    store = MemoryStore()
    asm = Assembler(WorkerConfig(), store)
    for e in events:
        asm.apply(e)
    req = store.get(f"r|{f.EID}|long")
    return store.size_bytes(f"r|{f.EID}|long"), len(req.segments)


def worker_throughput(events: list[dict[str, Any]], request_steps: int) -> float:
    import tempfile

    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config
    from sparseety.kafka import ensure_topics
    from tests.helpers import ComponentProcess, free_port, produce_events, read_topic

    tmp = Path(tempfile.mkdtemp(prefix="bench-asm-"))
    cfg = load_config(data_dir=str(tmp), broker={"port": free_port()})
    broker = EmbeddedBroker(cfg)
    broker.start(create_topics=False)
    try:
        cfg = broker.client_config().replace(
            topics={
                "engine_events": "b.ee",
                "timelines": "b.tl",
                "usage": "b.us",
                "dlq": "b.dlq",
                "partitions": 1,
            },
            worker={"app_id": "bench-asm", "take_max": 2000, "take_within_s": 0.05, "session_timeout_s": 6.0},
        )
        ensure_topics(cfg)
        produce_events(cfg, events)
        n_closed = sum(1 for e in events if ev.payload_type(e) == ev.REQUEST_FINISHED)
        worker = ComponentProcess(cfg, ["worker", "--loglevel", "warning"], tmp / "worker.log").start()
        first = None
        while True:
            n = len(read_topic(cfg, cfg.topics.timelines, quiet_s=0.2))
            if n and first is None:
                first = time.monotonic()
            if n >= n_closed:
                break
            if not worker.alive():
                raise RuntimeError(worker.tail())
            time.sleep(0.5)
        elapsed = time.monotonic() - (first or time.monotonic())
        worker.stop()
        return request_steps / max(elapsed, 1e-9)
    finally:
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help="also measure the real Faust worker")
    ap.add_argument("--by-kind", action="store_true", help="the fold's CPU per event kind, columns on/off")
    ap.add_argument(
        "--columns-only",
        action="store_true",
        help="with --by-kind: the columnar fold only (after a general-path fold in the same process "
        "the allocation-heavy events read slower: the garbage collector's passes move)",
    )
    ap.add_argument("--streams", metavar="DIR", help="fold with the streams/ copy in DIR (a paired A/B)")
    args = ap.parse_args()
    events, request_steps = synthetic(args.batch, args.steps)
    if args.by_kind:
        by_kind(events, args.runs, (True,) if args.columns_only else (False, True))
        return
    blobs = encodings(events)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    sizes = ", ".join(f"{k} {sum(map(len, b)) / len(b):,.0f} B/event" for k, b in blobs.items())
    print(
        f"workload: batch {args.batch}, {args.steps} steps, {len(events)} events, "
        f"{request_steps} request-steps; {sizes}"
    )
    times: dict[str, list[float]] = {"fold": []} | {k: [] for k in blobs}
    for _ in range(args.runs):  # interleaved, so a load change hits every variant alike
        times["fold"].append(fold(events))
        for k, b in blobs.items():
            times[k].append(decode_fold(b))
    for k, ts in times.items():
        s = statistics.median(ts)
        label = k if k == "fold" else f"decode+fold {k}"
        print(
            f"{label + ':':<26}{request_steps / s:>12,.0f} request-steps/s  ({len(events) / s:,.0f} events/s)"
        )
    size, segments = long_request_state()
    print(f"128k-token request state: {size / 1024:,.0f} KiB serialized, {segments} segments")
    if args.worker:
        rate = worker_throughput(events, request_steps)
        print(f"Faust worker: {rate:>12,.0f} request-steps/s (one process, embedded broker)")


if __name__ == "__main__":
    main()
