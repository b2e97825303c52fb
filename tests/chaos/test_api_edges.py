"""A hostile client against the HTTP API (issue 12): huge, zero, negative and far-future times,
buckets and limits on every registry route are 400s with a message, never a 500 or 503, and a
time beyond 2262 never wraps around Int64 into "every row"; the dashboard refuses a flood of ids.

The real API app (TestClient) over the real chDB store with the crafted data set.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseety.api.endpoints import routes
from tests.unit import test_api_app as app_tests

cfg, store, backend, client = app_tests.cfg, app_tests.store, app_tests.backend, app_tests.client
ADMIN = app_tests.ADMIN

HOSTILE_TIMES = [
    "999999999999w",
    "99999999999999999999999999999999999s",
    "0s",
    "0000000w",
    "9999-12-31",
    "9999-12-31T23:59:59Z",
    "2262-04-12",
    "1969-12-31T23:59:59Z",
    "0001-01-01",
    "-5m",
    "1e400",
    "nan",
    "",
]
HOSTILE_BUCKETS = ["0s", "99999999999999w", "367d", "9" * 400 + "s", "-1h", "1.5h", "0.0001s", "inf"]
HOSTILE_NS = [-1, 2**63, 2**64, -(2**63), 10**40]


def _status(client: TestClient, path: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = client.get(path, params=params, headers=ADMIN)
    return r.status_code, r.json()


@pytest.mark.parametrize("route", sorted(routes()))
def test_hostile_times_and_buckets_are_400s_on_every_route(client: TestClient, route: str) -> None:
    path = f"/api/v1/{route}"
    bucketed = routes()[route][0].query.bucket
    cases: list[dict[str, Any]] = [{"since": t} for t in HOSTILE_TIMES] + [
        {"until": t} for t in HOSTILE_TIMES
    ]
    cases += [{"since_ns": n} for n in HOSTILE_NS] + [{"until_ns": n} for n in HOSTILE_NS]
    if bucketed:
        cases += [{"bucket": b} for b in HOSTILE_BUCKETS]
    for params in cases:
        status, body = _status(client, path, params)
        assert status == 400, (path, params, body)
        assert body["error"] == "bad_parameter" and body["message"], (path, params, body)


def test_a_far_future_since_never_selects_every_row(client: TestClient) -> None:
    everything = client.get("/api/v1/requests", headers=ADMIN).json()["rows"]
    assert everything  # the crafted store is not empty
    status, body = _status(client, "/api/v1/requests", {"since": "9999-12-31"})
    assert status == 400 and "times must lie between" in body["message"]
    status, body = _status(client, "/api/v1/requests", {"since": "2262-04-11"})
    assert status == 200 and body["rows"] == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    number=st.integers(min_value=0, max_value=10**40),
    unit=st.sampled_from("smhdw"),
    which=st.sampled_from(["since", "until", "bucket"]),
)
def test_any_duration_is_an_answer_or_a_400(client: TestClient, number: int, unit: str, which: str) -> None:
    status, body = _status(client, "/api/v1/cost", {which: f"{number}{unit}"})
    assert status in (200, 400), body
    if status == 400:
        assert body["message"].startswith(f"bad {which}"), body


@pytest.mark.parametrize("top", [-1, 10_001, 2**63, 10**40])
def test_hostile_limits_are_400s(client: TestClient, top: int) -> None:
    status, body = _status(client, "/api/v1/duplication", {"top": top})
    assert status == 400 and "top" in body["message"], body
    status, body = _status(client, "/api/v1/requests", {"limit": top})
    assert status == 400 and "limit" in body["message"], body


def test_a_flood_of_dashboard_ids_is_refused_quickly(client: TestClient) -> None:
    r = client.get("/dashboard", params={"request_id": [f"e/{i}" for i in range(300)]}, headers=ADMIN)
    assert r.status_code == 400 and "at most 100 timelines" in r.json()["message"]
