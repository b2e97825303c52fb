"""Kafka plumbing shared by every component: clients from config, topics, codecs.

Users set client options once, in librdkafka's names (``kafka.client``: ``security.protocol``,
``sasl.*``, ``ssl.*``). confluent-kafka takes them as they are (:meth:`KafkaConfig.librdkafka`);
the asyncio clients (aiokafka, and Faust on top of it) do not speak those names, so
:func:`client_security` reads them once and :func:`aiokafka_settings` turns them into aiokafka's
keywords (the Faust runtime builds its credentials from the same :class:`ClientSecurity`,
``streams/runtime.py``). Nothing here imports Faust: replay runs on aiokafka alone.
"""

from __future__ import annotations

import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

from sparseety.config import Config
from sparseety.errors import ConfigError, KafkaUnavailableError, SparseetyError
from sparseety.schema_store import SchemaStore
from sparseety.serde import Decoder, Encoder

log = logging.getLogger("sparseety.kafka")


@dataclass(frozen=True, slots=True)
class Record:
    """A consumed Kafka record, whichever client read it: confluent-kafka in the sink loop
    (``sinks/consumer.py``), aiokafka in the worker's batches and refetches (``streams/compat.py``),
    and what a sink buffers undecoded (``sinks/base.py``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


#: The security protocols the asyncio clients (aiokafka, Faust) support.
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


@dataclass(frozen=True)
class ClientSecurity:
    """How the asyncio clients reach the cluster, read from the librdkafka options.

    Attributes:
        protocol: One of :data:`PROTOCOLS`.
        ssl_context: For SSL and SASL_SSL: trusting ``ssl.ca.location`` (else the system's CAs),
            with the client certificate of ``ssl.certificate.location`` / ``ssl.key.location``.
        sasl_mechanism, sasl_username, sasl_password: For SASL_*: ``sasl.*``.
    """

    protocol: str
    ssl_context: ssl.SSLContext | None = None
    sasl_mechanism: str = "PLAIN"
    sasl_username: str | None = None
    sasl_password: str | None = None

    @property
    def sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")


def client_security(cfg: Config) -> ClientSecurity:
    """The ``kafka.client`` security options for the asyncio clients.

    Raises:
        ConfigError: a security protocol they cannot use.
    """
    opts = cfg.kafka.client
    protocol = opts.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"security.protocol {protocol} is not supported by the Faust workers")
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=opts.get("ssl.ca.location"))
        if opts.get("ssl.certificate.location"):
            context.load_cert_chain(opts["ssl.certificate.location"], opts.get("ssl.key.location"))
    return ClientSecurity(
        protocol,
        context,
        opts.get("sasl.mechanism", "PLAIN"),
        opts.get("sasl.username"),
        opts.get("sasl.password"),
    )


def aiokafka_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments for aiokafka clients equivalent to the librdkafka pass-through options."""
    settings: dict[str, Any] = {"bootstrap_servers": cfg.kafka.bootstrap}
    sec = client_security(cfg)
    if sec.protocol == "PLAINTEXT":
        return settings
    settings["security_protocol"] = sec.protocol
    if sec.sasl:
        settings["sasl_mechanism"] = sec.sasl_mechanism
        settings["sasl_plain_username"] = sec.sasl_username
        settings["sasl_plain_password"] = sec.sasl_password
    if sec.ssl_context is not None:
        settings["ssl_context"] = sec.ssl_context
    return settings


def producer_conf(cfg: Config, **extra: Any) -> dict[str, Any]:
    """librdkafka producer settings: idempotent (no duplicates on retry), compressed, batched."""
    return cfg.kafka.librdkafka(
        **{
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": cfg.producer.compression,
            "linger.ms": cfg.producer.linger_ms,
            **extra,
        }
    )


def make_producer(cfg: Config, **extra: Any) -> Any:
    """A confluent-kafka Producer for ``cfg``."""
    from confluent_kafka import Producer

    return Producer(producer_conf(cfg, **extra))


def make_admin(cfg: Config) -> Any:
    """A confluent-kafka AdminClient for ``cfg``."""
    from confluent_kafka.admin import AdminClient

    return AdminClient(cfg.kafka.librdkafka())


def wait_for_kafka(cfg: Config, timeout_s: float = 30.0, *, quiet: bool = False) -> None:
    """Block until the cluster answers a metadata request (``quiet``: no "waiting" log line).

    Raises:
        KafkaUnavailableError: no answer within ``timeout_s``.
    """
    from confluent_kafka.admin import AdminClient

    # librdkafka would log every failed connect (~20 lines a second); the error below says it once.
    admin = AdminClient(cfg.kafka.librdkafka(log_level=2))
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
            return
        except Exception as exc:  # KafkaException, or a timeout
            if last is None and not quiet:
                log.warning("waiting up to %.0f s for Kafka at %s", timeout_s, cfg.kafka.bootstrap)
            last = exc
            time.sleep(0.2)
    raise KafkaUnavailableError(
        f"Kafka at {cfg.kafka.bootstrap} did not answer within {timeout_s:.0f} s: {last}",
        bootstrap=cfg.kafka.bootstrap,
    )


def ensure_topics(
    cfg: Config, topics: list[str] | None = None, partitions: int | None = None, timeout_s: float = 30.0
) -> list[str]:
    """Create missing topics with the configured partitions; return the ones created.

    Faust refuses a table whose source and changelog partition counts differ, and some brokers
    give auto-created topics their own default count, so topics are always created explicitly.

    Raises:
        SparseetyError: an existing topic has a different partition count, or creation failed.
    """
    from confluent_kafka.admin import NewTopic

    topics = topics if topics is not None else cfg.topics.all()
    partitions = partitions or cfg.topics.partitions
    admin = make_admin(cfg)
    existing = admin.list_topics(timeout=timeout_s).topics
    for name in topics:
        if name in existing and len(existing[name].partitions) != partitions:
            raise SparseetyError(
                f"topic {name} has {len(existing[name].partitions)} partitions, config says {partitions}",
                topic=name,
            )
    missing = [t for t in topics if t not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [
            NewTopic(t, num_partitions=partitions, replication_factor=cfg.topics.replication_factor)
            for t in missing
        ],
        request_timeout=timeout_s,
    )
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise SparseetyError(f"cannot create topic {name}: {exc}", topic=name) from exc
    _wait_for_leaders(admin, missing, timeout_s)
    return missing


def _wait_for_leaders(admin: Any, topics: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout_s).topics
        if all(t in md and md[t].partitions and md[t].error is None for t in topics):
            return
        time.sleep(0.1)
    raise SparseetyError(f"topics {topics} have no leaders after {timeout_s:.0f} s", topics=topics)


_registries: dict[tuple[tuple[str, Any], ...], Any] = {}


def make_registry(cfg: Config) -> Any | None:
    """The process's SchemaRegistryClient for the configured URL, or None without one.

    One client per URL and credentials, so schema ids are cached once (and ``mock://``
    registries, which live inside their client, are shared by everything in the process).
    """
    if not cfg.schema_registry.url:
        return None
    from confluent_kafka.schema_registry import SchemaRegistryClient

    conf = cfg.schema_registry.client_conf()
    key = tuple(sorted(conf.items()))
    if key not in _registries:
        _registries[key] = SchemaRegistryClient.new_client(conf)
    return _registries[key]


def make_encoder(
    cfg: Config, record: str, topic: str, store: SchemaStore | None = None, registry: Any = None
) -> Encoder:
    """Encoder for ``record`` on ``topic`` in the configured framing."""
    registry = registry if registry is not None else make_registry(cfg)
    return Encoder(store or SchemaStore.load(), record, registry=registry, topic=topic)


def make_decoder(cfg: Config, store: SchemaStore | None = None, registry: Any = None) -> Decoder:
    """Decoder that reads single-object payloads, and registry payloads when configured."""
    registry = registry if registry is not None else make_registry(cfg)
    return Decoder(store or SchemaStore.load(), registry=registry)
