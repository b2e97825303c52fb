"""The API's edges (issue 12): every time, bucket and limit is range-checked into a clear 400 by
the one time parser (sparseety/times.py) and the registry's Param checks, and the dashboard's
request ids are capped and fetched in a fixed number of queries however many there are."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from sparseety.api.dashboard import collect
from sparseety.api.params import MAX_DASHBOARD_REQUESTS
from sparseety.api.queries import ApiQueries
from sparseety.cli import main
from sparseety.queries.registry import QueryError, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.times import MAX_NS, check_ns, parse_bucket, parse_duration, parse_time
from tests.unit import test_api_app as app_tests
from tests.unit.test_api_app import error, get
from tests.unit.test_api_data import T0, uid

# the crafted store and the API over it, shared with test_api_app.py (module-scoped there, here)
cfg, store, backend, client = app_tests.cfg, app_tests.store, app_tests.backend, app_tests.client

NOW = T0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"since": "999999999999w"}, "bad since '999999999999w': at most"),
        ({"until": "99999999999999999999999999d"}, "bad until"),
        ({"since": "0s"}, "bad since '0s': must be positive"),
        ({"bucket": "99999999999999w"}, "bad bucket '99999999999999w': at most 366 days"),
        ({"bucket": "367d"}, "bad bucket '367d': at most 366 days"),
        ({"bucket": "0s"}, "bad bucket '0s': must be positive"),
        ({"since": "9999-12-31"}, "bad since '9999-12-31': times must lie between 1970-01-01 and 2262"),
        ({"until": "1969-12-31"}, "bad until '1969-12-31': times must lie between"),
        ({"since": "3000w"}, "bad since '3000w': times must lie between"),  # before 1970
        ({"since_ns": -1}, "bad since_ns -1: times must lie between"),
        ({"until_ns": 2**63}, "bad until_ns"),
    ],
)
def test_bad_times_and_buckets_are_clear_400s(
    client: TestClient, params: dict[str, Any], message: str
) -> None:
    assert message in error(client, "/api/v1/cost", 400, **params)


@pytest.mark.parametrize(
    ("path", "params", "message"),
    [
        ("/api/v1/duplication", {"top": -1}, "top"),
        ("/api/v1/duplication", {"top": 10**6}, "top"),
        ("/api/v1/duplication", {"top": 10**30}, "top"),
        ("/api/v1/requests", {"limit": 0}, "limit"),
        ("/api/v1/requests", {"limit": 10**6}, "limit"),
    ],
)
def test_limits_are_bounded(client: TestClient, path: str, params: dict[str, Any], message: str) -> None:
    assert message in error(client, path, 400, **params)


def test_edges_of_the_ranges_are_accepted(client: TestClient) -> None:
    get(client, "/api/v1/cost", bucket="1s", since="1970-01-01")
    get(client, "/api/v1/cost", bucket="366d", until="2262-04-11")
    get(client, "/api/v1/cost", since_ns=0, until_ns=MAX_NS)


def test_the_time_parser_bounds() -> None:
    assert parse_duration("15m").total_seconds() == 900
    assert parse_bucket("366d").days == 366
    assert parse_time("now", now_ns=5, name="since") == 5
    for bad in ("0s", "367d", "9" * 100 + "s"):
        with pytest.raises(QueryError, match="bad bucket"):
            parse_bucket(bad)
    with pytest.raises(QueryError, match="times must lie between"):
        parse_time("9999-12-31", now_ns=T0, name="since")
    with pytest.raises(QueryError, match="times must lie between"):
        check_ns(MAX_NS + 1, name="until_ns")


def test_the_query_cli_gives_one_line_usage_errors() -> None:
    runner = CliRunner()
    for args, message in [
        (["query", "cost", "--bucket", "0s"], "bad bucket '0s': must be positive"),
        (["query", "cost", "--since", "9999-12-31"], "times must lie between"),
        (["query", "cost", "--since", "999999999999w"], "at most"),
        (["query", "duplication", "--top", "-5"], "bad top -5: at least 0"),
    ]:
        r = runner.invoke(main, args)
        assert r.exit_code == 2, r.output
        assert message in r.output and "Traceback" not in r.output


class CountingStore:
    """The store, counting the queries it answers."""

    def __init__(self, inner: Store) -> None:
        self.store, self.database, self.queries = inner, inner.database, 0

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.queries += 1
        return self.store.query(sql, parameters)


def test_dashboard_fetches_many_requests_in_a_fixed_number_of_queries(store: Store) -> None:
    counting = CountingStore(store)
    q = ApiQueries(counting)  # type: ignore[arg-type]
    one = collect(q, scope=Scope(), request_uids=[uid("e1", "r1")], now_ns=NOW)
    few = counting.queries
    counting.queries = 0
    many = [uid("e1", "r1"), uid("e1", "r2"), uid("e3", "r4")] + [f"missing/{i}" for i in range(97)]
    data = collect(q, scope=Scope(), request_uids=many, now_ns=NOW)
    assert counting.queries == few  # the same queries for 100 ids as for one
    assert [r["request_uid"] for r in data.timelines] == many[:3]
    assert data.timelines[0] == one.timelines[0]
    assert q.request(uid("e1", "r1")) == one.timelines[0]


def test_dashboard_request_ids_are_capped(client: TestClient) -> None:
    ids = [f"e/{i}" for i in range(MAX_DASHBOARD_REQUESTS + 1)]
    r = client.get("/dashboard", params={"request_id": ids}, headers={"Authorization": "Bearer tok-admin"})
    assert r.status_code == 400, r.text
    assert f"at most {MAX_DASHBOARD_REQUESTS} timelines" in r.json()["message"]
    ok = client.get(
        "/dashboard", params={"request_id": ids[:-1]}, headers={"Authorization": "Bearer tok-admin"}
    )
    assert ok.status_code == 200, ok.text
