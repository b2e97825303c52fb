"""The Avro contract: every event round-trips through both framings and decodes with Apache's
reference ``avro`` package given only ``schemas/``; older readers read newer writers."""

from __future__ import annotations

import copy
import io
import json
import struct
from typing import Any

import avro.io
import avro.schema
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from sparseety import events as ev
from sparseety import packed
from sparseety.errors import InvalidEventError, SchemaError
from sparseety.schema_store import (
    WIRE_RECORDS,
    SchemaStore,
    _wire,
    crc64_avro,
    index_by_name,
    inline,
    read_schema_files,
    schema_dir,
)
from sparseety.serde import Decoder, Encoder
from tests import factories as f
from tests.helpers import plain_event as plain

STORE = SchemaStore.load()


RECORDS: list[tuple[str, dict[str, Any]]] = [("EngineEvent", e) for e in f.one_of_each()] + [
    ("RequestAccounting", f.accounting()),
    ("UsageWindow", f.usage_window()),
    ("DeadLetter", f.dead_letter()),
]


def test_every_wire_record_and_payload_type_is_covered() -> None:
    kinds = {ev.payload_type(e) for e in f.one_of_each()}
    union = json.loads(STORE.wire("EngineEvent").json)["fields"][-1]["type"]
    assert kinds == {
        u["name"] if isinstance(u, dict) else u
        for u in [(t if isinstance(t, str) else f"io.sparseety.v1.{t['name']}") for t in union]
    }
    assert {r for r, _ in RECORDS} == set(WIRE_RECORDS)


def test_every_field_is_documented_and_optional_fields_have_defaults() -> None:
    for raw in read_schema_files(schema_dir()):
        assert raw.get("doc"), f"{raw['name']} has no doc"
        for field in raw.get("fields", []):
            t = field["type"]
            if isinstance(t, list) and "null" in t:
                assert "default" in field, f"{raw['name']}.{field['name']} is optional without default"


@pytest.mark.parametrize(("record", "datum"), RECORDS, ids=lambda x: x if isinstance(x, str) else "")
def test_single_object_round_trip(record: str, datum: dict[str, Any]) -> None:
    data = Encoder(STORE, record).encode(datum)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == STORE.wire(record).fingerprint_bytes
    name, back = Decoder(STORE).decode(data)
    assert name == f"io.sparseety.v1.{record}"
    assert plain(back) == datum


@pytest.mark.parametrize(("record", "datum"), RECORDS, ids=lambda x: x if isinstance(x, str) else "")
def test_registry_round_trip(record: str, datum: dict[str, Any]) -> None:
    registry = SchemaRegistryClient.new_client({"url": "mock://contract"})
    data = Encoder(STORE, record, registry=registry, topic=f"topic-{record}").encode(datum)
    assert data[:1] == b"\x00"
    schema_id = struct.unpack(">I", data[1:5])[0]
    assert json.loads(registry.get_schema(schema_id).schema_str)["name"] == record
    name, back = Decoder(STORE, registry=registry).decode(data)
    assert name == f"io.sparseety.v1.{record}" and plain(back) == datum


def _references(node: Any) -> set[str]:
    if isinstance(node, str):
        return {node} if node.startswith("io.sparseety.v1.") else set()
    if isinstance(node, list):
        return set().union(*(_references(n) for n in node))
    if isinstance(node, dict):
        return set().union(
            *(_references(v) for k, v in node.items() if k in ("type", "items", "values", "fields"))
        )
    return set()


def _reference_schema(record: str) -> avro.schema.Schema:
    """What an independent reader builds from nothing but the files in schemas/."""
    raw = {f"io.sparseety.v1.{r['name']}": r for r in read_schema_files(schema_dir())}
    names = avro.schema.Names()
    done: dict[str, avro.schema.Schema] = {}

    def parse(name: str) -> None:
        if name in done:
            return
        for dep in _references(raw[name]) - {name}:
            if dep in raw:  # enums and inline records are defined inside their file
                parse(dep)
        done[name] = avro.schema.make_avsc_object(raw[name], names)

    parse(f"io.sparseety.v1.{record}")
    return done[f"io.sparseety.v1.{record}"]


