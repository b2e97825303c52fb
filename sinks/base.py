"""The contract every sink shares, and how sinks are found.

A sink receives decoded records with their Kafka position (:meth:`Sink.add`), buffers them per
partition, and writes everything it holds on :meth:`Sink.flush`. The consumer calls ``flush``
before it acknowledges the records, so an offset is committed only after its rows are stored
(at-least-once); sinks make the repeats harmless (idempotent writes), so a crash between write
and commit never double counts.

Sinks are extensible: a distribution registers ``name = "module:Class"`` under the entry-point
group ``sparseety.sinks``; :func:`load_sink_class` finds it and checks that it is a :class:`Sink`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, TypeVar

from sparseety.config import Config
from sparseety.errors import PluginLoadError
from sparseety.kafka import Record
from sparseety.schema_store import SchemaStore, WireSchema

ENTRY_POINT_GROUP = "sparseety.sinks"


@dataclass(frozen=True)
class Batch:
    """A contiguous run of one partition's records that was (or was not) written together."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int

    def as_tuple(self) -> tuple[str, int, int, int]:
        """``(topic, partition, first_offset, last_offset)``, as :class:`SinkWriteError` carries it."""
        return (self.topic, self.partition, self.first_offset, self.last_offset)


@dataclass(eq=False)
class Chunk:
    """Buffered records of one partition over a contiguous offset range: one :class:`Batch` once
    written. Sinks subclass it with what they buffer (rows, spans)."""

    topic: str
    partition: int
    first: int
    last: int

    @property
    def batch(self) -> Batch:
        """The offset range this chunk covers."""
        return Batch(self.topic, self.partition, self.first, self.last)


C = TypeVar("C", bound=Chunk)


class ChunkBuffer(Generic[C]):
    """What a sink holds between flushes: chunks in arrival order, one open chunk per partition.

    Args:
        make: ``(topic, partition, offset) -> chunk`` starting at ``offset``.
    """

    def __init__(self, make: Callable[[str, int, int], C]) -> None:
        self._make = make
        self.chunks: list[C] = []
        self._open: dict[tuple[str, int], C] = {}

    def chunk_for(self, topic: str, partition: int, offset: int) -> C:
        """The open chunk of the partition, or a new one; the caller advances ``chunk.last``."""
        chunk = self._open.get((topic, partition))
        if chunk is None or offset < chunk.last:
            # a partition read again from an earlier offset (a seek back) starts a new batch
            chunk = self._make(topic, partition, offset)
            self._open[(topic, partition)] = chunk
            self.chunks.append(chunk)
        return chunk

    def seal(self) -> list[C]:
        """Close every open chunk (later records start new ones); return all held chunks."""
        self._open.clear()
        return list(self.chunks)

    def remove(self, done: list[C]) -> None:
        """Forget chunks that were written."""
        self.chunks = [c for c in self.chunks if c not in done]

    def discard(self, topic: str, partition: int) -> list[C]:
        """Drop everything held for a partition (it was revoked); return what was dropped."""
        dropped = [c for c in self.chunks if (c.topic, c.partition) == (topic, partition)]
        self.remove(dropped)
        self._open.pop((topic, partition), None)
        return dropped

    def batches(self) -> list[Batch]:
        """The offset ranges held, in arrival order."""
        return [c.batch for c in self.chunks]


