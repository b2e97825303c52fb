"""An emitter's totals: the counters its heartbeats carry, Prometheus metrics (exported as
deltas, once a second) and the log line it writes when it stops (the design: :mod:`.emitter`'s
docstring)."""

from __future__ import annotations

import logging

from . import metrics
from .handoff import Source
from .ledger import EmitterStats, Ledger

log = logging.getLogger("sparseety.producer")


def counters(stats: EmitterStats, handoff: Source) -> dict[str, int]:
    """produced / dropped / spilled / drained / queued / restarts totals (drops at the hand-off
    included)."""
    return {
        "produced": stats.produced,
        "dropped": stats.dropped + sum(handoff.dropped_by.values()),
        "spilled": stats.spilled,
        "drained": stats.drained,
        "queued": handoff.queued,
        "restarts": stats.restarts,
    }


class Reporter:
    """Exports one stream's counters; remembers what it exported so far.

    ``exported``: what an earlier process already exported for this stream (a restarted relay
    starts from its predecessor's totals, which a multiprocess registry already holds)."""

    def __init__(
        self, handoff: Source, ledger: Ledger, stream: str, exported: dict[str, int] | None = None
    ) -> None:
        self.handoff = handoff
        self.ledger = ledger
        self.stream = stream
        self._exported: dict[str, int] = dict(exported or {})

    def sync_metrics(self, engine_name: str) -> None:
        """Export what changed since the last call (``engine_name``: "" until the stream is named)."""
        handoff, stats = self.handoff, self.ledger.stats
        labels = (engine_name, self.stream)
        at_handoff = handoff.dropped_by
        now = {
            "produced": stats.produced,
            "spilled": stats.spilled,
            "drained": stats.drained,
            "dropped": stats.dropped + sum(at_handoff.values()),
        }
        for outcome, value in now.items():
            delta = value - self._exported.get(outcome, 0)
            if delta > 0:
                metrics.EVENTS.labels(*labels, outcome).inc(delta)
        for reason, value in dict(stats.dropped_by, **at_handoff).items():
            delta = value - self._exported.get("r:" + reason, 0)
            if delta > 0:
                metrics.DROPPED.labels(*labels, reason).inc(delta)
            self._exported["r:" + reason] = value
        delta = stats.restarts - self._exported.get("restarts", 0)
        if delta > 0:
            metrics.RESTARTS.labels(*labels).inc(delta)
        self._exported.update(now, restarts=stats.restarts)
        metrics.QUEUE.labels(*labels).set(handoff.queued)
        metrics.MEMORY.labels(*labels).set(self.ledger.memory_bytes)
        metrics.JOURNAL.labels(*labels).set(self.ledger.journal_bytes)

    def log_totals(self, engine_id: str) -> None:
        totals = counters(self.ledger.stats, self.handoff)
        log.info(
            "sparseety producer %s/%s stopped: produced=%d dropped=%d spilled=%d drained=%d "
            "restarts=%d journal_bytes_left=%d%s",
            engine_id,
            self.stream,
            totals["produced"],
            totals["dropped"],
            totals["spilled"],
            totals["drained"],
            totals["restarts"],
            self.ledger.journal_bytes,
            f" (dropped by reason: {dict(self.ledger.stats.dropped_by, **self.handoff.dropped_by)})"
            if totals["dropped"]
            else "",
        )
