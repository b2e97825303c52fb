"""RequestAccounting decoded by ClickHouse itself: the sink's fast path into an embedded store.

Decoding a RequestAccounting in Python (fastavro, then one Python object per field) costs about
three times what writing its rows costs, so the sink process was bound by decoding. An embedded
(chDB) store can read an Avro object container from a local file, so for records whose writer
schema is the current one the sink skips Python decoding: the payload bodies (the single-object
header stripped) become one container, which ClickHouse parses once (``file(path, Avro)`` into a
temporary Memory table, :func:`stage_sql`), and one ``INSERT ... SELECT`` per table turns it into
exactly the rows :meth:`RowBuffer.add_accounting
<sparseety.sinks.clickhouse.rows.RowBuffer.add_accounting>` makes (a unit test compares every
row of every table).

A ClickHouse server cannot read the sink's local file, so only an embedded target takes this
path (:meth:`ClickHouseSink.takes_encoded <sparseety.sinks.clickhouse.writer.ClickHouseSink.takes_encoded>`).

Checks before anything is written (:func:`check_sql`, one read-only query over the stage):

* every body must end exactly where the record ends: the container's schema is the writer schema
  plus one trailing ``long`` field, and each body is followed by a random 62-bit nonce in that
  field. A body that is shorter or longer than its record shifts that read, and its row's nonce
  is wrong (fastavro, which decodes one payload at a time, rejects such bodies too);
* values the Python path would refuse (invalid UTF-8, which fastavro rejects; negative numbers
  for unsigned columns, which the insert rejects) are counted instead of written.

Any such record, or a body ClickHouse cannot parse at all, sends the whole batch back to the
Python path, which dead-letters exactly the bad payloads and writes the rest. The same query
counts the rows each table will get, so the sink reports rows it knows, not estimates.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sparseety.events import MOVED_FIELDS, REQUEST_ACCOUNTING, field_types
from sparseety.schema_store import WireSchema

from .tables import (
    BLOCK_FIELDS,
    EXPERT_LOAD,
    KV_BLOCKS,
    REQUEST_FIELDS,
    REQUEST_TOKENS,
    REQUESTS,
    SEGMENT_FIELDS,
    TOKEN_SEGMENTS,
    Table,
)

#: The extra trailing field of the container's schema that holds each body's nonce.
NONCE_FIELD = "_sparseety_body_end"
#: Tables the fast path writes, in the writer's table order.
TABLES: tuple[Table, ...] = (REQUESTS, TOKEN_SEGMENTS, KV_BLOCKS, EXPERT_LOAD, REQUEST_TOKENS)

# request_version: (complete << 63) | (max(0, finished_ts_ns) & (2**63 - 1))
_VERSION = (
    "bitOr(if(complete, toUInt64(9223372036854775808), toUInt64(0)), "
    "bitAnd(toUInt64(greatest(finished_ts_ns, 0)), toUInt64(9223372036854775807)))"
)
_HAS_EXPERTS = "notEmpty(expert_counts) AND expert_num_layers > 0"
_HAS_TOKENS = "token_privacy != ''"
_TOP = field_types(REQUEST_ACCOUNTING)
#: Top-level string fields of the current schema (each must be valid UTF-8, as fastavro requires).
_STRINGS = tuple(n for n, t in _TOP.items() if t == "string")
_NULLABLE_STRINGS = tuple(n for n, t in _TOP.items() if isinstance(t, list) and "string" in t)
#: Fields of the writer schema the SQL below reads (a writer without one of them keeps the Python path).
FIELDS = frozenset(
    {
        *REQUEST_FIELDS,
        *MOVED_FIELDS,
        *_STRINGS,
        *_NULLABLE_STRINGS,
        "timeline",
        "block_uses",
        "expert_counts",
        "expert_num_layers",
        "expert_num_experts",
        "prompt_token_ids",
        "prompt_token_hashes",
        "output_token_ids",
        "kv_groups",
        "kv_peak_bytes",
    }
)


def _kv_sum(field: str) -> str:
    return f"arraySum(g -> toInt128(tupleElement(g, '{field}')), kv_groups)"


_KV_KNOWN = "(notEmpty(kv_groups) AND arrayAll(g -> tupleElement(g, 'bytes_per_block') > 0, kv_groups))"


def _kv_byte_ms(field: str) -> str:
    total = (
        f"arraySum(g -> toInt128(tupleElement(g, '{field}')) * tupleElement(g, 'bytes_per_block'), kv_groups)"
    )
    return f"if({_KV_KNOWN}, toInt64(intDiv({total}, 1000000)), NULL)"


def _kv_total(field: str) -> str:
    return f"if(notEmpty(kv_groups), toInt64({_kv_sum(field)}), NULL)"


#: The KV memory-time columns (tables.KV_COLUMNS), as rows.kv_totals derives them.
_KV_EXPRS = (
    _kv_total("block_steps"),
    _kv_total("block_ns"),
    _kv_byte_ms("block_ns"),
    _kv_byte_ms("block_ns_amortized"),
    _kv_byte_ms("block_ns_actual"),
    f"if({_KV_KNOWN} AND kv_peak_bytes >= 0, kv_peak_bytes, NULL)",
    _kv_total("slot_steps_used"),
    _kv_total("slot_steps_allocated"),
    _kv_total("never_held_blocks"),
)
#: The ``requests`` columns REQUEST_FIELDS fill, a moved field added to its successor's.
_REQUEST_EXPRS = tuple(
    " + ".join([f, *(old for old, new in MOVED_FIELDS.items() if new == f)]) for f in REQUEST_FIELDS
)


def _fields(schema: Any) -> dict[str, Any]:
    return {f["name"]: f["type"] for f in schema.get("fields", ())} if isinstance(schema, dict) else {}


def _strings(fields: dict[str, Any]) -> set[str]:
    """Names of the string and nullable-string fields among ``fields``."""
    return {n for n, t in fields.items() if t == "string" or (isinstance(t, list) and "string" in t)}


def fits(writer: WireSchema) -> bool:
    """Whether the SQL of this module reads every field it needs from ``writer``'s records, and
    its check covers every string field (fastavro rejects invalid UTF-8 in any of them, so a
    string field the check does not know would let such a record through)."""
    top = _fields(json.loads(writer.json))
    if not top.keys() >= FIELDS or NONCE_FIELD in top:
        return False
    if not _strings(top) <= {*_STRINGS, *_NULLABLE_STRINGS}:
        return False
    timeline = _fields(top["timeline"])
    segments = timeline.get("segments")
    uses = top["block_uses"]
    if not isinstance(segments, dict) or not isinstance(uses, dict):
        return False
    segment, block = _fields(segments.get("items")), _fields(uses.get("items"))
    return (
        "attention_window" in timeline
        and segment.keys() >= set(SEGMENT_FIELDS)
        and block.keys() >= set(BLOCK_FIELDS)
        and _strings(segment) <= {"source_request_uid"}
        and not _strings(block)
        and not _strings(timeline)
    )


def _zigzag(n: int) -> bytes:
    """Avro ``long``: zigzag, then a little-endian base-128 varint."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _avro_bytes(b: bytes) -> bytes:
    return _zigzag(len(b)) + b


