"""StepBatch schema v3: packed int32 columns on the wire, the same fold as the v2 Avro arrays."""

from __future__ import annotations

import io
import json
from array import array
from typing import Any

import fastavro
import pytest

from sparseety import events as ev
from sparseety import packed
from sparseety.config import WorkerConfig
from sparseety.errors import CorruptPayloadError, InvalidEventError
from sparseety.schema_store import SchemaStore, schema_dir
from sparseety.serde import Decoder, Encoder
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.recorded import raw_events, scenarios

STORE = SchemaStore.load()
V2 = json.loads((schema_dir() / "history" / "EngineEvent.v2.avsc").read_text())
OLD = Encoder(STORE.with_current(V2), "EngineEvent")
NEW = Encoder(STORE, "EngineEvent")
DEC = Decoder(STORE)


def _fold(events: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    out = []
    for e in events:
        ev.validate_engine_event(e)
        out.extend((o.topic, o.key, o.record) for o in asm.apply(e))
    return out


def _raw_step(data: bytes) -> dict[str, Any]:
    """The StepBatch exactly as written (no unpacking), read with the current schema."""
    body = fastavro.schemaless_reader(io.BytesIO(data[10:]), NEW.wire.parsed, None, return_record_name=True)
    return body["payload"][1]  # type: ignore[no-any-return]


def test_int32_round_trip_is_little_endian() -> None:
    data = packed.pack_i32([1, 0, 2**24, 7])
    assert data[:4] == b"\x01\x00\x00\x00" and len(data) == 16
    assert packed.unpack_i32(data) == array("i", [1, 0, 2**24, 7])
    with pytest.raises(ValueError, match="multiple of 4"):
        packed.unpack_i32(b"\x01\x00\x00")


def test_current_writer_packs_and_v2_writer_does_not() -> None:
    step = f.wrap(
        5, ev.STEP_BATCH, f.step_batch(3, [("a", 4, 0, [1, 2]), ("b", 1, 9, [])], spec=[(2, 1), (0, 0)])
    )
    new, old = NEW.encode(step), OLD.encode(step)
    assert new[2:10] == STORE.wire("EngineEvent").fingerprint_bytes != old[2:10]
    raw = _raw_step(new)
    assert raw["num_scheduled_tokens"] == [] and raw["new_token_ids"] == []
    assert packed.unpack_i32(raw["num_scheduled_tokens_i32"]).tolist() == [4, 1]
    assert step["payload"][1]["num_scheduled_tokens"] == [4, 1]  # the caller's event is not changed
    _, from_new = DEC.decode(new)
    _, from_old = DEC.decode(old)
    for col in packed.INT_COLUMNS:
        assert isinstance(ev.payload(from_new)[col], array)
        assert list(ev.payload(from_new)[col]) == list(ev.payload(from_old)[col]) == step["payload"][1][col]
    assert not set(ev.payload(from_new)) - set(ev.payload(from_old))  # packed fields are dropped


@pytest.mark.parametrize("name", scenarios())
def test_v2_and_v3_encodings_of_recorded_events_fold_identically(name: str) -> None:
    """The committed recordings are v2 events: re-written by the current producer, same outputs."""
    old_bytes = raw_events(name)
    old_events = [DEC.decode(b)[1] for b in old_bytes]
    new_bytes = [NEW.encode(e) for e in old_events]
    assert all(b[2:10] == STORE.wire("EngineEvent").fingerprint_bytes for b in new_bytes)
    assert any(
        _raw_step(b)["num_scheduled_tokens_i32"]
        for b, e in zip(new_bytes, old_events, strict=True)
        if ev.payload_type(e) == ev.STEP_BATCH
    )
    new_events = [DEC.decode(b)[1] for b in new_bytes]
    folded = _fold(new_events)
    assert folded and folded == _fold([DEC.decode(b)[1] for b in old_bytes])


def test_truncated_packed_column_is_corrupt_and_bad_lengths_are_invalid() -> None:
    step = f.wrap(0, ev.STEP_BATCH, f.step_batch(0, [("a", 4, 0, [1])]))
    body = dict(step["payload"][1], num_scheduled_tokens_i32=b"\x04\x00\x00", num_scheduled_tokens=[])
    with pytest.raises(CorruptPayloadError, match="multiple of 4"):
        DEC.decode(NEW.encode(dict(step, payload=(ev.STEP_BATCH, body))))
    body = dict(step["payload"][1], num_computed_before_i32=packed.pack_i32([0, 0]))
    _, back = DEC.decode(NEW.encode(dict(step, payload=(ev.STEP_BATCH, body))))
    with pytest.raises(InvalidEventError, match="num_computed_before has 2 entries for 1"):
        ev.validate_engine_event(back)
    body = dict(step["payload"][1], num_scheduled_tokens=[-1])
    _, back = DEC.decode(NEW.encode(dict(step, payload=(ev.STEP_BATCH, body))))
    with pytest.raises(InvalidEventError, match="outside"):
        ev.validate_engine_event(back)


def test_a_held_v3_event_survives_the_state_round_trip() -> None:
    """An out-of-order StepBatch waits in the reorder buffer as decoded, with ``array('i')``
    columns; the worker's changelog must serialise it (issue 12's restart test hit this)."""
    from sparseety.streams.state import decode_state, encode_state
    from tests.sim import SimEngine, workload

    events = [DEC.decode(NEW.encode(e))[1] for e in SimEngine(seed=4).run(workload(6, seed=4))]
    i = next(i for i, e in enumerate(events) if i > 5 and e["payload"][0] == ev.STEP_BATCH)
    events[i - 1], events[i] = events[i], events[i - 1]  # the StepBatch arrives a seq early
    store = MemoryStore()
    asm = Assembler(WorkerConfig(closed_retention_s=0), store)
    for e in events[:i]:
        asm.apply(e)
    held = [v for v in store.data.values() if "array('i'" in repr(v)]
    assert held, "the early StepBatch is not held as decoded"
    copy = MemoryStore()
    for k, v in store.data.items():
        copy.data[k] = decode_state(encode_state(v))
    rest = events[i:]
    a = [o for e in rest for o in asm.apply(e)]
    b = [o for e in rest for o in Assembler(WorkerConfig(closed_retention_s=0), copy).apply(e)]
    assert a == b and a


HISTORY = sorted((schema_dir() / "history").glob("EngineEvent.v*.avsc"))


@pytest.mark.parametrize("path", HISTORY, ids=lambda p: p.stem)
def test_every_old_engine_event_version_decodes_and_folds(path: Any) -> None:
    """Replay reads topics written by any earlier producer: the recorded events, re-written with
    each schema in schemas/history, decode with the current reader, validate and fold into the
    same requests with the same token counts (fields a version lacks read as their defaults)."""
    old = Encoder(STORE.with_current(json.loads(path.read_text())), "EngineEvent")
    events = [DEC.decode(b)[1] for b in raw_events(scenarios()[0])]
    blobs = [old.encode(e) for e in events]
    assert all(b[2:10] == old.wire.fingerprint_bytes != NEW.wire.fingerprint_bytes for b in blobs)

    def counts(folded: list[tuple[str, str, dict[str, Any]]]) -> dict[str, tuple[int, ...]]:
        fields = ("prompt_tokens", "output_tokens", "cache_read_tokens", "uncached_computed_tokens")
        return {k: tuple(r[x] for x in fields) for t, k, r in folded if t == "timelines"}

    replayed = counts(_fold([DEC.decode(b)[1] for b in blobs]))
    assert replayed and replayed == counts(_fold(events))
