"""Wire formats: Avro single-object encoding, or Confluent Schema Registry framing.

Both are standard framings any Avro reader understands:

* single-object: ``C3 01`` + the writer schema's CRC-64-AVRO fingerprint (8 bytes, little-endian)
  + the Avro binary body; writer schemas resolve against ``schemas/`` (and ``schemas/history``).
* registry: ``00`` + the registry's 4-byte schema id (big-endian) + the Avro binary body; used when
  a schema registry URL is configured (``mock://`` works for tests).

A :class:`Decoder` reads both framings, whatever the writer used, so a fleet can switch framing
without a flag day. Every failure becomes a :class:`~sparseety.errors.DecodeError` subclass
that carries the raw bytes; fastavro and struct exceptions never leak.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import fastavro

from sparseety.errors import (
    BadMagicError,
    CorruptPayloadError,
    EncodeError,
    TruncatedPayloadError,
    UnknownSchemaError,
)
from sparseety.packed import from_wire, to_wire, writes_packed
from sparseety.schema_store import SchemaStore, WireSchema, full_name

_ENGINE_EVENT = full_name("EngineEvent")
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
REGISTRY_MAGIC = b"\x00"
_SINGLE_HEADER = len(SINGLE_OBJECT_MAGIC) + 8
_REGISTRY_HEADER = 5
#: Bytes before the Avro body of a single-object payload (magic and fingerprint).
SINGLE_OBJECT_HEADER = _SINGLE_HEADER


def subject_for(topic: str) -> str:
    """Registry subject of a topic's values (TopicNameStrategy: one record type per topic)."""
    return f"{topic}-value"


class Encoder:
    """Encodes one wire record type into the configured framing.

    Args:
        store: The schema contract.
        record: Short or full name of the wire record (e.g. ``EngineEvent``).
        registry: A ``confluent_kafka.schema_registry.SchemaRegistryClient``; None for
            single-object encoding.
        topic: Topic the records go to (names the registry subject).
    """

    def __init__(
        self,
        store: SchemaStore,
        record: str,
        *,
        registry: Any | None = None,
        topic: str | None = None,
    ) -> None:
        self.wire: WireSchema = store.wire(record)
        # StepBatch's integer columns travel packed when this schema has the v3 fields.
        self._pack = self.wire.name == _ENGINE_EVENT and writes_packed(self.wire.parsed)
        if registry is None:
            self._header = SINGLE_OBJECT_MAGIC + self.wire.fingerprint_bytes
        else:
            from confluent_kafka.schema_registry import Schema

            if topic is None:
                raise ValueError("registry framing needs the topic (it names the subject)")
            schema_id = registry.register_schema(subject_for(topic), Schema(self.wire.json, "AVRO"))
            self._header = REGISTRY_MAGIC + struct.pack(">I", schema_id)

    def encode(self, datum: Mapping[str, Any]) -> bytes:
        """Encode one record (a dict; unions of records as ``(full_name, dict)`` tuples)."""
        buf = io.BytesIO()
        buf.write(self._header)
        if self._pack:
            datum = to_wire(datum)
        try:
            fastavro.schemaless_writer(buf, self.wire.parsed, datum)
        except Exception as exc:  # fastavro raises ValueError, TypeError, KeyError, ...
            raise EncodeError(
                f"record does not match {self.wire.name}: {exc}", record=self.wire.name
            ) from exc
        return buf.getvalue()


