"""Tokens, tenant scoping, the open-mode exposure rule, the admin token file, time parameters."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from sparseety.api import params
from sparseety.api.auth import (
    AuthError,
    Principal,
    TokenTable,
    check_exposure,
    is_loopback,
    read_admin_token,
    remove_admin_token,
    write_admin_token,
)
from sparseety.config import ApiToken
from sparseety.errors import ConfigError
from sparseety.queries.registry import QueryError

S = 10**9


def test_tokens_map_to_their_tenants() -> None:
    table = TokenTable(
        {"a": ["acme"], "ab": ["acme", "beta", "acme"], "all": ["beta", "*"], "none": []}, "adm"
    )
    assert not table.open
    assert table.authenticate("Bearer a").tenants == ("acme",)
    assert table.authenticate("bearer ab").tenants == ("acme", "beta")
    assert table.authenticate("Bearer all").admin
    assert table.authenticate("Bearer adm") == Principal("admin", None, token_ids=True)
    assert not table.authenticate("Bearer all").allows("token_ids")  # '*' alone reads counts only
    flagged = TokenTable({"c": ApiToken(tenants=["acme"], token_ids=True)}).authenticate("Bearer c")
    assert flagged.tenants == ("acme",) and flagged.allows("token_ids")
    assert table.authenticate("Bearer none").tenants == ()
    for header, message in (
        (None, "missing"),
        ("Bearer", "malformed"),
        ("Basic a", "malformed"),
        ("Bearer x", "unknown"),
    ):
        with pytest.raises(AuthError, match=message) as info:
            table.authenticate(header)
        assert info.value.status == 401
    secret = TokenTable({"s3cr3t-token-value": ["acme"]})
    assert "s3cr3t" not in repr(vars(secret))  # only digests are held


def test_open_mode_and_visibility() -> None:
    assert TokenTable({}).authenticate(None).admin
    assert TokenTable({}, "adm").open  # the admin token alone does not close the API
    p = Principal("t", ("acme", "beta"))
    assert p.visible() == ("acme", "beta")
    assert p.visible(["beta", "gamma"]) == ("beta",)
    assert p.visible(["gamma"]) == ()
    assert Principal("a", None).visible() is None and Principal("a", None).visible(["x"]) == ("x",)
    with pytest.raises(AuthError, match="all tenants") as info:
        p.require_admin("metrics")
    assert info.value.status == 403


def test_an_open_api_listens_on_loopback_only() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_exposure(host, {})
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match=f"refusing to serve the API open on {host}"):
            check_exposure(host, {})
        check_exposure(host, {"t": ["*"]})


def test_the_admin_token_file_is_private(tmp_path: Path) -> None:
    token = write_admin_token(tmp_path)
    path = tmp_path / "api" / "admin-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 40
    assert read_admin_token(tmp_path) == token
    newer = write_admin_token(tmp_path)
    assert newer != token
    remove_admin_token(tmp_path, token)  # not ours any more: left alone
    assert read_admin_token(tmp_path) == newer
    remove_admin_token(tmp_path, newer)
    assert read_admin_token(tmp_path) is None


def test_time_parameters() -> None:
    now = 1_700_000_000 * S
    assert params.parse_time("now", now_ns=now, name="since") == now
    assert params.parse_time("2h", now_ns=now, name="since") == now - 7200 * S
    assert params.parse_time("2023-11-14T22:13:20Z", now_ns=0, name="since") == now
    assert params.parse_time("2023-11-14T22:13:20", now_ns=0, name="since") == now  # naive = UTC
    with pytest.raises(QueryError, match="bad until 'soon'"):
        params.parse_time("soon", now_ns=now, name="until")
    assert params.time_range(since=None, until=None, since_ns=5, until_ns=9, now_ns=now) == (5, 9)
    with pytest.raises(QueryError, match="empty time range"):
        params.time_range(since="1h", until="2h", since_ns=None, until_ns=None, now_ns=now)
    assert params.group_by(["tenant,model", "engine"], "tenant") == ("tenant", "model", "engine")
    assert params.group_by([], "model") == ("model",)
    with pytest.raises(QueryError, match="cannot group by 'planet'"):
        params.group_by(["planet"], "tenant")
