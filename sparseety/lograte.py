"""Repeated log lines of the Kafka clients, at most one per template every few seconds.

Observed (issue 31): with the broker down for 45 s, a worker logged 2,039 ERROR lines of
aiokafka's ``Unable connect to node with id %s: %s`` (``aiokafka/client.py``), one per
reconnect attempt of each of its clients, which buried everything else in its log. The
clients keep retrying as they should; only their log is thinned: the first record of a
template passes, the same template again within :data:`EVERY_S` is counted and held back, and the
next one to pass says how many were held. Nothing else is filtered.

The consumer group's completed steps (:data:`ALWAYS_PASSED`) are never held back: each needs a
successful answer from the coordinator, so they come at most once per rebalance, and thinned
they hid a whole second join round (issue 33: a restarted worker's "Joined group" and "Elected
group leader" lines stood 8 s apart, and the failed SyncGroup and the second join between them
were held back, which looked like a stalled thread). Nor are the partitions a rebalance gives
and takes (their tables are how an operator, and tests/topology/test_scale_out.py, see where a
partition went; a second rebalance within the interval had its assignment held back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: Least seconds between two records of one template of one logger.
EVERY_S = 10.0
#: The client loggers thinned (aiokafka's modules that log per connection attempt or retry, and
#: Faust's aiokafka driver).
KAFKA_LOGGERS = (
    "aiokafka",
    "aiokafka.client",
    "aiokafka.conn",
    "aiokafka.cluster",
    "aiokafka.consumer.consumer",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.producer.producer",
    "aiokafka.producer.sender",
    "faust.transport.drivers.aiokafka",
)

#: aiokafka's group coordinator templates of a completed join/sync step and of the partitions it
#: revoked and assigned, passed unthinned.
ALWAYS_PASSED = frozenset(
    {
        "Joined group '%s' (generation %s) with member_id %s",
        "Elected group leader -- performing partition assignments using %s",
        "Successfully synced group %s with generation %s",
        "Revoking previously assigned partitions %s for group %s",
        "Setting newly assigned partitions %s for group %s",
    }
)


class RateLimit(logging.Filter):
    """Passes at most one record per (logger, template) every ``every_s``; the next one that
    passes carries how many were held back meanwhile.

    Args:
        every_s: Least seconds between two records of one template.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in ALWAYS_PASSED:
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (float("-inf"), 0))
            if now - last < self.every_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} [{held} more like it in the last {now - last:.0f} s held back]"
        return True


def thin_kafka_client_logs(every_s: float = EVERY_S) -> None:
    """Put one :class:`RateLimit` on each of :data:`KAFKA_LOGGERS` (once per process)."""
    limit = RateLimit(every_s)
    for name in KAFKA_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimit) for f in logger.filters):
            logger.addFilter(limit)
