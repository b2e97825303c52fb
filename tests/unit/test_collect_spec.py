"""Issue 21: collect bodies that say what went wrong: the documented ``kind: vllm_log`` is a
kind like the others (the seed's ``trace_source`` still works), and a bad body names the allowed
kinds or its own kind's problem, not pydantic's text for every member of the union. Lines an
ingest refused are counted apart from the pipeline's own dead letters (health, dashboard)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from sparseety import events as ev
from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.config import Config
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store
from tests.unit.test_api_data import seed

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    cfg: Config = chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("collect")))
    with throwaway_store(cfg) as store:
        seed(store)  # one dead letter of the assembler's
        sink = ClickHouseSink(store)
        rejected = f.dead_letter(
            component="ingest", error_type="BadTraceLineError", reason="line 7: not JSON"
        )
        sink.add(ev.DEAD_LETTER, rejected, topic="dlq", partition=0, offset=1)
        sink.flush()
        sink.close()
        backend = Backend(cfg, store, tokens=TokenTable({"adm": ["*"]}))
        with TestClient(create_api(backend)) as c:
            yield c
        backend.close()


def message(client: TestClient, body: object) -> str:
    r = client.post("/api/v1/collect", json=body, headers=ADMIN)
    assert r.status_code == 400, r.text
    return str(r.json()["message"])


def test_kind_vllm_log_is_a_kind(client: TestClient, tmp_path: Path) -> None:
    # both names reach the job's own check (the file), neither is a schema error
    for name in ({"kind": "vllm_log"}, {"trace_source": "vllm_log"}):
        got = message(client, {**name, "log_path": str(tmp_path / "none.log")})
        assert got == f"no log file at {tmp_path / 'none.log'} on the API's machine"


def test_bad_bodies_name_the_allowed_kinds_or_their_problem(client: TestClient) -> None:
    assert message(client, {"kind": "vllm-log", "log_path": "/x"}) == (
        "unknown collect kind 'vllm-log': choose from replay, ingest, analyze, vllm_log "
        "(docs/api.md, Collect jobs)"
    )
    assert "choose from replay, ingest, analyze, vllm_log" in message(client, {"log_path": "/x"})
    replay = message(client, {"kind": "replay"})
    assert replay == "replay.topic: Field required"
    vllm = message(client, {"kind": "vllm_log"})
    assert vllm == "vllm_log.log_path: Field required"


def test_ingest_rejects_are_counted_apart_from_pipeline_dead_letters(client: TestClient) -> None:
    store = client.get("/api/v1/health", headers=ADMIN).json()["store"]
    assert (store["dead_letters"], store["ingest_rejects"]) == (2, 1)
    rows = client.get("/api/v1/dead-letters", params={"component": "ingest"}, headers=ADMIN).json()["rows"]
    assert [(r["component"], r["reason"]) for r in rows] == [("ingest", "line 7: not JSON")]
    assert len(client.get("/api/v1/dead-letters", headers=ADMIN).json()["rows"]) == 2
    page = client.get("/dashboard", headers=ADMIN).text
    assert "dead letters (pipeline)</th><td>1" in page
    assert "ingest rejects (bad lines of ingested files)</th><td>1" in page
    assert "/api/v1/dead-letters?component=ingest" in page
