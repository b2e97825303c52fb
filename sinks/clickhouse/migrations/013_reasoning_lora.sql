-- Issue 23: reasoning tokens per request, and LoRA adapters as their own column.
--
-- reasoning_output_tokens: output positions the engine's reasoning parser counts as reasoning (those
-- inside its think delimiters, vLLM's completion_tokens_details.reasoning_tokens), and
-- reasoning_spans which ones ([start, end) pairs of output indexes; token records' kind reasoning).
-- NULL = not observed (an engine without a reasoning parser, rows written before), never 0. Priced
-- as output unless the model has a 'reasoning_output' price (prices.token_class).

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS reasoning_output_tokens Nullable(Int32) AFTER source_history_lost_ts_ns,
    ADD COLUMN IF NOT EXISTS reasoning_spans Array(Int32) DEFAULT [] AFTER reasoning_output_tokens;

-- Usage windows are per adapter too (UsageWindow.lora_name; '' = the base model).
ALTER TABLE {db}.usage_1m{on_cluster}
    ADD COLUMN IF NOT EXISTS lora_name LowCardinality(String) DEFAULT '' AFTER waste_tokens;

-- Enum values are appended (old rows keep theirs); 5 is the KV memory price of migration 012
-- (issue 23), listed here too so that this list never drops it, whichever lands first.
ALTER TABLE {db}.prices{on_cluster}
    MODIFY COLUMN token_class Enum8('input' = 1, 'cached_input' = 2, 'output' = 3, 'gpu_hour' = 4,
                                    'kv' = 5, 'reasoning_output' = 6);

-- Rows written before issue 23 hold a LoRA request's adapter in `model` (the producer put it there).
-- They are rewritten once with the engine's base model, the `model` of the same engine's requests
-- without an adapter (what its served model name was), so `--by model` no longer scatters a base
-- model over its adapters and prices apply to the base. A row whose engine served no base-model
-- request keeps the adapter in `model` (its base is not known). The rewritten rows have the sort
-- key a replay of the old topic writes (the fold corrects old events the same way), so a replay
-- overwrites them. Usage windows first: they are found through the old requests rows.
INSERT INTO {db}.usage_1m (tenant, model, window_start_ns, engine_name, usage_id, kind, window_ns, requests,
    incomplete_requests, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens,
    recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, evicted_tokens,
    gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens,
    window_released_tokens, evicted_blocks_recomputed, waste_tokens, lora_name)
WITH (SELECT groupArray((engine_name, base)) FROM (
          SELECT engine_name, argMax(model, finished_ts_ns) AS base FROM {db}.requests FINAL
          WHERE lora_name IS NULL GROUP BY engine_name)) AS bases,
     (SELECT groupUniqArray((engine_name, model)) FROM {db}.requests FINAL
          WHERE lora_name IS NOT NULL AND model = lora_name) AS adapters
SELECT u.tenant, transform(u.engine_name, arrayMap(x -> x.1, bases), arrayMap(x -> x.2, bases), '') AS model,
    u.window_start_ns, u.engine_name, u.usage_id, u.kind, u.window_ns, u.requests,
    u.incomplete_requests, u.prompt_tokens, u.output_tokens, u.cache_read_tokens, u.uncached_computed_tokens,
    u.recomputed_tokens, u.draft_accepted_tokens, u.draft_rejected_tokens, u.skipped_tokens, u.evicted_tokens,
    u.gpu_time_ns, u.est_flops, u.recomputed_preemption_tokens, u.recomputed_eviction_tokens, u.draft_cut_tokens,
    u.window_released_tokens, u.evicted_blocks_recomputed, u.waste_tokens, u.model AS lora_name
FROM (SELECT * FROM {db}.usage_1m FINAL
      WHERE lora_name = '' AND has(adapters, (engine_name, model)) AND has(arrayMap(x -> x.1, bases), engine_name)) AS u;

ALTER TABLE {db}.usage_1m{on_cluster}
    DELETE WHERE lora_name = '' AND (engine_name, model) IN (
        SELECT engine_name, lora_name FROM {db}.usage_1m WHERE lora_name != '')
    SETTINGS mutations_sync = 2;

INSERT INTO {db}.requests
WITH (SELECT groupArray((engine_id, base)) FROM (
          SELECT engine_id, argMax(model, finished_ts_ns) AS base FROM {db}.requests FINAL
          WHERE lora_name IS NULL GROUP BY engine_id)) AS bases
SELECT * REPLACE (transform(engine_id, arrayMap(x -> x.1, bases), arrayMap(x -> x.2, bases), model) AS model)
FROM (SELECT * FROM {db}.requests FINAL
      WHERE lora_name IS NOT NULL AND model = lora_name AND has(arrayMap(x -> x.1, bases), engine_id));

ALTER TABLE {db}.requests{on_cluster}
    DELETE WHERE lora_name IS NOT NULL AND model = lora_name AND request_uid IN (
        SELECT request_uid FROM {db}.requests WHERE lora_name IS NOT NULL AND model != lora_name)
    SETTINGS mutations_sync = 2;

-- requests_v selects *: recreated so that it reads the new column (definition as in 010).
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);

