"""Collect jobs against the real broker and chDB: a replay of a timelines range, and a JSONL trace
ingested to engine-events then folded into the store by a replay job, both queryable after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from sparseety import events as ev
from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.cli import main
from sparseety.config import Config, to_env
from sparseety.kafka import make_encoder, make_producer
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price, set_prices
from tests import factories as f
from tests.helpers import finished_job, read_topic

S = 10**9
T0 = 1_700_000_000 * S
ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture
def api(kafka_cfg: Config) -> Iterator[TestClient]:
    store = Store.open(kafka_cfg)
    try:
        migrate(store)
        set_prices(
            store, [Price("tiny", c, p) for c, p in (("input", 1), ("cached_input", 0.25), ("output", 4))]
        )
        backend = Backend(kafka_cfg, store, tokens=TokenTable({"admin": ["*"], "acme": ["t0"]}))
        try:
            with TestClient(create_api(backend)) as client:
                yield client
        finally:
            backend.close()
    finally:
        store.close()


def run_job(client: TestClient, spec: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    r = client.post("/api/v1/collect", json=spec, headers=ADMIN)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] in ("queued", "running") and job["kind"] == spec["kind"]
    return finished_job(client, job, ADMIN, timeout_s)


def test_replay_job_of_a_timelines_range(kafka_cfg: Config, api: TestClient) -> None:
    cfg = kafka_cfg
    enc = make_encoder(cfg, "RequestAccounting", cfg.topics.timelines)
    producer = make_producer(cfg)
    for i in range(40):
        rec = f.accounting(f"{f.EID}/r{i}", tenant=f"t{i % 4}", finished_ts_ns=T0 + i * S)
        producer.produce(cfg.topics.timelines, key=rec["request_uid"].encode(), value=enc.encode(rec))
    assert producer.flush(30) == 0

    job = run_job(
        api, {"kind": "replay", "topic": "timelines", "from": "beginning", "to": "end", "idle_s": 0.5}
    )
    result = job["result"]
    assert result["records_in_range"] == 40 and result["rows_written"]["requests"] == 40
    assert job["progress"]["done"] == job["progress"]["total"] == 40 and job["progress"]["unit"] == "records"
    assert job["throughput_per_s"] > 0 and result["records_per_s"] > 0
    assert job["params"]["topic"] == cfg.topics.timelines

    cost = api.get("/api/v1/cost", headers=ADMIN).json()["rows"]
    assert {r["tenant"]: r["requests"] for r in cost} == {"t0": 10, "t1": 10, "t2": 10, "t3": 10}
    stats = api.get("/api/v1/tokens/statistics", params={"request_id": f"{f.EID}/r5"}, headers=ADMIN).json()
    assert stats["input_token_count"] == 10 and stats["cached_token_count"] == 4
    # the scoped token sees its tenant's rows of the replayed range only
    mine = api.get("/api/v1/cost", headers={"Authorization": "Bearer acme"}).json()["rows"]
    assert [(r["tenant"], r["requests"]) for r in mine] == [("t0", 10)]

    again = run_job(api, {"kind": "replay", "topic": "timelines", "idle_s": 0.5})
    assert again["result"]["records_in_range"] == 40
    assert api.get("/api/v1/cost", headers=ADMIN).json()["rows"] == cost  # idempotent
    listed = api.get("/api/v1/jobs", headers=ADMIN).json()["jobs"]
    assert [j["id"] for j in listed] == [again["id"], job["id"]]
    assert (
        'sparseety:jobs_total{kind="replay",state="succeeded"} 2.0' in api.get("/metrics", headers=ADMIN).text
    )


def test_jsonl_ingest_job_then_fold_into_the_store(
    kafka_cfg: Config, api: TestClient, tmp_path: Path
) -> None:
    base = 1_714_564_800
    lines = [
        json.dumps(
            {
                "id": f"q{i}",
                "tenant": "t0" if i % 2 else "t1",
                "model": "tiny",
                "arrival": base + i,
                "finished": base + i + 1,
                "usage": {
                    "prompt_tokens": 50 + i,
                    "completion_tokens": 5 + i,
                    "prompt_tokens_details": {"cached_tokens": 32 if i % 3 == 0 else 0},
                },
            }
        )
        for i in range(12)
    ]
    lines.insert(4, '{"id": "bad", "usage": {"prompt_tokens": "many"}}')
    path = tmp_path / "gateway.jsonl"
    path.write_text("\n".join(lines) + "\n")

    job = run_job(api, {"kind": "ingest", "path": str(path)})
    result = job["result"]
    assert result["format"] == "jsonl" and result["requests"] == 12 and result["bad_lines"] == 1
    assert result["errors"] == [
        {"line": 5, "reason": "usage.prompt_tokens must be a non-negative integer, got str"}
    ]
    assert result["events_published"] == 2 + 2 * 12
    assert job["progress"]["unit"] == "bytes" and job["progress"]["done"] == path.stat().st_size
    (engine_id,) = result["engine_ids"]

    # fold the engine-events topic into the store (the assembler's fold, through the replay path)
    fold = run_job(api, {"kind": "replay", "topic": "engine-events", "idle_s": 0.5})
    assert fold["result"]["records_in_range"] == 26 and fold["result"]["rows_written"]["requests"] == 12
    assert "1 epochs folded, 12 requests closed" in fold["result"]["summary"]

    stats = api.get(
        "/api/v1/tokens/statistics", params={"request_id": f"{engine_id}/q3"}, headers=ADMIN
    ).json()
    assert stats["input_token_count"] == 53 and stats["output_token_count"] == 8
    assert stats["cached_token_count"] == 32 and stats["computed_token_count"] == 53 - 32 + 7
    timeline = api.get(f"/api/v1/requests/{engine_id}/q3/timeline", headers=ADMIN).json()
    assert [(s["start"], s["end"], s["status"], s["kind"]) for s in timeline["segments"]] == [
        (0, 32, "cached", "prompt"),
        (32, 53, "computed", "prompt"),
        (53, 61, "computed", "output"),
    ]
    cost = {
        r["tenant"]: r for r in api.get("/api/v1/cost", params={"mode": "list"}, headers=ADMIN).json()["rows"]
    }
    assert cost["t0"]["requests"] == 6 and cost["t1"]["requests"] == 6
    assert cost["t0"]["input_tokens"] + cost["t1"]["input_tokens"] == sum(50 + i for i in range(12)) - 4 * 32
    usage = api.get("/api/v1/usage", headers=ADMIN).json()["rows"]
    assert sum(r["requests"] for r in usage) == 12


def test_ingest_command_publishes_and_reports_bad_lines(kafka_cfg: Config, tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    good = {
        "id": "a",
        "model": "tiny",
        "arrival": 1_714_564_800,
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    path.write_text(json.dumps(good) + "\n" + "not json\n")
    env = to_env(kafka_cfg)
    result = CliRunner().invoke(main, ["ingest", str(path), "--tenant", "acme"], env=env)
    assert result.exit_code == 1, result.output  # a skipped line is not success
    assert "jsonl: 2 records read, 1 requests, 4 events published" in result.output
    assert "skipped line 2: not valid JSON" in result.output
    assert f"1 bad lines skipped; 1 sent to {kafka_cfg.topics.dlq}" in result.output
    (dead,) = [r[3] for r in read_topic(kafka_cfg, kafka_cfg.topics.dlq, quiet_s=0.5)]
    assert (dead["component"], dead["offset"], dead["value"]) == ("ingest", 2, b"not json\n")
    records = read_topic(kafka_cfg, kafka_cfg.topics.engine_events, quiet_s=0.5)
    assert [ev.payload_type(r[3]) for r in sorted(records, key=lambda r: r[1])] == [
        ev.ENGINE_STARTED,
        ev.REQUEST_STARTED,
        ev.REQUEST_FINISHED,
        ev.ENGINE_STOPPED,
    ]
    assert {r[2] for r in records} == {b"trace-small"}
    started = next(r[3] for r in records if ev.payload_type(r[3]) == ev.REQUEST_STARTED)
    assert ev.payload(started)["tenant"] == "acme"
    strict = CliRunner().invoke(main, ["ingest", str(path), "--strict"], env=env)
    assert strict.exit_code == 2 and "nothing was published" in strict.output


def test_analyze_job_writes_the_reports_sparseety_analyze_writes(
    kafka_cfg: Config, api: TestClient, tmp_path: Path
) -> None:
    from sparseety.offline.analyze import Options, analyze
    from tests.recorded import DATA

    inputs = [str(DATA / "vllm_log" / "server.log"), str(DATA / "vllm_log" / "plugin-events.bin")]
    job = run_job(api, {"kind": "analyze", "inputs": inputs, "out": str(tmp_path / "api"), "model": "tiny"})
    direct = analyze(kafka_cfg, inputs, tmp_path / "cli", opts=Options(model="tiny"))
    result = job["result"]
    assert result["analysed"] == 2 and result["failed"] == 0
    assert result["totals"] == direct.totals and result["totals"]["requests"] > 0
    assert len(result["duplicates"]) == len(direct.duplicates) == 8  # the log's copies, counted once
    for name in ("summary.json", "server.log.json", "plugin-events.bin.json"):
        api_file, cli_file = tmp_path / "api" / name, tmp_path / "cli" / name
        assert json.loads(api_file.read_text())["totals"] == json.loads(cli_file.read_text())["totals"]
    # a rerun skips both finished inputs; a missing input is refused before any job runs
    again = run_job(api, {"kind": "analyze", "inputs": inputs, "out": str(tmp_path / "api")})
    assert again["result"]["skipped_finished"] == 2
    r = api.post(
        "/api/v1/collect",
        json={"kind": "analyze", "inputs": [str(tmp_path / "none.bin")], "out": str(tmp_path)},
        headers=ADMIN,
    )
    assert r.status_code == 400 and "no trace file" in r.json()["message"]
