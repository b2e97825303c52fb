"""``POST /api/v1/collect`` with the seed's ``trace_source: vllm_log`` body, against the real broker
and chDB: the real server log (rotated in two segments) becomes request-level requests in the
store; filters and window select; a request the plugin already accounted is not published again."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sparseety import events as ev
from sparseety.api.collect import LOG_REPORT_COLUMNS
from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import finished_job, produce_raw, read_topic
from tests.recorded import DATA, unpack
from tests.topology.test_api_collect import ADMIN, api  # noqa: F401  (api: the fixture)
from tests.topology.test_api_collect import run_job as run_kind_job

LOG = DATA / "vllm_log" / "server.log"


def _damaged(data: bytes, request: str) -> bytes:
    """The log with ``request``'s output ids line damaged: a request record that fails to parse."""
    line = f"Generated response {request} details: output_token_ids: [".encode()
    assert line in data
    return data.replace(line, line + b"x", 1)


def _rotated(tmp: Path) -> Path:
    # one damaged request record in each segment: the dead letters name their segments
    data = _damaged(_damaged(LOG.read_bytes(), "chatcmpl-log-1"), "chatcmpl-log-5")
    cut = data.index(b"Generated response chatcmpl-log-3: output") - 20  # mid-request, mid-line
    (tmp / "server.log.1").write_bytes(data[:cut])
    (tmp / "server.log").write_bytes(data[cut:])
    return tmp / "server.log"


def run_job(client: TestClient, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit a spec (the seed's body has no ``kind``) and wait for its job to succeed."""
    if "kind" in spec:
        return run_kind_job(client, spec)
    r = client.post("/api/v1/collect", json=spec, headers=ADMIN)
    assert r.status_code == 202, r.text
    job: dict[str, Any] = r.json()
    return finished_job(client, job, ADMIN)


def body(path: Path, **over: object) -> dict[str, object]:
    return {
        "trace_source": "vllm_log",
        "log_path": str(path),
        "output_format": "json",
        "window_seconds": 300,
        "filters": {"request_id": None, "model_name": "tiny"},
        **over,
    }


def _requests(kafka_cfg: Config) -> list[dict[str, object]]:
    store = Store.open(kafka_cfg)
    try:
        return store.query(
            f"SELECT request_id, engine_kind, prompt_tokens, output_tokens, model "
            f"FROM {store.table('requests')} FINAL ORDER BY request_id"
        )
    finally:
        store.close()


def test_seed_body_collects_a_rotated_log_into_the_store(
    kafka_cfg: Config,
    api: TestClient,  # noqa: F811
    tmp_path: Path,
) -> None:
    path = _rotated(tmp_path)
    job = run_job(api, body(path))
    result = job["result"]
    assert job["kind"] == "vllm_log" and job["params"]["segments"] == [str(tmp_path / "server.log.1")]
    assert result["format"] == "vllm-log" and result["requests"] == 8 and result["unfinished_requests"] == 1
    # only the damaged request records are dead letters; the server's other lines are skipped
    assert result["bad_lines"] == result["dead_lettered"] == 2 and result["already_accounted"] == 0
    assert result["skipped_lines"] > 300 and "hint" not in result
    dead = read_topic(kafka_cfg, kafka_cfg.topics.dlq)
    assert {d[3]["topic"] for d in dead} == {f"file:{tmp_path / 'server.log.1'}", f"file:{path}"}
    # filters: another model, or one request by the client's id
    assert run_job(api, body(path, filters={"model_name": "other"}))["result"]["requests"] == 0
    one = run_job(api, body(path, filters={"request_id": "chatcmpl-log-2", "model_name": None}))
    assert one["result"]["requests"] == 1
    fold = run_job(api, {"kind": "replay", "topic": "engine-events", "idle_s": 0.5})
    assert fold["result"]["rows_written"]["requests"] >= 8
    rows = _requests(kafka_cfg)
    assert len(rows) == 8 and {r["engine_kind"] for r in rows} == {"vllm_log"}
    assert {r["model"] for r in rows} == {"tiny"}
    chat0 = next(r for r in rows if str(r["request_id"]).startswith("chatcmpl-log-0-"))
    assert (chat0["prompt_tokens"], chat0["output_tokens"]) == (175, 5)  # the HTTP answer's usage
    # the report: written where the docs say (<data_dir>/collect/<job id>.json), one row per
    # request published, the same counts the store holds
    assert result["output"] == str(kafka_cfg.data_path / "collect" / f"{job['id']}.json")
    report = json.loads(Path(result["output"]).read_text())
    assert result["output_rows"] == len(report) == result["requests"] == 8
    # (an aborted request-level row is stored without outputs: the fold synthesises no steps
    # for an abort; the report says what the log logged)
    logged = {
        (r["engine_request_id"], r["prompt_tokens"], r["output_tokens"] * (r["finish_reason"] != "abort"))
        for r in report
    }
    assert logged == {(r["request_id"], r["prompt_tokens"], r["output_tokens"]) for r in rows}
    assert all("arrival_ts_ns" in r["modelled"] for r in report)  # the log's clock is modelled


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_the_report_file_in_each_output_format_is_written_and_served(
    kafka_cfg: Config,
    api: TestClient,  # noqa: F811
    tmp_path: Path,
    fmt: str,
) -> None:
    shutil.copy(LOG, tmp_path / "server.log")
    out = tmp_path / "reports" / f"day1.{fmt}"
    job = run_job(api, body(tmp_path / "server.log", output_format=fmt, output_path=str(out)))
    result = job["result"]
    assert result["output"] == str(out) and result["output_format"] == fmt and out.is_file()
    served = api.get(f"/api/v1/jobs/{job['id']}/output", headers=ADMIN)
    assert served.status_code == 200 and served.content == out.read_bytes()
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(served.text)))
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(io.BytesIO(served.content)).to_pylist()
    assert len(rows) == result["requests"] == 8
    assert list(rows[0]) == list(LOG_REPORT_COLUMNS)
    chat0 = next(r for r in rows if r["request_id"] == "chatcmpl-log-0")
    assert (int(chat0["prompt_tokens"]), int(chat0["output_tokens"])) == (175, 5)
    # a job that writes no report, and a bad format, say so
    replay = run_job(api, {"kind": "replay", "topic": "engine-events", "idle_s": 0.5})
    missing = api.get(f"/api/v1/jobs/{replay['id']}/output", headers=ADMIN)
    assert missing.status_code == 404 and "only vllm_log jobs do" in missing.text
    bad = api.post("/api/v1/collect", json=body(tmp_path / "server.log", output_format="xml"), headers=ADMIN)
    assert bad.status_code == 400 and "output_format" in bad.text


