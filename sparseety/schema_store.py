"""Load the Avro contract from ``schemas/`` and index it by name and fingerprint.

Every ``.avsc`` file holds one named type. Files reference each other by full name, so they are
parsed in dependency order into one set of named schemas. The records that travel on a topic
(the *wire records*) are fingerprinted with CRC-64-AVRO over their Parsing Canonical Form, the
identity Avro single-object encoding puts in front of each payload.

``schemas/history/`` may hold earlier versions of wire records (one file per version, any name):
their fingerprints resolve too, so a reader decodes what older writers wrote, and an older
reader given a newer writer's schema reads it through Avro schema resolution.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import fastavro

from sparseety.errors import SchemaError

NAMESPACE = "io.sparseety.v1"

#: Records that are written to a topic, by short name.
WIRE_RECORDS = ("EngineEvent", "RequestAccounting", "UsageWindow", "DeadLetter")


def full_name(name: str) -> str:
    """Return ``name`` qualified with the contract's namespace."""
    return name if "." in name else f"{NAMESPACE}.{name}"


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO (the Rabin fingerprint of the Avro specification) of ``data``, a schema's
    Parsing Canonical Form, as the integer whose 8 little-endian bytes single-object encoding
    writes (fastavro computes it and gives those bytes as hex)."""
    return int.from_bytes(bytes.fromhex(fastavro.schema.fingerprint(data.decode(), "CRC-64-AVRO")), "little")


def schema_dir() -> Path:
    """Path of the installed ``schemas/`` folder."""
    return Path(str(resources.files("sparseety.schemas")))


def read_schema_files(folder: Path) -> list[dict[str, Any]]:
    """Read every ``*.avsc`` directly in ``folder`` as JSON."""
    out = []
    for path in sorted(folder.glob("*.avsc")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise SchemaError(f"cannot read schema file {path}: {exc}", path=str(path)) from exc
    return out


def inline(schema: Any, raw_by_name: Mapping[str, Any], defined: set[str] | None = None) -> Any:
    """Inline named references into ``schema`` (raw JSON), giving a standalone schema.

    Each named type is defined at its first use and referenced by name afterwards, as Avro requires.
    """
    defined = set() if defined is None else defined
    if isinstance(schema, str):
        name = full_name(schema) if schema in raw_by_name or full_name(schema) in raw_by_name else schema
        if name in raw_by_name and name not in defined:
            return inline(raw_by_name[name], raw_by_name, defined)
        return schema
    if isinstance(schema, list):
        return [inline(s, raw_by_name, defined) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("type") in ("record", "enum", "fixed", "error"):
        defined.add(_qualify(out))
    if out.get("type") in ("record", "error"):
        out["fields"] = [{**f, "type": inline(f["type"], raw_by_name, defined)} for f in out["fields"]]
    elif out.get("type") == "array":
        out["items"] = inline(out["items"], raw_by_name, defined)
    elif out.get("type") == "map":
        out["values"] = inline(out["values"], raw_by_name, defined)
    elif isinstance(out.get("type"), (dict, list)):
        out["type"] = inline(out["type"], raw_by_name, defined)
    return out


def _qualify(schema: Mapping[str, Any]) -> str:
    name = str(schema["name"])
    if "." in name:
        return name
    return f"{schema.get('namespace', NAMESPACE)}.{name}"


def index_by_name(raw_schemas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Raw schemas by full name, checking that no name is defined twice."""
    out: dict[str, Any] = {}
    for raw in raw_schemas:
        name = _qualify(raw)
        if name in out:
            raise SchemaError(f"schema {name} is defined twice", name=name)
        out[name] = raw
    return out


def parse_standalone(schema: Mapping[str, Any]) -> Any:
    """Parse a standalone schema with fastavro, as a typed error when it is invalid."""
    try:
        return fastavro.parse_schema(dict(schema), named_schemas={})
    except Exception as exc:
        raise SchemaError(f"invalid schema {schema.get('name')!r}: {exc}") from exc


@dataclass(frozen=True)
class WireSchema:
    """One version of a wire record: parsed for fastavro, standalone JSON, and its fingerprint."""

    name: str
    parsed: Any
    json: str
    fingerprint: int

    @property
    def fingerprint_bytes(self) -> bytes:
        """The fingerprint as it appears in single-object encoding (8 bytes, little-endian)."""
        return self.fingerprint.to_bytes(8, "little")


@dataclass(frozen=True)
class SchemaStore:
    """The contract: current wire records (readers) and every known writer version by fingerprint."""

    current: Mapping[str, WireSchema]
    by_fingerprint: Mapping[int, WireSchema] = field(repr=False)

    @classmethod
    def load(cls, folder: Path | None = None) -> SchemaStore:
        """Load ``folder`` (default: the installed ``schemas/``) and its ``history/``."""
        folder = folder or schema_dir()
        raw_by_name = index_by_name(read_schema_files(folder))
        current = {}
        for short in WIRE_RECORDS:
            name = full_name(short)
            if name not in raw_by_name:
                raise SchemaError(f"wire record {name} missing from {folder}", name=name)
            current[name] = _wire(inline(raw_by_name[name], raw_by_name))
        by_fp = {w.fingerprint: w for w in current.values()}
        history = folder / "history"
        if history.is_dir():
            for raw in read_schema_files(history):
                w = _wire(inline(raw, raw_by_name))
                by_fp.setdefault(w.fingerprint, w)
        return cls(current=current, by_fingerprint=by_fp)

    def wire(self, name: str) -> WireSchema:
        """Current version of a wire record."""
        try:
            return self.current[full_name(name)]
        except KeyError:
            raise SchemaError(f"unknown wire record {name!r}", name=name) from None

    def with_current(self, schema: Mapping[str, Any]) -> SchemaStore:
        """A copy whose current version of that record is ``schema`` (standalone JSON): an
        encoder on it writes as a producer of that version did (tests, benchmarks)."""
        w = _wire(schema)
        return SchemaStore({**self.current, w.name: w}, {**self.by_fingerprint, w.fingerprint: w})

    def with_writer(self, schema: Mapping[str, Any]) -> SchemaStore:
        """A copy that also knows ``schema`` (standalone JSON) as a writer version."""
        w = _wire(schema)
        return SchemaStore(self.current, {**self.by_fingerprint, w.fingerprint: w})


def canonical_form(parsed: Mapping[str, Any]) -> str:
    """Avro Parsing Canonical Form of a parsed, standalone schema."""
    return str(fastavro.schema.to_parsing_canonical_form(dict(parsed)))


def _wire(standalone: Mapping[str, Any]) -> WireSchema:
    parsed = parse_standalone(standalone)
    canonical = canonical_form(parsed)
    return WireSchema(
        name=parsed["name"],
        parsed=parsed,
        json=json.dumps(standalone),
        fingerprint=crc64_avro(canonical.encode()),
    )
