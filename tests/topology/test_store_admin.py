"""Issue 21: prices, the schema status and your own SQL on a running stack. ``sparseety store``
(a real process owning the embedded store, its sink reading a real broker) serves them to the CLI
through its admin-only API; a tenant's token reads only its rows with ``sparseety sql``."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from sparseety.api.auth import read_admin_token
from sparseety.config import Config
from tests.helpers import wait_for
from tests.topology.test_api_store_process import N, cli, produce, started, store_process


@pytest.fixture
def cfg(kafka_cfg: Config) -> Config:
    return kafka_cfg.replace(api={"host": "127.0.0.1", "port": 0, "tokens": {"tok-acme": ["acme"]}})


def test_prices_status_and_sql_while_the_store_runs(cfg: Config, tmp_path: Path) -> None:
    store = store_process(cfg, tmp_path / "store.log")
    try:
        url = started(store, cfg)
        produce(cfg)
        admin = {"Authorization": f"Bearer {read_admin_token(cfg.data_path)}"}

        def stored() -> bool:
            r = httpx.get(f"{url}/api/v1/requests", params={"limit": 100}, headers=admin, timeout=10)
            return r.status_code == 200 and len(r.json()["rows"]) == N

        wait_for(stored, 90, 0.5, "the sink to store the records")
        db = cfg.clickhouse.database

        # prices: set one, load a file, list them: all through the store process
        out = cli(cfg, "prices", "set", "--model", "tiny", "--class", "input", "--usd", "10")
        assert out.returncode == 0, out.stderr
        (tmp_path / "p.toml").write_text('[[prices]]\nmodel = "tiny"\noutput = "40"\ncached_input = "2.5"\n')
        out = cli(cfg, "prices", "load", str(tmp_path / "p.toml"))
        assert out.returncode == 0 and out.stdout.startswith("2 prices set"), out.stderr
        out = cli(cfg, "prices", "list", "--format", "json")
        assert out.returncode == 0, out.stderr
        listed = {(p["token_class"], Decimal(p["usd"])) for p in json.loads(out.stdout)}
        assert listed == {("input", Decimal(10)), ("output", Decimal(40)), ("cached_input", Decimal("2.5"))}
        # the running store prices with them at once
        out = cli(cfg, "query", "cost", "--mode", "list", "--format", "json")
        assert out.returncode == 0, out.stderr
        assert all(Decimal(r["cost_usd"]) > 0 and r["unpriced_requests"] == 0 for r in json.loads(out.stdout))
        # a bad price is the store's answer, said as such
        out = cli(cfg, "prices", "set", "--model", "tiny", "--class", "input", "--usd", "0.0000001")
        assert out.returncode != 0 and "six decimals" in out.stderr

        out = cli(cfg, "db", "status", "--format", "json")
        assert out.returncode == 0, out.stderr
        assert all(m["applied"] and m["checksum_ok"] for m in json.loads(out.stdout))

        # your own SQL: the admin sees every tenant, a tenant's token only its own
        sql = f"SELECT tenant, count() AS n FROM {db}.requests_v GROUP BY tenant ORDER BY tenant"
        out = cli(cfg, "sql", sql, "--format", "json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [{"tenant": "acme", "n": N // 2}, {"tenant": "globex", "n": N // 2}]
        out = cli(cfg, "sql", sql, "--format", "json", "--token", "tok-acme")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [{"tenant": "acme", "n": N // 2}]
        out = cli(cfg, "sql", f"DROP TABLE {db}.prices")
        assert out.returncode != 0 and "one SELECT" in out.stderr

        # the prices and schema routes are the admin's
        acme = {"Authorization": "Bearer tok-acme"}
        r = httpx.post(
            f"{url}/api/v1/prices",
            json={"prices": [{"model": "tiny", "token_class": "input", "usd": "0"}]},
            headers=acme,
            timeout=10,
        )
        assert r.status_code == 403, r.text
        assert httpx.get(f"{url}/api/v1/db/status", headers=acme, timeout=10).status_code == 403
    finally:
        store.stop()
