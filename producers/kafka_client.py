"""The emitter's Kafka link: one confluent-kafka producer for one stream, with the librdkafka
settings for riding out an outage, its (re)creation and its fatal errors; and the rate-limited
logs for librdkafka's own messages and ours (the design: :mod:`.emitter`'s docstring)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sparseety.config import Config

log = logging.getLogger("sparseety.producer")

#: Builds a client from librdkafka settings (tests pass fakes with the same methods).
ProducerFactory = Callable[[dict[str, Any]], Any]
#: ``on_delivery(err, msg)``: called from :meth:`KafkaLink.poll`, ``err`` None once acknowledged.
OnDelivery = Callable[[Any, Any], None]


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


class WarnOnce:
    """Logs each kind of problem once per stream (a broken builder fails on every event)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._seen: set[str] = set()

    def __call__(self, key: str, msg: str, *args: Any) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        log.warning("sparseety producer %s: " + msg, self.stream, *args)


def producer_settings(cfg: Config, *, memory_limit_bytes: int, stream: str) -> dict[str, Any]:
    """librdkafka settings for one emitter's client (the link adds its error callback)."""
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
            "logger": rdkafka_log,
        },
    )


def confluent_producer(conf: dict[str, Any]) -> Any:
    from confluent_kafka import Producer

    return Producer(conf)


class KafkaLink:
    """One stream's Kafka client, used from the emitter's background thread only.

    Args:
        settings: librdkafka settings (:func:`producer_settings`); ``error_cb`` is the link's.
        topic: Where every message goes.
        factory: Builds the client from the settings.
        warn_once: Logs each kind of client problem once.

    :attr:`key` (the engine name: one engine's streams share a partition) is set once the stream
    is named; :attr:`fatal` says the client is in a state only a new one gets out of;
    :attr:`born` is when the current client was made (stall detection counts from it).
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        *,
        topic: str,
        factory: ProducerFactory = confluent_producer,
        warn_once: WarnOnce,
    ) -> None:
        self.settings = dict(settings)
        self.topic = topic
        self.key = b""
        self.fatal = False
        self.born = time.monotonic()
        #: The client's last non-fatal error, and whether it said every broker is down (the
        #: supervisor clears that once Kafka acknowledges again): :mod:`.delivery` reports them.
        self.last_error = ""
        self.brokers_down = False
        self._factory = factory
        self._warn_once = warn_once
        self._client: Any = None

    @property
    def connected(self) -> bool:
        """Whether a client exists (it may still be connecting)."""
        return self._client is not None

    def connect(self) -> None:
        """Make a new client (the old one, if any, was :meth:`discard`-ed)."""
        try:
            self._client = self._factory({**self.settings, "error_cb": self._on_error})
        except Exception as exc:
            self._client = None
            self._warn_once("producer", "cannot create the Kafka producer: %s", exc)
        self.born = time.monotonic()

    def produce(self, value: bytes, on_delivery: OnDelivery) -> bool:
        """Hand one value to the client: False when there is none or it cannot take more now."""
        client = self._client
        if client is None:
            return False
        try:
            client.produce(self.topic, value=value, key=self.key, on_delivery=on_delivery)
        except BufferError:
            return False
        except Exception as exc:  # KafkaException: fatal state, closed client
            self._warn_once("produce", "produce() failed: %s", exc)
            self.fatal = True
            return False
        return True

    def poll(self, timeout: float) -> None:
        """Serve delivery reports and errors, waiting up to ``timeout`` (a sleep with no client)."""
        client = self._client
        if client is not None:
            client.poll(timeout)
        elif timeout:
            time.sleep(timeout)

    def discard(self, wait_s: float) -> None:
        """Purge the client and poll until its messages came back as failed (or ``wait_s``
        passed), then drop it; :meth:`connect` makes the next one."""
        client, self._client = self._client, None
        self.fatal = False
        if client is not None:
            _purge(client, wait_s)

    def purge(self, wait_s: float) -> None:
        """Purge what the client holds (it comes back as failed deliveries); keep the client."""
        if self._client is not None:
            _purge(self._client, wait_s)

    def flush(self, timeout: float) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.flush(timeout)

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self.fatal = True
            log.warning("sparseety producer %s: fatal Kafka client error: %s", self._warn_once.stream, err)
        else:
            self.last_error = str(err)
            if err.code() == _ALL_BROKERS_DOWN:
                self.brokers_down = True
            rdkafka_log.info("kafka client: %s", err)


#: librdkafka's ``RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN`` (``KafkaError._ALL_BROKERS_DOWN``).
_ALL_BROKERS_DOWN = -187


def _purge(producer: Any, wait_s: float) -> None:
    with contextlib.suppress(Exception):
        producer.purge()
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        while len(producer) > 0 and time.monotonic() < deadline:
            producer.poll(0.05)
