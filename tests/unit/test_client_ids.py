"""Issue 21: a request found by the id its client has, and the n choices of one API request billed
as one invoice line in ``list`` mode.

The chain, each link real where it can be: vLLM's engine request ids as vLLM 0.32 builds them ->
the plugin's RequestStarted fields -> the fold's RequestAccounting -> the ``requests`` columns
(migration 009) on chDB -> look-ups, the requests filter, ``list`` cost, the HTTP API (409 with
the candidates when an id names several) and the remote client.

Crafted store (tenant, model m1: input $10, cached $2.5, output $40 per 1M tokens):

  e1/0_cmpl-nn-0-aaaa1111  acme  P1000 C0   O100  choice 0 of parent cmpl-nn-0-aaaa1111, T0+1m
  e1/1_cmpl-nn-0-aaaa1111  acme  P1000 C0   O150  choice 1, finished last: carries the prompt, T0+2m
  e1/chatcmpl-one-bbbb2222 acme  P500  C200 O50   n = 1, X-Request-Id "one"
  e1/chatcmpl-dup-cccc3333 acme  P10   C0   O1    the same front-end id ...
  e2/chatcmpl-dup-dddd4444 globex P10  C0   O1    ... on another engine
  e1/chatcmpl-old-eeee5555 acme  P10   C0   O1    written before migration 009 (no external id)
  e3/chatcmpl-spec-ffff6666 initech P10 C0  O9    drafts: 8 accepted, 2 rejected, 2 cut (1 of them
                                                   unverified), T0+7m
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sparseety import events as ev
from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.client import RemoteQueries
from sparseety.config import Config, WorkerConfig
from sparseety.errors import AmbiguousIdError
from sparseety.producers.vllm.request_ids import request_identity
from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import Price
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import store_fixtures, write_accounting

S = 1_000_000_000
T0 = 1_700_000_000 * S
MIN = 60 * S
D = Decimal

# --- vLLM's ids -> the plugin's fields ----------------------------------------------------------


@pytest.mark.parametrize(
    ("engine_id", "external", "parent", "index"),
    [
        # chat: chatcmpl-<X-Request-Id or random> + -<8 hex>
        ("chatcmpl-af58f0f913ef2327-99de1934", "chatcmpl-af58f0f913ef2327", "", 0),
        # completions: cmpl-<id>-<prompt index> + -<8 hex>
        ("cmpl-abc-0-0123abcd", "cmpl-abc-0", "", 0),
        # n = 2: <index>_<parent id>
        ("0_cmpl-abc-0-0123abcd", "cmpl-abc-0", "cmpl-abc-0-0123abcd", 0),
        ("1_chatcmpl-x-ffffffff", "chatcmpl-x", "chatcmpl-x-ffffffff", 1),
        # the offline LLM class counts: "3", then "3-<8 hex>"; its n > 1 choices the same way
        ("12_3-deadbeef", "3", "3-deadbeef", 12),
        # a client's X-Request-Id that looks like a choice prefix stays inside the front end's id
        ("chatcmpl-7_x-deadbeef", "chatcmpl-7_x", "", 0),
        # no random suffix: the id is the front end's (and "<digits>_" is not a choice then)
        ("my-own-id", "my-own-id", "", 0),
        ("2_no-suffix", "2_no-suffix", "", 0),
    ],
)
def test_request_identity_reads_vllm_ids(engine_id: str, external: str, parent: str, index: int) -> None:
    assert request_identity(engine_id, randomized=True) == {
        "external_request_id": external,
        "parent_request_id": parent,
        "choice_index": index,
    }


def test_request_identity_without_randomization(monkeypatch: pytest.MonkeyPatch) -> None:
    # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION: the id is the front end's; a hex tail is its own
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert request_identity("chatcmpl-abc-deadbeef") == {
        "external_request_id": "chatcmpl-abc-deadbeef",
        "parent_request_id": "",
        "choice_index": 0,
    }
    assert request_identity("1_cmpl-abc-0")["parent_request_id"] == "cmpl-abc-0"
    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")
    assert request_identity("chatcmpl-abc-deadbeef")["external_request_id"] == "chatcmpl-abc"


def test_request_started_carries_the_identity() -> None:
    from tests.unit.test_producer_vllm import _builder, _req

    _, p = _builder().request_started(_req("1_cmpl-q-0-0a0b0c0d", list(range(10))), 0)
    assert (p["external_request_id"], p["parent_request_id"], p["choice_index"]) == (
        "cmpl-q-0",
        "cmpl-q-0-0a0b0c0d",
        1,
    )


# --- the fold keeps them ------------------------------------------------------------------------


def test_fold_keeps_the_identity() -> None:
    asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
    ident = request_identity("1_chatcmpl-z-0a0b0c0d", randomized=True)
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("1_chatcmpl-z-0a0b0c0d", list(range(10)), **ident)),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("1_chatcmpl-z-0a0b0c0d", 10, 0, [7])])),
        f.wrap(3, ev.REQUEST_FINISHED, f.request_finished("1_chatcmpl-z-0a0b0c0d", prompt=10, output=1)),
    ]
    out = [o for e in events for o in asm.apply(e)]
    (acc,) = [o.record for o in out if o.topic == TIMELINES]
    assert (acc["external_request_id"], acc["parent_request_id"], acc["choice_index"]) == (
        "chatcmpl-z",
        "chatcmpl-z-0a0b0c0d",
        1,
    )


# --- the store ----------------------------------------------------------------------------------


def _row(
    engine: str, rid: str, tenant: str, minute: int, *, ident: bool = True, **counts: Any
) -> dict[str, Any]:
    """A row of ``counts`` (f.counted's P, C, O and any field) scheduling P - C + O - 1 positions."""
    return f.counted(
        f"{engine}@1/{rid}",
        request_id=rid,
        tenant=tenant,
        model="m1",
        finished_ts_ns=T0 + minute * MIN,
        S=counts["P"] - counts["C"] + counts["O"] - 1,
        block_uses=[],
        **(request_identity(rid, randomized=True) if ident else {}),
        **counts,
    )


# speculative decoding with cut drafts: 8 accepted, 2 rejected, 2 cut (1 by the stop after the
# verifier accepted it, 1 scheduled in the step the request ended in, never verified)
CUT_DRAFTS = {
    "draft_accepted_tokens": 8,
    "draft_rejected_tokens": 2,
    "draft_cut_tokens": 2,
    "draft_unverified_tokens": 1,
}
ROWS = [
    _row("e1", "0_cmpl-nn-0-aaaa1111", "acme", 1, P=1000, C=0, O=100),
    _row("e1", "1_cmpl-nn-0-aaaa1111", "acme", 2, P=1000, C=0, O=150),
    _row("e1", "chatcmpl-one-bbbb2222", "acme", 3, P=500, C=200, O=50),
    _row("e1", "chatcmpl-dup-cccc3333", "acme", 4, P=10, C=0, O=1),
    _row("e2", "chatcmpl-dup-dddd4444", "globex", 5, P=10, C=0, O=1),
    _row("e1", "chatcmpl-old-eeee5555", "acme", 6, P=10, C=0, O=1, ident=False),
    _row("e3", "chatcmpl-spec-ffff6666", "initech", 7, P=10, C=0, O=9, **CUT_DRAFTS),
]
PRICES = [
    Price("m1", "input", D("10"), 0),
    Price("m1", "cached_input", D("2.5"), 0),
    Price("m1", "output", D("40"), 0),
]


cfg, store = store_fixtures(lambda s: write_accounting(s, ROWS, PRICES), "client-ids")


@pytest.fixture
def q(store: Store) -> Queries:
    return Queries(store)


def test_store_keeps_the_identity(q: Queries) -> None:
    rows = q.store.query(
        f"SELECT request_id, external_request_id, parent_request_id, choice_index FROM {q.db}.requests_v "
        "ORDER BY request_uid"
    )
    got = {
        r["request_id"]: (r["external_request_id"], r["parent_request_id"], r["choice_index"]) for r in rows
    }
    assert got["1_cmpl-nn-0-aaaa1111"] == ("cmpl-nn-0", "cmpl-nn-0-aaaa1111", 1)
    assert got["chatcmpl-one-bbbb2222"] == ("chatcmpl-one", "", 0)
    assert got["chatcmpl-old-eeee5555"] == ("", "", 0)  # as a row from before migration 009


def test_list_bills_the_prompt_of_n_choices_once(q: Queries) -> None:
    # The response's usage for the n = 2 request: prompt 1000 (once), completion 100 + 150.
    scope = Scope(T0, T0 + 150 * S)  # the two choices only
    (row,) = q.cost(mode="list", scope=scope)
    got = (row["requests"], row["sequences"], row["input_tokens"], row["cached_tokens"], row["output_tokens"])
    assert got == (1, 2, 1000, 0, 250)  # one API request, served by two engine requests
    assert row["prompt_tokens"] == row["billed_prompt_tokens"] == 1000  # usage.prompt_tokens
    assert row["cost_usd"] == D("0.01") + D("0.01")  # 1000 x 10e-6 + 250 x 40e-6
    # the choice that finished last carries the prompt; the other its output only
    by_uid = q.requests_by_uid(["e1@1/0_cmpl-nn-0-aaaa1111", "e1@1/1_cmpl-nn-0-aaaa1111"])
    assert by_uid["e1@1/1_cmpl-nn-0-aaaa1111"]["cost"]["list"] == D("0.01") + D("0.006")
    assert by_uid["e1@1/0_cmpl-nn-0-aaaa1111"]["cost"]["list"] == D("0.004")
    # actual still charges each choice what the engine computed for it
    (actual,) = q.cost(mode="actual", scope=scope)
    assert actual["input_tokens"] == 999 + 999  # S - O per choice
    # savings' prompt is the same word (once per API request); its hit rate is the engine's,
    # over each choice's own prompt positions (issue 31: one meaning per word)
    (sav,) = q.savings(scope=scope)
    assert (sav["requests"], sav["prompt_tokens"]) == (row["requests"], row["prompt_tokens"]) == (1, 1000)
    assert (sav["sequences"], sav["sequence_prompt_tokens"]) == (2, 2000)


def test_list_for_n_1_is_unchanged(q: Queries) -> None:
    (row,) = q.cost(mode="list", scope=Scope(T0 + 150 * S, T0 + 210 * S))
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == (300, 200, 50)
    assert row["cost_usd"] == D("0.003") + D("0.0005") + D("0.002")


def test_found_by_the_response_id(q: Queries) -> None:
    found = q.request("chatcmpl-one")
    assert found is not None and found["request_uid"] == "e1@1/chatcmpl-one-bbbb2222"
    assert found["external_request_id"] == "chatcmpl-one"
    # the engine's id and the uid find it too, and the token statistics by the same ids
    assert q.request("chatcmpl-one-bbbb2222")["request_uid"] == found["request_uid"]  # type: ignore[index]
    assert q.request(found["request_uid"])["request_uid"] == found["request_uid"]  # type: ignore[index]
    stats = q.tokens_statistics("chatcmpl-one")
    assert stats is not None and (stats["input_token_count"], stats["cached_token_count"]) == (500, 200)
    records = q.token_records("chatcmpl-one")
    assert records is not None and records["request_uid"] == found["request_uid"]
    # a row written before the plugin recorded the external id: read off its engine id
    assert q.request("chatcmpl-old")["request_uid"] == "e1@1/chatcmpl-old-eeee5555"  # type: ignore[index]
    assert q.request("chatcmpl-nope") is None


def test_ambiguity_is_listed_never_guessed(q: Queries) -> None:
    # the n choices of one completions response: cmpl-nn is the response's id
    with pytest.raises(AmbiguousIdError) as n2:
        q.request("cmpl-nn")
    assert sorted(c["choice_index"] for c in n2.value.candidates) == [0, 1]
    assert {c["request_uid"] for c in n2.value.candidates} == {
        "e1@1/0_cmpl-nn-0-aaaa1111",
        "e1@1/1_cmpl-nn-0-aaaa1111",
    }
    # the same front-end id on two engines
    with pytest.raises(AmbiguousIdError) as two:
        q.tokens_statistics("chatcmpl-dup")
    assert {c["engine_name"] for c in two.value.candidates} == {"e1", "e2"}
    # scoped to one tenant, only its request is a candidate: found, not ambiguous
    assert q.request("chatcmpl-dup", scope=Scope(tenants=("globex",)))["engine_name"] == "e2"  # type: ignore[index]
    assert q.request("chatcmpl-one", scope=Scope(tenants=("globex",))) is None


def test_requests_filter_by_request_and_client_id(q: Queries) -> None:
    got = q.requests(request_id="cmpl-nn")
    pairs = sorted((r["external_request_id"], r["choice_index"]) for r in got)
    assert pairs == [("cmpl-nn-0", 0), ("cmpl-nn-0", 1)]
    assert [r["request_uid"] for r in q.requests(client_id="one")] == ["e1@1/chatcmpl-one-bbbb2222"]
    assert {r["engine_name"] for r in q.requests(client_id="dup")} == {"e1", "e2"}
    assert len(q.requests(client_id="nn")) == 2  # cmpl-nn-0: X-Request-Id "nn" with its prompt index
    assert q.requests(client_id="n") == []
    assert len(q.requests()) == len(ROWS)


# --- the HTTP API and the remote client ---------------------------------------------------------


@pytest.fixture(scope="module")
def client(cfg: Config, store: Store) -> Iterator[TestClient]:
    tokens = TokenTable({"adm": ["*"], "acme": ["acme"]}, admin_token="p")
    b = Backend(cfg, store, tokens=tokens, clock=lambda: T0)
    with TestClient(create_api(b)) as c:
        yield c
    b.close()


def test_api_finds_by_response_id_and_lists_ambiguity(client: TestClient) -> None:
    adm = {"Authorization": "Bearer adm"}
    r = client.get("/api/v1/tokens/statistics", params={"request_id": "chatcmpl-one"}, headers=adm)
    assert r.status_code == 200 and r.json()["input_token_count"] == 500, r.text
    r = client.get("/api/v1/requests/chatcmpl-one", headers=adm)
    assert r.status_code == 200 and r.json()["request_uid"] == "e1@1/chatcmpl-one-bbbb2222"
    r = client.get("/api/v1/requests/chatcmpl-dup", headers=adm)
    assert r.status_code == 409 and r.json()["error"] == "ambiguous", r.text
    assert len(r.json()["candidates"]) == 2
    # a tenant's token sees only its tenant's candidate
    r = client.get("/api/v1/requests/chatcmpl-dup", headers={"Authorization": "Bearer acme"})
    assert r.status_code == 200 and r.json()["engine_name"] == "e1"
    r = client.get("/api/v1/requests", params={"client_id": "dup"}, headers=adm)
    assert r.status_code == 200 and len(r.json()["rows"]) == 2
    remote = RemoteQueries("http://testserver", "adm", client=client)
    with pytest.raises(AmbiguousIdError) as amb:
        remote.request("cmpl-nn")
    assert len(amb.value.candidates) == 2
    assert remote.tokens_statistics("chatcmpl-one") == {
        k: v
        for k, v in client.get(
            "/api/v1/tokens/statistics", params={"request_id": "chatcmpl-one"}, headers=adm
        )
        .json()
        .items()
        if k != "request_id"
    }


def test_cli_finds_by_client_id_with_readable_tables(cfg: Config, store: Store) -> None:
    from click.testing import CliRunner

    from sparseety.cli import main

    env = {
        "SPARSEETY_CLICKHOUSE_DSN": cfg.clickhouse_dsn,
        "SPARSEETY_CLICKHOUSE_DATABASE": cfg.clickhouse.database,
    }
    run = CliRunner()
    out = run.invoke(main, ["query", "requests", "--client-id", "one"], env=env)
    assert out.exit_code == 0, out.output
    header = out.stdout.splitlines()[0].split()
    assert header[:3] == ["request_uid", "external_request_id", "choice_index"]
    assert "recomputed_tokens" not in header and "more columns: --wide" in out.stderr
    wide = run.invoke(main, ["query", "requests", "--request-id", "chatcmpl-one", "--wide"], env=env)
    assert wide.exit_code == 0 and "recomputed_tokens" in wide.stdout.splitlines()[0]
    # one request: times readable, the ns beside them
    one = run.invoke(main, ["query", "request", "chatcmpl-one"], env=env)
    assert one.exit_code == 0, one.output
    finished = next(x for x in one.stdout.splitlines() if x.strip().startswith("finished_ts_ns"))
    assert "2023-11-14T22:16:20.000Z" in finished and str(T0 + 3 * MIN) in finished
    # an id that names two: both listed, exit 1
    amb = run.invoke(main, ["query", "request", "chatcmpl-dup", "--format", "json"], env=env)
    assert amb.exit_code == 1 and "names 2 requests" in amb.stderr


def test_one_definition_of_draft_counts(q: Queries) -> None:
    """spec and the token statistics count drafts alike (docs/streams.md, Drafts): vLLM's counters
    hold the stop-cut draft as drafted and accepted, and the unverified one nowhere."""
    (spec,) = q.spec_efficiency(scope=Scope(tenants=("initech",)))
    assert (spec["draft_tokens"], spec["draft_unverified_tokens"]) == (12, 1)
    assert (spec["draft_verified_tokens"], spec["verifier_accepted_tokens"]) == (11, 9)  # vLLM's two
    assert spec["acceptance_rate"] == pytest.approx(8 / 12) and spec["vllm_acceptance_rate"] == pytest.approx(
        9 / 11
    )
    stats = q.tokens_statistics("chatcmpl-spec")
    assert stats is not None
    assert stats["draft_token_count"] + stats["draft_cut_count"] == spec["draft_tokens"]
    assert stats["draft_token_count"] == spec["draft_accepted_tokens"] + spec["draft_rejected_tokens"]
