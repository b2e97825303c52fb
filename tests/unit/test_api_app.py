"""The HTTP API against a real chDB store holding the crafted data set (tests/unit/test_api_data.py):
every endpoint, tenant-scoped tokens, bad input, metrics, and the remote client that mirrors the
query library."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.client import RemoteApiError, RemoteQueries
from sparseety.api.encode import jsonable
from sparseety.api.queries import ApiQueries
from sparseety.cli import main
from sparseety.config import Config
from sparseety.queries.registry import QueryError, Scope
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import store_fixtures
from tests.unit.test_api_data import MIN, T0, dataset, seed, uid

NOW = T0 + 10 * MIN
TOKENS = {"tok-admin": ["*"], "tok-acme": ["acme"], "tok-gi": ["globex", "initech"]}
ADMIN = {"Authorization": "Bearer tok-admin"}
ACME = {"Authorization": "Bearer tok-acme"}
GI = {"Authorization": "Bearer tok-gi"}


cfg, store = store_fixtures(seed, "api-data")


@pytest.fixture(scope="module")
def backend(cfg: Config, store: Store) -> Iterator[Backend]:
    b = Backend(cfg, store, tokens=TokenTable(TOKENS, admin_token="tok-process-admin"), clock=lambda: NOW)
    yield b
    b.close()


@pytest.fixture(scope="module")
def client(backend: Backend) -> Iterator[TestClient]:
    with TestClient(create_api(backend)) as c:
        yield c


@pytest.fixture
def local(store: Store) -> ApiQueries:
    return ApiQueries(store)


def get(client: TestClient, path: str, headers: dict[str, str] = ADMIN, **params: Any) -> Any:
    r = client.get(path, params=params, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def error(client: TestClient, path: str, status: int, headers: dict[str, str] = ADMIN, **params: Any) -> str:
    r = client.get(path, params=params, headers=headers)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "message"} and body["message"]
    return str(body["message"])


# --- every endpoint ---------------------------------------------------------------------------


def test_token_statistics(client: TestClient, local: ApiQueries) -> None:
    body = get(client, "/api/v1/tokens/statistics", request_id=uid("e1", "r1"))
    assert body == {
        "request_id": uid("e1", "r1"),
        "input_token_count": 96,
        "output_token_count": 32,
        "computed_token_count": 119,
        "cached_token_count": 0,
        "skipped_token_count": 0,
        "kv_cache_evicted_count": 0,
        "draft_token_count": 12,
        "draft_rejected_count": 4,
        "recomputed_preemption_count": 0,
        "recomputed_eviction_count": 0,
        "draft_cut_count": 0,
    }
    for rec in dataset():
        body = get(client, "/api/v1/tokens/statistics", request_id=rec["request_uid"])
        assert {k: v for k, v in body.items() if k != "request_id"} == local.tokens_statistics(
            rec["request_uid"]
        )
    r4 = get(client, "/api/v1/tokens/statistics", request_id=uid("e3", "r4"))
    assert (r4["skipped_token_count"], r4["kv_cache_evicted_count"], r4["computed_token_count"]) == (
        56,
        64,
        239,
    )


def test_timeline_counts_and_segments(client: TestClient) -> None:
    body = get(client, f"/api/v1/requests/{uid('e1', 'r3')}/timeline")
    assert body["tenant"] == "globex" and body["model"] == "tiny-moe"
    assert body["counts"] == {
        "computed": 64,
        "cached": 64,
        "recomputed_after_preemption": 0,
        "recomputed_after_eviction": 0,
        "not_computed": 0,
        "recomputed": 32,
        "skipped": 0,
        "evicted": 0,
        "window_released": 0,
        "prompt": 128,
        "output": 32,
        "draft_accepted": 0,
        "draft_rejected": 0,
        "positions": 160,
    }
    assert [(s["start"], s["end"], s["status"]) for s in body["segments"]] == [
        (0, 64, "cached"),
        (64, 96, "recomputed"),
        (96, 128, "computed"),
        (128, 160, "computed"),
    ]
    assert body["segments"][0]["source_request_uid"] == uid("e1", "r1")
    # r1 is acme's: globex's own token sees that another tenant computed its prefix, not which request.
    scoped = get(client, f"/api/v1/requests/{uid('e1', 'r3')}/timeline", headers=GI)
    assert scoped["segments"][0]["source_request_uid"] == "another tenant"
    detail = get(client, f"/api/v1/requests/{uid('e1', 'r3')}", headers=GI)
    assert uid("e1", "r1") not in str(detail)
    page = client.get("/dashboard", params={"request_id": uid("e1", "r3")}, headers=GI)
    assert page.status_code == 200 and "another tenant" in page.text and uid("e1", "r1") not in page.text
    admin_page = client.get("/dashboard", params={"request_id": uid("e1", "r3")}, headers=ADMIN)
    assert uid("e1", "r1") in admin_page.text
    acme = get(client, f"/api/v1/requests/{uid('e1', 'r2')}/timeline", headers=ACME)
    assert acme["segments"][0]["source_request_uid"] == uid("e1", "r1")  # its own tenant's request
    r1 = get(client, "/api/v1/requests/" + uid("e1", "r1").replace("/", "%2F") + "/timeline")
    assert (r1["counts"]["draft_accepted"], r1["counts"]["draft_rejected"]) == (8, 4)
    r4 = get(client, f"/api/v1/requests/{uid('e3', 'r4')}/timeline")
    assert (r4["counts"]["evicted"], r4["counts"]["skipped"]) == (64, 56)


def test_request_detail(client: TestClient, local: ApiQueries) -> None:
    body = get(client, f"/api/v1/requests/{uid('e1', 'r2')}")
    expected = jsonable(local.request(uid("e1", "r2")))
    assert body == expected
    # list price: 32 uncached x $10/M + 64 cached x $2.5/M + 16 output x $40/M
    assert Decimal(body["cost"]["list"]) == Decimal("0.00032") + Decimal("0.00016") + Decimal("0.00064")


@pytest.mark.parametrize("mode", ["actual", "amortized", "list", "gpu"])
def test_cost_in_each_mode_matches_the_query_library(
    client: TestClient, local: ApiQueries, mode: str
) -> None:
    body = get(client, "/api/v1/cost", mode=mode, group_by="tenant")
    assert body["mode"] == mode and body["group_by"] == ["tenant"]
    assert body["rows"] == jsonable(local.cost(mode=mode, by=("tenant",)))
    assert {r["tenant"] for r in body["rows"]} == {"acme", "globex", "initech"}
    assert all(isinstance(r["cost_usd"], str) for r in body["rows"])  # exact decimal text


def test_cost_by_model_time_range_and_bucket(client: TestClient, local: ApiQueries) -> None:
    since, until = "2023-11-14T22:15:00Z", "2023-11-14T22:18:00Z"  # T0+1m40s .. T0+4m40s: r2, r3, r4
    body = get(client, "/api/v1/cost", group_by=["model", "tenant"], since=since, until=until, bucket="1m")
    assert body["scope"]["since_ns"] == T0 + 100 * 10**9
    rows = body["rows"]
    assert sum(r["requests"] for r in rows) == 3
    assert {r["bucket"] for r in rows} == {
        "2023-11-14T22:15:00Z",
        "2023-11-14T22:16:00Z",
        "2023-11-14T22:17:00Z",
    }
    scope = Scope(T0 + 100 * 10**9, T0 + 280 * 10**9)
    assert rows == jsonable(local.cost(by=("model", "tenant"), bucket="1m", scope=scope))
    ns = get(client, "/api/v1/cost", since_ns=T0 + 100 * 10**9, until_ns=T0 + 280 * 10**9)
    assert sum(r["requests"] for r in ns["rows"]) == 3


@pytest.mark.parametrize(
    ("path", "method", "by"),
    [
        ("savings", "savings", ("tenant",)),
        ("waste", "waste", ("tenant",)),
        ("spec", "spec_efficiency", ("model",)),
        ("gpu", "gpu_time", ("tenant",)),
        ("usage", "usage", ("tenant",)),
    ],
)
def test_grouped_queries(
    client: TestClient, local: ApiQueries, path: str, method: str, by: tuple[str, ...]
) -> None:
    body = get(client, f"/api/v1/{path}")
    assert body["rows"] == jsonable(getattr(local, method)(by=by))
    assert body["rows"], f"{path} answered no rows"
    by_engine = get(client, f"/api/v1/{path}", group_by="engine")
    assert by_engine["rows"] == jsonable(getattr(local, method)(by=("engine",)))


def test_savings_waste_and_spec_values(client: TestClient) -> None:
    savings = {r["tenant"]: r for r in get(client, "/api/v1/savings")["rows"]}
    assert savings["acme"]["cache_read_tokens"] == 64 and Decimal(savings["acme"]["saved_usd"]) == Decimal(
        "0.00048"
    )  # 64 x (10 - 2.5) $/M
    waste = {r["tenant"]: r for r in get(client, "/api/v1/waste")["rows"]}
    assert (
        waste["globex"]["recomputed_preemption_tokens"] == 32 and waste["acme"]["draft_rejected_tokens"] == 4
    )
    spec = {r["model"]: r for r in get(client, "/api/v1/spec")["rows"]}
    assert spec["tiny-moe"]["draft_accepted_tokens"] == 8 and spec["tiny-moe"]["acceptance_rate"] == 8 / 12


def test_experts_duplication_requests_and_health(client: TestClient, local: ApiQueries) -> None:
    experts = get(client, "/api/v1/experts", model="tiny-moe")["rows"]
    assert experts == jsonable(local.expert_load(model="tiny-moe"))
    cell = {(r["layer"], r["expert"]): r["tokens"] for r in experts}
    assert cell[(0, 0)] == 14 and cell[(1, 1)] == 27
    dup = get(client, "/api/v1/duplication")["rows"]
    assert dup == jsonable(local.duplication()) and dup[0]["duplicated_blocks"] == 1
    top = get(client, "/api/v1/duplication", top=5)["rows"]
    assert top[0]["block_hash"] == b"b1".hex() and top[0]["engine_names"] == ["e1", "e2"]
    listed = get(client, "/api/v1/requests", order="recent", limit=3)["rows"]
    assert [r["request_uid"] for r in listed] == [uid("e2", "r6"), uid("e3", "r5"), uid("e3", "r4")]
    varied = get(client, "/api/v1/requests", order="varied", limit=3)["rows"]  # three kinds of fate each
    assert [r["request_uid"] for r in varied] == [uid("e3", "r4"), uid("e1", "r3"), uid("e1", "r1")]
    health = get(client, "/api/v1/health")
    assert health["store"] == {
        "requests": 6,
        "incomplete_requests": 1,
        "inconsistent_requests": 1,
        "seq_gap_requests": 0,
        "earliest_finished_ts_ns": T0 + 1 * MIN,
        "latest_finished_ts_ns": T0 + 6 * MIN,
        "freshness_s": 240.0,
        "dead_letters": 1,
        "ingest_rejects": 0,
    }
    assert health["pipeline"] == {"sink_in_process": False, "jobs_active": 0}


def test_metrics(client: TestClient) -> None:
    get(client, "/api/v1/cost")
    r = client.get("/metrics", headers=ADMIN)
    assert r.status_code == 200
    text = r.text
    assert 'sparseety:api_requests_total{method="GET",route="/api/v1/cost",status="200"}' in text
    assert "sparseety:freshness_seconds 240.0" in text
    assert 'sparseety:store_requests{state="incomplete"} 1.0' in text
    assert "sparseety:store_dead_letters 1.0" in text
    assert "sparseety:store_up 1.0" in text
    assert 'sparseety:store_query_duration_seconds_count{query="cost"}' in text
    assert 'sparseety:jobs_active{kind="replay"} 0.0' in text
    # issue 36's token classes, stored totals (the fixture's requests wrote and read from no tier)
    assert "sparseety:store_cache_write_tokens 0.0" in text
    assert 'sparseety:store_cache_read_tokens{tier="cpu_offload"} 0.0' in text
    assert 'sparseety:store_prompt_modality_tokens{modality="image"} 0.0' in text
    assert 'sparseety:store_encoder_tokens{kind="compute"} 0.0' in text


def test_scrapes_evaluate_the_regression_signals_at_most_once_per_interval(
    cfg: Config, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Backend(cfg, store, tokens=TokenTable({}, admin_token="tok-process-admin"), clock=lambda: NOW)
    calls = []
    evaluate = ApiQueries.regressions

    def counted(self: ApiQueries, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return evaluate(self, **kwargs)

    monkeypatch.setattr(ApiQueries, "regressions", counted)  # each read has its own ApiQueries
    try:
        with TestClient(create_api(b)) as c:
            for _ in range(3):
                assert c.get("/metrics").status_code == 200
            assert len(calls) == 1
            b.regressions_every_s = 0.0
            b._regressions_due = float("-inf")  # the interval has passed
            assert c.get("/metrics").status_code == 200
            assert len(calls) == 2
    finally:
        b.close()


def test_ops_docs_and_dashboard(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert "/api/v1/tokens/statistics" in spec["paths"] and "/api/v1/collect" in spec["paths"]
    page = client.get("/dashboard", headers=ADMIN)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for element in ('id="timeline"', 'id="cost"', 'id="savings"', 'id="experts-0"', 'id="health"'):
        assert element in html
    assert '<script src="/dashboard/plotly.min.js">' in html
    # issue 36: cache writes and reads by tier, per tenant and service tier
    assert "Cache writes, cache tiers and service tiers" in html and "cpu_offload" in html
    js = client.get("/dashboard/plotly.min.js")  # public: the library, no data
    assert js.status_code == 200 and b"plotly.js" in js.content[:200]
    assert client.get("/", follow_redirects=False).headers["location"] == "/dashboard"


# --- auth -------------------------------------------------------------------------------------


def test_missing_malformed_and_unknown_tokens_are_401(client: TestClient) -> None:
    r = client.get("/api/v1/cost")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "missing bearer token" in r.json()["message"]
    assert "malformed" in error(client, "/api/v1/cost", 401, {"Authorization": "Basic abc"})
    assert error(client, "/api/v1/cost", 401, {"Authorization": "Bearer nope"}) == "unknown token"
    assert client.get("/dashboard").status_code == 401
    assert client.get("/metrics").status_code == 401
    # the process's admin token (the CLI's) sees everything
    assert len(get(client, "/api/v1/cost", {"Authorization": "Bearer tok-process-admin"})["rows"]) == 3


def test_another_tenants_request_is_404_like_a_missing_one(client: TestClient) -> None:
    mine = get(client, "/api/v1/tokens/statistics", ACME, request_id=uid("e1", "r1"))
    assert mine["input_token_count"] == 96
    for path, params in (
        ("/api/v1/tokens/statistics", {"request_id": uid("e1", "r3")}),
        (f"/api/v1/requests/{uid('e1', 'r3')}/timeline", {}),
        (f"/api/v1/requests/{uid('e1', 'r3')}", {}),
    ):
        theirs = client.get(path, params=params, headers=ACME)
        missing = client.get(
            path.replace("r3", "r99"),
            params={k: v.replace("r3", "r99") for k, v in params.items()},
            headers=ACME,
        )
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"] == missing.json()["error"] == "not_found"
    # the admin sees it
    assert get(client, "/api/v1/tokens/statistics", request_id=uid("e1", "r3"))["input_token_count"] == 128


def test_aggregates_see_only_the_tokens_tenants(client: TestClient, local: ApiQueries) -> None:
    acme = get(client, "/api/v1/cost", ACME, mode="amortized")
    assert acme["scope"]["tenants"] == ["acme"]
    assert acme["rows"] == jsonable(local.cost(mode="amortized", scope=Scope(tenants=("acme",))))
    assert [r["tenant"] for r in acme["rows"]] == ["acme"]
    by_model = get(client, "/api/v1/cost", ACME, group_by="model")["rows"]
    assert [(r["model"], r["requests"]) for r in by_model] == [("tiny-moe", 2)]
    # asking for a tenant it may not see gives nothing, not an error (no existence leak)
    assert get(client, "/api/v1/cost", ACME, tenant="globex")["rows"] == []
    gi = get(client, "/api/v1/waste", GI, tenant=["globex", "acme"])
    assert [r["tenant"] for r in gi["rows"]] == ["globex"]
    assert {r["tenant"] for r in get(client, "/api/v1/savings", GI)["rows"]} == {"globex", "initech"}
    assert [r["request_uid"] for r in get(client, "/api/v1/requests", ACME)["rows"]] == [
        uid("e1", "r2"),
        uid("e1", "r1"),
    ]
    assert {r["tenant"] for r in get(client, "/api/v1/usage", ACME)["rows"]} == {"acme"}
    assert get(client, "/api/v1/experts", GI)["rows"] == jsonable(
        local.expert_load(scope=Scope(tenants=("globex", "initech")))
    )
    health = get(client, "/api/v1/health", ACME)
    assert health["store"]["requests"] == 2 and "dead_letters" not in health["store"]
    assert "pipeline" not in health
    page = client.get("/dashboard", headers=ACME).text
    assert "tenants: acme" in page and "globex" not in page


def test_whatif_is_modelled_tenant_scoped_and_checks_its_scenario(
    client: TestClient, local: ApiQueries
) -> None:
    for scenario in ("no-cache", "kv-curve", "no-spec", "window=32"):
        rows = get(client, "/api/v1/whatif", ACME, scenario=scenario)["rows"]
        assert rows == jsonable(local.whatif(scenario=scenario, scope=Scope(tenants=("acme",))))
        assert rows and {r["tenant"] for r in rows} == {"acme"} and {r["basis"] for r in rows} == {"modelled"}
    assert "unknown scenario 'cheaper'" in error(client, "/api/v1/whatif", 400, scenario="cheaper")


def test_regressions_route_is_the_library_query(client: TestClient, local: ApiQueries) -> None:
    until_ns = NOW
    body = get(client, "/api/v1/regressions", ACME, until_ns=until_ns, baseline="30d", all=1, min_requests=1)
    want = local.regressions(
        scope=Scope(until_ns=until_ns, tenants=("acme",)), baseline="30d", all_signals=1, min_requests=1
    )
    assert body["rows"] == jsonable(want)
    assert "bad window 'soon'" in error(client, "/api/v1/regressions", 400, window="soon")


def test_cross_tenant_operations_need_an_all_tenant_token(client: TestClient) -> None:
    assert "all tenants" in error(client, "/metrics", 403, ACME)
    assert "all tenants" in error(client, "/api/v1/jobs", 403, ACME)
    r = client.post("/api/v1/collect", json={"kind": "replay", "topic": "timelines"}, headers=ACME)
    assert r.status_code == 403 and r.json()["error"] == "forbidden"


# --- bad input --------------------------------------------------------------------------------


def test_bad_parameters_are_clear_400s(client: TestClient) -> None:
    assert "no request 'nope'" in error(client, "/api/v1/tokens/statistics", 404, request_id="nope")
    assert "no request" in error(client, "/api/v1/requests/nope/timeline", 404)
    assert "bad since 'yesterday-ish'" in error(client, "/api/v1/cost", 400, since="yesterday-ish")
    assert "bad until" in error(client, "/api/v1/cost", 400, until="2023-13-45T00:00:00")
    assert "empty time range" in error(
        client, "/api/v1/cost", 400, since="2023-11-15T00:00:00Z", until="2023-11-14"
    )
    assert "give since or since_ns" in error(client, "/api/v1/cost", 400, since="1h", since_ns=5)
    assert "unknown attribution mode 'cheapest'" in error(client, "/api/v1/cost", 400, mode="cheapest")
    assert "cannot group by 'planet'" in error(client, "/api/v1/savings", 400, group_by="tenant,planet")
    assert "bad bucket 'fortnight'" in error(client, "/api/v1/cost", 400, bucket="fortnight")
    assert "unknown order" in error(client, "/api/v1/requests", 400, order="random")
    assert "limit" in error(client, "/api/v1/requests", 400, limit="many")
    assert "request_id" in error(client, "/api/v1/tokens/statistics", 400)
    assert "since_ns" in error(client, "/api/v1/cost", 400, since_ns="soon")
    assert "duplication groups by model only" in error(client, "/api/v1/duplication", 400, group_by="tenant")
    assert "no job" in error(client, "/api/v1/jobs/abc", 404)


def test_bad_collect_specs_are_400_before_any_job_runs(client: TestClient, tmp_path: Path) -> None:
    def post(body: dict[str, Any]) -> str:
        r = client.post("/api/v1/collect", json=body, headers=ADMIN)
        assert r.status_code == 400, r.text
        return str(r.json()["message"])

    assert "unknown collect kind 'scrape': choose from replay, ingest, analyze, vllm_log" in post(
        {"kind": "scrape"}
    )
    assert "cannot read 'yesterday' as a replay bound" in post(
        {"kind": "replay", "topic": "timelines", "from": "yesterday"}
    )
    assert "empty replay range" in post({"kind": "replay", "topic": "timelines", "from": "end"})
    assert "not a SparSEEty topic" in post({"kind": "replay", "topic": "some.other.topic"})
    assert "no trace file" in post({"kind": "ingest", "path": str(tmp_path / "missing.jsonl")})
    assert "ingest.format" in post({"kind": "ingest", "path": str(tmp_path), "format": "csv"})
    assert "ingest.colour: Extra inputs" in post({"kind": "ingest", "path": "x", "colour": "red"})
    assert get(client, "/api/v1/jobs")["jobs"] == []


# --- open mode --------------------------------------------------------------------------------


def test_open_mode_needs_no_token(cfg: Config, store: Store) -> None:
    b = Backend(cfg, store, tokens=TokenTable({}, admin_token="tok-process-admin"), clock=lambda: NOW)
    try:
        with TestClient(create_api(b)) as c:
            assert c.get("/api/v1/cost").status_code == 200
            assert c.get("/metrics").status_code == 200
            assert c.get("/api/v1/jobs").json() == {"jobs": []}
    finally:
        b.close()


# --- the remote client mirrors the query library ----------------------------------------------


def test_remote_queries_return_what_the_library_returns(client: TestClient, local: ApiQueries) -> None:
    remote = RemoteQueries("http://testserver", "tok-admin", client=client)
    scope = Scope(T0 + 90 * 10**9, T0 + 10 * MIN, ("acme", "globex"))
    for mode in ("actual", "amortized", "list", "gpu"):
        assert remote.cost(mode=mode, by=("tenant", "model"), bucket="1h", scope=scope) == local.cost(
            mode=mode, by=("tenant", "model"), bucket="1h", scope=scope
        )
    for method in ("savings", "waste", "spec_efficiency", "gpu_time", "usage"):
        assert getattr(remote, method)(by=("tenant",)) == getattr(local, method)(by=("tenant",)), method
    assert remote.expert_load(model="tiny-moe") == local.expert_load(model="tiny-moe")
    assert remote.duplication() == local.duplication()
    assert remote.duplicated_blocks(limit=3) == local.duplicated_blocks(limit=3)
    assert remote.requests(order="varied", limit=4) == local.requests(order="varied", limit=4)
    for rec in dataset():
        assert remote.request(rec["request_uid"]) == local.request(rec["request_uid"])
        assert remote.tokens_statistics(rec["request_uid"]) == local.tokens_statistics(rec["request_uid"])
    assert remote.request("nope") is None and remote.tokens_statistics("nope") is None
    uids = [*[rec["request_uid"] for rec in dataset()][::-1], "nope"]
    batch = remote.requests_by_uid(uids)  # one API call, in the order asked, unknown ones left out
    assert list(batch) == [u for u in uids if u != "nope"]
    assert batch == local.requests_by_uid(uids) == {u: local.request(u) for u in batch}
    acme = Scope(tenants=("acme",))
    assert remote.requests_by_uid(uids, scope=acme) == local.requests_by_uid(uids, scope=acme)
    assert uid("e1", "r3") not in remote.requests_by_uid(uids, scope=acme)
    assert remote.request(uid("e1", "r3"), scope=Scope(tenants=("acme",))) is None
    assert remote.health() == local.health(now_ns=NOW)
    assert remote.cost(scope=Scope(tenants=())) == []
    assert isinstance(remote.cost()[0]["cost_usd"], Decimal)


def test_dashboard_command_writes_a_self_contained_file(cfg: Config, store: Store, tmp_path: Path) -> None:
    env = {
        "SPARSEETY_CLICKHOUSE_DSN": cfg.clickhouse.dsn,
        "SPARSEETY_CLICKHOUSE_DATABASE": cfg.clickhouse.database,
    }
    out = tmp_path / "d.html"
    result = CliRunner().invoke(main, ["dashboard", "--out", str(out), "--tenant", "globex"], env=env)
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "plotly.js v" in html and "<script src=" not in html and "tenants: globex" in html
    bad = CliRunner().invoke(main, ["dashboard", "--out", str(out), "--since", "soonish"], env=env)
    assert bad.exit_code == 2 and "bad since 'soonish'" in bad.output


def test_remote_errors_say_what_to_do(client: TestClient) -> None:
    down = RemoteQueries(
        "http://127.0.0.1:9", why="the embedded store at /x is open in process 7 (sparseety sink)"
    )
    with pytest.raises(RemoteApiError, match=r"open in process 7 \(sparseety sink\); the SparSEEty API at"):
        down.cost()
    down.close()
    refused = RemoteQueries("http://testserver", "wrong", client=client, data_dir="/data")
    with pytest.raises(RemoteApiError, match=r"refused the request \(401: unknown token\); .*/data/api"):
        refused.savings()
    scoped = RemoteQueries("http://testserver", "tok-acme", client=client)
    assert scoped.pipeline() == {}  # the pipeline's counters are for all-tenant tokens
    with pytest.raises(QueryError, match="unknown attribution mode"):
        scoped.cost(mode="cheapest")


def test_timeline_figure_shows_both_axes() -> None:
    from sparseety.api.figures import timeline_figure

    segments = [
        {
            "start": 0,
            "end": 8,
            "kind": "prompt",
            "status": "cached",
            "draft_accepted": False,
            "source_request_uid": "another tenant",
            "kv_fate": "window_released",
        },
        {
            "start": 8,
            "end": 12,
            "kind": "prompt",
            "status": "recomputed_after_eviction",
            "draft_accepted": False,
            "source_request_uid": None,
            "kv_fate": "skipped",
        },
        {
            "start": 12,
            "end": 20,
            "kind": "prompt",
            "status": "computed",
            "draft_accepted": False,
            "source_request_uid": None,
            "kv_fate": "kept",
        },
    ]
    fig = timeline_figure([{"request_uid": "e@1/r", "tenant": "acme", "segments": segments}])
    traces = {t["name"]: t for t in fig["data"]}
    assert set(traces) == {
        "cached",
        "recomputed_after_eviction",
        "computed",
        "KV window released",
        "KV skipped",
    }
    # Colour = how obtained; the KV fate is a transparent, hatched bar over the same positions.
    assert (traces["KV window released"]["base"], traces["KV window released"]["x"]) == ([0], [8])
    assert traces["KV skipped"]["marker"]["pattern"]["shape"] == "."
    assert traces["cached"]["customdata"][0][3] == "another tenant"


def test_sessions_route_command_and_remote_client_are_tenant_scoped(
    cfg: Config, client: TestClient, local: ApiQueries
) -> None:
    acme = get(client, "/api/v1/sessions", ACME)
    assert acme["rows"] == jsonable(local.sessions(scope=Scope(tenants=("acme",))))
    assert acme["rows"] and {r["tenant"] for r in acme["rows"]} == {"acme"}
    first = acme["rows"][0]
    turns = get(client, "/api/v1/sessions", ACME, session=first["session_id"], source="explicit")["rows"]
    assert [t["turn"] for t in turns] == list(range(1, first["turns"] + 1))
    assert get(client, "/api/v1/sessions", GI, session=first["session_id"])["rows"] == []  # not theirs
    assert "session source" in error(client, "/api/v1/sessions", 400, source="guess")
    remote = RemoteQueries("http://testserver", "tok-acme", client=client)
    assert remote.sessions() == local.sessions(scope=Scope(tenants=("acme",)))
    env = {
        "SPARSEETY_CLICKHOUSE_DSN": cfg.clickhouse.dsn,
        "SPARSEETY_CLICKHOUSE_DATABASE": cfg.clickhouse.database,
    }
    result = CliRunner().invoke(main, ["query", "sessions", "--tenant", "acme", "--format", "json"], env=env)
    assert result.exit_code == 0, result.output
    assert first["session_id"] in result.output and "globex" not in result.output
