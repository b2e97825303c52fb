"""The SQL query library: cost attribution and token-flow questions, as rows of dicts.

Every query reads current state only (``FINAL`` views, child rows of a request's current
version), is limited by a :class:`Scope` (finish-time range and the tenants the caller may see)
and binds every value as a server-side parameter. Money comes back as :class:`~decimal.Decimal`
USD, exact (it is computed in integer picodollars, see ``docs/cost-model.md``).

SQL is built by pure functions (``*_sql``) that return ``(sql, parameters)``; :class:`Queries`
runs them on anything with the :class:`~sparseety.sinks.clickhouse.client.Store` ``query``
method. Each query is one :class:`QuerySpec` (the registry at the end); :class:`QueryMethods`
has one explicit method per query, which the library and the remote client
(:mod:`sparseety.api.client`) share. How a query is served (route, command, texts, tables) is
the API's business: :mod:`sparseety.api.endpoints`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sparseety.errors import QueryError

from . import ids, outliers, regressions, routing, sessions, whatif
from .base import ANOTHER_TENANT as ANOTHER_TENANT  # re-exported: the library's public names
from .base import DIMENSIONS as DIMENSIONS
from .base import REQUEST_COUNTS, SEGMENT_FIELDS, Queryable, group, group_clause, segments_sql, with_group
from .base import Param as Param
from .base import QuerySpec as QuerySpec
from .base import Scope as Scope
from .caveats import note_lost_sources
from .export import export
from .listing import ORDERS, pd_bills_sql, requests_sql, timelines_sql
from .tokens import token_records_lookup

PICO = Decimal(10**12)
MODES = ("actual", "amortized", "list", "gpu")


def _per_request(db: str, select: str, measures: str, where: str, keys: str) -> str:
    """A grouped query over the per-request cost view (aliased ``c``)."""
    return (
        f"SELECT {with_group(select, measures)} FROM {db}.request_costs_v AS c "
        f"WHERE {where} {group_clause(keys)}"
    )


#: Of the output, the think section's positions (a reasoning parser split them; priced as output
#: unless a ``reasoning_output`` price says otherwise) and the requests whose split was observed:
#: NULL when none was (never 0).
REASONING = (
    "sum(c.reasoning_output_tokens) AS reasoning_output_tokens, "
    "countIf(c.reasoning_output_tokens IS NOT NULL) AS reasoning_observed_requests"
)

#: The bill of 2026 (issue 36; docs/cost-model.md): the new classes' tokens and what each adds to
#: the token cost before the service tier's factor (``cost_pico`` has them, times the factor).
BILL_2026 = (
    "sum(c.cache_write_tokens) AS cache_write_tokens, "
    "sum(c.cache_read_cpu_offload_tokens) AS cache_read_cpu_offload_tokens, "
    "sum(c.cache_read_host_tokens) AS cache_read_host_tokens, "
    "sum(c.cache_read_storage_tokens) AS cache_read_storage_tokens, "
    "sum(c.external_kv_tokens) AS external_kv_tokens, "
    "sum(c.image_tokens) AS image_tokens, sum(c.audio_tokens) AS audio_tokens, "
    "sum(c.video_tokens) AS video_tokens, "
    "sum(c.encoder_compute_tokens) AS encoder_compute_tokens, "
    "sum(c.encoder_cache_hit_tokens) AS encoder_cache_hit_tokens, "
    "sum(c.modality_premium_pico) AS modality_premium_pico, sum(c.encoder_pico) AS encoder_pico"
)

# --- SQL builders (pure) --------------------------------------------------------------------------


def cost_sql(
    db: str, *, mode: str, by: Sequence[str], bucket: str | None, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """Cost per group in one attribution mode (``docs/cost-model.md``)."""
    if mode not in MODES:
        raise QueryError(f"unknown attribution mode {mode!r}: choose from {', '.join(MODES)}")
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    if mode == "list":
        measures = (
            "sum(c.list_input_tokens) AS input_tokens, sum(c.list_billed_cached_tokens) AS cached_tokens, "
            # billed_prompt_tokens is prompt_tokens less what an aborted request never computed
            "input_tokens + cached_tokens AS billed_prompt_tokens, "
            "sumIf(c.prompt_tokens, c.list_prompt_billed = 1) AS prompt_tokens, "
            # a P/D pair's output once: the decode row's (request_costs_v list_output_billed)
            f"sum(c.list_output_tokens) AS output_tokens, {REASONING}, sum(c.list_pico) AS cost_pico, "
            f"countIf(NOT c.tokens_priced) AS unpriced_requests, {BILL_2026}, "
            "sumIf(c.cache_write_premium_pico, c.list_prompt_billed = 1) AS cache_write_premium_pico, "
            "sum(c.list_tier_read_pico) AS tier_read_pico"
        )
    elif mode == "gpu":
        # the cold first steps are engine overhead: beside the bill, never in it (issue 31)
        measures = (
            "sum(c.gpu_time_ns) AS gpu_time_ns, sum(c.billed_gpu_time_ns) AS billed_gpu_time_ns, "
            "sum(c.warmup_gpu_time_ns) AS warmup_gpu_time_ns, sum(c.gpu_pico) AS cost_pico, "
            "sum(c.warmup_gpu_pico) AS warmup_cost_pico, countIf(NOT c.gpu_priced) AS unpriced_requests"
        )
    else:
        cost = "c.actual_pico" if mode == "actual" else "(c.actual_pico + ifNull(d.delta_pico, 0))"
        measures = (
            "sum(c.actual_input_tokens) AS input_tokens, sum(c.cache_read_tokens) AS cached_tokens, "
            f"sum(c.output_tokens) AS output_tokens, {REASONING}, sum({cost}) AS cost_pico, "
            f"countIf(NOT c.tokens_priced) AS unpriced_requests, {BILL_2026}, "
            "sum(c.cache_write_premium_pico) AS cache_write_premium_pico, "
            "sum(c.tier_read_pico) AS tier_read_pico"
        )
        if mode == "amortized":
            measures += (
                ", sum(ifNull(d.delta_pico, 0)) AS shared_delta_pico, "
                "countIf(w.source_history_lost_ts_ns > 0) AS fallback_requests"
            )
        measures += ", " + kv_cost_measures(mode)
    join = (
        f"LEFT JOIN {db}.amortized_delta_v AS d ON c.request_uid = d.request_uid {_caveats_join(db)}"
        if mode == "amortized"
        else ""
    )
    if mode in ("actual", "amortized"):
        join += f" LEFT JOIN {db}.request_kv_costs_v AS k ON c.request_uid = k.request_uid"
    sql = (
        f"SELECT {with_group(select, REQUEST_COUNTS + ', ' + measures)} "
        f"FROM {db}.request_costs_v AS c {join} WHERE {where} {group_clause(keys)}"
    )
    return sql, params


def kv_cost_measures(mode: str) -> str:
    """``query cost``'s KV memory columns in ``actual`` or ``amortized`` mode (docs/cost-model.md,
    "kv"): the mode's byte-ms of KV cache held and their price, its own column beside the token
    cost (not added to ``cost_pico``); requests whose memory-time was not observed (NULL) are
    counted, never read as 0."""
    return (
        f"sum(k.kv_byte_ms_{mode}) AS kv_byte_ms, sum(k.kv_{mode}_pico) AS kv_cost_pico, "
        f"countIf(k.kv_byte_ms_{mode} IS NULL) AS kv_not_observed, "
        f"countIf(k.kv_byte_ms_{mode} IS NOT NULL AND NOT k.kv_priced) AS kv_unpriced"
    )


def savings_sql(
    db: str, *, by: Sequence[str], bucket: str | None, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """Prefix-cache savings: prompt positions served from the cache at admission, and what that saved.

    ``requests`` and ``prompt_tokens`` mean what they mean everywhere (``REQUEST_COUNTS``): API
    requests, and their prompts once each (usage.prompt_tokens); ``sequences`` and
    ``sequence_prompt_tokens`` count every engine request (an ``n = 2`` completion's two), which is
    what the engine held and what the cache could serve. hit_rate = cached_prompt_tokens /
    sequence_prompt_tokens, and saved_usd, use the same cache reads: the engine's admission hits
    (``cached_prompt_tokens``, each prompt position at most once). Re-reads of a resumed
    request after a preemption (``reread_tokens`` = cache_read_tokens - admission hits) only
    make up for the preemption, so they are reported beside, not counted as savings.
    """
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    measures = (
        f"{REQUEST_COUNTS}, sumIf(c.prompt_tokens, c.list_prompt_billed = 1) AS prompt_tokens, "
        "sum(c.prompt_tokens) AS sequence_prompt_tokens, "
        "sum(c.list_cached_tokens) AS cached_prompt_tokens, sum(c.cache_read_tokens) AS cache_read_tokens, "
        "cache_read_tokens - cached_prompt_tokens AS reread_tokens, "
        "if(sequence_prompt_tokens = 0, 0, cached_prompt_tokens / sequence_prompt_tokens) AS hit_rate, "
        "sum(toInt128(c.list_cached_tokens) * (c.input_price_micro - c.cached_price_micro)) AS saved_pico"
    )
    return _per_request(db, select, measures, where, keys), params


def waste_sql(db: str, *, by: Sequence[str], bucket: str | None, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Compute thrown away, and compute a larger KV cache would have avoided, kept apart.

    waste = recomputed_preemption + draft_rejected + draft_cut (compute that produced nothing
    kept), as a share of scheduled_tokens (everything the engine computed for the requests).
    Recompute after a prefix-cache eviction is first-time work for the request: it is reported
    as ``evictable_tokens`` / ``evictable_usd``, "avoidable with more KV cache", not as waste.
    ``computed_tokens`` means first-time computation (uncached_computed_tokens), as everywhere.
    """
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    measures = (
        f"{REQUEST_COUNTS}, sum(c.scheduled_tokens) AS scheduled_tokens, "
        "sum(c.uncached_computed_tokens) AS computed_tokens, "
        "sum(c.recomputed_preemption_tokens) AS recomputed_preemption_tokens, "
        "sum(c.draft_rejected_tokens) AS draft_rejected_tokens, "
        "sum(c.draft_cut_tokens) AS draft_cut_tokens, "
        "recomputed_preemption_tokens + draft_rejected_tokens + draft_cut_tokens AS waste_tokens, "
        "if(scheduled_tokens = 0, 0, waste_tokens / scheduled_tokens) AS waste_share, "
        "sum(toInt128(c.waste_tokens) * c.input_price_micro) AS waste_pico, "
        "sum(c.recomputed_eviction_tokens) AS evictable_tokens, "
        "if(scheduled_tokens = 0, 0, evictable_tokens / scheduled_tokens) AS evictable_share, "
        "sum(toInt128(c.recomputed_eviction_tokens) * c.input_price_micro) AS evictable_pico, "
        "sum(c.evicted_blocks_recomputed) AS evicted_blocks_recomputed, "
        "sum(c.preemptions) AS preemptions, sum(c.window_released_tokens) AS window_released_tokens"
    )
    return _per_request(db, select, measures, where, keys), params


def prefix_evictions_sql(
    db: str, *, by: Sequence[str], bucket: str | None, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """Observed prefix-cache eviction: blocks requests computed that later left the cache and
    had to be computed again, and the blocks requests recomputed because of an eviction."""
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    measures = (
        f"{REQUEST_COUNTS}, sum(ifNull(p.blocks_evicted_later, 0)) AS blocks_evicted_later, "
        "sum(ifNull(p.tokens_evicted_later, 0)) AS tokens_evicted_later, "
        "sum(c.evicted_blocks_recomputed) AS evicted_blocks_recomputed, "
        "sum(c.recomputed_eviction_tokens) AS recomputed_eviction_tokens, "
        "sum(toInt128(c.recomputed_eviction_tokens) * c.input_price_micro) AS evictable_pico"
    )
    join = f"LEFT JOIN {db}.prefix_evictions_v AS p ON c.request_uid = p.request_uid"
    sql = (
        f"SELECT {with_group(select, measures)} "
        f"FROM {db}.request_costs_v AS c {join} WHERE {where} {group_clause(keys)}"
    )
    return sql, params


#: What a tenant-scoped reader sees as the source of a prefix another tenant's request computed.
def requests_by_uid_sql(db: str, uids: Sequence[str], *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Requests in ``scope`` by uid, each row with its costs (``_cost_<mode>_pico``,
    ``_cost_priced``) and its segments (``_segments``: tuples of :data:`SEGMENT_FIELDS` in
    position order, sources masked as :func:`segments_sql` does), in one query."""
    where, params = scope.where("r")
    seg_sql, seg_params = segments_sql(db, uids, scope=scope)
    params.update(seg_params)
    params["uids"] = list(uids)
    packed = ", ".join(f"g.{f}" for f in SEGMENT_FIELDS)
    # the joined sides name nothing as requests_v does, so the row keeps its plain column names
    sql = (
        "SELECT r.* EXCEPT (_version), c._cost_list_pico AS _cost_list_pico, "
        "c._cost_actual_pico AS _cost_actual_pico, c._cost_amortized_pico AS _cost_amortized_pico, "
        "c._cost_gpu_pico AS _cost_gpu_pico, c._cost_priced AS _cost_priced, s._segments AS _segments "
        f"FROM {db}.requests_v AS r "
        "INNER JOIN (SELECT c.request_uid AS _c_uid, c.list_pico AS _cost_list_pico, "
        "c.actual_pico AS _cost_actual_pico, "
        "c.actual_pico + ifNull(d.delta_pico, 0) AS _cost_amortized_pico, "
        "c.gpu_pico AS _cost_gpu_pico, c.tokens_priced AS _cost_priced "
        f"FROM {db}.request_costs_v AS c "
        f"LEFT JOIN {db}.amortized_delta_v AS d ON c.request_uid = d.request_uid "
        "WHERE has({uids:Array(String)}, c.request_uid)) AS c ON r.request_uid = c._c_uid "
        "LEFT JOIN (SELECT g.request_uid AS _s_uid, "
        f"arraySort(x -> x.1, groupArray(tuple({packed}))) AS _segments "
        f"FROM ({seg_sql}) AS g GROUP BY g.request_uid) AS s ON r.request_uid = s._s_uid "
        f"WHERE has({{uids:Array(String)}}, r.request_uid) AND {where}"
    )
    return sql, params


def engines_sql(db: str, *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Each engine (by name) the store has requests of: its epochs, requests and the newest
    finish time (``sparseety status`` flags one whose newest finish is old)."""
    where, params = scope.where()
    sql = (
        "SELECT engine_name AS engine, uniqExact(engine_id) AS epochs, count() AS requests, "
        "max(finished_ts_ns) AS last_finished_ts_ns, "
        "fromUnixTimestamp64Nano(max(finished_ts_ns), 'UTC') AS last_finished_at "
        f"FROM {db}.requests_v WHERE {where} GROUP BY engine_name ORDER BY engine_name"
    )
    return sql, params


def spec_sql(db: str, *, by: Sequence[str], bucket: str | None, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Speculative decoding: drafts proposed, accepted, rejected, and what they bought.

    The draft identities of docs/streams.md ("Drafts"), with A accepted, J rejected, K cut and
    U unverified (a part of K): ``draft_tokens`` = A + J + K, every draft position the engine
    computed; ``draft_verified_tokens`` = A + J + K - U, the drafts the verifier judged (vLLM's
    ``num_draft_tokens``); ``verifier_accepted_tokens`` = A + K - U, the ones it accepted, the
    stop-cut ones included (vLLM's ``num_accepted_tokens``). ``acceptance_rate`` = A /
    draft_tokens is ours (what became output); ``vllm_acceptance_rate`` = verifier_accepted /
    verified is the one vLLM reports.
    """
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    measures = (
        "countIf(c.draft_accepted_tokens + c.draft_rejected_tokens + c.draft_cut_tokens > 0) "
        "AS requests_with_drafts, "
        "sum(c.draft_accepted_tokens) AS draft_accepted_tokens, "
        "sum(c.draft_rejected_tokens) AS draft_rejected_tokens, "
        "sum(c.draft_cut_tokens) AS draft_cut_tokens, "
        "sum(c.draft_unverified_tokens) AS draft_unverified_tokens, "
        "draft_accepted_tokens + draft_rejected_tokens + draft_cut_tokens AS draft_tokens, "
        "if(draft_tokens = 0, 0, draft_accepted_tokens / draft_tokens) AS acceptance_rate, "
        "draft_tokens - draft_unverified_tokens AS draft_verified_tokens, "
        "draft_accepted_tokens + draft_cut_tokens - draft_unverified_tokens AS verifier_accepted_tokens, "
        "if(draft_verified_tokens = 0, 0, verifier_accepted_tokens / draft_verified_tokens) "
        "AS vllm_acceptance_rate, "
        "sum(c.output_tokens) AS output_tokens, "
        "if(output_tokens = 0, 0, draft_accepted_tokens / output_tokens) AS output_from_drafts, "
        "sum(c.scheduled_tokens) AS scheduled_tokens, "
        "if(scheduled_tokens = 0, 0, (draft_rejected_tokens + draft_cut_tokens) / scheduled_tokens) "
        "AS rejected_compute_share"
    )
    return _per_request(db, select, measures, where, keys), params


def _caveats_join(db: str) -> str:
    """The fold's caveats of each request (streams/caveats.py) beside ``c``, as ``w``."""
    return (
        f"LEFT JOIN (SELECT request_uid, warmup_gpu_time_ns, source_history_lost_ts_ns FROM {db}.requests_v) "
        "AS w ON c.request_uid = w.request_uid"
    )


def gpu_time_sql(
    db: str, *, by: Sequence[str], bucket: str | None, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """GPU time per group (each request's FLOPs-weighted share of its steps' wall time), split
    into what is billed (``billed_gpu_time_ns``, ``cost_pico``) and the part from the engines'
    cold first steps (``warmup_gpu_time_ns``, ``warmup_cost_pico``: engine overhead, not in the
    bill)."""
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    measures = (
        f"{REQUEST_COUNTS}, sum(c.gpu_time_ns) AS gpu_time_ns, "
        "if(sum(sum(c.gpu_time_ns)) OVER () = 0, 0, "
        "gpu_time_ns / sum(sum(c.gpu_time_ns)) OVER ()) AS gpu_share, "
        "sum(c.billed_gpu_time_ns) AS billed_gpu_time_ns, sum(c.warmup_gpu_time_ns) AS warmup_gpu_time_ns, "
        "sum(c.est_flops) AS est_flops, sum(c.gpu_pico) AS cost_pico, "
        "sum(c.warmup_gpu_pico) AS warmup_cost_pico, countIf(NOT c.gpu_priced) AS unpriced_requests"
    )
    sql = (
        f"SELECT {with_group(select, measures)} FROM {db}.request_costs_v AS c "
        f"WHERE {where} {group_clause(keys)}"
    )
    return sql, params


def expert_load_sql(db: str, *, model: str | None, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Tokens routed to each (layer, expert), and each expert's share of its layer."""
    where, params = scope.where("e")
    if model is not None:
        where += " AND e.model = {model:String}"
        params["model"] = model
    sql = (
        "SELECT model, layer, expert, tokens, "
        "if(sum(tokens) OVER (PARTITION BY model, layer) = 0, 0, "
        "tokens / sum(tokens) OVER (PARTITION BY model, layer)) AS layer_share "
        "FROM (SELECT e.model AS model, toUInt32(intDiv(i - 1, e.num_experts)) AS layer, "
        "toUInt32((i - 1) % e.num_experts) AS expert, sum(c) AS tokens "
        f"FROM {db}.expert_load AS e FINAL ARRAY JOIN e.counts AS c, arrayEnumerate(e.counts) AS i "
        f"WHERE {where} GROUP BY model, layer, expert) "
        "ORDER BY model, layer, expert"
    )
    return sql, params


def duplication_sql(db: str, *, by: Sequence[str], scope: Scope) -> tuple[str, dict[str, Any]]:
    """Fleet prefix duplication: the same block computed on more than one engine."""
    if any(d not in ("model",) for d in by):
        raise QueryError("duplication groups by model only (blocks are shared across tenants)")
    where, params = scope.where("b")
    keys = ", ".join(by)
    inner = (
        "SELECT b.model AS model, b.block_hash AS block_hash, uniqExact(b.engine_name) AS engines, "
        "count() AS computations, max(b.tokens) AS tokens "
        f"FROM {db}.kv_blocks_v AS b WHERE b.role != 'cached' AND {where} GROUP BY model, block_hash"
    )
    measures = (
        "count() AS blocks, countIf(engines > 1) AS duplicated_blocks, "
        "sum(tokens * computations) AS computed_block_tokens, "
        "sum(tokens * (engines - 1)) AS duplicated_tokens, "
        "if(computed_block_tokens = 0, 0, duplicated_tokens / computed_block_tokens) AS duplicated_share"
    )
    sql = f"SELECT {with_group(keys, measures)} FROM ({inner}) {group_clause(keys)}"
    return sql, params


def duplicated_blocks_sql(db: str, *, scope: Scope, limit: int) -> tuple[str, dict[str, Any]]:
    """The blocks computed on the most engines."""
    where, params = scope.where("b")
    params["limit"] = limit
    sql = (
        "SELECT b.model AS model, lower(hex(b.block_hash)) AS block_hash, "
        "uniqExact(b.engine_name) AS engines, arraySort(groupUniqArray(b.engine_name)) AS engine_names, "
        "count() AS computations, max(b.tokens) AS tokens "
        f"FROM {db}.kv_blocks_v AS b WHERE b.role != 'cached' AND {where} "
        "GROUP BY model, b.block_hash HAVING engines > 1 "
        "ORDER BY engines DESC, computations DESC, block_hash LIMIT {limit:UInt32}"
    )
    return sql, params


def usage_sql(db: str, *, by: Sequence[str], bucket: str | None, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Windowed usage (topic usage) per group; finals and corrections summed.

    ``recomputed_tokens`` is both recompute senses; windows written before schema v2 read 0 in
    the split columns (``recomputed_preemption_tokens`` ..., ``waste_tokens``).
    """
    select, keys, _ = group(by, bucket, "u", time_column="window_start")
    where, params = scope.where("u", time_column="window_start_ns")
    measures = (
        "sum(u.requests) AS requests, sum(u.incomplete_requests) AS incomplete_requests, "
        "sum(u.prompt_tokens) AS prompt_tokens, sum(u.output_tokens) AS output_tokens, "
        "sum(u.cache_read_tokens) AS cache_read_tokens, "
        "sum(u.uncached_computed_tokens) AS uncached_computed_tokens, "
        "sum(u.recomputed_tokens) AS recomputed_tokens, "
        "sum(u.draft_accepted_tokens) AS draft_accepted_tokens, "
        "sum(u.draft_rejected_tokens) AS draft_rejected_tokens, sum(u.gpu_time_ns) AS gpu_time_ns, "
        "sum(u.recomputed_preemption_tokens) AS recomputed_preemption_tokens, "
        "sum(u.recomputed_eviction_tokens) AS recomputed_eviction_tokens, "
        "sum(u.draft_cut_tokens) AS draft_cut_tokens, sum(u.waste_tokens) AS waste_tokens, "
        "sum(u.corrections) AS corrections"
    )
    sql = f"SELECT {with_group(select, measures)} FROM {db}.usage_v AS u WHERE {where} {group_clause(keys)}"
    return sql, params


# --- running ------------------------------------------------------------------------------------


def money(pico: Any) -> Decimal:
    """Integer picodollars -> exact Decimal USD."""
    return Decimal(int(pico)) / PICO


def _finish(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Money columns (``*_pico``) become ``*_usd`` Decimals; buckets become aware UTC datetimes."""
    out = []
    for row in rows:
        r: dict[str, Any] = {}
        for k, v in row.items():
            if k.endswith("_pico"):
                # NULL money (KV memory-time not observed in the whole group) stays None, never 0
                r[k[: -len("_pico")] + "_usd"] = money(v) if v is not None else None
            elif isinstance(v, datetime) and v.tzinfo is None:
                r[k] = v.replace(tzinfo=UTC)
            else:
                r[k] = v
        out.append(r)
    return out


TOKEN_STATISTICS = (
    "input_token_count",
    "output_token_count",
    "computed_token_count",
    "cached_token_count",
    "skipped_token_count",
    "kv_cache_evicted_count",
    "draft_token_count",
    "draft_rejected_count",
    "recomputed_preemption_count",
    "recomputed_eviction_count",
    "draft_cut_count",
)


#: A grouped query's answer: one dict per row.
Rows = list[dict[str, Any]]


class QueryMethods:
    """One method per registry query (:data:`QUERIES`), for every front that answers them.

    A grouped query's method runs :meth:`ask`, a lookup's :meth:`fetch`; the library
    (:class:`Queries`) implements them over a store, the remote client over the HTTP API. Each
    method's arguments are its query's: ``by``, ``bucket``, ``scope`` and its params.
    """

    def ask(
        self,
        spec: QuerySpec,
        *,
        by: Sequence[str] | None = None,
        bucket: str | None = None,
        scope: Scope = Scope(),
        **arguments: Any,
    ) -> Rows:
        """Run one grouped registry query (``by`` defaults to its default grouping)."""
        raise NotImplementedError

    def fetch(self, spec: QuerySpec, key: str, *, scope: Scope = Scope(), **arguments: Any) -> Any:
        """Run one lookup (None: not stored, or outside ``scope``)."""
        raise NotImplementedError

    def cost(self, **arguments: Any) -> Rows:
        """Cost per group in one attribution mode (:data:`COST`)."""
        return self.ask(COST, **arguments)

    def savings(self, **arguments: Any) -> Rows:
        """Prefix-cache savings per group (:data:`SAVINGS`)."""
        return self.ask(SAVINGS, **arguments)

    def waste(self, **arguments: Any) -> Rows:
        """Waste per group, its share of scheduled compute and its cost (:data:`WASTE`)."""
        return self.ask(WASTE, **arguments)

    def prefix_evictions(self, **arguments: Any) -> Rows:
        """Observed prefix-cache eviction per group (:data:`PREFIX_EVICTIONS`)."""
        return self.ask(PREFIX_EVICTIONS, **arguments)

    def spec_efficiency(self, **arguments: Any) -> Rows:
        """Speculative decoding: acceptance and rejected compute (:data:`SPEC_EFFICIENCY`)."""
        return self.ask(SPEC_EFFICIENCY, **arguments)

    def engines(self, **arguments: Any) -> Rows:
        """Engines the store has requests of (:data:`ENGINES`)."""
        return self.ask(ENGINES, **arguments)

    def gpu_time(self, **arguments: Any) -> Rows:
        """GPU time attributed per group, its share and cost (:data:`GPU_TIME`)."""
        return self.ask(GPU_TIME, **arguments)

    def usage(self, **arguments: Any) -> Rows:
        """Windowed usage (usage topic), by window start (:data:`USAGE`)."""
        return self.ask(USAGE, **arguments)

    def expert_load(self, **arguments: Any) -> Rows:
        """Tokens per (layer, expert) and each expert's share of its layer (:data:`EXPERT_LOAD`)."""
        return self.ask(EXPERT_LOAD, **arguments)

    def whatif(self, **arguments: Any) -> Rows:
        """Counterfactual cost per group under one scenario (modelled) (:data:`WHATIF`)."""
        return self.ask(WHATIF, **arguments)

    def regressions(self, **arguments: Any) -> Rows:
        """Sparsity regressions per engine and model, against its own baseline (:data:`REGRESSIONS`)."""
        return self.ask(REGRESSIONS, **arguments)

    def routing_advice(self, **arguments: Any) -> Rows:
        """Prefix-routing advice: prefixes computed on several engines (:data:`ROUTING_ADVICE`)."""
        return self.ask(ROUTING_ADVICE, **arguments)

    def duplication(self, **arguments: Any) -> Rows:
        """Fleet prefix duplication: blocks computed on more than one engine (:data:`DUPLICATION`)."""
        return self.ask(DUPLICATION, **arguments)

    def duplicated_blocks(self, **arguments: Any) -> Rows:
        """The most duplicated blocks (:data:`DUPLICATED_BLOCKS`)."""
        return self.ask(DUPLICATED_BLOCKS, **arguments)

    def sessions(self, **arguments: Any) -> Rows:
        """Sessions (multi-turn conversations), or the turns of one (:data:`SESSIONS`)."""
        return self.ask(SESSIONS, **arguments)

    def outliers(self, **arguments: Any) -> Rows:
        """Per tenant the costliest and cheapest requests per output token, and why (:data:`OUTLIERS`)."""
        return self.ask(OUTLIERS, **arguments)

    def requests(self, **arguments: Any) -> Rows:
        """Requests in scope with their token counts (:data:`REQUESTS`)."""
        return self.ask(REQUESTS, **arguments)

    def timelines(self, **arguments: Any) -> Rows:
        """Timeline segments of every request in scope (:data:`TIMELINES`)."""
        return self.ask(TIMELINES, **arguments)

    def pd_bills(self, **arguments: Any) -> Rows:
        """One bill per client request served by a prefill and a decode engine (:data:`PD_BILLS`)."""
        return self.ask(PD_BILLS, **arguments)

    def request(self, request_id: str, *, scope: Scope = Scope(), **arguments: Any) -> Any:
        """One request: every count, its cost in each mode and its segments (:data:`REQUEST`)."""
        return self.fetch(REQUEST, request_id, scope=scope, **arguments)

    def tokens_statistics(self, request_id: str, *, scope: Scope = Scope(), **arguments: Any) -> Any:
        """Token statistics of one request (:data:`TOKENS_STATISTICS`)."""
        return self.fetch(TOKENS_STATISTICS, request_id, scope=scope, **arguments)

    def token_records(self, request_id: str, *, scope: Scope = Scope(), **arguments: Any) -> Any:
        """Token records of one request (:data:`TOKEN_RECORDS`)."""
        return self.fetch(TOKEN_RECORDS, request_id, scope=scope, **arguments)


class Queries(QueryMethods):
    """The query library over one store.

    Args:
        store: A :class:`~sparseety.sinks.clickhouse.client.Store` (or anything with its
            ``database`` and ``query``).
        tokenizers: Served model name -> its tokenizer's local path (``api.tokenizers``).
    """

    def __init__(self, store: Queryable, *, tokenizers: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.db = store.database
        #: Served model name -> local tokenizer path, for token records' text (``api.tokenizers``).
        self.tokenizers: Mapping[str, str] = dict(tokenizers or {})

    def _run(self, built: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
        sql, params = built
        return _finish(self.store.query(sql, params))

    def export(self, spec: QuerySpec, fmt: str, **arguments: Any) -> bytes | None:
        """One registry query as a Parquet or CSV file (:func:`~.export.export`)."""
        return export(self, spec, fmt, **arguments)

    def ask(
        self,
        spec: QuerySpec,
        *,
        by: Sequence[str] | None = None,
        bucket: str | None = None,
        scope: Scope = Scope(),
        **arguments: Any,
    ) -> Rows:
        """Run one grouped registry query (``by`` defaults to its default grouping)."""
        return self._run(spec.build(self.db, by=by, bucket=bucket, scope=scope, **arguments))

    def fetch(
        self, spec: QuerySpec, key: str, *, scope: Scope = Scope(), allowed: bool = True, **arguments: Any
    ) -> Any:
        """Run one lookup (None: not stored, or outside ``scope``); ``allowed``: whether the
        caller may read what a gated lookup guards (the library's caller may)."""
        return spec.fetch(self, key, scope=scope, allowed=allowed, **arguments)

    def requests_by_uid(
        self, request_uids: Sequence[str], *, scope: Scope = Scope()
    ) -> dict[str, dict[str, Any]]:
        """Several requests as :meth:`request` answers them, uid -> request (absent: not found).

        One query however many uids (row, costs and segments joined): the dashboard asks for up
        to a hundred timelines, and a query per uid took seconds.
        """
        uids = list(dict.fromkeys(request_uids))
        if not uids:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for r in self._run(requests_by_uid_sql(self.db, uids, scope=scope)):
            r["cost"] = {m: r.pop(f"_cost_{m}_usd") for m in ("list", "actual", "amortized", "gpu")}
            r["cost"]["priced"] = bool(r.pop("_cost_priced"))
            r["segments"] = [dict(zip(SEGMENT_FIELDS, seg, strict=True)) for seg in r.pop("_segments")]
            out[r["request_uid"]] = note_lost_sources(r)
        return {u: out[u] for u in uids if u in out}


# --- lookups: one object by its id (None = not stored, or outside the caller's scope) ----------


def request_lookup(q: Queries, request_id: str, *, scope: Scope) -> dict[str, Any] | None:
    """One request: every count, its cost in each mode and its segment timeline.

    ``request_id`` is any id the request is known by (:mod:`~sparseety.queries.ids`:
    its uid, the engine's id, the front end's or the response's). Returns None when it is not
    stored or outside ``scope`` (a caller cannot tell which).

    Raises:
        AmbiguousIdError: the id names several requests (listed).
    """
    uid = ids.resolve(q, request_id, scope=scope)
    return None if uid is None else q.requests_by_uid([uid], scope=scope).get(uid)


def token_statistics_sql(db: str, request_uid: str, *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """The token counts of one request, as the HTTP API serves them.

    ``computed_token_count`` = first-time computation (uncached_computed, the one meaning of
    computed); ``recomputed_preemption_count`` and ``recomputed_eviction_count`` the two
    recompute senses; ``draft_token_count`` = drafts verified (accepted + rejected) and
    ``draft_cut_count`` drafts cut by stop; so computed + both recomputes + draft + cut =
    every token the engine computed for the request. ``kv_cache_evicted_count`` (name kept
    for API compatibility) is window-released positions, not prefix-cache eviction.
    """
    where, params = scope.where()
    params["uid"] = request_uid
    sql = (
        "SELECT prompt_tokens AS input_token_count, output_tokens AS output_token_count, "
        "uncached_computed_tokens AS computed_token_count, "
        "cache_read_tokens AS cached_token_count, skipped_tokens AS skipped_token_count, "
        "toInt64(window_released_tokens) AS kv_cache_evicted_count, "
        "if(recomputed_preemption_tokens + recomputed_eviction_tokens = recomputed_tokens, "
        "recomputed_preemption_tokens, recomputed_tokens) AS recomputed_preemption_count, "
        "if(recomputed_preemption_tokens + recomputed_eviction_tokens = recomputed_tokens, "
        "recomputed_eviction_tokens, 0) AS recomputed_eviction_count, "
        "draft_cut_tokens AS draft_cut_count, "
        "toInt64(draft_accepted_tokens) + draft_rejected_tokens AS draft_token_count, "
        "draft_rejected_tokens AS draft_rejected_count "
        f"FROM {db}.requests_v WHERE request_uid = {{uid:String}} AND {where}"
    )
    return sql, params


def tokens_statistics_lookup(q: Queries, request_id: str, *, scope: Scope) -> dict[str, int] | None:
    """The token counts of one request (see :func:`token_statistics_sql`), by any id it is
    known by (as :func:`request_lookup`)."""
    request_uid = ids.resolve(q, request_id, scope=scope)
    if request_uid is None:
        return None
    rows = q.store.query(*token_statistics_sql(q.db, request_uid, scope=scope))
    if not rows:
        return None
    return {k: int(rows[0][k]) for k in TOKEN_STATISTICS}


# --- the registry -------------------------------------------------------------------------------
#
# One declaration per query: what it computes and takes. The query methods (QueryMethods, below)
# dispatch to it by name; how it is served (its HTTP route, CLI command, 404 text, permission and
# table shape) is declared beside the API and CLI, in sparseety/api/endpoints.py.


COST = QuerySpec(
    "cost",
    cost_sql,
    "Cost per group in one attribution mode; money is exact decimal USD text.\n\n"
    "Rows: the group keys, requests, the token counts the mode charges (input, cached, output; "
    "gpu_time_ns for gpu), cost_usd and unpriced_requests (requests whose model has no price at "
    "their finish time; they cost 0 here). amortized adds shared_delta_usd: what sharing moved "
    "onto (+) or off (-) the group, and fallback_requests: requests whose cached prefix lost its "
    "source with the engine's history (a seq gap), charged as read there, as in actual.\n\n"
    "input_tokens never includes cached tokens (not OpenAI's prompt_tokens): in list it is the "
    "uncached prompt (prompt - cache hits, the prompt once per API request), in actual and "
    "amortized every computed position that is not an output (prefill, recompute, rejected "
    "drafts); cached_tokens is beside it, and list adds prompt_tokens (OpenAI's usage.prompt_tokens, "
    "once per API request) and billed_prompt_tokens = input + cached (prompt_tokens less what an "
    "aborted request never computed). requests counts API requests (an n = 2 completion is one), "
    "sequences the engine requests that served them.",
    group_by="tenant",
    bucket=True,
    params=(
        Param(
            "mode",
            str,
            "actual",
            "actual, amortized, list or gpu (docs/cost-model.md).",
            choices=MODES,
            what="attribution mode",
        ),
    ),
)
SAVINGS = QuerySpec(
    "savings",
    savings_sql,
    "Prefix-cache savings per group: hit rate and saved_usd = admission hits x (input - cached "
    "price); re-reads on resume beside it as reread_tokens.",
    group_by="tenant",
    bucket=True,
)
WASTE = QuerySpec(
    "waste",
    waste_sql,
    "Waste (preemption recompute + rejected and cut drafts) per group, its share of scheduled "
    "compute and its cost; eviction recompute beside it as evictable_* (avoidable with more KV "
    "cache, not waste).",
    group_by="tenant",
    bucket=True,
)
PREFIX_EVICTIONS = QuerySpec(
    "prefix_evictions",
    prefix_evictions_sql,
    "Observed prefix-cache eviction per group: blocks computed that the cache later removed, "
    "and blocks recomputed because of an eviction.",
    group_by="tenant",
    bucket=True,
)
SPEC_EFFICIENCY = QuerySpec(
    "spec_efficiency",
    spec_sql,
    "Speculative decoding: acceptance and rejected compute.",
    group_by="model",
    bucket=True,
)
ENGINES = QuerySpec(
    "engines",
    engines_sql,
    "Engines the store has requests of: epochs, requests, the newest finish time "
    "(last_finished_ts_ns, last_finished_at).",
)
GPU_TIME = QuerySpec(
    "gpu_time",
    gpu_time_sql,
    "GPU time attributed per group, its share and cost; warmup_gpu_time_ns beside it is the "
    "part of it from the engines' cold first steps (docs/cost-model.md, Warm-up).",
    group_by="tenant",
    bucket=True,
)
USAGE = QuerySpec(
    "usage",
    usage_sql,
    "Windowed usage (usage topic), by window start.",
    group_by="tenant",
    bucket=True,
)
EXPERT_LOAD = QuerySpec(
    "expert_load",
    expert_load_sql,
    "Tokens routed to each (layer, expert) and each expert's share of its layer.",
    params=(Param("model", str, None, "Only this model."),),
)
WHATIF = QuerySpec(
    "whatif",
    whatif.whatif_sql,
    "Counterfactual cost (modelled, docs/cost-model.md 'What if'): actual and cf_ computed "
    "tokens, GPU time, token cost and GPU cost per group under one scenario, and delta_ = "
    "counterfactual - actual.",
    group_by="tenant",
    bucket=True,
    params=(Param("scenario", str, "no-cache", whatif.SCENARIO_HELP + "."),),
)
REGRESSIONS = QuerySpec(
    "regressions",
    regressions.regressions_sql,
    "Sparsity regressions per engine and model: each signal (prefix hit rate, spec acceptance "
    "and drafts per output, window skip share, expert-load entropy, eviction recompute share) over "
    "the current window (since..until, or the last --window) against the engine's own baseline "
    "(the --baseline before it), with the rule, and evidence (request uids, window bounds).",
    params=(
        Param("window", str, "15m", "Current window when no since is given (15m, 1h)."),
        Param("baseline", str, "1d", "Baseline: this long before the current window."),
        Param("min_requests", int, 5, "Requests each window needs before a signal is judged.", ge=1),
        Param("all_signals", int, 0, "1: every evaluated signal, firing or not.", http="all", ge=0, le=1),
    ),
)
ROUTING_ADVICE = QuerySpec(
    "routing_advice",
    routing.routing_advice_sql,
    "Prefix-routing advice: prefixes (root block hash + tenant, with their duplicated block-hash "
    "chain) computed on several engines, the duplicated compute and its cost per hour, a suggested "
    "affinity engine and the saving if it were followed (docs/cost-model.md, Prefix routing advice).",
    params=(
        Param(
            "limit",
            int,
            100,
            "The N prefixes with the most duplicated compute.",
            http="top",
            ge=1,
            le=10_000,
        ),
    ),
)
DUPLICATION = QuerySpec(
    "duplication",
    duplication_sql,
    "Fleet prefix duplication: blocks computed on more than one engine.",
    group_by="model",
    dims=("model",),
)
DUPLICATED_BLOCKS = QuerySpec(
    "duplicated_blocks",
    duplicated_blocks_sql,
    "The most duplicated blocks: hash, engines that computed it, computations.",
    params=(
        Param("limit", int, 20, "List the N most duplicated blocks instead.", http="top", ge=0, le=10_000),
    ),
)
SESSIONS = QuerySpec(
    "sessions",
    sessions.sessions_sql,
    "Sessions (multi-turn conversations): the client's session id, else inferred from prefix "
    "chains within a tenant (docs/sessions.md).\n\n"
    "Rows: tenant, session_id, explicit (the id came from the client), turns, the token counts "
    "of every class summed over the turns, cache_from_previous_turn_tokens and "
    "cache_from_earlier_turns_tokens (cache reads of positions turn N-1, or an earlier turn, "
    "computed), cross_turn_reuse_share (both over the prompt tokens of turns 2..N) and the cost "
    "in each mode (actual_usd, amortized_usd, list_usd, gpu_usd). With --session, one row per "
    "turn of that session instead.",
    params=(
        Param(
            "source",
            str,
            "auto",
            "auto (the client's id, else inferred), explicit or inferred.",
            choices=sessions.SOURCES,
            what="session source",
        ),
        Param("session", str, None, "List the turns of this session instead."),
        Param("limit", int, 1000, "At most this many rows.", ge=1, le=100_000),
    ),
)
OUTLIERS = QuerySpec(
    "outliers",
    outliers.outliers_sql,
    "Cost outliers: per tenant, the --top requests with the highest cost per output token and "
    "the --top with the lowest, in one attribution mode, each with what drives its cost "
    "(docs/cost-model.md, Outliers).\n\n"
    "Rows: tenant, side (top or bottom), rank, the request (uid, model, adapter, engine, "
    "finished_at), cost_usd, output_tokens, cost_per_output_token_usd, and the drivers: "
    "prompt_tokens beside the tenant's median, cache_miss_share, recomputed_tokens, "
    "rejected_draft_tokens (rejected + cut) of scheduled_tokens, reasoning_output_tokens, "
    "cut_by_limit (finish_reason length) and reasons (the drivers past their thresholds). "
    "With --summary 1: per tenant and feature, how much of the costly tail (the --top) has it "
    "beside the tenant's other requests (tail_share, rest_share, lift, shared_by_tail).",
    params=(
        Param(
            "mode",
            str,
            "actual",
            "actual, amortized, list or gpu (docs/cost-model.md).",
            choices=outliers.OUTLIER_MODES,
            what="attribution mode",
        ),
        Param("limit", int, 10, "The N costliest and N cheapest per tenant.", http="top", ge=1, le=10_000),
        Param("summary", int, 0, "1: which features the costly tail shares, instead.", ge=0, le=1),
    ),
)
REQUESTS = QuerySpec(
    "requests",
    requests_sql,
    "Requests in scope with their token counts, newest first or most varied timelines first; "
    "external_request_id is the front end's id (what the client got, docs/api.md).",
    params=(
        Param("limit", int, 50, "At most N requests.", ge=1, le=10_000),
        Param(
            "order",
            str,
            "recent",
            "recent, or varied (most kinds of token fate first).",
            choices=ORDERS,
            what="order",
        ),
        Param(
            "request_id",
            str,
            None,
            "Only the requests this id names: a request uid, the engine's id, or the id the "
            "client got (chatcmpl-..., cmpl-...; docs/api.md).",
        ),
        Param(
            "client_id",
            str,
            None,
            "Only the requests the client sent with this X-Request-Id (vLLM names them "
            "chatcmpl-<id> / cmpl-<id>).",
        ),
        Param(
            "inconsistent",
            int,
            0,
            "1: only requests whose counts disagree with the engine's own totals.",
            ge=0,
            le=1,
        ),
    ),
)
TIMELINES = QuerySpec(
    "timelines",
    timelines_sql,
    "Timeline segments of every request in scope (request_uid, tenant, model, start, end, kind, "
    "status, draft_accepted, source_request_uid, kv_fate), request by request.",
    params=(Param("limit", int, 1_000_000, "At most N segments.", ge=1, le=100_000_000),),
)
PD_BILLS = QuerySpec(
    "pd_bills",
    pd_bills_sql,
    "Prefill/decode disaggregation: one bill per client request that a prefill engine and a "
    "decode engine served, joined by the router's id (pd_join_id: X-Request-Id). Rows: both "
    "rows' request_uid, prompt_tokens once, output_tokens (the decode's), what the prefill engine "
    "computed and read, transferred_kv_tokens (loaded by the decode engine; not billed as a read "
    "unless cached_input_external is priced), decode_prompt_computed_tokens (the tail the decode "
    "engine computed again), discarded_output_tokens (the prefill's token), and the pair's "
    "list_cost_usd, actual_cost_usd and gpu_cost_usd. joined = 0: one of the two rows is not "
    "stored (yet).",
    params=(Param("limit", int, 50, "At most N client requests.", ge=1, le=10_000),),
)
REQUEST = QuerySpec(
    "request",
    None,
    "One request: every count, its cost in each mode and its segment timeline.",
    key="request_id",
    lookup=request_lookup,
    rows="segments",
)
TOKENS_STATISTICS = QuerySpec(
    "tokens_statistics",
    None,
    "Token statistics of one request (input, output, computed, cached, skipped, evicted, drafts).",
    key="request_id",
    lookup=tokens_statistics_lookup,
)
TOKEN_RECORDS = QuerySpec(
    "token_records",
    None,
    "Token records of one request: per run of positions (or per position), the token ids and "
    "their text when the privacy mode stored them and the caller may read them, input / output "
    "/ draft / cached flags, and the status on both axes (status, kv_fate).",
    key="request_id",
    lookup=token_records_lookup,
    params=(Param("per_position", bool, False, "One record per position instead of one per run."),),
    gated=True,
    rows="records",
)

QUERIES: tuple[QuerySpec, ...] = (
    COST,
    SAVINGS,
    WASTE,
    PREFIX_EVICTIONS,
    SPEC_EFFICIENCY,
    ENGINES,
    GPU_TIME,
    USAGE,
    EXPERT_LOAD,
    WHATIF,
    REGRESSIONS,
    ROUTING_ADVICE,
    DUPLICATION,
    DUPLICATED_BLOCKS,
    SESSIONS,
    OUTLIERS,
    REQUESTS,
    TIMELINES,
    PD_BILLS,
    REQUEST,
    TOKENS_STATISTICS,
    TOKEN_RECORDS,
)
#: The registry by method name.
BY_NAME: dict[str, QuerySpec] = {q.name: q for q in QUERIES}