class Decoder:
    """Decodes wire records in either framing into (full record name, dict).

    The reader schema is the store's current version of the writer's record, so a reader
    resolves older and newer writer versions through Avro schema resolution.

    Args:
        store: The schema contract.
        registry: Optional ``SchemaRegistryClient`` for registry-framed payloads.
    """

    def __init__(self, store: SchemaStore, *, registry: Any | None = None) -> None:
        self.store = store
        self.registry = registry
        self._by_id: dict[int, WireSchema] = {}
        # Per writer fingerprint, and per single-object header (magic + fingerprint) met: how to
        # read its body. The store never changes, so neither do these.
        self._by_fp: dict[int, _ReadPlan] = {}
        self._plans: dict[bytes, _ReadPlan] = {}

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """Decode one payload.

        Raises:
            BadMagicError, UnknownSchemaError, TruncatedPayloadError, CorruptPayloadError: all
            subclasses of DecodeError, carrying ``raw=data``.
        """
        if type(data) is bytes:
            # The worker's path: a single-object header seen before, one dict lookup.
            plan = self._plans.get(data[:_SINGLE_HEADER])
            if plan is not None:
                return self._read_body(data, _SINGLE_HEADER, plan)
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadMagicError(f"payload is {type(data).__name__}, not bytes", raw=None)
        else:
            data = bytes(data)
        if data[:2] == SINGLE_OBJECT_MAGIC:
            plan = self._plan(self._single_object_writer(data))
            self._plans[data[:_SINGLE_HEADER]] = plan
            return self._read_body(data, _SINGLE_HEADER, plan)
        if data[:1] == REGISTRY_MAGIC and self.registry is not None:
            if len(data) < _REGISTRY_HEADER:
                raise TruncatedPayloadError("registry header cut short", raw=data)
            (schema_id,) = struct.unpack(">I", data[1:_REGISTRY_HEADER])
            return self._read(data, _REGISTRY_HEADER, self._registry_schema(schema_id, data))
        raise self._bad_magic(data)

    def _bad_magic(self, data: bytes) -> BadMagicError:
        return BadMagicError(
            f"unknown framing {data[:2].hex() or 'empty'}: expected c301 (single-object)"
            + (" or 00 (registry)" if self.registry is not None else ""),
            raw=data,
        )

    def header(self, data: bytes) -> WireSchema | None:
        """The writer schema of a single-object payload, reading only its header (the body is
        not looked at); None for a registry-framed payload (its schema may need the registry).

        Raises:
            BadMagicError, UnknownSchemaError, TruncatedPayloadError: as :meth:`decode` would
            for the same header.
        """
        if data[:2] == SINGLE_OBJECT_MAGIC:
            return self._single_object_writer(data)
        if data[:1] == REGISTRY_MAGIC and self.registry is not None:
            return None
        raise self._bad_magic(bytes(data))

    def _single_object_writer(self, data: bytes) -> WireSchema:
        if len(data) < _SINGLE_HEADER:
            raise TruncatedPayloadError("single-object header cut short", raw=bytes(data))
        fp = int.from_bytes(data[2:_SINGLE_HEADER], "little")
        writer = self.store.by_fingerprint.get(fp)
        if writer is None:
            raise UnknownSchemaError(
                f"unknown writer schema fingerprint {fp:016x}", raw=bytes(data), fingerprint=fp
            )
        return writer

    def _registry_schema(self, schema_id: int, data: bytes) -> WireSchema:
        cached = self._by_id.get(schema_id)
        if cached is not None:
            return cached
        try:
            schema = self.registry.get_schema(schema_id)  # type: ignore[union-attr]
            import json

            wire = self.store.with_writer(json.loads(schema.schema_str)).by_fingerprint
        except Exception as exc:
            raise UnknownSchemaError(
                f"schema id {schema_id} not resolvable in the registry: {exc}",
                raw=data,
                schema_id=schema_id,
            ) from exc
        found = next(w for w in wire.values() if w.json == json.dumps(json.loads(schema.schema_str)))
        self._by_id[schema_id] = found
        return found

    def _read(self, data: bytes, start: int, writer: WireSchema) -> tuple[str, dict[str, Any]]:
        return self._read_body(data, start, self._plan(writer))

    def _plan(self, writer: WireSchema) -> _ReadPlan:
        plan = self._by_fp.get(writer.fingerprint)
        if plan is None:
            reader = self.store.current.get(full_name(writer.name))
            resolve = None if reader is None or reader.fingerprint == writer.fingerprint else reader.parsed
            plan = self._by_fp[writer.fingerprint] = _ReadPlan(
                writer.name, writer.parsed, resolve, writer.name == _ENGINE_EVENT
            )
        return plan

    def _read_body(self, data: bytes, start: int, plan: _ReadPlan) -> tuple[str, dict[str, Any]]:
        name, writer, reader, engine_event = plan
        buf = io.BytesIO(data)
        buf.seek(start)
        try:
            datum = fastavro.schemaless_reader(buf, writer, reader, return_record_name=True)
        except (EOFError, StopIteration) as exc:
            raise TruncatedPayloadError(f"{name} payload ends early", raw=data, record=name) from exc
        except Exception as exc:
            raise CorruptPayloadError(
                f"{name} payload is corrupt: {type(exc).__name__}: {exc}",
                raw=data,
                record=name,
            ) from exc
        if buf.tell() != len(data):
            # fastavro reads short strings without complaint; a length that overran the buffer
            # or bytes left over both mean the body was not what the header promised.
            raise CorruptPayloadError(
                f"{name} payload has {len(data) - buf.tell()} bytes left over",
                raw=data,
                record=name,
            )
        if not isinstance(datum, dict):
            raise CorruptPayloadError(f"{name} did not decode to a record", raw=data)
        if engine_event:
            try:
                from_wire(datum)
            except ValueError as exc:
                raise CorruptPayloadError(f"{name} payload is corrupt: {exc}", raw=data, record=name) from exc
        return name, datum


class _ReadPlan(NamedTuple):
    """How a :class:`Decoder` reads the body of one writer schema."""

    name: str  # the writer's record (full name)
    writer: Any  # its parsed schema
    reader: Any  # the current version's parsed schema; None when it is the writer's
    engine_event: bool  # EngineEvent: StepBatch columns may travel packed (sparseety/packed.py)
