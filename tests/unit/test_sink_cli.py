"""The sink's command line (db, prices, query) through click, output formats and price files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparseety import events as ev
from sparseety.cli import main
from sparseety.config import load_config
from sparseety.errors import ConfigError
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import Price, prices_from_csv, prices_from_toml
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.sinks.output import render
from tests import factories as f

TOML = """
[[prices]]
model = "tiny"
effective_from = 2023-01-01T00:00:00Z
input = "10"
cached_input = 2.5
output = "40.000001"
gpu_hour = "3.60"
note = "list price"
"""


@pytest.fixture
def env(tmp_path_factory: pytest.TempPathFactory, unique: str) -> Iterator[dict[str, str]]:
    path = tmp_path_factory.getbasetemp() / "chdb-unit"
    db = f"t{unique}"
    yield {"SPARSEETY_CLICKHOUSE_DSN": f"chdb://{path}", "SPARSEETY_CLICKHOUSE_DATABASE": db}
    with Store.open(load_config(clickhouse={"dsn": f"chdb://{path}", "database": db})) as s:
        s.command(f"DROP DATABASE IF EXISTS {db}")


def run(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_a_data_dir_without_a_stack_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "no-stack-here"
    env = {"SPARSEETY_DATA_DIR": str(empty)}
    for args in (("query", "cost"), ("prices", "list"), ("sql", "SELECT 1")):
        code, out = run(env, *args)
        assert code == 2 and f"no store at {empty / 'chdb'}" in out and "sparseety up" in out, out
    assert not empty.exists()  # nothing was created


def test_db_migrate_and_status(env: dict[str, str]) -> None:
    code, out = run(env, "db", "status")
    assert code == 1 and "tables" in out and "no" in out
    code, out = run(env, "query", "cost")
    assert code == 2 and "sparseety db migrate" in out
    code, out = run(env, "db", "migrate")
    assert code == 0 and "applied 001_tables" in out and "applied 002_views" in out
    assert run(env, "db", "migrate")[1].strip().endswith("is up to date")
    code, out = run(env, "db", "status", "--format", "json")
    assert code == 0 and all(m["applied"] and m["checksum_ok"] for m in json.loads(out))


def test_prices_and_queries(env: dict[str, str], tmp_path: Path) -> None:
    assert run(env, "db", "migrate")[0] == 0
    (tmp_path / "p.toml").write_text(TOML)
    code, out = run(env, "prices", "load", str(tmp_path / "p.toml"))
    assert code == 0 and out.startswith(f"4 prices set from {tmp_path / 'p.toml'}\n")
    assert "warning: no stored request has model 'tiny'" in out  # none stored yet
    code, out = run(env, "prices", "set", "--model", "tiny", "--class", "output", "--usd", "40")
    assert code == 0
    listed = json.loads(run(env, "prices", "list", "--format", "json")[1])
    assert {(p["token_class"], p["usd"], p["effective_from"][:4]) for p in listed} == {
        ("input", "10", "2023"),
        ("cached_input", "2.5", "2023"),
        ("output", "40.000001", "2023"),
        ("output", "40", "1970"),
        ("gpu_hour", "3.6", "2023"),
    }
    assert run(env, "prices", "set", "--model", "m", "--class", "input", "--usd", "0.0000001")[0] == 2

    assert run(env, "query", "cost")[1].strip() == "(no rows)"
    cfg = load_config(env=env)
    with Store.open(cfg) as store:
        sink = ClickHouseSink(store)
        for i in range(3):
            rec = f.accounting(f"{f.EID}/r{i}", tenant=f"t{i % 2}", finished_ts_ns=1_700_000_000 * 10**9)
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="t", partition=0, offset=i)
        sink.flush()

    code, out = run(env, "query", "cost", "--by", "tenant", "--mode", "list", "--format", "csv")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == (
        "tenant,requests,sequences,input_tokens,cached_tokens,billed_prompt_tokens,prompt_tokens,"
        "output_tokens,reasoning_output_tokens,reasoning_observed_requests,cost_usd,unpriced_requests,"
        # issue 36's classes: their tokens and what they add (docs/cost-model.md)
        "cache_write_tokens,cache_read_cpu_offload_tokens,cache_read_host_tokens,cache_read_storage_tokens,"
        "external_kv_tokens,image_tokens,audio_tokens,video_tokens,encoder_compute_tokens,"
        "encoder_cache_hit_tokens,modality_premium_usd,encoder_usd,cache_write_premium_usd,tier_read_usd"
    )
    # t0: r0 and r2, each 6 uncached x $10/M + 4 cached x $2.5/M + 3 output x $40.000001/M
    # billed prompt = input + cached = prompt (nothing aborted); reasoning not observed (no
    # parser): empty, not 0; none of issue 36's classes
    assert lines[1] == "t0,2,2,12,8,20,20,6,,0,0.000380000006,0" + ",0" * 10 + ",0,0,0,0"
    code, out = run(
        env, "query", "cost", "--by", "tenant", "--by", "model", "--bucket", "1h", "--since", "2023-11-14"
    )
    assert code == 0 and "t1" in out and "2023-11-14T22:00:00Z" in out
    assert "(no rows)" in run(env, "query", "cost", "--since", "2h")[1]
    assert "(no rows)" in run(env, "query", "cost", "--tenant", "nobody")[1]
    for sub in ("savings", "waste", "spec", "gpu", "usage", "experts", "duplication"):
        code, out = run(env, "query", sub)
        assert code == 0, (sub, out)
    code, out = run(env, "query", "request", f"{f.EID}/r1", "--format", "json")
    assert code == 0
    one = json.loads(out)
    assert one["tenant"] == "t1" and one["cost"]["list"] == "0.000190000003" and len(one["segments"]) == 3
    code, out = run(env, "query", "request", f"{f.EID}/r1")
    assert code == 0 and "cached" in out and "amortized" in out
    # r1's cached prefix was computed by r0, tenant t0: a t1-scoped reader sees no uid.
    assert one["segments"][0]["source_request_uid"] == f"{f.EID}/r0"
    code, out = run(env, "query", "request", f"{f.EID}/r1", "--tenant", "t1", "--format", "json")
    assert json.loads(out)["segments"][0]["source_request_uid"] == "another tenant"
    code, out = run(env, "query", "tokens", f"{f.EID}/r1", "--format", "json")
    assert json.loads(out)["cached_token_count"] == 4
    code, out = run(env, "query", "request", "nope")
    assert code == 1 and "no request" in out
    for bad in ("banana", "12"):  # not a time; an offset is a replay bound, not a time
        code, out = run(env, "query", "cost", "--since", bad)
        assert code == 2 and f"'{bad}' is not a time" in out, out


def test_render_formats() -> None:
    rows = [
        {
            "tenant": "a",
            "cost_usd": Decimal("0.123456789"),
            "share": 0.5,
            "at": datetime(2024, 1, 1, tzinfo=UTC),
        },
        {"tenant": "bb", "cost_usd": Decimal("12"), "share": 0.25, "at": None, "hash": b"\x01"},
    ]
    table = render(rows).splitlines()
    assert table[0].split() == ["tenant", "cost_usd", "share", "at", "hash"]
    # money exact (issue 31: it was rounded to six decimals), the points aligned
    assert table[2].split()[:3] == ["a", "0.123456789", "0.5000"]
    assert table[2].index("0.123456789") + 11 == table[3].index("12.000000000") + 12
    assert json.loads(render(rows, "json"))[0] == {
        "tenant": "a",
        "cost_usd": "0.123456789",
        "share": 0.5,
        "at": "2024-01-01T00:00:00Z",
    }
    assert render(rows, "csv").splitlines()[2] == "bb,12,0.25,,01"
    assert render([], "table") == "(no rows)"
    with pytest.raises(ValueError):
        render(rows, "xml")


def test_price_files() -> None:
    got = prices_from_toml(TOML)
    assert [(p.token_class, p.micro) for p in got] == [
        ("input", 10_000_000),
        ("cached_input", 2_500_000),
        ("output", 40_000_001),
        ("gpu_hour", 3_600_000),
    ]
    assert got[0].effective_from_ns == 1_672_531_200 * 10**9 and got[0].note == "list price"
    csv = "model,token_class,usd,effective_from\ntiny,input,0.15,2025-01-01\ntiny,output,0.6,\n"
    assert [(p.token_class, p.micro, p.effective_from_ns) for p in prices_from_csv(csv)] == [
        ("input", 150_000, 1_735_689_600 * 10**9),
        ("output", 600_000, 0),
    ]
    # the CSV's columns as TOML keys: the same price as the CSV row
    same = prices_from_toml(
        '[[prices]]\nmodel = "tiny"\ntoken_class = "input"\nusd = "0.15"\neffective_from = 2025-01-01'
    )
    assert same == prices_from_csv(csv)[:1]
    for bad, match in [
        ('[[prices]]\nmodel = "m"\ntoken_class = "premium"\nusd = "1"', "token class"),
        ('[[prices]]\nmodel = "m"\ntoken_class = "input"\nusd = "1"\ninput = "2"', "unknown keys"),
        ('[[prices]]\nmodel = "m"\ninput = "-1"', "non-negative"),
        ('[[prices]]\nmodel = "m"\ninput = "0.0000001"', "six decimals"),
        ('[[prices]]\nmodel = "m"\nspeculative = "1"', "unknown keys"),
        ('[[prices]]\ninput = "1"', "model is empty"),
        ('[[prices]]\nmodel = "m"\neffective_from = "soon"\ninput = "1"', "ISO-8601"),
    ]:
        with pytest.raises(ConfigError, match=match):
            prices_from_toml(bad)
    with pytest.raises(ConfigError, match="token class"):
        prices_from_csv("model,token_class,usd\nm,premium,1\n")
    with pytest.raises(ConfigError, match="header"):
        prices_from_csv("a,b\n1,2\n")
    assert Price("m", "input", 0.1).usd == Decimal("0.1")  # type: ignore[arg-type]