def container_schema(writer: WireSchema) -> str:
    """The writer schema with the trailing nonce field (JSON)."""
    schema = json.loads(writer.json)
    schema["fields"] = [*schema["fields"], {"name": NONCE_FIELD, "type": "long"}]
    return json.dumps(schema)


@dataclass(frozen=True)
class Container:
    """An Avro object container (one block, null codec) of payload bodies, and its nonce."""

    data: bytes
    nonce: int
    records: int


def build_container(schema_json: str, bodies: Iterable[bytes | memoryview]) -> Container:
    """One Avro object container holding ``bodies`` (Avro binary records, headers stripped),
    each followed by the nonce (:data:`NONCE_FIELD`)."""
    nonce = secrets.randbits(62) | (1 << 61)  # 9 varint bytes: a stray match is about 2**-61
    tail = _zigzag(nonce)
    parts = []
    n = 0
    for body in bodies:
        parts.append(body)
        parts.append(tail)
        n += 1
    block = b"".join(parts)
    sync = os.urandom(16)
    meta = (
        _zigzag(2)
        + _avro_bytes(b"avro.schema")
        + _avro_bytes(schema_json.encode())
        + _avro_bytes(b"avro.codec")
        + _avro_bytes(b"null")
        + _zigzag(0)
    )
    data = b"Obj\x01" + meta + sync + _zigzag(n) + _zigzag(len(block)) + block + sync
    return Container(data, nonce, n)


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def file_source(path: str) -> str:
    """The container file as a table (``file(path, Avro)``: chDB reads an absolute path)."""
    return f"file({_quote(path)}, Avro)"


