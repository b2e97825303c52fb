"""Request-level JSONL traces: parsing, bad lines (typed, numbered, counted), and the events they
become, folded by the real assembler into the accounting a request-level producer should get."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.kafka import make_decoder
from sparseety.producers.logs.errors import BadTraceLineError, TraceError
from sparseety.producers.logs.format import detect_format
from sparseety.producers.logs.ingest import ingest
from sparseety.producers.logs.jsonl import TraceEpoch, parse_line
from sparseety.streams.replay import FoldProcessor

S = 1_000_000_000
T0 = 1_714_564_800  # 2024-05-01T12:00:00Z


class FakeProducer:
    """confluent-kafka's Producer surface the publisher uses; every message is delivered."""

    def __init__(self, *, fail: bool = False) -> None:
        self.messages: list[tuple[str, bytes, bytes]] = []
        self.pending: list[Any] = []
        self.fail = fail

    def produce(self, topic: str, *, key: bytes, value: bytes, on_delivery: Any) -> None:
        self.messages.append((topic, key, value))
        self.pending.append(on_delivery)

    def poll(self, _timeout: float) -> int:
        return 0

    def flush(self, _timeout: float) -> int:
        for cb in self.pending:
            cb("broker down" if self.fail else None, None)
        self.pending.clear()
        return 0


def line(i: int, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": f"req-{i}",
        "tenant": ["acme", "globex"][i % 2],
        "model": "llama-8b",
        "arrival": T0 + i,
        "finished": T0 + i + 0.5,
        "finish_reason": "stop",
        "usage": {
            "prompt_tokens": 100 + i,
            "completion_tokens": 10 + i,
            "prompt_tokens_details": {"cached_tokens": 64 if i % 2 else 0},
        },
    }
    rec.update(over)
    return rec


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load_config(data_dir=str(tmp_path / "data"))


def test_parse_line_reads_usage_timestamps_and_defaults() -> None:
    req = parse_line(json.dumps(line(3)), 7)
    assert req is not None
    assert (req.request_id, req.tenant, req.model) == ("req-3", "globex", "llama-8b")
    assert (req.prompt_tokens, req.completion_tokens, req.cached_tokens) == (103, 13, 64)
    assert req.arrival_ns == (T0 + 3) * S and req.finished_ns == (T0 + 3) * S + S // 2
    iso = parse_line(
        json.dumps(
            {
                "request_id": 9,
                "created": "2024-05-01T12:00:00Z",
                "usage": {"prompt_tokens": 5, "completion_tokens": 1},
            }
        ),
        1,
        default_tenant="t",
        default_model="m",
    )
    assert iso is not None and (iso.request_id, iso.tenant, iso.model) == ("9", "t", "m")
    assert (
        iso.arrival_ns == iso.finished_ns == T0 * S and iso.cached_tokens == 0 and iso.finish_reason == "stop"
    )
    ns = parse_line(
        json.dumps(
            line(
                1,
                arrival_ts_ns=5,
                finished_ts_ns=9,
                choices=[{"finish_reason": "length"}],
                finish_reason=None,
            )
        ),
        1,
    )
    assert ns is not None and (ns.arrival_ns, ns.finished_ns, ns.finish_reason) == (5, 9, "length")
    assert parse_line("   \n", 3) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({**line(1), "id": None}), "missing request id"),
        (json.dumps({k: v for k, v in line(1).items() if k != "usage"}), "missing usage object"),
        (
            json.dumps(line(1, usage={"prompt_tokens": -1, "completion_tokens": 1})),
            "usage.prompt_tokens must be a non-negative integer, got -1",
        ),
        (
            json.dumps(line(1, usage={"prompt_tokens": "12", "completion_tokens": 1})),
            "usage.prompt_tokens must be a non-negative integer, got str",
        ),
        (
            json.dumps(
                line(
                    1,
                    usage={
                        "prompt_tokens": 5,
                        "completion_tokens": 1,
                        "prompt_tokens_details": {"cached_tokens": 9},
                    },
                )
            ),
            "cached_tokens 9 exceeds prompt_tokens 5",
        ),
        (json.dumps({k: v for k, v in line(1).items() if k != "model"}), "missing model"),
        (json.dumps({k: v for k, v in line(1).items() if k != "arrival"}), "missing arrival time"),
        (json.dumps(line(1, arrival="half past ten")), "arrival is not an ISO-8601 time"),
        (json.dumps(line(1, finished=T0 - 100)), "finished is before arrival"),
        (json.dumps(line(1, tenant=7)), "tenant must be a string, got int"),
    ],
)
def test_bad_lines_are_typed_errors_with_their_line_number(text: str, reason: str) -> None:
    with pytest.raises(BadTraceLineError) as info:
        parse_line(text, 42)
    assert info.value.line == 42 and reason in info.value.reason
    assert str(info.value).startswith("line 42: ")


