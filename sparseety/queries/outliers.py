"""Where the money goes: the costliest and cheapest requests per output token, and why.

``sparseety query outliers`` ranks, per tenant, the requests of a window by cost per output token
(one attribution mode, ``actual`` by default) and lists the top and the bottom ``--top`` of them,
each with the features that drive its cost (``docs/cost-model.md``, "Outliers"). With
``--summary 1`` it answers instead which of those features the costly tail shares: per tenant and
feature, the share of the tail that has it beside the share of the other requests.

Every feature is an observed count of the request (nothing here is modelled); a feature whose
count was not observed for a request is NULL there, and is not counted as present.
"""

from __future__ import annotations

from typing import Any

from sparseety.errors import QueryError

from .base import Scope

#: Attribution modes a request's cost can be read in (docs/cost-model.md).
OUTLIER_MODES = ("actual", "amortized", "list", "gpu")

#: A prompt is "long" at this many times the median prompt of its tenant's requests in the window.
LONG_PROMPT_FACTOR = 2
#: A request "misses the cache" when at least this share of its prompt was not read from it.
CACHE_MISS_SHARE = 0.5
#: Rejected and cut drafts count as a driver from this share of the request's scheduled compute.
REJECTED_DRAFT_SHARE = 0.1
#: KV memory-time is "heavy" at this many times the median of its tenant's requests (that have it).
KV_HEAVY_FACTOR = 2

#: The features, in the order ``reasons`` lists them: (name, SQL condition over the ``base`` rows).
FEATURES: tuple[tuple[str, str], ...] = (
    (
        "long_prompt",
        f"prompt_tokens >= {LONG_PROMPT_FACTOR} * tenant_median_prompt_tokens AND prompt_tokens > 0",
    ),
    ("cache_miss", f"cache_miss_share >= {CACHE_MISS_SHARE}"),
    ("recompute", "recomputed_tokens > 0"),
    (
        "rejected_drafts",
        f"rejected_draft_tokens > 0 AND rejected_draft_tokens >= {REJECTED_DRAFT_SHARE} * scheduled_tokens",
    ),
    # NULL (memory-time not observed) is not a driver
    (
        "kv_memory",
        f"ifNull(kv_byte_ms > 0 AND kv_byte_ms >= {KV_HEAVY_FACTOR} * tenant_median_kv_byte_ms, 0)",
    ),
    ("cut_by_limit", "cut_by_limit"),
)


def _cost(mode: str) -> str:
    if mode not in OUTLIER_MODES:
        raise QueryError(f"unknown attribution mode {mode!r}: choose from {', '.join(OUTLIER_MODES)}")
    return {
        "actual": "c.actual_pico",
        "amortized": "(c.actual_pico + ifNull(d.delta_pico, 0))",
        "list": "c.list_pico",
        "gpu": "c.gpu_pico",
    }[mode]


def _base(db: str, mode: str, scope: Scope) -> tuple[str, dict[str, Any]]:
    """One row per request in scope with output: its cost, cost per output token, the drivers'
    counts, its tenant's median prompt and its rank from the top and from the bottom."""
    where, params = scope.where("c")
    join = (
        f"LEFT JOIN {db}.amortized_delta_v AS d ON c.request_uid = d.request_uid"
        if mode == "amortized"
        else ""
    )
    # KV memory-time in the mode's sharing (amortized splits shared blocks; the others charge
    # them to their first holder, as actual does), NULL when not observed (docs/cost-model.md).
    kv = "kv_byte_ms_amortized" if mode == "amortized" else "kv_byte_ms_actual"
    join += (
        f" LEFT JOIN (SELECT request_uid, {kv} AS kv FROM {db}.requests_v) AS k "
        "ON c.request_uid = k.request_uid"
    )
    sql = (
        "SELECT c.request_uid AS request_uid, c.tenant AS tenant, c.model AS model, "
        "ifNull(c.lora_name, '') AS adapter, c.engine_name AS engine, c.finished_at AS finished_at, "
        f"toInt128({_cost(mode)}) AS cost_pico, toInt64(c.output_tokens) AS output_tokens, "
        "intDiv(cost_pico, output_tokens) AS cost_per_output_token_pico, "
        "toInt64(c.prompt_tokens) AS prompt_tokens, "
        "if(c.prompt_tokens = 0, 0, (c.prompt_tokens - c.list_cached_tokens) / c.prompt_tokens) "
        "AS cache_miss_share, "
        "c.recomputed_preemption_tokens + c.recomputed_eviction_tokens AS recomputed_tokens, "
        "toInt64(c.draft_rejected_tokens) + c.draft_cut_tokens AS rejected_draft_tokens, "
        "toInt64(c.scheduled_tokens) AS scheduled_tokens, "
        "c.reasoning_output_tokens AS reasoning_output_tokens, "
        "k.kv AS kv_byte_ms, "
        "c.finish_reason AS finish_reason, c.finish_reason = 'length' AS cut_by_limit, "
        "median(c.prompt_tokens) OVER (PARTITION BY c.tenant) AS tenant_median_prompt_tokens, "
        "median(k.kv) OVER (PARTITION BY c.tenant) AS tenant_median_kv_byte_ms, "
        "count() OVER (PARTITION BY c.tenant) AS tenant_requests, "
        "row_number() OVER (PARTITION BY c.tenant ORDER BY cost_per_output_token_pico DESC, c.request_uid) "
        "AS rank_top, "
        "row_number() OVER (PARTITION BY c.tenant ORDER BY cost_per_output_token_pico ASC, c.request_uid) "
        "AS rank_bottom "
        f"FROM {db}.request_costs_v AS c {join} WHERE c.output_tokens > 0 AND {where}"
    )
    return sql, params


