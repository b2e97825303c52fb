"""vLLM server logs captured from a real ``vllm serve`` (tests/data/vllm_log, written by
scripts/capture_vllm_log.py): the parsed requests equal what the HTTP API answered and what the
plugin's events of the same run say; bad lines are dead-lettered with their numbers; rotation
and a cut last line; the plugin/log dedup."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseety import events as ev
from sparseety.config import Config, load_config
from sparseety.kafka import make_decoder
from sparseety.offline.source_dedup import Counted, dedup_key, dedup_step
from sparseety.producers.logs.errors import BadTraceLineError
from sparseety.producers.logs.format import detect_format
from sparseety.producers.logs.ingest import ingest
from sparseety.producers.logs.vllm_log import (
    ALWAYS_MODELLED,
    LogParse,
    VllmLogParser,
    read_log,
    rotation_order,
)
from tests.recorded import DATA, unpack
from tests.unit.test_ingest_jsonl import FakeProducer

LOG = DATA / "vllm_log" / "server.log"
TRUTH = json.loads((DATA / "vllm_log" / "truth.json").read_text())
LINES = io.BytesIO(LOG.read_bytes()).readlines()  # lines end at \n only, as the parser reads them


def parse(paths: list[Path]) -> tuple[LogParse, list[tuple[str, int, str]]]:
    parser = VllmLogParser(year=2026)
    bad: list[tuple[str, int, str]] = []
    done = list(read_log(paths, parser, lambda p, exc: bad.append((p.name, exc.line, exc.reason))))
    result = parser.finish()
    assert done == result.requests
    return result, bad


def plugin_request_ids() -> dict[str, str]:
    """External id -> engine request id, from the plugin's RequestStarted events of the same run."""
    dec = make_decoder(load_config())
    out = {}
    for value in unpack((DATA / "vllm_log" / "plugin-events.bin").read_bytes()):
        _, e = dec.decode(value)
        if ev.payload_type(e) == ev.REQUEST_STARTED:
            rid = e["payload"][1]["request_id"]
            out[rid.rsplit("-", 1)[0]] = rid
    return out


def test_fixture_records_the_vllm_version_and_the_logging_flags() -> None:
    assert TRUTH["vllm_version"] == "0.32.0"
    assert {"--enable-log-requests", "--enable-log-outputs"} <= set(TRUTH["server_args"])
    assert TRUTH["env"]["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_parsed_requests_equal_the_http_answers_and_the_plugin_ids() -> None:
    result, _ = parse([LOG])
    got = {r.request_id: r for r in result.requests}
    engine_ids = plugin_request_ids()
    truth = {t["request_id"]: t for t in TRUTH["requests"]}
    chat = [t for t in TRUTH["requests"] if t["endpoint"] == "chat"]
    assert len(chat) == 6
    for t in chat:
        r = got[t["request_id"]]
        assert r.prompt_token_ids == t["prompt_token_ids"]
        assert r.prompt_tokens == t["usage"]["prompt_tokens"]
        assert r.output_token_ids == t["output_token_ids"]
        assert r.output_tokens == t["usage"]["completion_tokens"]
        assert r.finish_reason == t["finish_reason"]
        assert r.engine_request_id == engine_ids[t["request_id"]]  # the dedup key
        assert r.arrival_ns <= r.finished_ns
        assert r.modelled == set(ALWAYS_MODELLED)
    # streamed: deltas without text are not logged, so the count is a lower bound, marked modelled
    stream = got["chatcmpl-log-stream"]
    assert stream.prompt_tokens == truth["chatcmpl-log-stream"]["usage"]["prompt_tokens"]
    assert 0 < stream.output_tokens <= truth["chatcmpl-log-stream"]["usage"]["completion_tokens"]
    assert "output_tokens" in stream.modelled
    # a client that went away mid-stream: ended by "Aborted request(s)"
    abort = got["chatcmpl-log-abort"]
    assert abort.finish_reason == "abort" and abort.engine_request_id == engine_ids["chatcmpl-log-abort"]
    # /v1/completions logs no output in vLLM 0.32: received, never finished
    cmpl = next(t for t in TRUTH["requests"] if t["endpoint"] == "completions")
    assert [(u.request_id, u.prompt_token_ids) for u in result.unfinished] == [
        (cmpl["request_id"] + "-0", cmpl["prompt_token_ids"])
    ]


def test_lines_that_are_not_request_records_are_skipped_and_damaged_request_lines_are_bad() -> None:
    result, bad = parse([LOG])
    # the real server log: library warnings, tracebacks and progress bars are not request
    # records: skipped and counted, none of them bad (issue 21: 44 used to be dead letters)
    assert bad == []
    foreign = [b for b in LINES if b.strip() and b" pid=" not in b[:60] and not b.startswith(b"INFO:")]
    assert result.foreign_lines == len(foreign) > 0
    assert result.ignored_lines > 300
    assert result.skipped_lines == result.ignored_lines + result.foreign_lines
    # a request line vLLM would write, damaged: bad, at its own number
    damaged = LOG.read_bytes().replace(
        b"output_token_ids: [211, 412, 385, 58, 347]", b"output_token_ids: [211, x]", 1
    )
    path = LOG.parent / "damaged.log"
    try:
        path.write_bytes(damaged)
        _, bad2 = parse([path])
    finally:
        path.unlink()
    ((name, line, reason),) = bad2
    assert name == "damaged.log" and "request log line" in reason
    assert b"output_token_ids: [211, x]" in io.BytesIO(damaged).readlines()[line - 1]


@pytest.mark.parametrize("cut", ["between_lines", "inside_a_line"])
def test_a_log_rotated_mid_request_reads_as_one(tmp_path: Path, cut: str) -> None:
    whole, bad = parse([LOG])
    # rotate between "Received request chatcmpl-log-3" and its "Generated response"
    at = next(i for i, b in enumerate(LINES) if b"Added request chatcmpl-log-3" in b) + 1
    data = LOG.read_bytes()
    split = sum(len(b) for b in LINES[:at]) + (40 if cut == "inside_a_line" else 0)
    (tmp_path / "server.log.1").write_bytes(data[:split])
    (tmp_path / "server.log").write_bytes(data[split:])
    segments = rotation_order([tmp_path / "server.log", tmp_path / "server.log.1"])
    assert [p.name for p in segments] == ["server.log.1", "server.log"]
    rotated, bad_rotated = parse(segments)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in rotated.requests] == [
        (r.request_id, r.prompt_tokens, r.output_tokens) for r in whole.requests
    ]
    assert len(bad_rotated) == len(bad)
    assert len(rotated.partial) == len(
        whole.partial
    )  # the fixture ends inside a line: so does the rotated one


