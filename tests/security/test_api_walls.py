"""Issue 30, findings 1-3 and 5 through the running API (uvicorn, real chDB): the ClickHouse
interface and ``/api/v1/sql`` refuse host files and settings; one heavy query freezes nothing
(``/healthz``, another tenant and the sink's writes answer meanwhile), stops at its limits and
when its client goes away; a token's queries at once are capped; bodies are capped before
authentication; tokens never reach the access log; the batch route answers 400, not 500."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import clickhouse_connect
import httpx
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from sparseety import events as ev
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.security.conftest import HEAVY, Api, wait_until


def ch_client(api: Api, token: str) -> Any:
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    return clickhouse_connect.get_client(
        host=host, port=int(port), username="x", password=token, proxy_path="/clickhouse"
    )


def running(api: Api, marker: str) -> int:
    """How many statements whose text holds ``marker`` the store runs now."""
    rows = api.store.query(
        "SELECT count() AS n FROM system.processes WHERE position(query, {m:String}) > 0 "
        "AND position(query, 'system.processes') = 0",
        {"m": marker},
    )
    return int(rows[0]["n"])


def test_the_clickhouse_interface_reads_no_host_file(api: Api) -> None:
    ch = ch_client(api, "tok-all")
    for sql, why in [
        ("SELECT substring(file('/etc/passwd'), 1, 20)", "function file"),
        ("SELECT getSetting('readonly') AS r) SETTINGS readonly=0 --", "does not parse"),
        ("SELECT 'x' AS x INTO OUTFILE '/tmp/sparseety-ch-probe'", "INTO OUTFILE"),
        ("SELECT * FROM url('http://127.0.0.1:9/', 'CSV')", "table function url"),
    ]:
        with pytest.raises(DatabaseError, match=why):
            ch.query(sql)
    assert not Path("/tmp/sparseety-ch-probe").exists()
    assert ch.query("SELECT getSetting('readonly')").result_rows == [(2,)]
    # the same through /api/v1/sql, with the API's error shape
    r = api.sql("SELECT file('/proc/self/environ')", "tok-all")
    assert r.status_code == 400 and "function file" in r.json()["message"]
    r = api.sql("SELECT 1 AS x SETTINGS readonly = 0", "tok-all")
    assert r.status_code == 400 and "SETTINGS" in r.json()["message"]


def test_a_heavy_query_freezes_nothing_and_stops_at_its_limit(api: Api) -> None:
    heavy = HEAVY.format(n=450_001)
    answer: dict[str, Any] = {}

    def tenant_query() -> None:
        started = time.monotonic()
        answer["r"] = api.sql(heavy, "tok-acme")
        answer["s"] = time.monotonic() - started

    t = threading.Thread(target=tenant_query)
    t.start()
    wait_until(lambda: running(api, "450001") == 1, 10, "the heavy query to run")
    # meanwhile: /healthz, another tenant's query, an admin's query and a sink write all answer
    for _ in range(5):
        started = time.monotonic()
        assert api.get("/healthz").status_code == 200
        assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert api.get("/api/v1/requests", "tok-globex").status_code == 200
    assert api.sql(f"SELECT count() FROM {api.store.database}.requests_v", "tok-all").status_code == 200
    sink = ClickHouseSink(api.store)
    during = f.accounting(f"{f.EID}/during", tenant="initech")
    sink.add(ev.REQUEST_ACCOUNTING, during, topic="w", partition=0, offset=0)
    sink.flush()
    sink.close()
    assert time.monotonic() - started < 2.0
    assert api.sql(
        f"SELECT count() FROM {api.store.database}.requests WHERE request_uid = '{f.EID}/during'", "tok-all"
    ).json()["rows"] == [[1]]
    t.join(30)
    # the tenant's limit (3 s in this tier) stopped it, with a message that names it
    assert answer["r"].status_code == 400, answer["r"].text
    assert (
        answer["r"].json()["error"] == "query_limit" and "Timeout exceeded" in answer["r"].json()["message"]
    )
    assert answer["s"] < 10
    assert running(api, "450001") == 0


def test_a_query_stops_when_its_client_goes_away(api: Api) -> None:
    heavy = HEAVY.format(n=450_002)  # an admin's: its limit (60 s) is far away
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            api.url + "/api/v1/sql",
            json={"sql": heavy},
            headers={"Authorization": "Bearer tok-all"},
            timeout=1.5,
        )
    gone = time.monotonic()
    wait_until(lambda: running(api, "450002") == 0, 5, "the abandoned query to be killed")
    assert time.monotonic() - gone < 5


def test_a_token_runs_its_cap_of_queries_at_once(api: Api) -> None:
    heavy = HEAVY.format(n=450_003)
    first = threading.Thread(target=lambda: api.sql(heavy, "tok-acme"))
    first.start()
    wait_until(lambda: running(api, "450003") == 1, 10, "the first query to run")
    second = api.sql("SELECT 1", "tok-acme")  # max_concurrent 1 in this tier
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"] == "too_many_queries"
    assert api.sql("SELECT 1", "tok-globex").status_code == 200  # another token is not held
    first.join(30)
    assert api.sql("SELECT 1", "tok-acme").status_code == 200  # free again


def test_bodies_are_capped_before_authentication(api: Api) -> None:
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    big = 200 << 20
    # a declared 200 MB body, unauthenticated: answered 413 without a byte of it read
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST /api/v1/sql HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {big}\r\n\r\n".encode()
        )
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply

    # a chunked body past the cap: 413 as soon as it grows past it
    def chunks() -> Any:
        for _ in range(64):
            yield b"x" * (64 << 10)

    r = httpx.post(api.url + "/api/v1/sql", content=chunks(), timeout=30)
    assert r.status_code == 413
    # authenticated: the body cap, then the SQL text's own
    r = httpx.post(
        api.url + "/api/v1/sql",
        content=b"{" + b" " * (2 << 20) + b"}",
        headers={"Authorization": "Bearer tok-all"},
    )
    assert r.status_code == 413
    r = api.sql("SELECT '" + "x" * (300 << 10) + "'", "tok-all")
    assert r.status_code == 400 and "max_sql_bytes" in r.json()["message"]


def test_the_batch_route_answers_400_without_an_id(api: Api) -> None:
    r = api.get("/api/v1/requests/batch", "tok-acme")
    assert r.status_code == 400 and r.json()["error"] == "bad_parameter", r.text
    r = api.get("/api/v1/requests/batch", "tok-acme", params={"request_id": f"{f.EID}/r1"})
    assert r.status_code == 200


def test_tokens_never_reach_the_access_log(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        r = httpx.get(
            api.url + "/clickhouse", params={"query": "SELECT 1", "password": "tok-all"}, timeout=10
        )
        assert r.status_code == 200 and r.text == "1\n"
        httpx.get(api.url + "/clickhouse/ping?user=x&password=tok-all-ids", timeout=10)
        wait_until(lambda: sum("/clickhouse" in r.getMessage() for r in caplog.records) >= 2, 5, "the log")
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert lines and all("tok-all" not in line for line in lines), lines
    assert any("password=***" in line for line in lines), lines
