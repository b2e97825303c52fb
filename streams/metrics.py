"""Prometheus metrics of the assembler worker (names ``sparseety:<noun>_<unit>``)."""

from __future__ import annotations

import contextlib
from dataclasses import astuple, fields

from prometheus_client import Counter, Gauge, Histogram

from .assembler import Stats

EVENTS_IN = Counter("sparseety:worker_events_total", "Engine events consumed by the assembler.")
OUTPUTS = Counter("sparseety:worker_outputs_total", "Records sent by the assembler.", ["topic"])
DEAD_LETTERS = Counter(
    "sparseety:dead_letters_total", "Inputs sent to the dead-letter topic.", ["component", "error_type"]
)
REFETCHED = Counter(
    "sparseety:worker_refetched_events_total", "Events the stream consumer skipped and the worker re-read."
)
STAGE_CPU = Counter(
    "sparseety:worker_stage_cpu_seconds_total",
    "CPU time of the worker's batch-handling thread per stage of a batch: decode (bytes to "
    "validated events), fold (Assembler.apply), encode (the outputs' Avro), send (from handing the "
    "outputs over until Kafka acknowledged them) and state (changelog encode, send and "
    "acknowledgement). Thread CPU time, so send and state include whatever else ran on the event "
    "loop while the batch waited for Kafka; decode and fold split the thread CPU of the loop that "
    "decodes and folds each event in turn by their shares of its wall time; the process's CPU "
    "outside these is Faust's, aiokafka's and the other threads'.",
    ["stage"],
)
FOLD_SECONDS = Histogram("sparseety:worker_batch_fold_seconds", "Time to fold one partition batch.")
ASSEMBLER = Counter(
    "sparseety:assembler_events_total",
    "Assembler outcomes: duplicates dropped, events reordered, events lost (gaps), late events, "
    "requests closed, incomplete requests, window corrections.",
    ["outcome"],
)

LAG = Gauge(
    "sparseety:worker_lag_events",
    "Engine events not yet processed, per assigned partition: high watermark - next offset to process.",
    ["partition"],
)
LAST_EVENT_TS = Gauge(
    "sparseety:worker_last_event_timestamp_seconds",
    "Wall clock (ts_ns) of the last engine event processed, per partition; freshness = time() - this.",
    ["partition"],
)

ENGINE_LAST_EVENT_TS = Gauge(
    "sparseety:worker_engine_last_event_timestamp_seconds",
    "Wall clock (ts_ns) of the last event of each engine this worker folded, heartbeats included "
    "(a live engine sends one every producer.heartbeat_interval_s, idle or not); an engine that "
    "stopped cleanly (EngineStopped) is removed, so time() - this grows only for a silent one.",
    ["engine"],
)

_last: dict[int, tuple[int, ...]] = {}
_names = [f.name for f in fields(Stats)]


def export(key: int, stats: Stats) -> None:
    """Add what changed in ``stats`` since the last export of the same assembler."""
    now = astuple(stats)
    before = _last.get(key, (0,) * len(now))
    for name, a, b in zip(_names, before, now, strict=True):
        if b > a and name != "events":
            ASSEMBLER.labels(name).inc(b - a)
    _last[key] = now


def set_lag(partition: int, *, highwater: int, position: int) -> None:
    """A partition's lag: events up to the high watermark not yet processed."""
    LAG.labels(str(partition)).set(max(highwater - position, 0))


def engine_seen(last: dict[str, int], stopped: set[str]) -> None:
    """Per engine name: the ts_ns of its last event in a batch; ``stopped``: engines whose
    EngineStopped the batch held (their series ends)."""
    for engine, ts_ns in last.items():
        if engine in stopped:
            with contextlib.suppress(KeyError):
                ENGINE_LAST_EVENT_TS.remove(engine)
        else:
            ENGINE_LAST_EVENT_TS.labels(engine).set(ts_ns / 1e9)


def forget_partitions() -> None:
    """Drop the per-partition gauges (partitions were revoked; the next owner reports them)."""
    LAG.clear()
    LAST_EVENT_TS.clear()
    ENGINE_LAST_EVENT_TS.clear()
