-- Issue 11, the two-axis position model (docs/streams.md): how a position was obtained and what
-- became of its KV are separate columns; recompute is split into its two senses; waste means
-- preemption recompute + rejected drafts + drafts cut by stop. Rows written before this
-- migration read 0 in the new columns (see the views for how they are interpreted).

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS recomputed_preemption_tokens Int32 DEFAULT 0 AFTER expert_num_experts,
    ADD COLUMN IF NOT EXISTS recomputed_eviction_tokens Int32 DEFAULT 0 AFTER recomputed_preemption_tokens,
    ADD COLUMN IF NOT EXISTS draft_cut_tokens Int32 DEFAULT 0 AFTER recomputed_eviction_tokens,
    ADD COLUMN IF NOT EXISTS window_released_tokens Int32 DEFAULT 0 AFTER draft_cut_tokens,
    ADD COLUMN IF NOT EXISTS evicted_blocks_recomputed Int32 DEFAULT 0 AFTER window_released_tokens,
    ADD COLUMN IF NOT EXISTS waste_tokens Int32 DEFAULT 0 AFTER evicted_blocks_recomputed;

-- Enum values are appended (old rows keep theirs); kv_fate is the second axis.
ALTER TABLE {db}.token_segments{on_cluster}
    MODIFY COLUMN status Enum8('computed' = 1, 'cached' = 2, 'recomputed' = 3, 'skipped' = 4, 'evicted' = 5,
                               'recomputed_after_preemption' = 6, 'recomputed_after_eviction' = 7,
                               'not_computed' = 8),
    ADD COLUMN IF NOT EXISTS kv_fate Enum8('kept' = 1, 'window_released' = 2, 'skipped' = 3) DEFAULT 'kept'
        AFTER source_request_uid;

ALTER TABLE {db}.usage_1m{on_cluster}
    ADD COLUMN IF NOT EXISTS recomputed_preemption_tokens Int64 DEFAULT 0 AFTER est_flops,
    ADD COLUMN IF NOT EXISTS recomputed_eviction_tokens Int64 DEFAULT 0 AFTER recomputed_preemption_tokens,
    ADD COLUMN IF NOT EXISTS draft_cut_tokens Int64 DEFAULT 0 AFTER recomputed_eviction_tokens,
    ADD COLUMN IF NOT EXISTS window_released_tokens Int64 DEFAULT 0 AFTER draft_cut_tokens,
    ADD COLUMN IF NOT EXISTS evicted_blocks_recomputed Int64 DEFAULT 0 AFTER window_released_tokens,
    ADD COLUMN IF NOT EXISTS waste_tokens Int64 DEFAULT 0 AFTER evicted_blocks_recomputed;

CREATE OR REPLACE VIEW {db}.usage_v{on_cluster} AS
SELECT
    tenant, model, engine_name, window_start_ns, window_ns,
    fromUnixTimestamp64Nano(window_start_ns, 'UTC') AS window_start,
    countIf(kind = 'correction') AS corrections,
    sum(requests) AS requests, sum(incomplete_requests) AS incomplete_requests,
    sum(prompt_tokens) AS prompt_tokens, sum(output_tokens) AS output_tokens,
    sum(cache_read_tokens) AS cache_read_tokens, sum(uncached_computed_tokens) AS uncached_computed_tokens,
    sum(recomputed_tokens) AS recomputed_tokens, sum(draft_accepted_tokens) AS draft_accepted_tokens,
    sum(draft_rejected_tokens) AS draft_rejected_tokens, sum(skipped_tokens) AS skipped_tokens,
    sum(evicted_tokens) AS evicted_tokens, sum(gpu_time_ns) AS gpu_time_ns, sum(est_flops) AS est_flops,
    sum(recomputed_preemption_tokens) AS recomputed_preemption_tokens,
    sum(recomputed_eviction_tokens) AS recomputed_eviction_tokens,
    sum(draft_cut_tokens) AS draft_cut_tokens, sum(window_released_tokens) AS window_released_tokens,
    sum(evicted_blocks_recomputed) AS evicted_blocks_recomputed, sum(waste_tokens) AS waste_tokens
FROM {db}.usage_1m FINAL
GROUP BY tenant, model, engine_name, window_start_ns, window_ns;

CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL;

CREATE OR REPLACE VIEW {db}.token_segments_v{on_cluster} AS
SELECT s.*, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name, r.finished_ts_ns AS finished_ts_ns
FROM {db}.token_segments AS s FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model, engine_name, finished_ts_ns FROM {db}.requests FINAL) AS r
    ON s.request_uid = r.request_uid AND s._version = r._version;

