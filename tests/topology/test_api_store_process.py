"""The two process models, as real processes: ``sparseety store`` (Faust sink + API in one process,
owning the embedded store) serving what its sink writes, the CLI's queries going through it while
it owns the store, and ``sparseety api`` alone over the same store afterwards."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparseety.api.auth import read_admin_token
from sparseety.api.client import RemoteQueries
from sparseety.api.server import read_endpoint
from sparseety.config import Config, to_env
from sparseety.kafka import make_encoder, make_producer
from tests import factories as f
from tests.helpers import VENV_BIN, ComponentProcess, wait_for

S = 10**9
T0 = 1_700_000_000 * S
N = 12


@pytest.fixture
def cfg(kafka_cfg: Config) -> Config:
    return kafka_cfg.replace(api={"host": "127.0.0.1", "port": 0, "tokens": {"tok-acme": ["acme"]}})


def cli(cfg: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update(to_env(cfg))
    return subprocess.run(
        [str(VENV_BIN / "sparseety"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def store_process(cfg: Config, log: Path) -> ComponentProcess:
    """``sparseety store``, started."""
    return ComponentProcess(cfg, ["store", "--session-timeout", "6", "--loglevel", "warning"], log).start()


def started(proc: ComponentProcess, cfg: Config) -> str:
    def ready() -> str | None:
        assert proc.alive(), proc.tail()
        found = read_endpoint(cfg.data_path)
        return str(found["url"]) if found else None

    url = wait_for(ready, 90, 0.3, "the API endpoint record")
    return str(url)


def produce(cfg: Config) -> list[dict[str, Any]]:
    enc = make_encoder(cfg, "RequestAccounting", cfg.topics.timelines)
    producer = make_producer(cfg)
    records = [
        f.accounting(f"{f.EID}/r{i}", tenant=("acme", "globex")[i % 2], finished_ts_ns=T0 + i * S)
        for i in range(N)
    ]
    for rec in records:
        producer.produce(cfg.topics.timelines, key=rec["request_uid"].encode(), value=enc.encode(rec))
    assert producer.flush(30) == 0
    return records


def test_store_process_serves_its_sink_and_the_cli_goes_through_it(cfg: Config, tmp_path: Path) -> None:
    store = store_process(cfg, tmp_path / "store.log")
    try:
        url = started(store, cfg)
        admin = read_admin_token(cfg.data_path)
        assert admin
        token_file = cfg.data_path / "api" / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        records = produce(cfg)
        headers = {"Authorization": f"Bearer {admin}"}

        def stored() -> bool:
            r = httpx.get(f"{url}/api/v1/requests", params={"limit": 100}, headers=headers, timeout=10)
            assert r.status_code == 200, r.text
            return len(r.json()["rows"]) == N

        wait_for(stored, 90, 0.5, "the sink to store the records")
        api_cost = httpx.get(f"{url}/api/v1/cost", headers=headers, timeout=10).json()["rows"]
        assert {r["tenant"]: r["requests"] for r in api_cost} == {"acme": N // 2, "globex": N // 2}
        # a tenant token sees its own rows only, and another tenant's request as missing
        acme = {"Authorization": "Bearer tok-acme"}
        mine = httpx.get(f"{url}/api/v1/cost", headers=acme, timeout=10).json()["rows"]
        assert [r["tenant"] for r in mine] == ["acme"]
        theirs = httpx.get(
            f"{url}/api/v1/tokens/statistics", params={"request_id": f"{f.EID}/r1"}, headers=acme, timeout=10
        )
        assert theirs.status_code == 404
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
        assert f"sparseety:sink_records_total {float(N)}" in metrics
        assert "sparseety:store_up 1.0" in metrics

        # the CLI cannot open the store (this process owns it): it goes through the API
        out = cli(cfg, "query", "cost", "--format", "json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert {r["tenant"]: (r["requests"], Decimal(r["cost_usd"])) for r in rows} == {
            r["tenant"]: (r["requests"], Decimal(r["cost_usd"])) for r in api_cost
        }
        out = cli(cfg, "query", "tokens", records[3]["request_uid"], "--format", "json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["input_token_count"] == records[3]["prompt_tokens"]
    finally:
        store.stop()
    assert store.proc is not None and store.proc.returncode is not None, store.tail()
    assert read_endpoint(cfg.data_path) is None, "the store process left its endpoint record"
    assert read_admin_token(cfg.data_path) is None, "the store process left its admin token"

    # the API alone over the same store, now that no sink runs
    api = ComponentProcess(cfg, ["api", "--loglevel", "warning"], tmp_path / "api.log")
    api.start()
    try:
        url = started(api, cfg)
        with RemoteQueries.from_config(cfg) as remote:
            assert remote.base_url == url
            assert sum(r["requests"] for r in remote.cost()) == N
            assert remote.tokens_statistics(records[0]["request_uid"]) is not None
    finally:
        api.stop()


def test_an_open_api_refuses_a_non_loopback_address(kafka_cfg: Config) -> None:
    cfg = kafka_cfg.replace(api={"host": "0.0.0.0", "port": 0, "tokens": {}})
    out = cli(cfg, "api")
    assert out.returncode == 2
    assert "refusing to serve the API open on 0.0.0.0" in out.stderr
