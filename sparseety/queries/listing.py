"""Listings of stored requests, their timelines and the bills of disaggregated requests (registry
queries ``requests``, ``timelines`` and ``pd_bills``): what a table view, the dashboard and an
export read, request by request."""

from __future__ import annotations

from typing import Any

from sparseety.errors import QueryError

from . import ids
from .base import Scope, hidden_source

ORDERS = ("recent", "varied")

#: How many kinds of token fate a request shows: "varied" lists the most telling timelines first.
_VARIETY = (
    "(cache_read_tokens > 0) + (recomputed_tokens > 0) + (skipped_tokens > 0) "
    "+ (window_released_tokens > 0) + (draft_cut_tokens > 0) "
    "+ (draft_accepted_tokens > 0) + (draft_rejected_tokens > 0) + (uncached_computed_tokens > 0)"
)


def requests_sql(
    db: str,
    *,
    scope: Scope,
    limit: int,
    order: str,
    request_id: str | None = None,
    client_id: str | None = None,
    inconsistent: int = 0,
) -> tuple[str, dict[str, Any]]:
    """Requests in scope, newest first (``recent``) or most varied timelines first (``varied``).

    ``request_id`` keeps the requests that id names (any of their ids: ``ids.id_condition``);
    ``client_id`` those whose front-end id was built from the client's ``X-Request-Id``
    (``ids.client_id_condition``); ``inconsistent`` = 1 those whose counts disagree with the
    engine's own totals (``consistent`` false: the dashboard's "inconsistent N" links here).
    """
    if order not in ORDERS:
        raise QueryError(f"unknown order {order!r}: choose from {', '.join(ORDERS)}")
    if not 1 <= limit <= 10_000:
        raise QueryError("limit must be between 1 and 10000")
    where, params = scope.where()
    params["limit"] = limit
    if request_id:
        where += f" AND {ids.id_condition('key')}"
        params["key"] = request_id
    if client_id:
        where += f" AND {ids.client_id_condition('client_id')}"
        params["client_id"] = client_id
    if inconsistent:
        where += " AND NOT consistent"
    by = "finished_ts_ns DESC, request_uid" if order == "recent" else f"{_VARIETY} DESC, finished_ts_ns DESC"
    sql = (
        f"SELECT request_uid, {ids.EXTERNAL} AS external_request_id, choice_index, "
        "tenant, model, engine_name, engine_kind, finished_at, finish_reason, complete, "
        "consistent, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, "
        "recomputed_tokens, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_accepted_tokens, "
        "draft_rejected_tokens, draft_cut_tokens, skipped_tokens, window_released_tokens, "
        f"gpu_time_ns FROM {db}.requests_v WHERE {where} ORDER BY {by} LIMIT {{limit:UInt32}}"
    )
    return sql, params


def timelines_sql(db: str, *, scope: Scope, limit: int) -> tuple[str, dict[str, Any]]:
    """The timeline segments of every request in scope, request by request, in position order.

    ``source_request_uid`` is hidden from a tenant-scoped reader as in a single timeline
    (:func:`~sparseety.queries.base.segments_sql`).
    """

    where, params = scope.where("s")
    params["limit"] = limit
    source, join = hidden_source(db, scope, params)
    sql = (
        "SELECT s.request_uid AS request_uid, s.tenant AS tenant, s.model AS model, "
        "s.start AS start, s.end AS end, s.kind AS kind, s.status AS status, "
        f"s.draft_accepted AS draft_accepted, {source} AS source_request_uid, s.kv_fate AS kv_fate "
        f"FROM {db}.token_segments_v AS s {join} WHERE {where} "
        "ORDER BY s.request_uid, s.start LIMIT {limit:UInt64}"
    )
    return sql, params


def pd_bills_sql(db: str, *, scope: Scope, limit: int) -> tuple[str, dict[str, Any]]:
    """One row per client request that a prefill engine and a decode engine served (P/D), newest
    first: both rows' uids, what each engine did with the prompt, the output once, and the pair's
    cost in ``list``, ``actual`` and ``gpu`` mode (``pd_bills_v``, docs/cost-model.md "P/D").
    ``joined`` = 0 while only one of the two rows is stored."""
    if not 1 <= limit <= 10_000:
        raise QueryError("limit must be between 1 and 10000")
    where, params = scope.where()
    params["limit"] = limit
    sql = (
        "SELECT pd_join_id, tenant, model, finished_at, joined, prefill_request_uid, decode_request_uid, "
        "prompt_tokens, output_tokens, prefill_computed_tokens, prefill_cached_tokens, "
        "transferred_kv_tokens, decode_prompt_cached_tokens, decode_prompt_computed_tokens, "
        "discarded_output_tokens, list_pico AS list_cost_pico, actual_pico AS actual_cost_pico, "
        "gpu_pico AS gpu_cost_pico, tokens_priced "
        f"FROM {db}.pd_bills_v WHERE {where} ORDER BY finished_ts_ns DESC, pd_join_id LIMIT {{limit:UInt32}}"
    )
    return sql, params
