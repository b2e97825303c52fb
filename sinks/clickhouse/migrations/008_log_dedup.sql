-- Issue 14 part 3: one request accounted by two sources (the plugin and the vLLM server log) is
-- counted once by the store itself, whatever the arrival order and whatever path wrote the log's
-- copy (`sparseety ingest --format vllm-log`, the collect job, a replay). Both copies carry vLLM's
-- engine request id (`<client id>-<8 random hex>`, unique per server process) as request_id; the
-- rule is streams/source_dedup.py's: the step-level accounting wins. The raw table keeps both rows
-- (idempotent, replay-safe, and the log's copy reappears by itself if the plugin's is deleted);
-- the views hide a `vllm_log` row whose request_id a step-level row (engine_kind not vllm_log,
-- trace or proxy) also has. The key is request_id alone: the log cannot know the plugin's engine
-- name or epoch, and its tenant and model may differ from the plugin's.

-- The hidden copies. The inner set is limited to ids that a log row has, so a store without logs
-- builds an empty set.
CREATE OR REPLACE VIEW {db}.log_duplicates_v{on_cluster} AS
SELECT request_uid, request_id, tenant, model, engine_name, finished_ts_ns, complete,
       prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, evicted_tokens, gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens, window_released_tokens, evicted_blocks_recomputed, waste_tokens
FROM {db}.requests FINAL
WHERE engine_kind = 'vllm_log'
  AND request_id IN (SELECT request_id FROM {db}.requests
                     WHERE engine_kind NOT IN ('vllm_log', 'trace', 'proxy')
                       AND request_id IN (SELECT request_id FROM {db}.requests WHERE engine_kind = 'vllm_log'));

CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);

-- The views that joined `requests FINAL` read requests_v instead: a hidden copy has no
-- segments, blocks or token ids in any answer (definitions otherwise as in 003 and 007).
CREATE OR REPLACE VIEW {db}.token_segments_v{on_cluster} AS
SELECT s.*, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name, r.finished_ts_ns AS finished_ts_ns
FROM {db}.token_segments AS s FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model, engine_name, finished_ts_ns FROM {db}.requests_v) AS r
    ON s.request_uid = r.request_uid AND s._version = r._version;

CREATE OR REPLACE VIEW {db}.kv_blocks_v{on_cluster} AS
SELECT b.*, r.engine_id AS engine_id, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name,
       r.finished_ts_ns AS finished_ts_ns
FROM {db}.kv_blocks AS b FINAL
INNER JOIN (SELECT request_uid, _version, engine_id, tenant, model, engine_name, finished_ts_ns
            FROM {db}.requests_v) AS r
    ON b.request_uid = r.request_uid AND b._version = r._version;

CREATE OR REPLACE VIEW {db}.request_tokens_v{on_cluster} AS
SELECT t.*, r.tenant AS tenant, r.model AS model
FROM {db}.request_tokens AS t FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model FROM {db}.requests_v) AS r
    ON t.request_uid = r.request_uid AND t._version = r._version;

-- Per-request cost as in 003, over requests_v (sparsity_signals_v, amortized_delta_v and every
-- cost query read this view, so they count the request once too).
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
FROM {db}.requests_v AS r
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

-- Usage windows (usage_1m) are the worker's pre-aggregates: the log's engine emitted windows that
-- include its copies. Each hidden copy is subtracted from the window of its own engine, tenant and
-- model holding its finish time (streams/windows.py: start = finish - finish % window_ns), once that
-- window is stored (a copy whose window has not been emitted yet is not subtracted, so a sum never
-- goes below what was stored). `corrections` counts stored correction rows only.
CREATE OR REPLACE VIEW {db}.usage_v{on_cluster} AS
SELECT
    tenant, model, engine_name, window_start_ns, window_ns,
    fromUnixTimestamp64Nano(window_start_ns, 'UTC') AS window_start,
    countIf(kind = 'correction') AS corrections,
    sum(requests) AS requests,
    sum(incomplete_requests) AS incomplete_requests,
    sum(prompt_tokens) AS prompt_tokens,
    sum(output_tokens) AS output_tokens,
    sum(cache_read_tokens) AS cache_read_tokens,
    sum(uncached_computed_tokens) AS uncached_computed_tokens,
    sum(recomputed_tokens) AS recomputed_tokens,
    sum(draft_accepted_tokens) AS draft_accepted_tokens,
    sum(draft_rejected_tokens) AS draft_rejected_tokens,
    sum(skipped_tokens) AS skipped_tokens,
    sum(evicted_tokens) AS evicted_tokens,
    sum(gpu_time_ns) AS gpu_time_ns,
    sum(est_flops) AS est_flops,
    sum(recomputed_preemption_tokens) AS recomputed_preemption_tokens,
    sum(recomputed_eviction_tokens) AS recomputed_eviction_tokens,
    sum(draft_cut_tokens) AS draft_cut_tokens,
    sum(window_released_tokens) AS window_released_tokens,
    sum(evicted_blocks_recomputed) AS evicted_blocks_recomputed,
    sum(waste_tokens) AS waste_tokens
FROM (
    SELECT tenant, model, engine_name, window_start_ns, window_ns, toString(kind) AS kind,
           requests, incomplete_requests, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, evicted_tokens, gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens, window_released_tokens, evicted_blocks_recomputed, waste_tokens
    FROM {db}.usage_1m FINAL
    UNION ALL
    SELECT d.tenant AS tenant, d.model AS model, d.engine_name AS engine_name,
           d.finished_ts_ns - d.finished_ts_ns % w.window_ns AS window_start_ns, w.window_ns AS window_ns,
           'duplicate' AS kind,
        toInt64(-1) AS requests,
        -toInt64(NOT d.complete) AS incomplete_requests,
        -toInt64(d.prompt_tokens) AS prompt_tokens,
        -toInt64(d.output_tokens) AS output_tokens,
        -toInt64(d.cache_read_tokens) AS cache_read_tokens,
        -toInt64(d.uncached_computed_tokens) AS uncached_computed_tokens,
        -toInt64(d.recomputed_tokens) AS recomputed_tokens,
        -toInt64(d.draft_accepted_tokens) AS draft_accepted_tokens,
        -toInt64(d.draft_rejected_tokens) AS draft_rejected_tokens,
        -toInt64(d.skipped_tokens) AS skipped_tokens,
        -toInt64(d.evicted_tokens) AS evicted_tokens,
        -toInt64(d.gpu_time_ns) AS gpu_time_ns,
        -d.est_flops AS est_flops,
        -toInt64(d.recomputed_preemption_tokens) AS recomputed_preemption_tokens,
        -toInt64(d.recomputed_eviction_tokens) AS recomputed_eviction_tokens,
        -toInt64(d.draft_cut_tokens) AS draft_cut_tokens,
        -toInt64(d.window_released_tokens) AS window_released_tokens,
        -toInt64(d.evicted_blocks_recomputed) AS evicted_blocks_recomputed,
        -toInt64(d.waste_tokens) AS waste_tokens
    FROM {db}.log_duplicates_v AS d
    INNER JOIN (SELECT DISTINCT tenant, model, engine_name, window_ns FROM {db}.usage_1m) AS w
        ON d.tenant = w.tenant AND d.model = w.model AND d.engine_name = w.engine_name
    WHERE (d.tenant, d.model, d.engine_name, d.finished_ts_ns - d.finished_ts_ns % w.window_ns, w.window_ns)
          IN (SELECT tenant, model, engine_name, window_start_ns, window_ns FROM {db}.usage_1m)
)
GROUP BY tenant, model, engine_name, window_start_ns, window_ns;