@dataclass
class FlushResult:
    """What one :meth:`Sink.flush` did.

    Attributes:
        rows: Rows written per table.
        written: Batches now completely stored.
        failed: Batches still buffered because their write kept failing.
        inserts: Insert statements issued (one per table per flush when all is well).
        rejected: Records the sink could not store (data errors) and wrote to ``dead_letters``.
        undecoded: Records taken undecoded that the sink hands back instead of writing them (the
            store refused the batch they came in): no longer buffered; the caller decodes each
            one (dead-lettering those that do not decode) and adds it again with :meth:`Sink.add`.
    """

    rows: dict[str, int] = field(default_factory=dict)
    written: list[Batch] = field(default_factory=list)
    failed: list[Batch] = field(default_factory=list)
    inserts: int = 0
    rejected: int = 0
    undecoded: list[Record] = field(default_factory=list)

    @property
    def total_rows(self) -> int:
        """Rows written over all tables."""
        return sum(self.rows.values())

    def merge(self, other: FlushResult) -> None:
        """Add ``other``'s counts to this result."""
        for table, n in other.rows.items():
            self.rows[table] = self.rows.get(table, 0) + n
        self.written.extend(other.written)
        self.failed.extend(other.failed)
        self.inserts += other.inserts
        self.rejected += other.rejected
        self.undecoded.extend(other.undecoded)


class Sink(abc.ABC):
    """Stores decoded records; idempotent, batched per partition.

    Subclasses set :attr:`records` (the full record names they store) and implement
    :meth:`from_config` so the consumer and the replay can build them from the configuration.
    """

    #: Full Avro names of the records this sink stores; the consumer dead-letters others.
    records: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: Config, **options: Any) -> Sink:
        """Build the sink for ``cfg`` (opening whatever store it writes to)."""

    def accepts(self, record_name: str) -> bool:
        """Whether this sink stores records of that full name."""
        return record_name in self.records

    @abc.abstractmethod
    def add(
        self, record_name: str, record: Mapping[str, Any], *, topic: str, partition: int, offset: int
    ) -> None:
        """Buffer one record read at ``topic``/``partition``/``offset``.

        Several records may share one position (a processor may derive several records from one
        input record); a position before the previous one of the partition starts a new batch.
        """

    def takes_encoded(self, writer: WireSchema, store: SchemaStore) -> bool:
        """Whether :meth:`add_encoded` takes records of ``writer`` undecoded (``store``: the
        contract, whose ``current`` versions readers use). By default no sink does."""
        return False

    def add_encoded(
        self, writer: WireSchema, value: bytes, *, key: bytes | None, topic: str, partition: int, offset: int
    ) -> None:
        """Buffer one payload undecoded (only for writers :meth:`takes_encoded` accepts): its header
        was read, its body was not. A flush writes it, or hands it back in
        :attr:`FlushResult.undecoded`, never drops it."""
        raise NotImplementedError(f"{type(self).__name__} takes no undecoded records")

    @abc.abstractmethod
    def pending_rows(self) -> int:
        """Rows buffered and not yet written."""

    @abc.abstractmethod
    def pending_batches(self) -> list[Batch]:
        """Batches buffered and not yet written (after a failed flush: the failed ones)."""

    @abc.abstractmethod
    def flush(self) -> FlushResult:
        """Write everything buffered, per partition batch.

        Raises:
            SinkWriteError: some batches could not be written after retries; they stay
                buffered (``failed`` names them) and the next flush tries them again.
        """

    @abc.abstractmethod
    def discard(self, topic: str, partition: int) -> int:
        """Forget the buffered records of a partition this process no longer owns; return rows."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store. Unwritten records are not flushed: call :meth:`flush` first."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def available_sinks() -> dict[str, str]:
    """Registered sinks: name -> ``module:attribute``."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_sink_class(name: str) -> type[Sink]:
    """The sink class registered under ``name`` in the ``sparseety.sinks`` entry-point group.

    Raises:
        PluginLoadError: no such sink, it fails to import, or it is not a :class:`Sink` subclass.
    """
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = ", ".join(sorted(available_sinks())) or "none"
        raise PluginLoadError(
            f"no sink named {name!r} in entry-point group {ENTRY_POINT_GROUP} (registered: {known})",
            name=name,
            group=ENTRY_POINT_GROUP,
        )
    ep = found[0]
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginLoadError(
            f"sink {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}",
            name=name,
            target=ep.value,
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Sink)):
        raise PluginLoadError(
            f"sink {name!r} ({ep.value}) is {obj!r}, not a subclass of sparseety.sinks.base.Sink",
            name=name,
            target=ep.value,
        )
    return obj
