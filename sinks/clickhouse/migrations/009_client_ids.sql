-- Issue 21: what a client can name a request by, and n > 1 billed as the invoice bills it.
--
-- external_request_id is the id the serving front end gave the engine (vLLM's external_req_id:
-- chatcmpl-<id>, cmpl-<id>-<prompt index>), so `sparseety query request chatcmpl-...` finds the
-- request without vLLM's random suffix. parent_request_id and choice_index say which API request
-- a request is one of the n choices of (RequestStarted; docs/cost-model.md). Rows written before
-- read '' and 0: each is its own API request, as before.

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS external_request_id String DEFAULT '' AFTER session_id,
    ADD COLUMN IF NOT EXISTS parent_request_id String DEFAULT '' AFTER external_request_id,
    ADD COLUMN IF NOT EXISTS choice_index Int32 DEFAULT 0 AFTER parent_request_id;

-- requests_v selects *: recreated so that it reads the new columns (definition as in 008).
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);

-- Per-request cost as in 008, but `list` bills the prompt of an API request once: the n choices
-- of one parent (same engine_id and parent_request_id) are one invoice line, whose prompt (and
-- its cache hits) is carried by one choice, the one that finished last (ties: the highest
-- choice_index), as vLLM's usage reports the cached tokens of the choice that completed the
-- response; the others are billed their output only (list_prompt_billed = 0).
-- prompt_input_tokens is each request's own uncached prompt (what list_input_tokens was; the
-- actual mode of request-level rows still uses it), list_cached_tokens each request's own
-- admission hits (the savings and regressions hit rate), list_billed_cached_tokens what list bills.
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
    toInt64(ifNull(pg.price_micro, 0)) AS gpu_hour_price_micro,
    ifNull(pin.found, 0) = 1 AND ifNull(pout.found, 0) = 1 AS tokens_priced,
    ifNull(pg.found, 0) = 1 AS gpu_priced,
    toInt128(list_input_tokens) * input_price_micro
        + toInt128(list_billed_cached_tokens) * cached_price_micro
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
    ON r.model = pg.model AND r.finished_ts_ns >= pg.effective_from_ns
LEFT JOIN (SELECT engine_id AS _p_engine, parent_request_id AS _p_parent,
                  argMax(request_uid, (finished_ts_ns, choice_index)) AS _p_billed
           FROM {db}.requests_v WHERE parent_request_id != ''
           GROUP BY engine_id, parent_request_id) AS par
    ON r.engine_id = par._p_engine AND r.parent_request_id = par._p_parent;
