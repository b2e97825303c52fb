"""What the emitter owes Kafka: the memory budget, the backlog, the messages in flight, the
failed ones to retry, and the disk journal that takes over when Kafka is away (the design:
:mod:`.emitter`'s docstring).

It produces through a :class:`Link` (the stream's :class:`~.kafka_client.KafkaLink`):
``produce(value, on_delivery) -> bool`` (False: not taken now); ``on_delivery(err, msg)`` is
called later with ``err`` None once acknowledged.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .journal import Journal, JournalError, JournalFullError
from .kafka_client import OnDelivery, WarnOnce

log = logging.getLogger("sparseety.producer")

#: Memory a queued message costs beside its value: librdkafka's message struct, key copy and the
#: Python delivery callback. Measured here: ~580 B of RSS per queued 100-byte message.
MSG_OVERHEAD = 512

NEW, BACKLOG, JOURNAL = 0, 1, 2


class Link(Protocol):
    """What the ledger needs of the Kafka client: the stream's key (journaled beside each value)
    and a produce call that says whether the client took the value."""

    key: bytes

    def produce(self, value: bytes, on_delivery: OnDelivery) -> bool: ...


@dataclass
class EmitterStats:
    """Totals since the emitter started (the Heartbeat's counters)."""

    produced: int = 0
    spilled: int = 0
    drained: int = 0
    restarts: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())


def _cost(value: bytes) -> int:
    return len(value) + MSG_OVERHEAD


