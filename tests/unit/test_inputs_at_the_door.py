"""Issue 31, "inputs checked where they enter": prices and tenant names are refused at the door
with the rule they break, never stored to overflow, echo oddly or bill a misspelt model silently.

Prices: the rule of ``parse_usd`` for ``prices set``, ``prices load`` and ``POST /api/v1/prices``
alike; ``prices delete``; a warning for a model no request has. Tenants: one rule
(:mod:`sparseety.tenants`) at the vLLM server's middleware, the proxy, trace ingest and a config's
tokens, and a visible ``invalid-tenant`` where an engine cannot refuse."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.cli import main
from sparseety.config import load_config
from sparseety.errors import ConfigError, InvalidTenantError
from sparseety.producers.logs.errors import BadTraceLineError
from sparseety.producers.logs.jsonl import parse_line
from sparseety.producers.vllm.middleware import TenantHeaderMiddleware
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import (
    PRICE_CLASSES,
    Price,
    delete_prices,
    list_prices,
    parse_usd,
    prices_from_csv,
    prices_from_toml,
    set_prices,
    unseen_models,
)
from sparseety.tenants import INVALID_TENANT, MAX_TENANT_CHARS, check_tenant, engine_tenant, tenant_problem
from tests import factories as f
from tests.helpers import accounting_store, chdb_config, write_accounting
from tests.unit.test_ingest_jsonl import line

# --- prices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, rule",
    [
        ("99999999999999", "above the largest price"),
        ("1e3", "not a plain decimal"),
        ("1E+3", "not a plain decimal"),
        ("-1", "non-negative"),
        ("0.0000001", "more than six decimals"),
        ("abc", "not an amount"),
        ("NaN", "non-negative"),
        (" 1 000", "not an amount"),
    ],
)
def test_a_price_breaking_the_rule_is_refused_with_it(text: str, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule):
        parse_usd(text)


def test_plain_prices_pass_and_print_as_written() -> None:
    assert parse_usd("0.15") == Decimal("0.15") and parse_usd(12) == Decimal(12)
    assert parse_usd("1000000") == Decimal(1_000_000)
    assert f"{parse_usd('1000'):f}" == "1000"
    with pytest.raises(ConfigError, match="quote it in TOML"):
        prices_from_toml('[[prices]]\nmodel = "m"\ninput = 1e-7\n')
    # every class, reasoning_output included, is a class of the file as of the CLI
    every = "\n".join(
        f'{c} = {{ flex = "0.5", "1h" = "1.6" }}' if c.endswith("_multiplier") else f'{c} = "1"'
        for c in PRICE_CLASSES
    )
    got = prices_from_toml(f'[[prices]]\nmodel = "m"\n{every}\n')
    assert {p.token_class for p in got} == set(PRICE_CLASSES)
    # a multiplier (issue 36) is a factor per qualifier; without one it is refused, as a
    # qualifier on any other class is
    assert {(p.token_class, p.qualifier, p.usd) for p in got if p.qualifier} == {
        (c, q, Decimal(v))
        for c in ("service_tier_multiplier", "cache_write_ttl_multiplier")
        for q, v in (("flex", "0.5"), ("1h", "1.6"))
    }
    with pytest.raises(ConfigError, match="needs a qualifier"):
        prices_from_toml('[[prices]]\nmodel = "m"\nservice_tier_multiplier = "0.5"\n')
    with pytest.raises(ConfigError, match="take a qualifier"):
        prices_from_csv("model,token_class,usd,qualifier\nm,input,1,flex\n")
    (csv_one,) = prices_from_csv("model,token_class,usd,qualifier\nm,service_tier_multiplier,0.5,flex\n")
    assert (csv_one.qualifier, csv_one.usd) == ("flex", Decimal("0.5"))


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with accounting_store(tmp_path_factory, [f.accounting(model="seen-model")]) as s:
        yield s


def test_prices_delete_and_unseen_models(store: Store) -> None:
    set_prices(store, [Price("seen-model", c, Decimal("1"), 0) for c in ("input", "output")])
    set_prices(store, [Price("seen-modle", "input", Decimal("1"), 0)])
    assert unseen_models(store, ["seen-model", "seen-modle"]) == ["seen-modle"]
    assert delete_prices(store, "seen-modle") == 1
    assert delete_prices(store, "seen-model", "output") == 1
    assert [(p["model"], p["token_class"]) for p in list_prices(store)] == [("seen-model", "input")]
    assert delete_prices(store, "nothing") == 0
    with pytest.raises(ConfigError, match="not one of"):
        delete_prices(store, "seen-model", "inptu")


@pytest.fixture
def cli_env(tmp_path_factory: pytest.TempPathFactory, unique: str) -> Iterator[dict[str, str]]:
    path = tmp_path_factory.getbasetemp() / "chdb-unit"
    db = f"t{unique}"
    env = {"SPARSEETY_CLICKHOUSE_DSN": f"chdb://{path}", "SPARSEETY_CLICKHOUSE_DATABASE": db}
    cfg = load_config(env=env)
    with Store.open(cfg) as s:
        write_accounting(s, [f.accounting(model="tiny")])
    yield env
    with Store.open(cfg) as s:
        s.command(f"DROP DATABASE IF EXISTS {db}")


def run(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_prices_cli(cli_env: dict[str, str]) -> None:
    code, out = run(
        cli_env, "prices", "set", "--model", "tiny", "--class", "input", "--usd", "99999999999999"
    )
    assert code == 2 and "above the largest price" in out and "503" not in out
    code, out = run(cli_env, "prices", "set", "--model", "tiny", "--class", "input", "--usd", "1e3")
    assert code == 2 and "not a plain decimal" in out
    code, out = run(
        cli_env, "prices", "set", "--model", "tiny", "--class", "reasoning_output", "--usd", "1000"
    )
    assert code == 0 and out == "tiny reasoning_output: $1000 from always\n", out
    code, out = run(cli_env, "prices", "set", "--model", "tinyy", "--class", "input", "--usd", "1")
    assert code == 0 and "warning: no stored request has model 'tinyy' (a typo?)" in out
    code, out = run(cli_env, "prices", "delete", "--model", "tinyy")
    assert (code, out) == (0, "1 prices deleted\n")
    assert run(cli_env, "prices", "delete", "--model", "tinyy") == (1, "0 prices deleted\n")
    listed = json.loads(run(cli_env, "prices", "list", "--format", "json")[1])
    assert [(p["model"], p["token_class"], p["usd"]) for p in listed] == [
        ("tiny", "reasoning_output", "1000")
    ]


def test_the_api_answers_a_bad_price_400_and_deletes(
    tmp_path_factory: pytest.TempPathFactory, store: Store
) -> None:
    cfg = chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("door")))
    backend = Backend(cfg, store, tokens=TokenTable({"adm": ["*"], "acme": ["acme"]}))
    admin = {"Authorization": "Bearer adm"}
    try:
        with TestClient(create_api(backend)) as c:
            bad = {"prices": [{"model": "seen-model", "token_class": "input", "usd": "99999999999999"}]}
            r = c.post("/api/v1/prices", json=bad, headers=admin)
            assert r.status_code == 400 and "above the largest price" in r.json()["message"], r.text
            ok = {"prices": [{"model": "seen-model", "token_class": "input", "usd": "2"}]}
            assert c.post("/api/v1/prices", json=ok, headers=admin).json() == {"set": 1}
            r = c.get("/api/v1/prices/unseen", params={"model": ["seen-model", "other"]}, headers=admin)
            assert r.json() == {"models": ["other"]}
            r = c.delete(
                "/api/v1/prices", params={"model": "seen-model"}, headers={"Authorization": "Bearer acme"}
            )
            assert r.status_code == 403
            r = c.delete(
                "/api/v1/prices", params={"model": "seen-model", "token_class": "nope"}, headers=admin
            )
            assert r.status_code == 400
            assert c.delete("/api/v1/prices", params={"model": "seen-model"}, headers=admin).json() == {
                "deleted": 1
            }
    finally:
        backend.close()


# --- tenants ---------------------------------------------------------------------------------

BAD_TENANTS = ["x" * 5000, "acme\nglobex", "tab\there", " acme", "acme ", "\u202eemca"]


@pytest.mark.parametrize("bad", BAD_TENANTS)
def test_one_rule_for_tenant_names(bad: str) -> None:
    assert tenant_problem(bad) is not None
    with pytest.raises(InvalidTenantError) as exc:
        check_tenant(bad, where="here")
    assert exc.value.rule and len(str(exc.value)) < 300  # quoted cut, never 5,000 characters
    assert engine_tenant(bad) == INVALID_TENANT


def test_good_tenant_names_pass() -> None:
    for good in ("acme", "team/a b", "Ünïcode", "a" * MAX_TENANT_CHARS, ""):
        assert tenant_problem(good) is None and engine_tenant(good) == good


def test_the_engine_logs_a_bad_tenant_rule_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sparseety.tenants"):
        for _ in range(3):
            engine_tenant("y" * 999)
    assert sum("invalid-tenant" in r.getMessage() for r in caplog.records) <= 1


def test_the_vllm_middleware_answers_400() -> None:
    sent: list[dict[str, Any]] = []
    reached: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"x-sparseety-tenant", b"x" * 300)],
    }
    asyncio.run(TenantHeaderMiddleware(app)(scope, receive, send))
    assert not reached and sent[0]["status"] == 400
    assert "at most 128 characters" in json.loads(sent[1]["body"])["error"]["message"]


def test_ingest_dead_letters_a_line_with_a_bad_tenant() -> None:
    for bad in ("x" * 5000, "a\nb"):
        with pytest.raises(BadTraceLineError, match="tenant"):
            parse_line(json.dumps({**line(1), "tenant": bad}).encode(), 1)
    assert parse_line(json.dumps({**line(1), "tenant": "acme"}).encode(), 1) is not None


def test_a_config_token_with_a_bad_tenant_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a tenant name"):
        load_config(api={"tokens": {"tok": ["a\nb"]}})
    with pytest.raises(ConfigError, match="not a tenant name"):
        load_config(api={"tokens": {"tok": {"tenants": ["x" * 200]}}})
    assert load_config(api={"tokens": {"tok": ["*"], "t2": ["acme"]}}).api.tokens


def test_an_unknown_tenant_gets_a_hint_and_money_is_exact(cli_env: dict[str, str]) -> None:
    code, out = run(cli_env, "query", "cost", "--tenant", "nosuch")
    assert code == 0 and "(no rows)" in out and "no stored request of 'nosuch'" in out
    code, out = run(cli_env, "query", "cost", "--tenant", "acme")  # the request's tenant: a row
    assert code == 0 and "no stored request" not in out
    assert run(cli_env, "prices", "set", "--model", "tiny", "--class", "input", "--usd", "0.123457")[0] == 0
    code, out = run(cli_env, "query", "cost", "--by", "tenant", "--mode", "list")
    # 10 prompt tokens (no cached price: p_cached = p_in) at 0.123457 USD per 1M, exactly; it was
    # printed rounded to six decimals, 0.000001
    assert "0.00000123457" in out.split(), out