def test_a_cut_last_line_is_partial_not_bad(tmp_path: Path) -> None:
    whole, bad = parse([LOG])
    at = next(i for i, b in enumerate(LINES) if b"Generated response chatcmpl-log-5: output" in b)
    path = tmp_path / "server.log"
    path.write_bytes(b"".join(LINES[:at]) + LINES[at][:120])  # the server is writing this line
    cut, bad_cut = parse([path])
    assert cut.partial == [(str(path), at + 1)]
    assert [r.request_id for r in cut.requests] == [
        r.request_id for r in whole.requests if r.finish_line <= at
    ]
    assert "chatcmpl-log-5" in {u.request_id for u in cut.unfinished}
    # open at the cut: received before it (line numbers from 1; the cut line is at + 1), finished after
    assert {u.request_id for u in cut.unfinished} == {
        r.request_id
        for r in [*whole.requests, *whole.unfinished]
        if r.line <= at and not 0 < r.finish_line <= at
    }
    assert len(bad_cut) == len([b for b in bad if b[1] <= at])


def test_clock_is_modelled_from_year_and_offset() -> None:
    p = VllmLogParser(year=2025, utc_offset_s=3600)
    plus_one = timezone(timedelta(hours=1))
    assert (
        p._ns("12-31 23:59:59")
        == int(datetime(2025, 12, 31, 23, 59, 59, tzinfo=plus_one).timestamp()) * 10**9
    )
    # the month went back: the year rolled over
    assert p._ns("01-01 00:00:01") == int(datetime(2026, 1, 1, 0, 0, 1, tzinfo=plus_one).timestamp()) * 10**9


def test_unknown_request_line_and_orphan_response_are_bad() -> None:
    p = VllmLogParser(year=2026)
    prefix = "(APIServer pid=1) INFO 12-01 04:05:36 [x.py:1] "
    with pytest.raises(BadTraceLineError, match="never received") as exc:
        p.line(prefix + "Generated response r1: output: 'a', finish_reason: stop", 9)
    assert exc.value.line == 9
    with pytest.raises(BadTraceLineError, match="unknown format"):
        p.line(prefix + "Received request r1 with nothing else", 10)
    # not a request record: skipped, not bad
    assert p.line("garbage", 11) is None and p.result.foreign_lines == 1


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load_config(data_dir=str(tmp_path / "data"))