class Ledger:
    """Admits encoded events within the memory budget, spills the rest, drains in order.

    Args:
        link: The stream's Kafka client (:class:`Link`).
        limit_bytes: Memory budget for messages in flight plus the backlog.
        journal_dir: Where to spill (see :meth:`bind`).
        journal_max_bytes: The journal's bound; beyond it events are dropped.
        stream: For log lines.
        warn_once: Logs each kind of warning once.
        bootstrap: The Kafka bootstrap the producer uses (named in the spill warning).
    """

    def __init__(
        self,
        link: Link,
        *,
        limit_bytes: int,
        journal_dir: Path,
        journal_max_bytes: int,
        stream: str,
        warn_once: WarnOnce | None = None,
        bootstrap: str = "",
    ) -> None:
        self.link = link
        self.limit_bytes = limit_bytes
        self.journal_dir = journal_dir
        self.journal_max_bytes = journal_max_bytes
        self.stream = stream
        self.bootstrap = bootstrap  # named when Kafka does not take events: the setting to check
        self.warn_once = warn_once or WarnOnce(stream)
        self.stats = EmitterStats()
        self.journal: Journal | None = None
        self.journal_broken = False
        self.journal_left = 0  # journal bytes not yet read, as of the last flush
        self.backlog: deque[tuple[int, bytes, int]] = deque()
        self.backlog_bytes = 0
        self.inflight = 0
        self.inflight_bytes = 0
        self.failed: list[tuple[int, bytes, int]] = []
        self._order = itertools.count()

    def bind(self, journal_dir: Path) -> None:
        """The stream's journal folder (known once the engine is named)."""
        self.journal_dir = journal_dir

    @property
    def idle(self) -> bool:
        """Nothing in flight, in the backlog or (as of the last flush) in the journal."""
        return not self.inflight and not self.backlog and not self.journal_left

    @property
    def pending(self) -> bool:
        """Anything still owed to Kafka."""
        return bool(self.inflight or self.backlog or (self.journal is not None and self.journal))

    @property
    def memory_bytes(self) -> int:
        return self.inflight_bytes + self.backlog_bytes

    @property
    def journal_bytes(self) -> int:
        return self.journal.pending_bytes if self.journal is not None else 0

    def route(self, value: bytes) -> None:
        """Send one new encoded event, or queue it in memory, or spill it."""
        if self.journal is not None and self.journal:
            self.spill(value)  # stay behind what waits on disk
            return
        size = _cost(value)
        if self.memory_bytes + size <= self.limit_bytes:
            if not self.backlog and self.try_produce(value, NEW):
                return
            self.backlog.append((next(self._order), value, NEW))
            self.backlog_bytes += size
            return
        self.spill(value)

    def try_produce(self, value: bytes, origin: int) -> bool:
        size = _cost(value)
        order = next(self._order)
        if not self.link.produce(value, functools.partial(self._on_delivery, order, origin, size)):
            return False
        self.inflight += 1
        self.inflight_bytes += size
        return True

    def _on_delivery(self, order: int, origin: int, size: int, err: Any, msg: Any) -> None:
        self.inflight -= 1
        self.inflight_bytes -= size
        if err is None:
            self.stats.produced += 1
            if origin == JOURNAL:
                self.stats.drained += 1
            return
        self.failed.append((order, msg.value(), origin))
        if "PURGE" not in err.name():
            self.warn_once(f"delivery:{err.name()}", "delivery failed, will retry: %s", err)

    def spill(self, value: bytes) -> None:
        draining = self.journal is not None and bool(self.journal)  # behind older spilled events
        if self.journal is None and not self.open_journal():
            self.drop("journal_error")
            return
        assert self.journal is not None
        try:
            self.journal.append(self.link.key, value)
        except JournalFullError:
            self.drop("journal_full")
            return
        except OSError as exc:
            self.warn_once("journal-write", "cannot write the journal: %s", exc)
            self.drop("journal_error")
            return
        self.journal_left = self.journal.pending_bytes
        if self.stats.spilled == 0:
            if draining:
                # a healthy drain: new events queue on disk behind the older ones, in order
                log.info(
                    "sparseety producer %s: draining the journal %s into Kafka; new events queue behind it",
                    self.stream,
                    self.journal_dir,
                )
            else:
                log.warning(
                    "sparseety producer %s: Kafka at %s does not take events (unreachable, or slower than "
                    "the engine); spilling to %s. Check kafka.bootstrap (SPARSEETY_KAFKA_BOOTSTRAP) and "
                    "that the broker runs; `sparseety status` lists engines with undelivered journals",
                    self.stream,
                    self.bootstrap or "(kafka.bootstrap unset)",
                    self.journal_dir,
                )
        self.stats.spilled += 1

    def open_journal(self) -> bool:
        if self.journal_broken:
            return False
        try:
            self.journal = Journal(self.journal_dir, self.journal_max_bytes)
        except JournalError as exc:
            self.journal_broken = True
            log.error(
                "sparseety producer %s: %s; events that do not fit in memory are lost", self.stream, exc
            )
            return False
        return True

    def flush_journal(self) -> None:
        if self.journal is not None:
            self.journal.flush()
            self.journal_left = self.journal.pending_bytes

    def close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def drop(self, reason: str, count: int = 1) -> None:
        self.stats.dropped_by[reason] = self.stats.dropped_by.get(reason, 0) + count

    def requeue_failed(self) -> None:
        if not self.failed:
            return
        failed = sorted(self.failed)
        self.failed.clear()
        self.backlog.extendleft(reversed(failed))
        self.backlog_bytes += sum(_cost(value) for _, value, _ in failed)

    def pump(self, budget: int = 20_000) -> None:
        """Produce from the backlog, then from the journal, in order, within the budget."""
        backlog = self.backlog
        while backlog and budget:
            _, value, origin = backlog[0]
            size = _cost(value)
            if self.inflight_bytes + size > self.limit_bytes or not self.try_produce(value, origin):
                return
            backlog.popleft()
            self.backlog_bytes -= size
            budget -= 1
        journal = self.journal
        if journal is None or not journal:
            return
        while budget:
            rec = journal.peek()
            if rec is None:
                journal.compact()
                return
            value = rec[1]
            if self.inflight_bytes + _cost(value) > self.limit_bytes:
                return
            if not self.try_produce(value, JOURNAL):
                return
            journal.pop()
            budget -= 1

    def forget_inflight(self) -> None:
        """A purged client did not hand these messages back: count them as dropped."""
        log.error(
            "sparseety producer %s: %d purged messages never came back; counted as dropped",
            self.stream,
            self.inflight,
        )
        self.drop("purge_lost", self.inflight)
        self.inflight = 0
        self.inflight_bytes = 0

    def spill_backlog(self) -> None:
        """At shutdown: put the backlog in front of the journal for the next start."""
        if not self.backlog:
            return
        left = [(self.link.key, value) for _, value, _ in self.backlog]
        if self.journal is None:
            self.open_journal()
        written = self.journal.prepend(left) if self.journal is not None else 0
        self.stats.spilled += written
        if len(left) > written:
            self.drop("journal_full", len(left) - written)
        self.backlog.clear()
        self.backlog_bytes = 0
