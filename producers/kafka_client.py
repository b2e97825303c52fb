"""The emitter's Kafka client: librdkafka settings for riding out an outage, a rate-limited
log for librdkafka's own messages, and the confluent-kafka producer itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sparseety.config import Config


class RateLimitedLog(logging.Filter):
    """One line per message kind per ``every_s`` (librdkafka repeats connection errors fast)."""

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def filter(self, rec: logging.LogRecord) -> bool:
        key = rec.getMessage()[:60]
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.every_s:
            return False
        self._last[key] = now
        return True


rdkafka_log = logging.getLogger("sparseety.producer.librdkafka")
rdkafka_log.addFilter(RateLimitedLog())


def producer_settings(
    cfg: Config, *, memory_limit_bytes: int, stream: str, error_cb: Callable[[Any], None]
) -> dict[str, Any]:
    """librdkafka settings for one emitter's client."""
    from sparseety.kafka import producer_conf

    limit_kb = max(1024, memory_limit_bytes // 1024 * 2)
    return producer_conf(
        cfg,
        **{
            # Kafka away: keep messages (bounded by our own accounting) instead of failing them.
            "message.timeout.ms": 0,
            "queue.buffering.max.kbytes": limit_kb,
            "queue.buffering.max.messages": 10_000_000,
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 2000,
            "client.id": f"sparseety-{stream}",
            "error_cb": error_cb,
            "logger": rdkafka_log,
        },
    )


def confluent_producer(conf: dict[str, Any]) -> Any:
    from confluent_kafka import Producer

    return Producer(conf)
