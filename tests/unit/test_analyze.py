"""``sparseety analyze``: reports per input and a summary, resumable, failures retried and
reported, csv/parquet read back, and a vLLM log of an engine whose plugin recording is analysed
too counted once. (Equality with the streaming pipeline's store: tests/topology/test_analyze.py.)"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sparseety.cli import main
from sparseety.config import Config, load_config
from sparseety.offline.analyze import AnalyzeInput, InputResult, Options, analyze, fold_input, plan
from tests.recorded import DATA, load_scenario

RECORDING = DATA / "vllm_log" / "plugin-events.bin"
LOG = DATA / "vllm_log" / "server.log"
TRUTH = json.loads((DATA / "vllm_log" / "truth.json").read_text())


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load_config(data_dir=str(tmp_path / "data"))


def test_recording_and_its_log_report_each_and_count_each_request_once(cfg: Config, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = analyze(cfg, [LOG, RECORDING], out, opts=Options(model="tiny"))
    assert [i["input"] for i in summary.inputs] == ["plugin-events.bin", "server.log"]  # recordings first
    rec = json.loads((out / "plugin-events.bin.json").read_text())
    log = json.loads((out / "server.log.json").read_text())
    by_external = {r["request_id"].rsplit("-", 1)[0]: r for r in rec["requests"]}
    for t in [t for t in TRUTH["requests"] if "usage" in t]:  # the recording equals the HTTP answers
        r = by_external[t["request_id"] if t["endpoint"] != "completions" else t["request_id"] + "-0"]
        assert r["prompt_tokens"] == t["usage"]["prompt_tokens"]
        assert r["output_tokens"] == t["usage"]["completion_tokens"]
        assert r["engine_cached_tokens"] == t["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r["consistent"] and r["engine_kind"] == "vllm" and r["modelled"] == ""
    assert all(r["engine_kind"] == "vllm_log" for r in log["requests"])
    assert all("cache_read_tokens" in r["modelled"].split(",") for r in log["requests"])
    # the server's other lines are skipped, not bad lines (issue 21); none of its request records is bad
    assert log["bad_lines"] == 0 and log["skipped_lines"] > log["ignored_lines"] > 0
    assert [u["request_id"] for u in log["unfinished_requests"]] == ["cmpl-log-cmpl-0"]
    # every log request is a plugin request: listed as a duplicate, counted once
    assert len(summary.duplicates) == len(log["requests"]) == 8
    assert {d["request_id"] for d in summary.duplicates} <= {r["request_id"] for r in rec["requests"]}
    assert summary.totals == rec["totals"]
    assert json.loads((out / "summary.json").read_text())["totals"] == rec["totals"]


def test_a_rerun_skips_finished_inputs_and_a_changed_file_is_analysed_again(
    cfg: Config, tmp_path: Path
) -> None:
    src = tmp_path / "in"
    src.mkdir()
    a = shutil.copy(DATA / "prefix_reuse" / "events.bin", src / "a.bin")
    b = shutil.copy(RECORDING, src / "b.bin")
    out = tmp_path / "out"
    first = analyze(cfg, [a, b], out)
    assert first.analysed == 2
    calls: list[str] = []

    def counting(cfg: Config, inp: AnalyzeInput, opts: Options) -> InputResult:
        calls.append(inp.name)
        return fold_input(cfg, inp, opts)

    again = analyze(cfg, [a, b], out, fold=counting)
    assert calls == [] and again.skipped == 2 and again.totals == first.totals
    Path(b).write_bytes(Path(b).read_bytes()[:-7])  # the last record cut: a different file
    third = analyze(cfg, [a, b], out, fold=counting)
    assert calls == ["b.bin"] and third.skipped == 1 and third.analysed == 1
    report = json.loads((out / "b.bin.json").read_text())
    assert report["bad_lines"] == 1 and "truncated" in report["bad_line_list"][0]["reason"]


def test_a_failing_input_is_retried_then_reported_and_the_others_finish(cfg: Config, tmp_path: Path) -> None:
    a, b = DATA / "prefix_reuse" / "events.bin", RECORDING
    attempts: dict[str, int] = {}

    def flaky(fail_times: int) -> Any:
        def fold(cfg: Config, inp: AnalyzeInput, opts: Options) -> InputResult:
            attempts[inp.name] = attempts.get(inp.name, 0) + 1
            if inp.name.startswith("prefix_reuse") and attempts[inp.name] <= fail_times:
                raise OSError("disk hiccup")
            return fold_input(cfg, inp, opts)

        return fold

    out = tmp_path / "out"
    s = analyze(cfg, [a, b], out, retries=1, fold=flaky(5))
    assert s.failed == 1 and s.analysed == 1 and attempts["prefix_reuse-events.bin"] == 2
    failed = next(i for i in s.inputs if i["status"] == "failed")
    assert failed["input"] == "prefix_reuse-events.bin" and "disk hiccup" in failed["error"]
    attempts.clear()
    s2 = analyze(cfg, [a, b], out, retries=1, fold=flaky(1))  # a failed input is not finished
    assert s2.failed == 0 and s2.analysed == 1 and s2.skipped == 1
    assert attempts == {"prefix_reuse-events.bin": 2}
    _, truth = load_scenario("prefix_reuse")
    assert s2.totals["requests"] == len(truth["requests"]) + 9


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables_read_back(cfg: Config, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    analyze(cfg, [RECORDING, LOG], out, fmt=fmt)
    if fmt == "csv":
        with (out / "plugin-events.bin.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        with (out / "summary.csv").open() as fh:
            summary = list(csv.DictReader(fh))
        prompt = sum(int(r["prompt_tokens"]) for r in rows)
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(out / "plugin-events.bin.parquet").to_pylist()
        summary = pq.read_table(out / "summary.parquet").to_pylist()
        prompt = sum(r["prompt_tokens"] for r in rows)
    assert len(rows) == 9  # 8 answered + 1 aborted by its client (no usage answered)
    aborted = next(r for r in rows if str(r["request_id"]).startswith("chatcmpl-log-abort-"))
    answered = sum(t["usage"]["prompt_tokens"] for t in TRUTH["requests"] if "usage" in t)
    assert prompt - int(aborted["prompt_tokens"]) == answered
    assert [r["input"] for r in summary][-1].startswith("(total")
    assert int(summary[-1]["requests"]) == 9  # the log's 8 duplicates are not counted
    assert json.loads((out / "server.log.meta.json").read_text())["unfinished_requests"]


def test_rotated_segments_are_one_input(tmp_path: Path) -> None:
    data = LOG.read_bytes()
    (tmp_path / "server.log.1").write_bytes(data[: len(data) // 2])
    (tmp_path / "server.log").write_bytes(data[len(data) // 2 :])
    (inp,) = plan([tmp_path / "server.log", tmp_path / "server.log.1"])
    assert inp.name == "server.log" and [p.name for p in inp.paths] == ["server.log.1", "server.log"]
    assert inp.format == "vllm-log"


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--data-dir", str(tmp_path / "d"), "analyze", str(RECORDING), str(LOG), "--output", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "total: 9 requests (8 duplicates not counted)" in r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and r.output.count("skipped (finished earlier)") == 2


def test_a_jsonl_log_gives_what_ingest_and_the_worker_fold_give(cfg: Config, tmp_path: Path) -> None:
    from sparseety.kafka import make_decoder
    from sparseety.producers.logs.ingest import ingest
    from sparseety.streams.assembler import Assembler
    from sparseety.streams.state import MemoryStore
    from tests.unit.test_ingest_jsonl import FakeProducer, line, write

    path = write(tmp_path / "gw.jsonl", [line(i) for i in range(6)] + ["{not json"])
    producer = FakeProducer()
    ingest(cfg, path, producer=producer)
    dec = make_decoder(cfg)
    asm = Assembler(cfg.worker, MemoryStore())
    folded = {
        out.record["request_uid"]: out.record
        for topic, _key, value in producer.messages
        if topic == cfg.topics.engine_events
        for out in asm.apply(dec.decode(value)[1])
        if out.record_name.endswith("RequestAccounting")
    }
    analyze(cfg, [path], tmp_path / "out")
    report = json.loads((tmp_path / "out" / "gw.jsonl.json").read_text())
    assert report["bad_lines"] == 1 and report["bad_line_list"][0]["line"] == 7
    assert {
        r["request_uid"]: (r["prompt_tokens"], r["cache_read_tokens"], r["tenant"])
        for r in report["requests"]
    } == {uid: (a["prompt_tokens"], a["cache_read_tokens"], a["tenant"]) for uid, a in folded.items()}
    assert len(folded) == 6
