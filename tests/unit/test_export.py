"""Exports (issue 14 part 5): every registry query to Parquet and CSV, from the library, the HTTP API
(streamed) and the CLI; the Parquet files read back with pyarrow equal the rows the JSON answers
carry (money as exact decimals, times as UTC)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.client import RemoteQueries
from sparseety.api.encode import decode_rows
from sparseety.cli import main
from sparseety.config import Config
from sparseety.queries.registry import BY_NAME, QUERIES, Queries, Scope
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import store_fixtures
from tests.unit.test_api_data import seed, uid

ARGS: dict[str, dict[str, Any]] = {"cost": {"mode": "amortized", "by": ["tenant", "model"], "bucket": "1h"}}


def parquet(data: bytes | None) -> list[dict[str, Any]]:
    assert data is not None and data[:4] == b"PAR1"
    return pq.read_table(io.BytesIO(data)).to_pylist()  # type: ignore[no-any-return]


cfg, store = store_fixtures(seed, "export")


@pytest.fixture(scope="module")
def client(cfg: Config, store: Store) -> Iterator[TestClient]:
    backend = Backend(cfg, store, tokens=TokenTable({"tok-admin": ["*"], "tok-acme": ["acme"]}))
    with TestClient(create_api(backend)) as c:
        yield c
    backend.close()


@pytest.mark.parametrize("spec", [q for q in QUERIES if q.key is None], ids=lambda q: q.name)
def test_every_sql_query_exports_through_clickhouse_and_reads_back(store: Store, spec: Any) -> None:
    q = Queries(store)
    args = ARGS.get(spec.name, {})
    rows = q.ask(spec, **args)
    assert parquet(q.export(spec, "parquet", **args)) == rows
    table = list(csv.DictReader(io.StringIO((q.export(spec, "csv", **args) or b"").decode())))
    assert len(table) == len(rows)
    if rows:
        assert list(table[0]) == list(rows[0])


def test_money_is_exact_and_scope_applies(store: Store) -> None:
    q = Queries(store)
    rows = parquet(q.export(BY_NAME["cost"], "parquet", mode="actual", scope=Scope(tenants=("acme",))))
    assert [r["tenant"] for r in rows] == ["acme"]
    assert rows == q.cost(mode="actual", scope=Scope(tenants=("acme",)))
    assert str(rows[0]["cost_usd"]).startswith("0.00338")  # Decimal(38, 12), not a float


def test_a_request_exports_its_timeline(store: Store) -> None:
    q = Queries(store)
    got = parquet(q.export(BY_NAME["request"], "parquet", key=uid("e1", "r1")))
    assert got == q.request(uid("e1", "r1"))["segments"]
    assert q.export(BY_NAME["request"], "parquet", key="nope") is None


def test_the_api_streams_files_and_the_remote_client_reads_them(client: TestClient, store: Store) -> None:
    admin = {"Authorization": "Bearer tok-admin"}
    r = client.get("/api/v1/cost", params={"format": "parquet", "mode": "list"}, headers=admin)
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.apache.parquet"
    assert 'filename="cost.parquet"' in r.headers["content-disposition"]
    body = client.get("/api/v1/cost", params={"mode": "list"}, headers=admin).json()
    assert parquet(r.content) == decode_rows(body["rows"])
    r = client.get(
        "/api/v1/timelines", params={"format": "csv"}, headers={"Authorization": "Bearer tok-acme"}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert {row["tenant"] for row in csv.DictReader(io.StringIO(r.text))} == {"acme"}
    bad = client.get("/api/v1/cost", params={"format": "xlsx"}, headers=admin)
    assert bad.status_code == 400 and "unknown export format" in bad.json()["message"]
    missing = client.get("/api/v1/requests/nope", params={"format": "parquet"}, headers=admin)
    assert missing.status_code == 404
    remote = RemoteQueries("http://testserver", "tok-admin", client=client)
    local = Queries(store)
    for name in ("requests", "timelines", "duplication", "duplicated_blocks", "cost"):
        spec = BY_NAME[name]
        assert parquet(remote.export(spec, "parquet")) == parquet(local.export(spec, "parquet")), name
    assert parquet(remote.export(BY_NAME["request"], "parquet", key=uid("e1", "r1"))) == parquet(
        local.export(BY_NAME["request"], "parquet", key=uid("e1", "r1"))
    )
    assert remote.export(BY_NAME["request"], "parquet", key="nope") is None


def test_cli_writes_parquet_and_csv_files(cfg: Config, store: Store, tmp_path: Path) -> None:
    env = {"SPARSEETY_CLICKHOUSE_DSN": cfg.clickhouse_dsn, "SPARSEETY_CLICKHOUSE_DATABASE": store.database}
    out = tmp_path / "requests.parquet"
    result = CliRunner().invoke(
        main, ["query", "requests", "--format", "parquet", "--output", str(out)], env=env
    )
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).to_pylist() == Queries(store).requests()
    out = tmp_path / "timeline.csv"
    result = CliRunner().invoke(
        main, ["query", "request", uid("e1", "r1"), "--format", "csv", "--output", str(out)], env=env
    )
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert [int(r["start"]) for r in rows] == [
        s["start"] for s in Queries(store).request(uid("e1", "r1"))["segments"]
    ]
    result = CliRunner().invoke(main, ["query", "cost", "--format", "parquet"], env=env)
    assert result.exit_code == 2 and "--output" in result.output
    result = CliRunner().invoke(main, ["query", "cost", "--output", str(out)], env=env)
    assert result.exit_code == 2 and "parquet or csv" in result.output
