"""The security tier's store and API: the crafted data set of tests/unit/test_api_data.py (acme,
globex, initech; prices, usage windows, a dead letter) plus raw token ids for an acme and a
globex request, on real chDB, served by the real API app under uvicorn (a thread of the test
process) with tokens for a tenant, a tenant with ``token_ids``, an all-tenant token without it,
and an all-tenant token with it. Tenant limits are tightened so that a heavy query reaches them
in seconds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from sparseety import events as ev
from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.server import ApiServer
from sparseety.config import ApiToken, Config
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store
from tests.unit.test_api_data import seed

TOKENS: dict[str, Any] = {
    "tok-acme": ["acme"],
    "tok-acme-ids": ApiToken(tenants=["acme"], token_ids=True),
    "tok-globex": ["globex"],
    "tok-all": ["*"],
    "tok-all-ids": ApiToken(tenants=["*"], token_ids=True),
}
#: The tenant limits of this tier: a cross join of two 450k-row sets takes ~50 s here.
TENANT_LIMITS = {"max_execution_time_s": 3.0, "max_memory_bytes": 512 << 20, "max_concurrent": 1}
#: A query that runs far longer than any limit here, read from no table.
HEAVY = "SELECT count() FROM (SELECT arrayJoin(range({n})) a) x, (SELECT arrayJoin(range({n})) b) y"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return chdb_config(
        tmp_path_factory,
        data_dir=str(tmp_path_factory.mktemp("security")),
        api={"limits": {"tenant": TENANT_LIMITS, "readers": 4}},
    )


@pytest.fixture(scope="module")
def store(cfg: Config) -> Iterator[Store]:
    with throwaway_store(cfg) as s:
        seed(s)
        sink = ClickHouseSink(s)
        for i, tenant in enumerate(("acme", "globex")):
            rec = f.accounting(
                f"{f.EID}/ids-{tenant}",
                tenant=tenant,
                token_privacy="raw",
                prompt_token_ids=[11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
                output_token_ids=[21, 22, 23],
                finished_ts_ns=time.time_ns(),  # request_tokens' TTL drops rows 30 days old
            )
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="ids", partition=0, offset=i)
        sink.flush()
        sink.close()
        yield s


@dataclass
class Api:
    url: str
    backend: Backend
    store: Store

    def get(self, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=auth(token) if token else {}, timeout=30, **kw)

    def sql(self, sql: str, token: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + "/api/v1/sql", json={"sql": sql}, headers=auth(token), timeout=60, **kw)


@pytest.fixture(scope="module")
def api(cfg: Config, store: Store) -> Iterator[Api]:
    """The app served as ``sparseety store`` serves it (:class:`ApiServer`, access log on)."""
    backend = Backend(cfg, store, tokens=TokenTable(TOKENS))
    ready = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        server = ApiServer(create_api(backend), host="127.0.0.1", port=0, access_log=True, log_level="info")
        box["url"] = await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(30), "the API did not start"
    try:
        yield Api(box["url"], backend, store)
    finally:
        stop.set()
        thread.join(30)
        backend.close()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
