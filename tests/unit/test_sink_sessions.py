"""Sessions in real chDB: explicit ids, inference from prefix chains, cache reuse across turns.

Blocks are 4 tokens. Block hashes are named by content: ``x0 x1`` is conversation X's system
prompt, so a request whose blocks start ``x0 x1 x2 x3`` holds X's first turn (prompt 10 + output
7 = 17 tokens, full blocks 0..3, the last two holding output). Tenant A unless said:

  x1  prompt 10 (x0 x1)             output 7 (x2 x3)   session id conv-x
  w1  prompt 12 (x0 x1 w2)          output 9 (w3 w4)   no id; shares X's system prompt only
  x2  prompt 22 (x0..x3 y4)         output 6 (y5 y6)   conv-x; reads 0..16 computed by x1
  w2  prompt 24 (x0 x1 w2 w3 w4 v5) output 2           no id; continues w1
  x3  prompt 32 (x0..x3 y4..y6 z7)  output 3           conv-x; reads 0..16 (x1) and 16..28 (x2)
  rt  prompt 10 (x0 x1)             output 7 (x2 x3)   no id; x1 again (a regeneration, not a turn)
  b1  tenant B, prompt 20 (x0..x3 b4) output 2         no id; X's first turn, another tenant
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from sparseety.errors import QueryError
from sparseety.queries.registry import Queries, Scope
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.prices import Price
from tests import factories as f
from tests.helpers import accounting_store

S = 1_000_000_000
T0 = 1_700_000_000 * S
EID = "e1@1"


def uid(name: str) -> str:
    return f"{EID}/{name}"


def seg(start: int, end: int, kind: str, status: str, source: str | None = None) -> dict[str, Any]:
    return f.segment(start, end, kind, status, source_request_uid=None if source is None else uid(source))


def turn(
    name: str,
    at: int,
    prompt: int,
    output: int,
    blocks: str,
    *,
    reads: tuple[tuple[int, int, str], ...] = (),
    session: str = "",
    tenant: str = "A",
) -> dict[str, Any]:
    """One request: ``blocks`` names its full blocks in order (prompt's, then output's);
    ``reads`` are the cached prompt spans ``(start, end, computed by)``."""
    cached = sum(e - s for s, e, _ in reads)
    names = blocks.split()
    uses = [
        {
            "block_hash": h.encode(),
            "lifetime_seq": 1,
            "role": "cached" if (i + 1) * 4 <= cached else "computed",
            "tokens": 4,
        }
        for i, h in enumerate(names)
    ]
    segments = [seg(s, e, "prompt", "cached", src) for s, e, src in reads]
    segments += [
        seg(cached, prompt, "prompt", "computed"),
        seg(prompt, prompt + output, "output", "computed"),
    ]
    computed = prompt - cached + output - 1
    return f.accounting(
        uid(name),
        engine_id=EID,
        tenant=tenant,
        arrival_ts_ns=T0 + at * S,
        finished_ts_ns=T0 + at * S + S // 2,
        prompt_tokens=prompt,
        output_tokens=output,
        cache_read_tokens=cached,
        uncached_computed_tokens=computed,
        scheduled_tokens=computed,
        engine_prompt_tokens=prompt,
        engine_output_tokens=output,
        engine_cached_tokens=cached,
        block_uses=uses,
        timeline={"segments": segments, "attention_window": None},
        session_id=session,
    )


def dataset() -> list[dict[str, Any]]:
    return [
        turn("x1", 1, 10, 7, "x0 x1 x2 x3", session="conv-x"),
        turn("w1", 2, 12, 9, "x0 x1 w2 w3 w4", reads=((0, 8, "x1"),)),
        turn("x2", 3, 22, 6, "x0 x1 x2 x3 y4 y5 y6", reads=((0, 16, "x1"),), session="conv-x"),
        turn("w2", 4, 24, 2, "x0 x1 w2 w3 w4 v5", reads=((0, 8, "x1"), (8, 20, "w1"))),
        turn(
            "x3",
            5,
            32,
            3,
            "x0 x1 x2 x3 y4 y5 y6 z7",
            reads=((0, 16, "x1"), (16, 28, "x2")),
            session="conv-x",
        ),
        turn("rt", 6, 10, 7, "x0 x1 x2 x3", reads=((0, 8, "x1"),)),
        turn("b1", 7, 20, 2, "x0 x1 x2 x3 b4", tenant="B"),
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    prices = [
        Price("tiny", "input", Decimal("10"), 0),
        Price("tiny", "cached_input", Decimal("1"), 0),
        Price("tiny", "output", Decimal("40"), 0),
    ]
    with accounting_store(tmp_path_factory, dataset(), prices) as s:
        yield s


@pytest.fixture
def q(store: Store) -> Queries:
    return Queries(store)


EVERYTHING = Scope()


def members(q: Queries, source: str, scope: Scope = EVERYTHING) -> dict[tuple[str, str], list[str]]:
    """(tenant, session) -> its requests in turn order."""
    out = {}
    for row in q.sessions(source=source, scope=scope):
        turns = q.sessions(source=source, session=row["session_id"], scope=scope)
        out[(row["tenant"], row["session_id"])] = [
            t["request_uid"].rsplit("/", 1)[1] for t in turns if t["tenant"] == row["tenant"]
        ]
        assert row["turns"] == len(out[(row["tenant"], row["session_id"])])
    return out


def test_inferred_sessions_follow_prefix_chains_within_a_tenant(q: Queries) -> None:
    assert members(q, "inferred") == {
        ("A", uid("x1")): ["x1", "x2", "x3"],
        ("A", uid("w1")): ["w1", "w2"],  # the shared system prompt alone links nothing
        ("A", uid("rt")): ["rt"],  # the same prompt again is not a next turn
        ("B", uid("b1")): ["b1"],  # the same tokens in another tenant are another conversation
    }


def test_explicit_ids_win_in_auto_and_stand_alone_in_explicit(q: Queries) -> None:
    assert members(q, "auto") == {
        ("A", "conv-x"): ["x1", "x2", "x3"],
        ("A", uid("w1")): ["w1", "w2"],
        ("A", uid("rt")): ["rt"],
        ("B", uid("b1")): ["b1"],
    }
    explicit = members(q, "explicit")
    assert explicit[("A", "conv-x")] == ["x1", "x2", "x3"]
    assert explicit[("A", uid("w2"))] == ["w2"]  # no id, no inference: a session of one turn
    by_session = {r["session_id"]: r for r in q.sessions(source="auto")}
    assert by_session["conv-x"]["explicit"] and not by_session[uid("w1")]["explicit"]


def test_turns_name_the_turn_they_continue_and_what_they_read_from_earlier_turns(q: Queries) -> None:
    turns = q.sessions(source="inferred", session=uid("x1"))
    assert [(t["turn"], t["continues_uid"]) for t in turns] == [(1, ""), (2, uid("x1")), (3, uid("x2"))]
    assert [(t["cache_from_previous_turn_tokens"], t["cache_from_earlier_turns_tokens"]) for t in turns] == [
        (0, 0),
        (16, 0),
        (12, 16),
    ]
    (x,) = (r for r in q.sessions(source="inferred") if r["session_id"] == uid("x1"))
    assert (x["cache_from_previous_turn_tokens"], x["cache_from_earlier_turns_tokens"]) == (28, 16)
    assert x["later_turns_prompt_tokens"] == 22 + 32
    assert x["cross_turn_reuse_share"] == pytest.approx(44 / 54)
    # w2 read 8 tokens x1 computed: another session's, so neither previous nor earlier turn
    (w2,) = (t for t in q.sessions(source="inferred", session=uid("w1")) if t["turn"] == 2)
    assert (w2["cache_read_tokens"], w2["cache_from_previous_turn_tokens"]) == (20, 12)
    assert w2["cache_from_earlier_turns_tokens"] == 0


def test_session_counts_and_costs_are_the_sums_of_their_turns(q: Queries) -> None:
    (x,) = (r for r in q.sessions(source="auto") if r["session_id"] == "conv-x")
    got = [q.request(uid(n)) for n in ("x1", "x2", "x3")]
    assert all(r is not None for r in got)
    for key in ("prompt_tokens", "output_tokens", "cache_read_tokens", "uncached_computed_tokens"):
        assert x[key] == sum(r[key] for r in got if r is not None), key
    for mode in ("actual", "amortized", "list", "gpu"):
        assert x[f"{mode}_usd"] == sum((r["cost"][mode] for r in got if r is not None), Decimal(0)), mode
    assert x["actual_usd"] > 0 and x["unpriced_turns"] == 0


def test_sessions_are_tenant_scoped_and_a_range_keeps_an_earlier_first_turn(q: Queries) -> None:
    assert set(members(q, "inferred", Scope(tenants=("B",)))) == {("B", uid("b1"))}
    assert all(t == "A" for t, _ in members(q, "inferred", Scope(tenants=("A",))))
    later = members(q, "inferred", Scope(since_ns=T0 + 2 * S))
    assert later[("A", uid("x1"))] == ["x2", "x3"]  # x1 finished before the range: still the key


def test_unknown_source_is_refused(q: Queries) -> None:
    with pytest.raises(QueryError, match="session source"):
        q.sessions(source="guess")


def short_answers() -> list[dict[str, Any]]:
    """Tenant C (issue 31: a real chat's turns came out as one-turn sessions, and one
    conversation re-sent in a later engine run was merged with the first):

      s1  prompt 10 (s0 s1)          output 1: no full block holds output; its tail is s1
      k1  prompt 11 (s0 s1)          output 8: another conversation's first turn, same system prompt
      s2  prompt 16 (s0 s1 s2 s3)    output 1: s1's prompt, its answer, a new message
      s3  prompt 22 (s0 .. s4)       output 1: continues s2 (the longer chain), and s1 through it
      r1  prompt 10 (s0 s1)          output 1: the conversation again, in a later run
      r2  prompt 16 (s0 s1 s2 s3)    output 1: its second turn there
    """
    return [
        turn("s1", 1, 10, 1, "s0 s1", tenant="C"),
        turn("k1", 2, 11, 8, "s0 s1 k2 k3", reads=((0, 8, "s1"),), tenant="C"),
        turn("s2", 3, 16, 1, "s0 s1 s2 s3", reads=((0, 8, "s1"),), tenant="C"),
        turn("s3", 4, 22, 1, "s0 s1 s2 s3 s4", reads=((0, 16, "s2"),), tenant="C"),
        turn("r1", 10, 10, 1, "s0 s1", reads=((0, 8, "s1"),), tenant="C"),
        turn("r2", 11, 16, 1, "s0 s1 s2 s3", reads=((0, 16, "s2"),), tenant="C"),
    ]


def test_short_answers_siblings_and_a_conversation_sent_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with accounting_store(tmp_path_factory, short_answers()) as s:
        q = Queries(s)
        assert members(q, "inferred") == {
            ("C", uid("s1")): ["s1", "s2", "s3"],
            ("C", uid("k1")): ["k1"],  # shares the system prompt, never continues s1
            ("C", uid("r1")): ["r1", "r2"],  # the later run's conversation is its own
        }
        turns = {t["request_uid"]: t for t in q.sessions(source="inferred", session=uid("s1"))}
        assert turns[uid("s3")]["continues_uid"] == uid("s2")  # the longest chain, not s1
        # the range starts after s1 and s2: s3 still belongs to s1's conversation
        later = Scope(since_ns=T0 + 4 * S)
        assert [
            r["session_id"] for r in q.sessions(source="inferred", scope=later) if r["tenant"] == "C"
        ] == [
            uid("s1"),
            uid("r1"),
        ]