@pytest.mark.parametrize(("record", "datum"), RECORDS, ids=lambda x: x if isinstance(x, str) else "")
def test_apache_avro_reads_what_we_write(record: str, datum: dict[str, Any]) -> None:
    schema = _reference_schema(record)
    data = Encoder(STORE, record).encode(datum)
    # The reference library computes the same fingerprint from the same files ...
    assert schema.fingerprint("CRC-64-AVRO") == data[2:10]
    # ... and decodes the body.
    back = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    expected = copy.deepcopy(dict(packed.to_wire(datum)))  # StepBatch's columns travel packed
    if record == "EngineEvent":
        expected["payload"] = expected["payload"][1]  # the reference reader drops the branch name
    assert back == expected


def test_crc64_matches_the_specification_example() -> None:
    # Fingerprint of the canonical form of "null" is a published constant (Avro spec test vector).
    assert crc64_avro(b'"null"') == 0x63DD24E7CC258F8A


def _previous_engine_event() -> dict[str, Any]:
    """EngineEvent as it was before RequestFinished gained first_token_ts_ns and chunk_arrival_ns."""
    raw_by_name = index_by_name(read_schema_files(schema_dir()))
    older = copy.deepcopy(raw_by_name)
    rf = older["io.sparseety.v1.RequestFinished"]
    rf["fields"] = [x for x in rf["fields"] if x["name"] not in ("first_token_ts_ns", "chunk_arrival_ns")]
    return inline(older["io.sparseety.v1.EngineEvent"], older)  # type: ignore[no-any-return]


def with_reader(store: SchemaStore, schema: dict[str, Any]) -> SchemaStore:
    """A copy of ``store`` whose current (reader) version of that record is ``schema``."""
    w = _wire(schema)
    return SchemaStore({**store.current, w.name: w}, {**store.by_fingerprint, w.fingerprint: w})


def test_previous_reader_reads_record_with_added_field_single_object() -> None:
    old = _previous_engine_event()
    datum = f.wrap(3, ev.REQUEST_FINISHED, f.request_finished(first_token_ts_ns=123, chunk_arrival_ns=[1, 2]))
    data = Encoder(STORE, "EngineEvent").encode(datum)
    # An old consumer: its reader schema is the previous version; it has the writer's schema
    # (schemas/history ships every version a fleet may write).
    old_reader = with_reader(STORE, old)
    _, back = Decoder(old_reader).decode(data)
    body = ev.payload(back)
    assert "first_token_ts_ns" not in body and body["num_output_tokens"] == 3


def test_new_reader_fills_defaults_for_old_writer() -> None:
    old = _previous_engine_event()
    old_store = with_reader(STORE, old)
    datum = f.wrap(
        3,
        ev.REQUEST_FINISHED,
        {k: v for k, v in f.request_finished().items() if k not in ("first_token_ts_ns", "chunk_arrival_ns")},
    )
    data = Encoder(old_store, "EngineEvent").encode(datum)
    _, back = Decoder(STORE.with_writer(old)).decode(data)
    assert ev.payload(back)["first_token_ts_ns"] == 0 and ev.payload(back)["chunk_arrival_ns"] == []


def test_previous_reader_reads_record_with_added_field_registry() -> None:
    registry = SchemaRegistryClient.new_client({"url": "mock://evolution"})
    datum = f.wrap(3, ev.REQUEST_FINISHED, f.request_finished(first_token_ts_ns=5))
    data = Encoder(STORE, "EngineEvent", registry=registry, topic="evo").encode(datum)
    old_reader = with_reader(STORE, _previous_engine_event())
    _, back = Decoder(old_reader, registry=registry).decode(data)
    assert "first_token_ts_ns" not in ev.payload(back)


