"""Token records (issue 14 part 1): ids stored as the privacy mode allows, restored per run or per
position with text from the model's local tokenizer; tenant scoping and the token_ids permission;
the same answer from the library, the HTTP route, the remote client and the CLI."""

from __future__ import annotations

import json
import time
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
from sparseety.api.client import RemoteQueries
from sparseety.cli import main
from sparseety.config import ApiToken, Config, load_config
from sparseety.errors import ConfigError
from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate, set_retention
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.stack.tiny_models import build_tiny_model
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store

MODEL_CACHE = Path("~/.cache/sparseety-tiny-models").expanduser()
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
OUTPUT = [21, 22, 23]
HASHES = [-(1 << 62) + i for i in range(10)]
TOKENS: dict[str, Any] = {
    "tok-admin": ["*"],
    "tok-acme-content": ApiToken(tenants=["acme"], token_ids=True),
    "tok-acme": ["acme"],
}


@pytest.fixture(scope="module")
def model() -> str:
    """A model whose tokenizer is on this machine (the tiny Llama: a local path)."""
    return str(build_tiny_model("llama", MODEL_CACHE / "llama"))


def uid(r: str) -> str:
    return f"{f.EID}/{r}"


def records(model: str) -> list[dict[str, Any]]:
    now = time.time_ns()  # request_tokens' TTL drops rows that finished 30 days ago at insert
    base = {"tenant": "acme", "model": model, "finished_ts_ns": now}
    return [
        f.accounting(
            uid("raw"), **base, token_privacy="raw", prompt_token_ids=PROMPT, output_token_ids=OUTPUT
        ),
        f.accounting(
            uid("hashed"),
            **base,
            token_privacy="hashed",
            prompt_token_ids=[],
            prompt_token_hashes=HASHES,
            output_token_ids=[],
        ),
        f.accounting(uid("none"), **base, token_privacy="none", prompt_token_ids=[], output_token_ids=[]),
        f.accounting(uid("old"), **base, token_privacy="", prompt_token_ids=[], output_token_ids=[]),
        f.accounting(uid("other"), **{**base, "tenant": "globex"}),
    ]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("tokens")))


@pytest.fixture(scope="module")
def store(cfg: Config, model: str) -> Iterator[Store]:
    with throwaway_store(cfg) as s:
        migrate(s)
        sink = ClickHouseSink(s)
        for i, rec in enumerate(records(model)):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="t", partition=0, offset=i)
        sink.flush()
        yield s


@pytest.fixture(scope="module")
def client(cfg: Config, store: Store) -> Iterator[TestClient]:
    backend = Backend(cfg, store, tokens=TokenTable(TOKENS))
    with TestClient(create_api(backend)) as c:
        yield c
    backend.close()


