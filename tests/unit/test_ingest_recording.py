"""SparSEEty event recordings (tests/data/<scenario>/events.bin, written by
scripts/record_fixtures.py): read, validated and published byte for byte; cut-short and corrupt
records are counted with their record numbers."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sparseety.config import load_config
from sparseety.kafka import make_decoder
from sparseety.producers.logs.errors import BadTraceLineError
from sparseety.producers.logs.format import detect_format, iter_recording, pack
from sparseety.producers.logs.ingest import ingest
from tests.recorded import DATA, load_scenario, raw_events, reconstruct, unpack
from tests.unit.test_ingest_jsonl import FakeProducer

SCENARIO = "prefix_reuse"


def test_the_format_is_the_fixture_recorders() -> None:
    values = raw_events(SCENARIO)
    data = (DATA / SCENARIO / "events.bin").read_bytes()
    assert pack(values) == data and unpack(pack(values)) == values
    assert [v for _, v in iter_recording(io.BytesIO(data))] == values
    assert detect_format(data[:64]) == "recording"
    assert list(iter_recording(io.BytesIO(b""))) == []


def test_cut_short_recordings_are_bad_records() -> None:
    values = [b"\xc3\x01abc", b"\xc3\x01defg"]
    data = pack(values)
    with pytest.raises(BadTraceLineError, match=r"line 2: truncated record \(3 of 6 bytes\)"):
        list(iter_recording(io.BytesIO(data[:-3])))
    with pytest.raises(BadTraceLineError, match="line 3: truncated length prefix"):
        list(iter_recording(io.BytesIO(data + b"\x00\x00")))
    with pytest.raises(BadTraceLineError, match="not a recording"):
        list(iter_recording(io.BytesIO(b"\xff\xff\xff\xff" + b"x" * 10)))


def test_ingest_publishes_a_recording_unchanged_keyed_by_engine(tmp_path: Path) -> None:
    cfg = load_config(data_dir=str(tmp_path))
    path = DATA / SCENARIO / "events.bin"
    producer = FakeProducer()
    report = ingest(cfg, path, producer=producer)
    values = raw_events(SCENARIO)
    assert report.format == "recording" and report.bad == 0
    assert [v for _, _, v in producer.messages] == values  # byte for byte, in order
    assert report.events_published == report.records_read == len(values)
    assert report.bytes_read == path.stat().st_size
    events, _ = load_scenario(SCENARIO)
    assert [k for _, k, _ in producer.messages] == [e["engine_name"].encode() for e in events]
    assert sorted(report.engine_ids) == sorted({e["engine_id"] for e in events})
    finished = [r for r in reconstruct(events).values() if r["finished"] is not None]
    assert report.requests == len(finished) > 0


def test_corrupt_records_are_skipped_and_counted(tmp_path: Path) -> None:
    cfg = load_config(data_dir=str(tmp_path))
    values = raw_events(SCENARIO)[:20]
    broken = [
        *values[:5],
        b"\xc3\x01" + b"\x00" * 8 + b"garbage",
        *values[5:10],
        b"\x00\x00\x00\x00\x63",
        *values[10:],
    ]
    path = tmp_path / "broken.bin"
    path.write_bytes(pack(broken) + b"\x00\x00\x01")  # and a cut-short tail
    producer = FakeProducer()
    report = ingest(cfg, path, producer=producer)
    assert [v for t, _, v in producer.messages if t == cfg.topics.engine_events] == values
    assert report.bad == 3 and [n for n, _ in report.errors] == [6, 12, 23]
    dead = [make_decoder(cfg).decode(v)[1] for t, _, v in producer.messages if t == cfg.topics.dlq]
    assert report.dead_lettered == 3
    assert [(d["offset"], d["value"]) for d in dead] == [
        (6, broken[5]),
        (12, broken[11]),
        (23, None),  # a cut-short frame has no record bytes to keep
    ]
    assert "UnknownSchemaError" in report.errors[0][1] and "truncated length prefix" in report.errors[2][1]
    with pytest.raises(BadTraceLineError, match="line 6: UnknownSchemaError"):
        ingest(cfg, path, strict=True, producer=FakeProducer())