def test_history_folder_versions_resolve(tmp_path: Any) -> None:
    import shutil

    folder = tmp_path / "schemas"
    shutil.copytree(schema_dir(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "history").mkdir(exist_ok=True)
    (folder / "history" / "EngineEvent.v0.avsc").write_text(json.dumps(_previous_engine_event()))
    store = SchemaStore.load(folder)
    shipped = len(list((schema_dir() / "history").glob("*.avsc")))
    assert len(store.by_fingerprint) == len(WIRE_RECORDS) + shipped + 1


def test_schema_errors_are_typed(tmp_path: Any) -> None:
    (tmp_path / "A.avsc").write_text(
        '{"type": "record", "name": "A", "fields": [{"name": "x", "type": "Nope"}]}'
    )
    with pytest.raises(SchemaError):
        SchemaStore.load(tmp_path)


def test_invalid_step_batch_is_rejected() -> None:
    bad = f.wrap(0, ev.STEP_BATCH, f.step_batch(0, [("r1", 3, 0, [1])]))
    ev.payload(bad)["num_computed_before"] = []
    with pytest.raises(InvalidEventError) as info:
        ev.validate_engine_event(bad, raw=b"raw")
    assert info.value.fields["field"] == "num_computed_before" and info.value.raw == b"raw"
    assert ev.validate_engine_event(f.one_of_each()[2]) is not None


def _history(name: str) -> dict[str, Any]:
    return json.loads((schema_dir() / "history" / f"{name}.v1.avsc").read_text())  # type: ignore[no-any-return]


def _old_accounting() -> dict[str, Any]:
    """A RequestAccounting as schema v1 wrote it: one recompute class, evicted as a status."""
    rec = f.accounting(recomputed_tokens=4, evicted_tokens=4)
    for name in (
        "recomputed_preemption_tokens",
        "recomputed_eviction_tokens",
        "draft_cut_tokens",
        "window_released_tokens",
        "evicted_blocks_recomputed",
        "waste_tokens",
    ):
        del rec[name]
    for seg in rec["timeline"]["segments"]:
        del seg["kv_fate"]
    rec["timeline"]["segments"][0]["status"] = "evicted"
    rec["timeline"]["segments"][1]["status"] = "recomputed"
    return rec


def test_record_written_with_schema_v1_decodes_with_defaults() -> None:
    old = _history("RequestAccounting")
    data = Encoder(with_reader(STORE, old), "RequestAccounting").encode(_old_accounting())
    assert data[2:10] != STORE.wire("RequestAccounting").fingerprint_bytes
    _, back = Decoder(STORE).decode(data)  # the shipped history resolves the old writer
    assert back["recomputed_tokens"] == 4 and back["evicted_tokens"] == 4
    assert back["recomputed_preemption_tokens"] == 0 and back["waste_tokens"] == 0
    segs = back["timeline"]["segments"]
    assert [s["status"] for s in segs] == ["evicted", "recomputed", "computed"]
    assert {s["kv_fate"] for s in segs} == {"kept"}


def test_engine_event_written_with_schema_v1_decodes_and_replays() -> None:
    from sparseety.config import WorkerConfig
    from sparseety.streams.assembler import Assembler
    from sparseety.streams.state import MemoryStore

    old = _history("EngineEvent")
    old_store = with_reader(STORE, old)
    started = f.engine_started()
    for g in started["kv_cache_groups"]:
        del g["attention_chunk_size"]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, started),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(6)))),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 6, 0, [9])])),
        f.wrap(3, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=6, output=1, cached=0)),
    ]
    decoded = [Decoder(STORE).decode(Encoder(old_store, "EngineEvent").encode(e))[1] for e in events]
    assert ev.payload(decoded[0])["kv_cache_groups"][0]["attention_chunk_size"] is None
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    accounts = [o.record for e in decoded for o in asm.apply(e) if o.record_name == ev.REQUEST_ACCOUNTING]
    assert accounts and accounts[0]["consistent"] and accounts[0]["uncached_computed_tokens"] == 6


def test_usage_window_written_with_schema_v1_decodes_with_defaults() -> None:
    old = _history("UsageWindow")
    rec = {k: v for k, v in f.usage_window().items() if k not in ev.POSITION_COUNTS}
    data = Encoder(with_reader(STORE, old), "UsageWindow").encode(rec)
    _, back = Decoder(STORE).decode(data)
    assert back == f.usage_window()


