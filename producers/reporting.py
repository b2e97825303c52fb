"""An emitter's totals, as Prometheus metrics (exported as deltas, once a second) and as the
log line it writes when it stops."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import metrics
from .ledger import Ledger

if TYPE_CHECKING:
    from .emitter import Emitter

log = logging.getLogger("sparseety.producer")


class Reporter:
    """Exports one emitter's counters; remembers what it exported so far."""

    def __init__(self, owner: Emitter, ledger: Ledger) -> None:
        self.owner = owner
        self.ledger = ledger
        self._exported: dict[str, int] = {}

    def sync_metrics(self) -> None:
        owner, stats = self.owner, self.ledger.stats
        labels = (owner.engine_name, owner.stream)
        queue_full = owner.handoff.dropped
        now = {
            "produced": stats.produced,
            "spilled": stats.spilled,
            "drained": stats.drained,
            "dropped": stats.dropped + queue_full,
        }
        for outcome, value in now.items():
            delta = value - self._exported.get(outcome, 0)
            if delta > 0:
                metrics.EVENTS.labels(*labels, outcome).inc(delta)
        for reason, value in dict(stats.dropped_by, queue_full=queue_full).items():
            delta = value - self._exported.get("r:" + reason, 0)
            if delta > 0:
                metrics.DROPPED.labels(*labels, reason).inc(delta)
            self._exported["r:" + reason] = value
        delta = stats.restarts - self._exported.get("restarts", 0)
        if delta > 0:
            metrics.RESTARTS.labels(*labels).inc(delta)
        self._exported.update(now, restarts=stats.restarts)
        metrics.QUEUE.labels(*labels).set(owner.handoff.queued)
        metrics.MEMORY.labels(*labels).set(self.ledger.memory_bytes)
        metrics.JOURNAL.labels(*labels).set(self.ledger.journal_bytes)

    def log_totals(self) -> None:
        owner = self.owner
        counters = owner.counters()
        log.info(
            "sparseety producer %s/%s stopped: produced=%d dropped=%d spilled=%d drained=%d "
            "restarts=%d journal_bytes_left=%d%s",
            owner.engine_id,
            owner.stream,
            counters["produced"],
            counters["dropped"],
            counters["spilled"],
            counters["drained"],
            counters["restarts"],
            self.ledger.journal_bytes,
            f" (dropped by reason: {dict(self.ledger.stats.dropped_by, queue_full=owner.handoff.dropped)})"
            if counters["dropped"]
            else "",
        )
