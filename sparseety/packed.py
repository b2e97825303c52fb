"""StepBatch's integer columns on the wire: packed little-endian int32 (schema v3).

An engine step at batch 256 carries five integer columns of 256 entries plus the new token ids.
As Avro arrays each entry is a zig-zag varint that fastavro turns into one Python ``int`` inside a
``list``, which cost about as much as the fold itself (docs/benchmarks.md). Since schema v3 each
integer column travels as one ``bytes`` field (``<column>_i32``, 4 bytes per entry, little-endian)
and its Avro array is written empty; reading one is a copy into an ``array.array('i')``.

In memory every StepBatch keeps the classic shape (``num_scheduled_tokens`` etc. as sequences of
int), whichever version wrote it, so the validation, the fold, replay and the tests do not care:

* :func:`to_wire` (called by :class:`~sparseety.serde.Encoder` when its schema is v3 or later)
  packs the columns into a copy of the event;
* :func:`from_wire` (called by :class:`~sparseety.serde.Decoder` on every EngineEvent) replaces
  non-empty packed fields by ``array('i')`` columns under the classic names and drops the packed
  fields; events from v1/v2 writers keep their Avro-decoded lists.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from sparseety.schema_store import full_name

STEP_BATCH = full_name("StepBatch")

#: Integer columns of StepBatch, each with a packed twin named ``<column>_i32`` since v3.
INT_COLUMNS = (
    "num_scheduled_tokens",
    "num_computed_before",
    "num_new_tokens",
    "new_token_ids",
    "spec_proposed",
    "spec_accepted",
)
PACKED = {col: f"{col}_i32" for col in INT_COLUMNS}
_PACKED_PAIRS = tuple(PACKED.items())

_SWAP = sys.byteorder != "little"
if array("i").itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError("array('i') is not 32 bits on this platform; packed columns need int32")


def pack_i32(values: Iterable[int]) -> bytes:
    """Little-endian int32 bytes of ``values``.

    Raises:
        OverflowError: a value outside the int32 range (the contract bounds are far below it).
    """
    a = values if isinstance(values, array) and values.typecode == "i" else array("i", values)
    if _SWAP:
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def unpack_i32(data: bytes) -> array:  # type: ignore[type-arg]
    """The int32 column packed in ``data`` (no Python object per entry).

    Raises:
        ValueError: ``data`` is not a whole number of int32 entries.
    """
    if len(data) % 4:
        raise ValueError(f"packed int32 column of {len(data)} bytes is not a multiple of 4")
    a = array("i")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a


def writes_packed(parsed_schema: Mapping[str, Any]) -> bool:
    """Whether an EngineEvent schema (parsed, standalone) has StepBatch's packed columns (v3+)."""
    for f in parsed_schema.get("fields", ()):
        if f["name"] != "payload":
            continue
        for branch in f["type"]:
            if isinstance(branch, dict) and branch.get("name") == STEP_BATCH:
                return any(g["name"] == PACKED[INT_COLUMNS[0]] for g in branch["fields"])
    return False


def to_wire(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """``event`` with a StepBatch's integer columns packed (a copy; other events as they are)."""
    payload = event.get("payload")
    if not isinstance(payload, tuple) or payload[0] != STEP_BATCH:
        return event
    body = dict(payload[1])
    for col, packed in PACKED.items():
        if body.get(packed):
            continue  # already packed by the caller
        values = body.get(col)
        body[packed] = pack_i32(values) if values else b""
        body[col] = []
    out = dict(event)
    out["payload"] = (STEP_BATCH, body)
    return out


def from_wire(event: dict[str, Any]) -> dict[str, Any]:
    """Unpack a decoded StepBatch's packed columns in place under the classic names.

    Raises:
        ValueError: a packed column is not a whole number of int32 entries.
    """
    payload = event.get("payload")
    if isinstance(payload, tuple) and payload[0] == STEP_BATCH:
        pop = (body := payload[1]).pop
        for col, packed in _PACKED_PAIRS:
            data = pop(packed, b"")
            if data:
                if len(data) & 3:
                    raise ValueError(f"packed int32 column of {len(data)} bytes is not a multiple of 4")
                a = body[col] = array("i", data)  # a bytes initializer is one frombytes
                if _SWAP:
                    a.byteswap()
    return event