def test_usage_counters_are_only_appended() -> None:
    """The worker persists a window's counters as a list in events.USAGE_COUNTERS order (derived
    from schemas/UsageWindow.avsc; streams/state.py): every earlier version's are a prefix."""
    for path in sorted((schema_dir() / "history").glob("UsageWindow.*.avsc")):
        fields = json.loads(path.read_text())["fields"]
        counters = tuple(
            x["name"]
            for x in fields
            if x["type"] in ("long", "double") and x["name"] not in ("window_start_ns", "window_ns")
        )
        assert len(counters) > 10 and ev.USAGE_COUNTERS[: len(counters)] == counters, path.name


def test_records_written_before_sessions_decode_with_no_session() -> None:
    """EngineEvent and RequestAccounting v2 (before session_id) resolve from schemas/history."""
    old_events = json.loads((schema_dir() / "history" / "EngineEvent.v2.avsc").read_text())
    started = {k: v for k, v in f.request_started("r1", list(range(6))).items() if k != "session_id"}
    data = Encoder(with_reader(STORE, old_events), "EngineEvent").encode(
        f.wrap(1, ev.REQUEST_STARTED, started)
    )
    assert data[2:10] != STORE.wire("EngineEvent").fingerprint_bytes
    _, back = Decoder(STORE).decode(data)
    assert ev.payload(back)["session_id"] == "" and ev.payload(back)["tenant"] == "acme"
    old_accounting = json.loads((schema_dir() / "history" / "RequestAccounting.v2.avsc").read_text())
    # v3 added session_id and the token-record fields; a v2 record reads them as their defaults
    added = {
        "session_id": "",
        "token_privacy": "",
        "prompt_token_ids": [],
        "prompt_token_hashes": [],
        "output_token_ids": [],
    }
    rec = {k: v for k, v in f.accounting().items() if k not in added}
    data = Encoder(with_reader(STORE, old_accounting), "RequestAccounting").encode(rec)
    _, back = Decoder(STORE).decode(data)
    assert back == {**f.accounting(), **added}


#: Issue 36's fields (schema v7) and what a record written before them reads.
V7_STARTED = {
    "cached_tokens_by_source": {},
    "service_tier": "",
    "cache_ttl": "",
    "pd_join_id": "",
    "pd_role": "none",
    "mm_inputs": [],
}
V7_FINISHED = {
    "num_cache_creation_tokens": -1,
    "prompt_tokens_by_modality": {},
    "num_encoder_compute_tokens": -1,
    "num_encoder_cache_hit_tokens": -1,
}


def test_records_written_before_the_bill_of_2026_decode_with_its_defaults() -> None:
    """EngineEvent and RequestAccounting v6 (schemas/history, before issue 36) resolve: the new
    fields read their defaults, which mean what a v6 producer reported (no tier split, no
    service tier, not disaggregated, no cache-write or encoder count: -1, not reported)."""
    old_events = json.loads((schema_dir() / "history" / "EngineEvent.v6.avsc").read_text())
    old = with_reader(STORE, old_events)
    started = {k: v for k, v in f.request_started("r1", list(range(6))).items() if k not in V7_STARTED}
    finished = {k: v for k, v in f.request_finished("r1").items() if k not in V7_FINISHED}
    for kind, body, added in (
        (ev.REQUEST_STARTED, started, V7_STARTED),
        (ev.REQUEST_FINISHED, finished, V7_FINISHED),
    ):
        data = Encoder(old, "EngineEvent").encode(f.wrap(1, kind, body))
        assert data[2:10] != STORE.wire("EngineEvent").fingerprint_bytes
        _, back = Decoder(STORE).decode(data)
        assert {k: ev.payload(back)[k] for k in added} == added
    old_accounting = json.loads((schema_dir() / "history" / "RequestAccounting.v6.avsc").read_text())
    v6_fields = {fld["name"] for fld in old_accounting["fields"]}
    rec = {k: v for k, v in f.accounting().items() if k in v6_fields}
    data = Encoder(with_reader(STORE, old_accounting), "RequestAccounting").encode(rec)
    _, back = Decoder(STORE).decode(data)
    new = {k: v for k, v in f.accounting().items() if k not in v6_fields}
    assert len(new) == 18 and back == {**rec, **new}
    assert (new["engine_cache_write_tokens"], new["pd_role"], new["cache_write_tokens"]) == (-1, "none", 0)