def test_requests_the_plugin_accounted_are_not_collected_again(
    kafka_cfg: Config,
    api: TestClient,  # noqa: F811
    tmp_path: Path,
) -> None:
    values = unpack((DATA / "vllm_log" / "plugin-events.bin").read_bytes())
    produce_raw(kafka_cfg, kafka_cfg.topics.engine_events, [(b"e2e-vllm-log", v) for v in values])
    run_job(api, {"kind": "replay", "topic": "engine-events", "idle_s": 0.5})
    before = _requests(kafka_cfg)
    assert len(before) == 9 and {r["engine_kind"] for r in before} == {"vllm"}
    shutil.copy(LOG, tmp_path / "server.log")
    job = run_job(api, body(tmp_path / "server.log"))
    assert job["result"]["already_accounted"] == 8 and job["result"]["requests"] == 0
    published = [
        e
        for _, _, _, e in read_topic(kafka_cfg, kafka_cfg.topics.engine_events)
        if e["engine_name"] != "e2e-vllm-log"
    ]
    assert not [e for e in published if ev.payload_type(e) == ev.REQUEST_STARTED]


def test_ingest_command_reads_rotated_segments_as_one_log(kafka_cfg: Config, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sparseety.cli import main
    from sparseety.config import to_env

    path = _rotated(tmp_path)
    args = ["ingest", "--format", "vllm-log", str(path), str(tmp_path / "server.log.1"), "--tenant", "acme"]
    result = CliRunner().invoke(main, args, env=to_env(kafka_cfg))
    assert result.exit_code == 1, result.output  # the two damaged request records are bad lines
    assert (
        "8 requests, 18 events published" in result.output
    )  # EngineStarted, 8 x (start, finish), EngineStopped
    assert "2 bad lines skipped" in result.output
    assert "lines that are not request records skipped (not dead-lettered)" in result.output
    records = read_topic(kafka_cfg, kafka_cfg.topics.engine_events, quiet_s=0.5)
    started = [ev.payload(r[3]) for r in records if ev.payload_type(r[3]) == ev.REQUEST_STARTED]
    assert len(started) == 8 and {s["tenant"] for s in started} == {"acme"}
    assert {r[2] for r in records} == {b"vllm-log-server.log"}
    only_one = CliRunner().invoke(main, ["ingest", str(path), str(path)], env=to_env(kafka_cfg))
    assert only_one.exit_code == 2 and "several files only with --format vllm-log" in only_one.output