-- Per-request cost, as in 002, plus the position classes. Rows written before schema v2 cannot
-- split recompute: their recomputed_tokens count as preemption recompute (the old meaning of
-- waste), and their evicted_tokens (window release) as window_released_tokens. List mode no
-- longer charges an aborted request for prompt positions it never computed: its list input is
-- at most what it computed of the prompt for the first time.
CREATE OR REPLACE VIEW {db}.request_costs_v{on_cluster} AS
SELECT
    r.request_uid AS request_uid, r.tenant AS tenant, r.model AS model,
    r.engine_name AS engine_name, r.engine_id AS engine_id, r.lora_name AS lora_name,
    r.finished_ts_ns AS finished_ts_ns, fromUnixTimestamp64Nano(r.finished_ts_ns, 'UTC') AS finished_at,
    r.prompt_tokens AS prompt_tokens, r.output_tokens AS output_tokens,
    r.cache_read_tokens AS cache_read_tokens, r.scheduled_tokens AS scheduled_tokens,
    r.uncached_computed_tokens AS uncached_computed_tokens,
    r.recomputed_tokens AS recomputed_tokens, r.draft_accepted_tokens AS draft_accepted_tokens,
    r.draft_rejected_tokens AS draft_rejected_tokens, r.skipped_tokens AS skipped_tokens,
    r.evicted_tokens AS evicted_tokens, r.preemptions AS preemptions, r.gpu_time_ns AS gpu_time_ns,
    r.est_flops AS est_flops, r.complete AS complete,
    toInt64(if(r.recomputed_preemption_tokens + r.recomputed_eviction_tokens = r.recomputed_tokens,
               r.recomputed_preemption_tokens, r.recomputed_tokens)) AS recomputed_preemption_tokens,
    toInt64(if(r.recomputed_preemption_tokens + r.recomputed_eviction_tokens = r.recomputed_tokens,
               r.recomputed_eviction_tokens, 0)) AS recomputed_eviction_tokens,
    toInt64(r.draft_cut_tokens) AS draft_cut_tokens,
    toInt64(r.window_released_tokens + r.evicted_tokens) AS window_released_tokens,
    toInt64(r.evicted_blocks_recomputed) AS evicted_blocks_recomputed,
    recomputed_preemption_tokens + toInt64(r.draft_rejected_tokens) + draft_cut_tokens AS waste_tokens,
    toInt64(least(if(r.engine_cached_tokens >= 0, r.engine_cached_tokens, r.cache_read_tokens), r.prompt_tokens))
        AS list_cached_tokens,
    toInt64(if(r.finish_reason = 'abort',
               least(toInt64(r.prompt_tokens) - list_cached_tokens,
                     toInt64(r.uncached_computed_tokens) + r.recomputed_eviction_tokens),
               toInt64(r.prompt_tokens) - list_cached_tokens)) AS list_input_tokens,
    toInt64(if(r.scheduled_tokens > 0, greatest(r.scheduled_tokens - r.output_tokens, 0), list_input_tokens))
        AS actual_input_tokens,
    toInt64(ifNull(pin.price_micro, 0)) AS input_price_micro,
    toInt64(if(ifNull(pca.found, 0) = 1, ifNull(pca.price_micro, 0), input_price_micro)) AS cached_price_micro,
    toInt64(ifNull(pout.price_micro, 0)) AS output_price_micro,
    toInt64(ifNull(pg.price_micro, 0)) AS gpu_hour_price_micro,
    ifNull(pin.found, 0) = 1 AND ifNull(pout.found, 0) = 1 AS tokens_priced,
    ifNull(pg.found, 0) = 1 AS gpu_priced,
    toInt128(list_input_tokens) * input_price_micro
        + toInt128(list_cached_tokens) * cached_price_micro
        + toInt128(r.output_tokens) * output_price_micro AS list_pico,
    toInt128(actual_input_tokens) * input_price_micro
        + toInt128(r.cache_read_tokens) * cached_price_micro
        + toInt128(r.output_tokens) * output_price_micro AS actual_pico,
    intDiv(toInt128(r.gpu_time_ns) * gpu_hour_price_micro, 3600000) AS gpu_pico
FROM {db}.requests AS r FINAL
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'input') AS pin
    ON r.model = pin.model AND r.finished_ts_ns >= pin.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input') AS pca
    ON r.model = pca.model AND r.finished_ts_ns >= pca.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'output') AS pout
    ON r.model = pout.model AND r.finished_ts_ns >= pout.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'gpu_hour') AS pg
    ON r.model = pg.model AND r.finished_ts_ns >= pg.effective_from_ns;

-- Observed prefix-cache eviction per request (axis 2 after the request, from kv_blocks): the
-- blocks it computed whose cache lifetime later ended, i.e. a later request computed the same
-- hash again as recomputed_after_eviction (role 'recomputed') in a newer lifetime on that engine.
-- A block still cached, or evicted but never needed again, is not counted: only evictions that
-- someone paid for are observable from the stored accounting.
CREATE OR REPLACE VIEW {db}.prefix_evictions_v{on_cluster} AS
WITH
    computed AS (
        SELECT engine_id, block_hash, lifetime_seq, request_uid, tenant, model, engine_name, finished_ts_ns, tokens
        FROM {db}.kv_blocks_v
        WHERE role != 'cached' AND lifetime_seq >= 0
    ),
    recomputed AS (
        SELECT engine_id, block_hash, min(lifetime_seq) AS next_lifetime_seq
        FROM {db}.kv_blocks_v
        WHERE role = 'recomputed' AND lifetime_seq >= 0
        GROUP BY engine_id, block_hash
    )
SELECT c.request_uid AS request_uid, any(c.tenant) AS tenant, any(c.model) AS model,
       any(c.engine_name) AS engine_name, any(c.finished_ts_ns) AS finished_ts_ns,
       count() AS blocks_evicted_later, sum(c.tokens) AS tokens_evicted_later
FROM computed AS c
INNER JOIN recomputed AS x ON c.engine_id = x.engine_id AND c.block_hash = x.block_hash
WHERE x.next_lifetime_seq > c.lifetime_seq
GROUP BY c.request_uid;
