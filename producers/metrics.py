"""Prometheus metrics of the engine-side producers (names ``sparseety:<noun>_<unit>``).

They live in the process's default registry: whatever serves that registry exposes them (the
proxy's ``/metrics``; vLLM's API server when it runs Prometheus in multiprocess mode with
``PROMETHEUS_MULTIPROC_DIR``). The same counters travel in every Heartbeat event and are logged
when a producer stops, so they reach operators even where no registry is scraped.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

EVENTS = Counter(
    "sparseety:producer_events_total",
    "Engine events by outcome: produced (acknowledged by Kafka), spilled (written to the disk "
    "journal), drained (journal events acknowledged later), dropped (lost: a seq gap).",
    ["engine", "stream", "outcome"],
)
DROPPED = Counter(
    "sparseety:producer_dropped_events_total",
    "Engine events lost, by reason: queue_full, journal_full, unencodable, journal_error.",
    ["engine", "stream", "reason"],
)
RESTARTS = Counter(
    "sparseety:producer_restarts_total",
    "Kafka producer clients recreated after a fatal error or a stall.",
    ["engine", "stream"],
)
QUEUE = Gauge(
    "sparseety:producer_queue_events", "Events waiting in the hand-off queue.", ["engine", "stream"]
)
MEMORY = Gauge(
    "sparseety:producer_memory_bytes",
    "Encoded event bytes held in memory (in the Kafka client or waiting for it).",
    ["engine", "stream"],
)
JOURNAL = Gauge(
    "sparseety:producer_journal_bytes", "Bytes in the disk journal not yet delivered.", ["engine", "stream"]
)