def _reasons() -> str:
    flags = ", ".join(f"if({cond}, '{name}', '')" for name, cond in FEATURES)
    return f"arrayFilter(x -> x != '', [{flags}]) AS reasons"


def outliers_sql(
    db: str, *, mode: str, limit: int, summary: int = 0, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """The outliers (``summary`` 0) or the features their tail shares (``summary`` 1).

    Per tenant, the ``limit`` requests with the highest cost per output token (``side`` top)
    and the ``limit`` with the lowest (bottom), each with its drivers and ``reasons``.

    A request among both (a tenant with fewer than 2 x limit requests) is listed once, as top.
    Requests without output have no cost per output token and are left out.
    """
    if summary:
        return outliers_summary_sql(db, mode=mode, limit=limit, scope=scope)
    base, params = _base(db, mode, scope)
    params["limit"] = limit
    sql = (
        "SELECT tenant, if(rank_top <= {limit:UInt32}, 'top', 'bottom') AS side, "
        "if(side = 'top', rank_top, rank_bottom) AS rank, request_uid, model, adapter, engine, finished_at, "
        "cost_pico, output_tokens, cost_per_output_token_pico, prompt_tokens, tenant_median_prompt_tokens, "
        "cache_miss_share, recomputed_tokens, rejected_draft_tokens, scheduled_tokens, "
        "reasoning_output_tokens, kv_byte_ms, "
        f"finish_reason, cut_by_limit, {_reasons()}, tenant_requests "
        f"FROM ({base}) WHERE rank_top <= {{limit:UInt32}} OR rank_bottom <= {{limit:UInt32}} "
        "ORDER BY tenant, side = 'bottom', rank"
    )
    return sql, params


def outliers_summary_sql(db: str, *, mode: str, limit: int, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Which features the costly tail shares: per tenant and feature, of the ``limit`` costliest
    requests per output token (the tail) and of the tenant's other requests, how many have it
    (``tail_with``, ``rest_with``) and the shares; ``lift`` = tail_share - rest_share, and
    ``shared_by_tail`` when at least half the tail has it and more often than the rest
    (rest_share NULL when the tenant has no other request)."""
    if limit < 1:
        raise QueryError("outliers --summary needs a tail: --top of at least 1")
    base, params = _base(db, mode, scope)
    params["limit"] = limit
    features = ", ".join(f"('{name}', toUInt8({cond}))" for name, cond in FEATURES)
    sql = (
        "SELECT tenant, f.1 AS feature, countIf(tail) AS tail_requests, "
        "countIf(tail AND f.2 = 1) AS tail_with, "
        "tail_with / tail_requests AS tail_share, countIf(NOT tail) AS rest_requests, "
        "countIf(NOT tail AND f.2 = 1) AS rest_with, "
        "if(rest_requests = 0, NULL, rest_with / rest_requests) AS rest_share, "
        "tail_share - ifNull(rest_share, 0) AS lift, "
        "tail_share >= 0.5 AND tail_share > ifNull(rest_share, 0) AS shared_by_tail, "
        "sumIf(cost_pico, tail) AS tail_cost_pico, sum(cost_pico) AS tenant_cost_pico "
        f"FROM (SELECT *, rank_top <= {{limit:UInt32}} AS tail, arrayJoin([{features}]) AS f FROM ({base})) "
        "GROUP BY tenant, feature ORDER BY tenant, indexOf(["
        + ", ".join(f"'{name}'" for name, _ in FEATURES)
        + "], feature)"
    )
    return sql, params
