"""Browser sessions (issue 21): a token exchanged once for an HttpOnly cookie that authorizes reads
only, for as long as the session lives; the API over a real chDB store (test_api_data's set)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from sparseety.api.app import create_api
from sparseety.api.auth import SESSION_COOKIE, Principal, Sessions, TokenTable
from sparseety.api.backend import Backend
from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import chdb_config, throwaway_store
from tests.unit.test_api_data import MIN, T0, seed

HTML = {"Accept": "text/html,application/xhtml+xml"}


def test_sessions_expire_and_end() -> None:
    now = [0.0]
    sessions = Sessions(ttl_s=10, clock=lambda: now[0])
    who = Principal("token-1", ("acme",))
    sid = sessions.create(who)
    assert sessions.get(sid) == who and sessions.get("other") is None and sessions.get(None) is None
    now[0] = 9.9
    assert sessions.get(sid) == who
    now[0] = 10.0
    assert sessions.get(sid) is None  # expired, and forgotten
    sid = sessions.create(who)
    sessions.drop(sid)
    assert sessions.get(sid) is None


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("sessions")))


@pytest.fixture(scope="module")
def store(cfg: Config) -> Iterator[Store]:
    with throwaway_store(cfg) as s:
        seed(s)
        yield s


def _client(cfg: Config, store: Store, tokens: dict[str, list[str]]) -> TestClient:
    backend = Backend(cfg, store, tokens=TokenTable(tokens), clock=lambda: T0 + 10 * MIN)
    return TestClient(create_api(backend), follow_redirects=False)


def test_login_exchanges_a_token_for_a_read_only_session(cfg: Config, store: Store) -> None:
    with _client(cfg, store, {"tok-admin": ["*"], "tok-acme": ["acme"]}) as c:
        # a browser without credentials is sent to the sign-in page; an API client gets 401
        r = c.get("/dashboard", headers=HTML)
        assert r.status_code == 303 and r.headers["location"] == "/login"
        assert c.get("/dashboard").status_code == 401
        page = c.get("/login")
        assert (
            page.status_code == 200
            and 'name="token"' in page.text
            and "no-store" in page.headers["cache-control"]
        )
        # a wrong token: the form again, no cookie
        r = c.post("/login", data={"token": "nope"})
        assert r.status_code == 401 and "not known" in r.text and SESSION_COOKIE not in r.cookies
        # the right one: a cookie that is not the token, HttpOnly and SameSite=Strict
        r = c.post("/login", data={"token": "tok-acme"})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "tok-acme" not in cookie
        sid = r.cookies[SESSION_COOKIE]
        c.cookies.set(SESSION_COOKIE, sid)
        assert c.get("/dashboard", headers=HTML).status_code == 200
        # reads with the session are the token's reads: acme's rows only
        rows = c.get("/api/v1/cost").json()["rows"]
        assert [r["tenant"] for r in rows] == ["acme"]
        # a write is never authorized by the cookie (a form another site posts gets nothing)
        assert c.post("/api/v1/sql", json={"sql": "SELECT 1"}).status_code == 401
        # a bearer header wins over the cookie
        admin = c.get("/api/v1/cost", headers={"Authorization": "Bearer tok-admin"}).json()["rows"]
        assert len(admin) == 3
        # JSON login (the page's fetch), logout
        c.cookies.clear()
        r = c.post("/login", json={"token": "tok-admin"})
        assert r.status_code == 200 and r.json() == {"ok": True}
        admin_sid = r.cookies[SESSION_COOKIE]
        c.cookies.clear()
        c.cookies.set(SESSION_COOKIE, admin_sid)
        assert len(c.get("/api/v1/cost").json()["rows"]) == 3
        r = c.post("/logout")
        assert r.status_code == 303 and r.headers["location"] == "/login"
        c.cookies.clear()
        c.cookies.set(SESSION_COOKIE, admin_sid)  # a browser that kept it anyway
        assert c.get("/api/v1/cost").status_code == 401  # the session is gone on the server


def test_an_open_api_needs_no_login(cfg: Config, store: Store) -> None:
    with _client(cfg, store, {}) as c:
        r = c.get("/login")
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        assert c.get("/dashboard", headers=HTML).status_code == 200
