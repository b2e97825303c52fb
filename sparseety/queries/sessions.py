"""Sessions (multi-turn conversations): the SQL that groups stored requests into them.

A request's session is the id its client sent (``requests.session_id``, from
``vllm_xargs.session`` or the ``X-Sparseety-Session`` header) or, when it sent none, one inferred
from prefix chains within its tenant (docs/sessions.md). A request A's *tails* are its last full
KV block (prompt or output) and its last full prompt block (a client that re-sends the answer
as text may re-tokenize it, so that only the prompt's chain matches); ``kv_blocks`` holds the
prompt's full blocks at idx 0..P-1, then the output's, so idx is the block index. Then

    request B may continue request A  iff  A arrived before B, both belong to one tenant, B's
    prompt has one of A's tail hashes at the same block index, and B's prompt is longer than
    A's by more than half of A's output (rounded up);

and B's previous turn is the candidate with the longest such chain (the highest tail index;
among equals, one whose whole prompt and answer fit in B's prompt, then the latest arrival).
Block hashes are chained (each covers every token before it), so a match means B's prompt
starts with A's whole prompt up to that block. The length rule keeps apart the first turns of
two conversations that share a system prompt (a sibling is rarely longer than A's prompt plus
half of A's answer; a next turn re-sends the answer, re-tokenized perhaps, and adds a message),
and an identical request sent again (same length) is never a continuation, so a conversation
re-sent in a later engine run links to its own turns. The session key of an inferred session is
the uid of its first turn, found by following previous turns back (a recursive CTE: turns are
strictly earlier, so the chain ends). A heuristic on hashes and lengths, labelled as such in
docs/sessions.md: an explicit session id always wins.

Cache reuse across turns comes from the timeline: a cached segment names the request that
computed it (``source_request_uid``). Positions a turn read from the cache are split by who
computed them: turn N - 1, an earlier turn of the same session, or anyone else.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sparseety.errors import QueryError

from .base import Scope

#: How a request's session is chosen: the client's id, else inferred (auto); only the client's
#: (explicit: requests without one are sessions of one turn); or only inferred (ids ignored).
SOURCES = ("auto", "explicit", "inferred")

#: The per-request counts a session sums (request_costs_v columns; old rows read as there).
COUNTS = (
    "prompt_tokens",
    "output_tokens",
    "cache_read_tokens",
    "uncached_computed_tokens",
    "recomputed_preemption_tokens",
    "recomputed_eviction_tokens",
    "draft_accepted_tokens",
    "draft_rejected_tokens",
    "draft_cut_tokens",
    "waste_tokens",
    "scheduled_tokens",
    "gpu_time_ns",
)

#: Attribution modes with a per-request cost (docs/cost-model.md), as ``<mode>_pico`` columns.
COST_MODES = ("actual", "amortized", "list", "gpu")


def _turns(db: str, *, source: str, scope: Scope) -> tuple[str, dict[str, Any]]:
    """WITH clauses ending in ``per_turn``: one row per request in scope with its session, its
    turn number in the session, what it read from earlier turns, its counts and its costs.

    The session is settled on the narrow ``requests`` columns first; the cost views (FINAL, ASOF
    price joins, amortized shares) are read once, for the requests in scope, at the end.
    """
    if source not in SOURCES:
        raise QueryError(f"unknown session source {source!r}: choose from {', '.join(SOURCES)}")
    where, params = scope.where()
    clauses = [
        "scoped AS (SELECT request_uid, tenant, arrival_ts_ns, finished_ts_ns, prompt_tokens, "
        f"session_id AS client_session FROM {db}.requests_v WHERE {where})"
    ]
    if source == "explicit":
        session = "if(s.client_session != '', s.client_session, s.request_uid)"
        link = "''"
        joins = ""
    else:
        # Earlier turns may have finished before the range: any time before its end, same tenants.
        earlier = replace(scope, since_ns=None)
        parents_where, parents_params = earlier.where("b")
        everyone_where, _ = earlier.where("r")
        params.update(parents_params)
        clauses += [
            "everyone AS (SELECT r.request_uid AS request_uid, r.tenant AS tenant, "
            "r.arrival_ts_ns AS arrival_ts_ns, r.prompt_tokens AS prompt_tokens "
            f"FROM {db}.requests_v AS r WHERE {everyone_where})",
            # Each request's two tails: its last full block, and its last full prompt block (a
            # client that re-sends the answer as text may re-tokenize it: then only the prompt's
            # chain matches).
            "ends AS ("
            "SELECT b.request_uid AS parent_uid, b.tenant AS tenant, any(p.arrival_ts_ns) AS parent_arrival, "
            "any(p.prompt_tokens) AS parent_prompt, any(p.output_tokens) AS parent_output, "
            "max(b.idx) AS last_idx, argMax(b.block_hash, b.idx) AS last_hash, "
            "maxIf(b.idx, (b.idx + 1) * b.tokens <= p.prompt_tokens) AS prompt_idx, "
            "argMaxIf(b.block_hash, b.idx, (b.idx + 1) * b.tokens <= p.prompt_tokens) AS prompt_hash, "
            "countIf((b.idx + 1) * b.tokens <= p.prompt_tokens) AS prompt_blocks "
            f"FROM {db}.kv_blocks_v AS b "
            "INNER JOIN (SELECT request_uid, arrival_ts_ns, prompt_tokens, output_tokens "
            f"FROM {db}.requests_v) AS p ON b.request_uid = p.request_uid "
            f"WHERE {parents_where} GROUP BY b.request_uid, b.tenant)",
            "tails AS ("
            "SELECT parent_uid, tenant, parent_arrival, parent_prompt, parent_output, "
            "last_idx AS idx, last_hash AS block_hash FROM ends "
            "UNION ALL SELECT parent_uid, tenant, parent_arrival, parent_prompt, parent_output, "
            "prompt_idx AS idx, prompt_hash AS block_hash FROM ends "
            "WHERE prompt_blocks > 0 AND prompt_idx != last_idx)",
            # Each request's previous turn: the longest chain it continues.
            "parents AS ("
            "SELECT s.request_uid AS request_uid, "
            "argMax(t.parent_uid, (t.idx, s.prompt_tokens > t.parent_prompt + t.parent_output, "
            "t.parent_arrival, t.parent_uid)) AS parent_uid "
            f"FROM {db}.kv_blocks_v AS q INNER JOIN everyone AS s ON q.request_uid = s.request_uid "
            "INNER JOIN tails AS t ON q.block_hash = t.block_hash AND q.idx = t.idx AND s.tenant = t.tenant "
            "WHERE (q.idx + 1) * q.tokens <= s.prompt_tokens AND t.parent_arrival < s.arrival_ts_ns "
            "AND toInt64(s.prompt_tokens) > "
            "toInt64(t.parent_prompt) + intDiv(toInt64(t.parent_output) + 1, 2) "
            "GROUP BY s.request_uid)",
            # Back along previous turns to the first, for the requests in scope (their earlier
            # turns may lie before the range).
            "climb AS ("
            "SELECT p.request_uid AS request_uid, p.parent_uid AS up FROM parents AS p "
            "INNER JOIN scoped AS s ON p.request_uid = s.request_uid "
            "UNION ALL SELECT c.request_uid AS request_uid, pp.parent_uid AS up "
            "FROM climb AS c INNER JOIN parents AS pp ON c.up = pp.request_uid)",
            "links AS ("
            "SELECT c.request_uid AS request_uid, "
            "anyIf(c.up, c.up NOT IN (SELECT request_uid FROM parents)) AS root_uid, "
            "any(p.parent_uid) AS parent_uid "
            "FROM climb AS c INNER JOIN parents AS p ON c.request_uid = p.request_uid "
            "GROUP BY c.request_uid)",
        ]
        inferred = "if(l.root_uid != '', l.root_uid, s.request_uid)"
        session = (
            inferred if source == "inferred" else f"if(s.client_session != '', s.client_session, {inferred})"
        )
        link = "l.parent_uid"
        joins = "LEFT JOIN links AS l ON s.request_uid = l.request_uid"
    explicit = "0" if source == "inferred" else "s.client_session != ''"
    counts = ", ".join(f"c.{n} AS {n}" for n in COUNTS)
    clauses += [
        "numbered AS ("
        f"SELECT s.request_uid AS request_uid, s.tenant AS tenant, {session} AS session_id, "
        f"toBool({explicit}) AS explicit, {link} AS continues_uid, s.arrival_ts_ns AS arrival_ts_ns, "
        "s.finished_ts_ns AS finished_ts_ns, toUInt32(row_number() OVER "
        "(PARTITION BY s.tenant, session_id ORDER BY s.arrival_ts_ns, s.request_uid)) AS turn "
        f"FROM scoped AS s {joins})",
        # Cached positions of each turn, by the turn of the same session that computed them.
        "reuse AS ("
        "SELECT g.request_uid AS request_uid, "
        "sumIf(g.end - g.start, src.session_id = n.session_id AND src.turn + 1 = n.turn) AS from_previous, "
        "sumIf(g.end - g.start, src.session_id = n.session_id AND src.turn + 1 < n.turn) AS from_earlier "
        f"FROM {db}.token_segments_v AS g INNER JOIN numbered AS n ON g.request_uid = n.request_uid "
        "LEFT JOIN (SELECT request_uid, tenant, session_id, turn FROM numbered) AS src "
        "ON g.source_request_uid = src.request_uid AND n.tenant = src.tenant "
        "WHERE g.status = 'cached' GROUP BY g.request_uid)",
        "per_turn AS ("
        "SELECT n.request_uid AS request_uid, n.tenant AS tenant, n.session_id AS session_id, "
        "n.explicit AS explicit, n.continues_uid AS continues_uid, n.arrival_ts_ns AS arrival_ts_ns, "
        f"n.finished_ts_ns AS finished_ts_ns, n.turn AS turn, {counts}, "
        "toInt64(ifNull(u.from_previous, 0)) AS cache_from_previous_turn_tokens, "
        "toInt64(ifNull(u.from_earlier, 0)) AS cache_from_earlier_turns_tokens, "
        "c.actual_pico AS actual_pico, c.actual_pico + ifNull(d.delta_pico, 0) AS amortized_pico, "
        "c.list_pico AS list_pico, c.gpu_pico AS gpu_pico, c.tokens_priced AS tokens_priced "
        f"FROM numbered AS n INNER JOIN {db}.request_costs_v AS c ON n.request_uid = c.request_uid "
        f"LEFT JOIN {db}.amortized_delta_v AS d ON n.request_uid = d.request_uid "
        "LEFT JOIN reuse AS u ON n.request_uid = u.request_uid)",
    ]
    return ("WITH " if source == "explicit" else "WITH RECURSIVE ") + ", ".join(clauses), params


def sessions_sql(
    db: str, *, source: str, session: str | None, limit: int, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """One row per session (first turn first), or, given ``session``, one row per turn of it."""
    with_, params = _turns(db, source=source, scope=scope)
    params["limit"] = limit
    if session is not None:
        params["session"] = session
        counts = ", ".join(COUNTS)
        costs = ", ".join(f"{m}_pico" for m in COST_MODES)
        sql = (
            f"{with_} SELECT tenant, session_id, turn, request_uid, continues_uid, explicit, "
            f"arrival_ts_ns, finished_ts_ns, {counts}, cache_from_previous_turn_tokens, "
            f"cache_from_earlier_turns_tokens, {costs}, tokens_priced "
            "FROM per_turn WHERE session_id = {session:String} "
            "ORDER BY tenant, turn LIMIT {limit:UInt32}"
        )
        return sql, params
    sums = ", ".join(f"sum(p.{n}) AS {n}" for n in COUNTS)
    costs = ", ".join(f"sum(p.{m}_pico) AS {m}_pico" for m in COST_MODES)
    sql = (
        f"{with_} SELECT p.tenant AS tenant, p.session_id AS session_id, max(p.explicit) AS explicit, "
        "count() AS turns, min(p.arrival_ts_ns) AS first_arrival_ts_ns, "
        f"max(p.finished_ts_ns) AS last_finished_ts_ns, {sums}, "
        "sum(p.cache_from_previous_turn_tokens) AS cache_from_previous_turn_tokens, "
        "sum(p.cache_from_earlier_turns_tokens) AS cache_from_earlier_turns_tokens, "
        "sumIf(p.prompt_tokens, p.turn > 1) AS later_turns_prompt_tokens, "
        "if(later_turns_prompt_tokens = 0, 0, "
        "(cache_from_previous_turn_tokens + cache_from_earlier_turns_tokens) / later_turns_prompt_tokens) "
        f"AS cross_turn_reuse_share, {costs}, countIf(NOT p.tokens_priced) AS unpriced_turns "
        "FROM per_turn AS p GROUP BY p.tenant, p.session_id "
        "ORDER BY first_arrival_ts_ns, tenant, session_id LIMIT {limit:UInt32}"
    )
    return sql, params
