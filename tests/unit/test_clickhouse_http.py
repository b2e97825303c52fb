"""The embedded store on ClickHouse's HTTP interface (issue 21), with clickhouse-connect as the
client: the real API app under uvicorn over a real chDB store, answering the queries a ClickHouse
client sends (its handshake, Native results, server-side parameters), read-only, and only to an
all-tenant token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import clickhouse_connect
import httpx
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.queries.registry import Queries
from tests import factories as f
from tests.helpers import chdb_config, serving, throwaway_store, write_accounting

TOKENS = {"tok-admin": ["*"], "tok-acme": ["acme"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Any]]:
    cfg = chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("ch-http")))
    with throwaway_store(cfg) as store:
        tenants = ["acme", "acme", "globex"]
        write_accounting(
            store,
            [f.accounting(f"{f.EID}/r{i}", tenant=t, prompt_tokens=10 + i) for i, t in enumerate(tenants)],
        )
        backend = Backend(cfg, store, tokens=TokenTable(TOKENS))
        try:
            with serving(create_api(backend), "the API") as url:
                yield int(url.rsplit(":", 1)[1]), store
        finally:
            backend.close()


def client(port: int, token: str) -> Any:
    return clickhouse_connect.get_client(
        host="127.0.0.1", port=port, username="sparseety", password=token, proxy_path="/clickhouse"
    )


def test_clickhouse_connect_reads_the_embedded_store(server: tuple[int, Any]) -> None:
    port, store = server
    ch = client(port, "tok-admin")  # its handshake: version(), system.settings, a Native check
    db = store.database
    result = ch.query(
        f"SELECT tenant, count() AS n, sum(prompt_tokens) AS p FROM {db}.requests_v "
        "WHERE prompt_tokens >= {least:UInt32} GROUP BY tenant ORDER BY tenant",
        parameters={"least": 10},
    )
    assert result.column_names == ("tenant", "n", "p")
    # the same rows the store answers in process, and what was written
    inproc = store.query(
        f"SELECT tenant, count() AS n, sum(prompt_tokens) AS p FROM {db}.requests_v "
        "WHERE prompt_tokens >= 10 GROUP BY tenant ORDER BY tenant"
    )
    assert result.result_rows == [tuple(r.values()) for r in inproc] == [("acme", 2, 21), ("globex", 1, 12)]
    assert ch.command("SELECT count() FROM " + f"{db}.requests_v") == 3
    assert ch.query("SELECT {s:String} AS s", parameters={"s": "a'b\\c\tx"}).result_rows == [("a'b\\c\tx",)]
    got = ch.query("SELECT {l:Array(String)} AS l", parameters={"l": ["a'b", "c"]}).result_rows
    assert got == [(["a'b", "c"],)]
    assert httpx.get(f"http://127.0.0.1:{port}/clickhouse/ping").text == "Ok.\n"


def test_it_is_read_only_and_for_all_tenant_tokens(server: tuple[int, Any]) -> None:
    port, store = server
    ch = client(port, "tok-admin")
    with pytest.raises(DatabaseError, match="read-only"):
        ch.command(f"INSERT INTO {store.database}.prices VALUES ('m', 'input', 0, 1, '')")
    # a query is one SELECT of the store's tables: no table function reads outside the store
    with pytest.raises(DatabaseError, match="table function file"):
        ch.query("SELECT * FROM file('/etc/hostname', 'LineAsString')")
    with pytest.raises(DatabaseError, match="Multi-statements are not allowed"):
        ch.query("SELECT 1; DROP TABLE x")
    with pytest.raises(DatabaseError, match="all-tenant tokens"):
        client(port, "tok-acme")
    with pytest.raises(DatabaseError, match="authentication failed"):
        client(port, "tok-nobody")
    assert Queries(store).requests(limit=10)  # the store still serves its own queries