def stage_sql(stage: str, path: str) -> str:
    """Parse the container once into a temporary Memory table ``stage`` (every field: a body
    ClickHouse cannot parse fails here), which the check and the inserts then read."""
    return f"CREATE TEMPORARY TABLE {stage} ENGINE = Memory AS SELECT * FROM {file_source(path)}"


def check_sql(source: str, nonce: int) -> str:
    """``records, bad, <rows per table of TABLES>`` of the container read as ``source``
    (:func:`file_source` or a stage); ``bad`` counts records the Python path must judge."""
    valid = " AND ".join(
        [
            f"{NONCE_FIELD} = {nonce}",
            *(f"isValidUTF8({f})" for f in _STRINGS),
            *(f"isValidUTF8(ifNull({f}, ''))" for f in _NULLABLE_STRINGS),
            "arrayAll(s -> isValidUTF8(ifNull(s.source_request_uid, '')), timeline.segments)",
            "arrayAll(b -> b.tokens >= 0, block_uses)",
            f"(NOT ({_HAS_EXPERTS}) OR (expert_num_experts >= 0 AND arrayAll(x -> x >= 0, expert_counts)))",
            # ignore() reads every field: read from the file, a field nothing reads is skipped
            # unchecked (an enum index out of range), and such a body must fail here
            f"ignore({', '.join(sorted(FIELDS))}) = 0",
        ]
    )
    return (
        f"SELECT count(), countIf(NOT ({valid})), count(), sum(length(timeline.segments)), "
        f"sum(length(block_uses)), countIf({_HAS_EXPERTS}), countIf({_HAS_TOKENS}) "
        f"FROM {source}"
    )


def insert_sql(table: Table, target: str, source: str) -> str:
    """``INSERT INTO target (columns) SELECT ... FROM source`` giving ``table`` exactly the rows
    :meth:`RowBuffer.add_accounting` gives it (``source``: :func:`file_source` or a stage)."""
    src = source
    if table is REQUESTS:
        exprs = [
            *_REQUEST_EXPRS,
            *_KV_EXPRS,
            "timeline.attention_window",
            "length(timeline.segments)",
            "length(block_uses)",
            _VERSION,
        ]
        tail = ""
    elif table is TOKEN_SEGMENTS:
        exprs = [
            "request_uid",
            "toUInt32(n - 1)",
            _VERSION,
            "s.start",
            "s.end",
            "toString(s.kind)",
            "toString(s.status)",
            "s.draft_accepted",
            "s.source_request_uid",
            "toString(s.kv_fate)",
        ]
        tail = " ARRAY JOIN timeline.segments AS s, arrayEnumerate(timeline.segments) AS n"
    elif table is KV_BLOCKS:
        exprs = [
            "request_uid",
            "toUInt32(n - 1)",
            _VERSION,
            "b.block_hash",
            "b.lifetime_seq",
            "toString(b.role)",
            "b.tokens",
        ]
        tail = " ARRAY JOIN block_uses AS b, arrayEnumerate(block_uses) AS n"
    elif table is EXPERT_LOAD:
        exprs = [
            "model",
            "request_uid",
            _VERSION,
            "tenant",
            "engine_name",
            "finished_ts_ns",
            "expert_num_layers",
            "expert_num_experts",
            "expert_counts",
        ]
        tail = f" WHERE {_HAS_EXPERTS}"
    elif table is REQUEST_TOKENS:
        exprs = [
            "request_uid",
            _VERSION,
            "finished_ts_ns",
            "token_privacy",
            "prompt_token_ids",
            "prompt_token_hashes",
            "output_token_ids",
        ]
        tail = f" WHERE {_HAS_TOKENS}"
    else:
        raise KeyError(table.name)
    assert len(exprs) == len(table.columns), table.name
    columns = ", ".join(f"`{c}`" for c in table.columns)
    return f"INSERT INTO {target} ({columns}) SELECT {', '.join(exprs)} FROM {src}{tail}"


def row_counts(counts: Sequence[Any]) -> tuple[int, int, dict[str, int]]:
    """``(records, bad, rows per table)`` from the row :func:`check_sql` returns."""
    records, bad, *per_table = (int(v or 0) for v in counts)
    return records, bad, {t.name: n for t, n in zip(TABLES, per_table, strict=True)}
