"""Ingest is line-safe: every bad line, however big, deep or strange, is dead-lettered with its
line number and reason, and the lines after it are still published (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.deadletter_limits import MAX_DEAD_LETTER_BYTES, cap_raw
from sparseety.kafka import make_decoder
from sparseety.producers.logs.errors import BadTraceLineError
from sparseety.producers.logs.ingest import Limits, ingest
from sparseety.producers.logs.jsonl import MAX_DEPTH, parse_line
from tests.unit.test_ingest_jsonl import FakeProducer, line


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load_config(data_dir=str(tmp_path / "data"))


def _dead(cfg: Config, producer: FakeProducer) -> list[dict[str, object]]:
    decoder = make_decoder(cfg)
    return [decoder.decode(v)[1] for t, _, v in producer.messages if t == cfg.topics.dlq]


def _parse(raw: bytes) -> None:
    """parse_line either gives a request, None, or a BadTraceLineError: nothing else escapes."""
    try:
        parse_line(raw, 7, default_model="m")
    except BadTraceLineError as exc:
        assert exc.line == 7 and exc.reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_a_request_or_a_bad_line(raw: bytes) -> None:
    _parse(raw)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    usage=st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "prompt_tokens_details"]), _json
    ),
    huge=st.integers(min_value=2**31, max_value=10**40) | st.integers(max_value=-1),
    field=st.sampled_from(["prompt_tokens", "completion_tokens"]),
)
def test_huge_and_strange_values_are_bad_lines(usage: dict[str, object], huge: int, field: str) -> None:
    rec = line(1)
    rec["usage"] = {**rec["usage"], **usage}
    _parse(json.dumps(rec).encode())
    rec = line(1)
    rec["usage"][field] = huge
    with pytest.raises(BadTraceLineError):
        parse_line(json.dumps(rec).encode(), 1)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(min_value=MAX_DEPTH + 1, max_value=300_000), opener=st.sampled_from(["[", '{"a":']))
def test_deep_nesting_is_a_bad_line(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    raw = (opener * depth + "1" + closer * depth).encode()
    with pytest.raises(BadTraceLineError, match="nested deeper"):
        parse_line(raw, 3, max_line_bytes=len(raw) + 1)


@settings(max_examples=20, deadline=None)
@given(size=st.integers(min_value=1025, max_value=200_000))
def test_long_lines_are_bad_lines(size: int) -> None:
    raw = json.dumps({**line(1), "pad": "x" * size}).encode()
    with pytest.raises(BadTraceLineError, match="over the 1024-byte limit"):
        parse_line(raw, 1, max_line_bytes=1024)


def test_the_line_limit_counts_the_content_not_the_newline() -> None:
    raw = json.dumps(line(1)).encode()
    assert parse_line(raw + b"\r\n", 1, max_line_bytes=len(raw)) is not None
    with pytest.raises(BadTraceLineError, match="over the"):
        parse_line(raw, 1, max_line_bytes=len(raw) - 1)


def test_an_ingest_of_hostile_lines_dead_letters_each_and_publishes_the_rest(
    cfg: Config, tmp_path: Path
) -> None:
    big = json.dumps({**line(90), "pad": "x" * (10 * 1024 * 1024)})
    hostile = [
        line(1),
        line(2, usage={"prompt_tokens": 10**30, "completion_tokens": 1}),  # line 2
        "[" * 200_000 + "]" * 200_000,  # line 3
        big,  # line 4: 10 MB
        line(5, usage={"prompt_tokens": 5, "completion_tokens": 2**31}),  # line 5
        line(6, arrival_ts_ns=2**70),  # line 6
        line(7, max_tokens=10**20),  # line 7
        '{"id": 1, "usage": {"prompt_tokens": 1' + "0" * 5000 + "}}",  # line 8: over Python's digit limit
        line(9, arrival=1e300),  # line 9
        b"\xff\xfe not utf-8",  # line 10
        line(11),
    ]
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(
        b"".join(
            (x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n"
            for x in hostile
        )
    )
    producer = FakeProducer()
    report = ingest(cfg, path, producer=producer)
    assert report.requests == 2 and report.bad == 9
    assert [n for n, _ in report.errors] == list(range(2, 11))
    dead = _dead(cfg, producer)
    assert [d["offset"] for d in dead] == list(range(2, 11)) and report.dead_lettered == 9
    by_line = {d["offset"]: d for d in dead}
    assert "over the" in str(by_line[4]["reason"]) and "sha256" in str(by_line[4]["reason"])
    assert str(len(big) + 1) in str(by_line[4]["reason"])
    assert "nested deeper" in str(by_line[3]["reason"])
    # every dead letter fits far under the broker's 1 MiB message limit
    assert all(len(v) < 2 * MAX_DEAD_LETTER_BYTES for t, _, v in producer.messages if t == cfg.topics.dlq)
    published = [m for m in producer.messages if m[0] == cfg.topics.engine_events]
    assert len(published) == 1 + 2 * 2 + 1  # EngineStarted, two requests, EngineStopped


def test_a_file_without_newlines_is_one_bad_line(cfg: Config, tmp_path: Path) -> None:
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\x00\xff" * (3 * 1024 * 1024))
    producer = FakeProducer()
    report = ingest(cfg, path, fmt="jsonl", producer=producer, limits=Limits(max_line_bytes=4096))
    assert report.bad == 1 and report.errors[0][0] == 1 and report.requests == 0
    (dead,) = _dead(cfg, producer)
    assert isinstance(dead["value"], bytes) and len(dead["value"]) == 4097 and "sha256" in str(dead["reason"])


def test_dead_letters_keep_a_hash_and_the_length_of_what_they_cut() -> None:
    value, reason = cap_raw(b"a" * (MAX_DEAD_LETTER_BYTES + 1), "bad")
    assert value is not None and len(value) == MAX_DEAD_LETTER_BYTES
    assert reason.startswith("bad [value truncated") and str(MAX_DEAD_LETTER_BYTES + 1) in reason
    assert cap_raw(b"ok", "fine") == (b"ok", "fine")
    record = ev.dead_letter("E", "r", "c", topic="t", partition=0, offset=1, key=None, value=b"x" * 10**7)
    assert len(record["value"]) == MAX_DEAD_LETTER_BYTES and "sha256" in record["reason"]