def test_ingest_publishes_request_level_events_and_dead_letters_bad_lines(
    cfg: Config, tmp_path: Path
) -> None:
    assert detect_format(LOG.read_bytes()[:4096]) == "vllm-log"
    producer = FakeProducer()
    report = ingest(cfg, LOG, default_model="tiny", producer=producer)
    whole, _ = parse([LOG])
    assert report.format == "vllm-log" and report.requests == 8 and report.unfinished == 1
    # the real log's other lines are skipped, not dead letters (issue 21: 44 were)
    assert report.bad == report.dead_lettered == 0 and report.skipped == whole.skipped_lines > 0
    assert not [m for m in producer.messages if m[0] == cfg.topics.dlq]
    assert report.to_dict()["skipped_lines"] == report.skipped and "hint" not in report.to_dict()
    # a damaged request line is dead-lettered with its number
    log = tmp_path / "server.log"
    good = b"output_token_ids: [211, 412, 385, 58, 347]"
    log.write_bytes(LOG.read_bytes().replace(good, b"output_token_ids: [211, x]", 1))
    producer = FakeProducer()
    report = ingest(cfg, log, default_model="tiny", producer=producer)
    _, bad = parse([log])
    assert report.bad == report.dead_lettered == len(bad) == 1
    assert [n for n, _ in report.errors] == [n for _, n, _ in bad]
    dec = make_decoder(cfg)
    events = [dec.decode(v)[1] for t, _, v in producer.messages if t == cfg.topics.engine_events]
    dead = [dec.decode(v)[1] for t, _, v in producer.messages if t == cfg.topics.dlq]
    assert [d["offset"] for d in dead] == [n for _, n, _ in bad]
    assert all(d["topic"] == f"file:{log}" and d["component"] == "ingest" for d in dead)
    started = events[0]["payload"][1]
    assert started["engine_kind"] == "vllm_log"  # request level: no per-step classes claimed
    assert started["privacy_mode"] == "raw"
    starts = [e["payload"][1] for e in events if ev.payload_type(e) == ev.REQUEST_STARTED]
    truth = {t["request_id"]: t for t in TRUTH["requests"] if t["endpoint"] == "chat"}
    ids = plugin_request_ids()
    for s in starts:
        external = s["request_id"].rsplit("-", 1)[0]
        assert s["request_id"] == ids[external]
        if external in truth:
            assert s["prompt_token_ids"] == truth[external]["prompt_token_ids"]


def acc(uid: str, rid: str, kind: str) -> dict[str, Any]:
    return {"request_uid": uid, "request_id": rid, "engine_kind": kind}


@pytest.mark.parametrize("order", ["plugin_first", "log_first"])
def test_a_request_in_both_sources_is_counted_once_and_the_plugin_wins(order: str) -> None:
    plugin, log = acc("eng@1/r-ab", "r-ab", "vllm"), acc("vllm-log-x@2/r-ab", "r-ab", "vllm_log")
    other = acc("vllm-log-x@2/r-cd", "r-cd", "vllm_log")
    state: dict[str, Counted] = {}
    decisions: dict[str, tuple[bool, str | None]] = {}
    for a in [plugin, log, other] if order == "plugin_first" else [log, other, plugin]:
        state[dedup_key(a)], out = dedup_step(state.get(dedup_key(a)), a)
        for uid, counted, dup in out:
            decisions[uid] = (counted, dup)
    assert decisions == {
        plugin["request_uid"]: (True, None),
        log["request_uid"]: (False, plugin["request_uid"]),
        other["request_uid"]: (True, None),
    }
    held = state["r-ab"]
    after, again = dedup_step(held, plugin)  # the same accounting again (a replay) stays counted
    assert again == [(plugin["request_uid"], True, None)]
    assert after == held == Counted(plugin["request_uid"], False)  # pure: a value, not a mutation


@given(st.lists(st.binary(max_size=300) | st.text(max_size=300).map(str.encode), max_size=20))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_bytes_are_lines_never_an_abort(tmp_path: Path, chunks: list[bytes]) -> None:
    prefix = b"(APIServer pid=1) INFO 12-01 04:05:36 [x.py:1] "
    words = [
        b"Received request ",
        b"Generated response ",
        b"Added request ",
        b"Request ",
        b"Aborted request(s) ",
    ]
    data = b"\n".join(prefix + words[i % 5] + c if i % 2 else c for i, c in enumerate(chunks))
    path = tmp_path / "fuzz.log"
    path.write_bytes(data)
    _result, bad = parse([path])  # only BadTraceLineError is caught inside: anything else fails
    lines = data.count(b"\n") + 1 if data else 0
    assert all(1 <= n <= lines for _, n, _ in bad)


def test_an_over_long_line_is_one_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"".join(LINES[:300]) + b"x" * 5000 + b"\n" + b"".join(LINES[300:]))
    parser = VllmLogParser(year=2026)
    bad: list[tuple[int, str]] = []
    from sparseety.producers.logs import vllm_log

    done = []
    for _seg, n, text, _cut in vllm_log.iter_segments([path], max_line_bytes=4096):
        if text is vllm_log.TOO_LONG:
            bad.append((n, "too long"))
            continue
        try:
            if parser.line(text, n) is not None:
                done.append(n)
        except BadTraceLineError:
            pass
    assert bad == [(301, "too long")]
    whole, _ = parse([LOG])
    assert len(done) == len(whole.requests)


def test_a_log_without_request_lines_says_how_to_get_them(cfg: Config, tmp_path: Path) -> None:
    # what a server started without --enable-log-requests writes: its start-up lines only
    lines = LOG.read_text().splitlines(keepends=True)
    quiet = tmp_path / "quiet-server.log"
    quiet.write_text("".join(line for line in lines if "request" not in line.lower()))
    report = ingest(cfg, quiet, fmt="vllm-log", default_model="tiny", producer=FakeProducer())
    assert report.requests == 0 and "--enable-log-requests" in report.hint
    assert report.to_dict()["hint"] == report.hint
    # a log with requests gets no hint
    assert not ingest(cfg, LOG, default_model="tiny", producer=FakeProducer()).hint