def test_raw_ids_are_restored_with_text_run_length_and_per_position(store: Store, model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    got = Queries(store).token_records(uid("raw"))
    assert got["privacy"] == "raw" and got["content"] == "ids" and got["tokenizer"] == model
    assert got["prompt_token_ids"] == PROMPT and got["output_token_ids"] == OUTPUT
    assert got["prompt_text"] == tok.decode(PROMPT, skip_special_tokens=True)
    assert got["output_text"] == tok.decode(OUTPUT, skip_special_tokens=True)
    runs = got["records"]
    segments = f.accounting()["timeline"]["segments"]
    assert [(r["position"], r["count"]) for r in runs] == [
        (s["start"], s["end"] - s["start"]) for s in segments
    ]
    assert [r["token_ids"] for r in runs] == [PROMPT[:4], PROMPT[4:], OUTPUT]
    assert [(r["is_input"], r["is_output"], r["is_cached"], r["status"]) for r in runs] == [
        (True, False, True, "cached"),
        (True, False, False, "computed"),
        (False, True, False, "computed"),
    ]
    assert all(r["kv_fate"] == "kept" and not r["is_draft"] for r in runs)
    assert runs[0]["source_request_uid"] == uid("r0")
    each = Queries(store).token_records(uid("raw"), per_position=True)["records"]
    assert [r["position"] for r in each] == list(range(13))
    assert [r["token_id"] for r in each] == PROMPT + OUTPUT
    assert [r["text"] for r in each] == [tok.decode([t], skip_special_tokens=True) for t in PROMPT + OUTPUT]


def test_privacy_modes_and_the_permission_decide_the_content(store: Store) -> None:
    q = Queries(store)
    hashed = q.token_records(uid("hashed"))
    assert (hashed["privacy"], hashed["content"], hashed["prompt_token_hashes"]) == (
        "hashed",
        "hashes",
        HASHES,
    )
    assert hashed["prompt_token_ids"] is None and hashed["records"][0]["token_hashes"] == HASHES[:4]
    assert hashed["records"][2]["token_hashes"] is None  # outputs are not stored in mode hashed
    none = q.token_records(uid("none"))
    assert (none["privacy"], none["content"]) == ("none", "counts") and "privacy mode none" in none["note"]
    old = q.token_records(uid("old"))  # written before token records: no row at all
    assert old["privacy"] is None and old["content"] == "counts"
    counts = q.token_records(uid("raw"), allowed=False)
    assert counts["content"] == "counts" and "token_ids permission" in counts["note"]
    assert all(r["token_ids"] is None and r["text"] is None for r in counts["records"])
    assert [r["count"] for r in counts["records"]] == [4, 6, 3]  # counts and statuses stay
    assert q.token_records(uid("raw"), scope=Scope(tenants=("globex",))) is None
    assert q.token_records("nope") is None


def test_the_route_needs_the_token_ids_permission_for_content(client: TestClient, store: Store) -> None:
    path = f"/api/v1/requests/{uid('raw')}/tokens"
    flagged = client.get(path, headers={"Authorization": "Bearer tok-acme-content"}).json()
    assert flagged["content"] == "ids" and flagged["prompt_token_ids"] == PROMPT
    plain = client.get(path, headers={"Authorization": "Bearer tok-acme"}).json()
    assert plain["content"] == "counts" and plain["prompt_token_ids"] is None
    admin = client.get(path, headers={"Authorization": "Bearer tok-admin"}).json()
    assert admin["content"] == "counts"  # all tenants, but not flagged
    other = client.get(
        f"/api/v1/requests/{uid('other')}/tokens", headers={"Authorization": "Bearer tok-acme"}
    )
    assert other.status_code == 404 and other.json()["message"] == f"no request {uid('other')!r}"
    # the request detail route (a catch-all path) still answers its own path
    assert client.get(f"/api/v1/requests/{uid('raw')}", headers={"Authorization": "Bearer tok-admin"}).json()[
        "request_uid"
    ] == uid("raw")
    remote = RemoteQueries("http://testserver", "tok-acme-content", client=client)
    acme = Scope(tenants=("acme",))  # what the token sees (r0, the cache source, is not acme's)
    local = Queries(store).token_records(uid("raw"), scope=acme)
    assert (
        remote.token_records(uid("raw")) == local
        and local["records"][0]["source_request_uid"] == "another tenant"
    )
    assert remote.token_records(uid("raw"), per_position=True) == Queries(store).token_records(
        uid("raw"), scope=acme, per_position=True
    )
    assert remote.token_records(uid("other")) is None


def test_cli_tokens_records(cfg: Config, store: Store) -> None:
    env = {"SPARSEETY_CLICKHOUSE_DSN": cfg.clickhouse_dsn, "SPARSEETY_CLICKHOUSE_DATABASE": store.database}
    result = CliRunner().invoke(
        main, ["query", "tokens", uid("raw"), "--records", "--format", "json"], env=env
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["prompt_token_ids"] == PROMPT
    result = CliRunner().invoke(main, ["query", "tokens", uid("raw"), "--records"], env=env)
    assert result.exit_code == 0 and "is_cached" in result.output and "privacy" in result.output
    stats = CliRunner().invoke(main, ["query", "tokens", uid("raw"), "--format", "json"], env=env)
    assert json.loads(stats.output)["input_token_count"] == 10


def test_retention_is_configurable_per_table(store: Store) -> None:
    def ttl() -> str:
        (row,) = store.query(
            "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'request_tokens'",
            {"db": store.database},
        )
        return str(row["engine_full"])

    assert "toIntervalDay(30)" in ttl()  # the documented default, from the migration
    assert load_config().clickhouse.ttl_days == {"request_tokens": 30}
    assert set_retention(store, {"request_tokens": 30}) == {}  # unchanged: no rewrite
    assert set_retention(store, {"request_tokens": 7}) == {"request_tokens": 7}
    assert "toIntervalDay(7)" in ttl()
    assert set_retention(store, {"request_tokens": 0}) == {"request_tokens": 0}
    assert " TTL " not in f" {ttl()} "
    set_retention(store, {"request_tokens": 30})
    with pytest.raises(ConfigError, match="no retention for table"):
        load_config(clickhouse={"ttl_days": {"kv_blocks": 3}})


def test_token_records_export_to_parquet_and_csv(store: Store, client: TestClient) -> None:
    import csv
    import io

    import pyarrow.parquet as pq

    from sparseety.queries.registry import BY_NAME

    q = Queries(store)
    spec = BY_NAME["token_records"]
    data = q.export(spec, "parquet", key=uid("raw"), per_position=True)
    assert data is not None
    assert (
        pq.read_table(io.BytesIO(data)).to_pylist()
        == q.token_records(uid("raw"), per_position=True)["records"]
    )
    runs = pq.read_table(io.BytesIO(q.export(spec, "parquet", key=uid("raw")) or b"")).to_pylist()
    assert [r["token_ids"] for r in runs] == [PROMPT[:4], PROMPT[4:], OUTPUT]
    r = client.get(
        f"/api/v1/requests/{uid('raw')}/tokens",
        params={"format": "csv", "per_position": "true"},
        headers={"Authorization": "Bearer tok-acme"},
    )
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert r.status_code == 200 and len(rows) == 13
    assert {row["token_id"] for row in rows} == {""}  # no token_ids permission: counts and statuses
