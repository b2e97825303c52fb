"""Prefix-routing advice: fleet prefix duplication turned into engine affinity (SQL builder).

A **prefix** is identified by the root block of a request's prompt (``kv_blocks.idx = 0``; vLLM's
block hashes are chained, so a block hash names its whole prefix) and the tenant. For each prefix
and model, the blocks under it that were computed (not read from the cache) on more than one
engine are duplicated work: ``duplicated_tokens = tokens x (engines that computed it - 1)``, as
in ``query duplication`` (recomputing on the same engine is eviction, not duplication). The
advice routes the prefix to one engine (``affinity_engine``: the engine that used its blocks most,
ties by name); followed, each duplicated block is computed once, so the saving equals the
duplicated compute, priced at the input price of the computing requests. Per hour: over the
scope's time range when both bounds are given, else over the span of the stored finishes in
scope (at least one second). The row format is the JSON export (docs/cost-model.md, "Prefix
routing advice"; how it maps onto llm-d's KV-cache indexer and Dynamo's KV router is there too).
"""

from __future__ import annotations

from typing import Any

from .base import Scope


def routing_advice_sql(db: str, *, scope: Scope, limit: int) -> tuple[str, dict[str, Any]]:
    """Prefixes recomputed on several engines, their cost per hour, affinity and saving."""
    where, params = scope.where("b")
    params["limit"] = limit
    if scope.since_ns is not None and scope.until_ns is not None:
        span = "toInt64({until_ns:Int64} - {since_ns:Int64})"
    else:
        span = "(SELECT greatest(max(finished_ts_ns) - min(finished_ts_ns), 1000000000) FROM uses)"
    sql = (
        "WITH uses AS ("
        "SELECT b.request_uid AS request_uid, b.idx AS idx, b.block_hash AS block_hash, b.role AS role, "
        "b.tokens AS tokens, b.engine_name AS engine_name, b.tenant AS tenant, b.model AS model, "
        "b.finished_ts_ns AS finished_ts_ns, c.input_price_micro AS price "
        f"FROM {db}.kv_blocks_v AS b INNER JOIN "
        f"(SELECT request_uid, input_price_micro FROM {db}.request_costs_v) AS c "
        f"ON b.request_uid = c.request_uid WHERE {where}), "
        "rooted AS (SELECT u.*, r.root AS root FROM uses AS u INNER JOIN "
        "(SELECT request_uid, block_hash AS root FROM uses WHERE idx = 0) AS r "
        "ON u.request_uid = r.request_uid), "
        "blocks AS (SELECT model, tenant, root, block_hash, min(idx) AS depth, max(tokens) AS tokens, "
        "uniqExactIf(engine_name, role != 'cached') AS engines, "
        "countIf(role != 'cached') AS computations, max(price) AS price "
        "FROM rooted GROUP BY model, tenant, root, block_hash HAVING engines > 1), "
        "engine_uses AS (SELECT model, tenant, root, engine_name, count() AS n, "
        "countIf(role != 'cached') AS computed FROM rooted GROUP BY model, tenant, root, engine_name), "
        "per_engine AS (SELECT model, tenant, root, "
        "arraySort(x -> (-x.2, x.1), groupArray((engine_name, n, computed))) AS ranked "
        "FROM engine_uses GROUP BY model, tenant, root) "
        "SELECT k.model AS model, k.tenant AS tenant, lower(hex(k.root)) AS prefix_hash, "
        "arrayMap(x -> lower(hex(x.2)), arraySort(groupArray((k.depth, k.block_hash)))) AS block_hashes, "
        "count() AS duplicated_blocks, max(k.tokens) AS block_tokens, "
        "arraySort(arrayMap(x -> x.1, arrayFilter(x -> x.3 > 0, any(e.ranked)))) AS engines, "
        "any(e.ranked)[1].1 AS affinity_engine, sum(k.computations) AS computations, "
        "sum(toInt64(k.tokens) * (k.engines - 1)) AS duplicated_tokens, "
        "sum(toInt128(k.tokens) * (k.engines - 1) * k.price) AS duplicated_cost_pico, "
        f"{span} AS window_ns, "
        "intDiv(duplicated_cost_pico * 3600000000000, window_ns) AS cost_per_hour_pico, "
        "duplicated_tokens AS saving_tokens, cost_per_hour_pico AS saving_per_hour_pico "
        "FROM blocks AS k INNER JOIN per_engine AS e "
        "ON k.model = e.model AND k.tenant = e.tenant AND k.root = e.root "
        "GROUP BY k.model, k.tenant, k.root "
        "ORDER BY duplicated_tokens DESC, model, tenant, prefix_hash LIMIT {limit:UInt32}"
    )
    return sql, params