-- Per-request cost as in 009; output positions are priced apart: the answer at the output price,
-- the think section at the model's 'reasoning_output' price, else at the output price (so with no
-- such price, and for rows whose reasoning is not observed, the cost is what it was).
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
    r.parent_request_id AS parent_request_id, r.choice_index AS choice_index,
    r.reasoning_output_tokens AS reasoning_output_tokens, r.finish_reason AS finish_reason,
    toInt64(r.output_tokens) - toInt64(ifNull(r.reasoning_output_tokens, 0)) AS answer_output_tokens,
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
               toInt64(r.prompt_tokens) - list_cached_tokens)) AS prompt_input_tokens,
    toUInt8(r.parent_request_id = '' OR par._p_billed = r.request_uid) AS list_prompt_billed,
    if(list_prompt_billed = 1, prompt_input_tokens, 0) AS list_input_tokens,
    if(list_prompt_billed = 1, list_cached_tokens, 0) AS list_billed_cached_tokens,
    toInt64(if(r.scheduled_tokens > 0, greatest(r.scheduled_tokens - r.output_tokens, 0), prompt_input_tokens))
        AS actual_input_tokens,
    toInt64(ifNull(pin.price_micro, 0)) AS input_price_micro,
    toInt64(if(ifNull(pca.found, 0) = 1, ifNull(pca.price_micro, 0), input_price_micro)) AS cached_price_micro,
    toInt64(ifNull(pout.price_micro, 0)) AS output_price_micro,
    toInt64(if(ifNull(pre.found, 0) = 1, ifNull(pre.price_micro, 0), output_price_micro)) AS reasoning_price_micro,
    toInt64(ifNull(pg.price_micro, 0)) AS gpu_hour_price_micro,
    ifNull(pin.found, 0) = 1 AND ifNull(pout.found, 0) = 1 AS tokens_priced,
    ifNull(pg.found, 0) = 1 AS gpu_priced,
    toInt128(list_input_tokens) * input_price_micro
        + toInt128(list_billed_cached_tokens) * cached_price_micro
        + toInt128(answer_output_tokens) * output_price_micro
        + toInt128(ifNull(r.reasoning_output_tokens, 0)) * reasoning_price_micro AS list_pico,
    toInt128(actual_input_tokens) * input_price_micro
        + toInt128(r.cache_read_tokens) * cached_price_micro
        + toInt128(answer_output_tokens) * output_price_micro
        + toInt128(ifNull(r.reasoning_output_tokens, 0)) * reasoning_price_micro AS actual_pico,
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
                FROM {db}.prices FINAL WHERE token_class = 'reasoning_output') AS pre
    ON r.model = pre.model AND r.finished_ts_ns >= pre.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'gpu_hour') AS pg
    ON r.model = pg.model AND r.finished_ts_ns >= pg.effective_from_ns
LEFT JOIN (SELECT engine_id AS _p_engine, parent_request_id AS _p_parent,
                  argMax(request_uid, (finished_ts_ns, choice_index)) AS _p_billed
           FROM {db}.requests_v WHERE parent_request_id != ''
           GROUP BY engine_id, parent_request_id) AS par
    ON r.engine_id = par._p_engine AND r.parent_request_id = par._p_parent;

-- Usage windows per adapter (definition as in 008, lora_name beside model).
CREATE OR REPLACE VIEW {db}.usage_v{on_cluster} AS
SELECT
    tenant, model, lora_name, engine_name, window_start_ns, window_ns,
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
    SELECT tenant, model, lora_name, engine_name, window_start_ns, window_ns, toString(kind) AS kind,
           requests, incomplete_requests, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, evicted_tokens, gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens, window_released_tokens, evicted_blocks_recomputed, waste_tokens
    FROM {db}.usage_1m FINAL
    UNION ALL
    SELECT d.tenant AS tenant, d.model AS model, '' AS lora_name, d.engine_name AS engine_name,
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
GROUP BY tenant, model, lora_name, engine_name, window_start_ns, window_ns;