def test_epoch_events_are_gap_free_and_end_with_engine_stopped() -> None:
    epoch = TraceEpoch("trace-x", "abc", "x.jsonl")
    assert list(epoch.stop()) == []  # nothing started, nothing to stop
    reqs = [parse_line(json.dumps(line(i)), i + 1) for i in range(3)]
    events = [e for r in reqs if r for e in epoch.request(r)] + list(epoch.stop())
    assert [e["seq"] for e in events] == list(range(8))
    assert [ev.payload_type(e) for e in events][:3] == [
        ev.ENGINE_STARTED,
        ev.REQUEST_STARTED,
        ev.REQUEST_FINISHED,
    ]
    assert ev.payload_type(events[-1]) == ev.ENGINE_STOPPED
    assert ev.payload(events[0])["engine_kind"] == "trace"
    assert events[0]["ts_ns"] <= events[1]["ts_ns"] and events[-1]["ts_ns"] == max(e["ts_ns"] for e in events)
    assert {e["engine_id"] for e in events} == {"trace-x@abc"}


def test_ingest_skips_and_reports_bad_lines_and_the_fold_accounts_every_good_one(
    cfg: Config, tmp_path: Path
) -> None:
    lines: list[Any] = [line(i) for i in range(6)]
    lines.insert(2, "{oops")
    lines.insert(5, "")
    lines.append(line(1))  # duplicate id
    path = write(tmp_path / "requests.jsonl", lines)
    assert detect_format(path.read_bytes()[:64]) == "jsonl"
    producer = FakeProducer()
    seen: list[tuple[int, int]] = []
    report = ingest(cfg, path, producer=producer, progress=lambda d, t: seen.append((d, t)))
    assert (report.format, report.requests, report.bad, report.records_read) == ("jsonl", 6, 2, 8)
    assert report.errors == [
        (3, "not valid JSON (Expecting property name enclosed in double quotes)"),
        (9, "duplicate request id 'req-1' in this file"),
    ]
    events = [m for m in producer.messages if m[0] == cfg.topics.engine_events]
    assert report.events_published == len(events) == 1 + 2 * 6 + 1
    assert seen[-1] == (path.stat().st_size, path.stat().st_size)
    (engine_id,) = report.engine_ids
    assert engine_id.startswith("trace-requests@")
    assert {k for _, k, _ in events} == {b"trace-requests"}

    # each bad line went to the dlq topic with its reason, position and bytes
    decoder = make_decoder(cfg)
    dead = [decoder.decode(v) for t, _, v in producer.messages if t == cfg.topics.dlq]
    assert report.dead_lettered == len(dead) == 2 == len(producer.messages) - len(events)
    assert {name for name, _ in dead} == {ev.DEAD_LETTER}
    assert [(d["offset"], d["value"], d["component"]) for _, d in dead] == [
        (3, b"{oops\n", "ingest"),
        (9, (json.dumps(line(1)) + "\n").encode(), "ingest"),
    ]
    assert dead[0][1]["topic"] == f"file:{path}" and "not valid JSON" in dead[0][1]["reason"]
    assert dead[1][1]["error_type"] == "BadTraceLineError"

    # the real assembler turns the events into request-level accounting
    fold = FoldProcessor(cfg)
    out = [o for i, (_, _, v) in enumerate(events) for o in fold(*decoder.decode(v), "t", 0, i)]
    accounting = {r["request_id"]: r for name, r in out if name == ev.REQUEST_ACCOUNTING}
    assert set(accounting) == {f"req-{i}" for i in range(6)}
    for i in range(6):
        a = accounting[f"req-{i}"]
        cached = 64 if i % 2 else 0
        assert a["request_uid"] == f"{engine_id}/req-{i}"
        assert (a["prompt_tokens"], a["output_tokens"], a["cache_read_tokens"]) == (100 + i, 10 + i, cached)
        assert a["uncached_computed_tokens"] == 100 + i - cached + 9 + i
        assert a["engine_kind"] == "trace" and a["complete"] and a["consistent"]
        assert a["tenant"] == ["acme", "globex"][i % 2] and a["model"] == "llama-8b"
        assert a["finished_ts_ns"] == (T0 + i) * S + S // 2
    assert any(name == ev.USAGE_WINDOW for name, _ in out)

    # the same file again: the same epoch, so the same event ids and request uids
    again = ingest(cfg, path, producer=FakeProducer())
    assert again.engine_ids == report.engine_ids


def test_strict_mode_publishes_nothing_when_a_line_is_bad(cfg: Config, tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [line(0), "{oops", line(1), "[]"])
    producer = FakeProducer()
    with pytest.raises(BadTraceLineError) as info:
        ingest(cfg, path, strict=True, producer=producer)
    assert info.value.line == 2 and "2 bad lines in all; nothing was published" in str(info.value)
    assert producer.messages == []
    ok = write(tmp_path / "ok.jsonl", [line(0), line(1)])
    assert ingest(cfg, ok, strict=True, producer=producer).requests == 2


def test_undelivered_events_and_unreadable_files_are_errors(cfg: Config, tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [line(0)])
    with pytest.raises(TraceError, match=r"4 of 4 events were not delivered .*broker down"):
        ingest(cfg, path, producer=FakeProducer(fail=True))
    with pytest.raises(TraceError, match="cannot read trace file"):
        ingest(cfg, tmp_path / "missing.jsonl", producer=FakeProducer())
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(TraceError, match="empty"):
        ingest(cfg, tmp_path / "empty", producer=FakeProducer())
    (tmp_path / "csv").write_text("id,tenant\n1,a\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        ingest(cfg, tmp_path / "csv", producer=FakeProducer())
    with pytest.raises(TraceError, match="unknown trace format 'xml'"):
        ingest(cfg, path, fmt="xml", producer=FakeProducer())
