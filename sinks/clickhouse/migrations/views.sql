-- Every view, defined once (issue 34): applied by `sparseety db migrate` after the numbered
-- migrations whenever this file changed or a numbered migration was applied after it (a repeatable
-- migration, recorded as version 0), so a view that selects * reads the columns a migration adds.
-- Change a view here, never in a numbered migration: those hold table changes and data moves only,
-- and none of their statements may read a view (a fresh store has none until this file runs). To
-- remove a view, replace its definition with DROP VIEW IF EXISTS {db}.<name>{on_cluster}.
-- Order: a view comes after the views it reads.

-- One request, two sources (issue 14 part 3, docs/clickhouse.md): a `vllm_log` row whose
-- request_id a step-level row (engine_kind not vllm_log, trace or proxy) also has is a hidden
-- copy; the raw table keeps both rows. The inner set is limited to ids that a log row has, so a
-- store without logs builds an empty set.
CREATE OR REPLACE VIEW {db}.log_duplicates_v{on_cluster} AS
SELECT request_uid, request_id, tenant, model, engine_name, finished_ts_ns, complete,
       prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens, window_released_tokens, evicted_blocks_recomputed, waste_tokens
FROM {db}.requests FINAL
WHERE engine_kind = 'vllm_log'
  AND request_id IN (SELECT request_id FROM {db}.requests
                     WHERE engine_kind NOT IN ('vllm_log', 'trace', 'proxy')
                       AND request_id IN (SELECT request_id FROM {db}.requests WHERE engine_kind = 'vllm_log'));

-- The current version of each request, without the hidden copies. It selects *: it reads the
-- columns a migration adds because this file is applied again after every migration.
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);

-- Child rows of the request's current version only, joined through requests_v, which also
-- supplies tenant, model and time: a hidden copy has no segments, blocks or token ids in any
-- answer.
CREATE OR REPLACE VIEW {db}.token_segments_v{on_cluster} AS
SELECT s.*, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name, r.finished_ts_ns AS finished_ts_ns
FROM {db}.token_segments AS s FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model, engine_name, finished_ts_ns FROM {db}.requests_v) AS r
    ON s.request_uid = r.request_uid AND s._version = r._version;

-- Blocks of the request's current version (as token_segments_v), with the engine_id that makes a
-- cache lifetime (engine_id, block_hash, lifetime_seq).
CREATE OR REPLACE VIEW {db}.kv_blocks_v{on_cluster} AS
SELECT b.*, r.engine_id AS engine_id, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name,
       r.finished_ts_ns AS finished_ts_ns
FROM {db}.kv_blocks AS b FINAL
INNER JOIN (SELECT request_uid, _version, engine_id, tenant, model, engine_name, finished_ts_ns
            FROM {db}.requests_v) AS r
    ON b.request_uid = r.request_uid AND b._version = r._version;

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

-- Token records (request_tokens) of the request's current version, as token_segments_v.
CREATE OR REPLACE VIEW {db}.request_tokens_v{on_cluster} AS
SELECT t.*, r.tenant AS tenant, r.model AS model
FROM {db}.request_tokens AS t FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model FROM {db}.requests_v) AS r
    ON t.request_uid = r.request_uid AND t._version = r._version;

-- KV memory cost per request, beside request_costs_v (joined by request_uid): byte-ms x USD per
-- GiB-hour, in picodollars: byte_ms * price_micro * 10^6 / (2^30 * 3.6 * 10^6) =
-- byte_ms * price_micro * 10 / 38654705664, floored per request. NULL where not observed.
CREATE OR REPLACE VIEW {db}.request_kv_costs_v{on_cluster} AS
SELECT
    r.request_uid AS request_uid,
    r.kv_byte_ms AS kv_byte_ms, r.kv_byte_ms_amortized AS kv_byte_ms_amortized,
    r.kv_byte_ms_actual AS kv_byte_ms_actual, r.kv_peak_bytes AS kv_peak_bytes,
    toInt64(ifNull(pk.price_micro, 0)) AS kv_gib_hour_price_micro,
    ifNull(pk.found, 0) = 1 AS kv_priced,
    if(isNull(r.kv_byte_ms_actual), NULL,
       intDiv(toInt128(r.kv_byte_ms_actual) * kv_gib_hour_price_micro * 10, 38654705664)) AS kv_actual_pico,
    if(isNull(r.kv_byte_ms_amortized), NULL,
       intDiv(toInt128(r.kv_byte_ms_amortized) * kv_gib_hour_price_micro * 10, 38654705664)) AS kv_amortized_pico
FROM {db}.requests_v AS r
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'kv') AS pk
    ON r.model = pk.model AND r.finished_ts_ns >= pk.effective_from_ns;

-- Per-request cost in picodollars (Int128) in every attribution mode (docs/cost-model.md): tokens
-- x micro-USD per million tokens. Prices apply as of the request's finish time (ASOF: the latest
-- effective_from <= finished). Over requests_v, so a hidden log copy is not counted
-- (sparsity_signals_v, amortized_delta_v and every cost query read this view).
-- Rows written before schema v2 cannot split recompute: their recomputed_tokens count as
-- preemption recompute (the old meaning of waste); their window release, which schema v1 counted
-- in evicted_tokens, is in window_released_tokens (migration 016). List mode does not charge an
-- aborted request for prompt positions it never computed: its list input is at most what it
-- computed of the prompt for the first time.
-- `list` bills the prompt of an API request once: the n choices of one parent (same engine_id and
-- parent_request_id) are one invoice line, whose prompt (and its cache hits) is carried by one
-- choice, the one that finished last (ties: the highest choice_index), as vLLM's usage reports
-- the cached tokens of the choice that completed the response; the others are billed their
-- output only (list_prompt_billed = 0). prompt_input_tokens is each request's own uncached prompt
-- (the actual mode of request-level rows uses it), list_cached_tokens each request's own
-- admission hits (the savings and regressions hit rate), list_billed_cached_tokens what list bills.
-- Output positions are priced apart: the answer at the output price, the think section at the
-- model's 'reasoning_output' price, else at the output price (so with no such price, and for rows
-- whose reasoning is not observed, the cost is what it was).
-- The bill of 2026 (issue 36; docs/cost-model.md): a cache write is priced at 'cache_write'
-- (times the 'cache_write_ttl_multiplier' of the request's cache_ttl) in place of input, a
-- premium on the written positions; each cache tier has its read price (cpu_offload, host and
-- storage fall back to cached_input; external to nothing in actual, to cached_input in list); a
-- modality's computed positions are priced at its '<m>_input' price in place of input; the
-- encoder's work at 'encoder_compute' / 'encoder_cache_read'; and the whole token charge of a
-- request times the 'service_tier_multiplier' of its service_tier, floored to the picodollar.
-- With none of these prices the cost is what it was (the premiums are 0, the factors 1).
-- P/D as one request (issue 36 part 3, docs/cost-model.md "P/D"): when a prefill row and a decode
-- row share a pd_join_id (the router's X-Request-Id) they are one client request. list bills its
-- prompt once, on the prefill row (the decode row's list_prompt_billed = 0: neither the tail it
-- computed again nor the KV it loaded is billed as prompt), and its output once, on the decode row
-- (the prefill row's list_output_billed = 0: the token it sampled never reached the client). The
-- loaded KV is billed in list only when the model has a 'cached_input_external' price
-- (pd_transfer_tokens at external_price_micro). actual and amortized bill what each engine
-- computed, as for any row; the decode row's modality premium and encoder work are not billed in
-- list either (the prompt is the prefill row's). requests counts the pair once (the prefill row
-- carries list_prompt_billed).
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
    r.preemptions AS preemptions, r.gpu_time_ns AS gpu_time_ns,
    r.est_flops AS est_flops, r.complete AS complete,
    -- The engine's cold first step is engine overhead, not the tenants' (issue 31): gpu mode
    -- bills gpu_time_ns less the request's share of its epoch's first step.
    toInt64(ifNull(r.warmup_gpu_time_ns, 0)) AS warmup_gpu_time_ns,
    toInt64(r.gpu_time_ns) - warmup_gpu_time_ns AS billed_gpu_time_ns,
    r.parent_request_id AS parent_request_id, r.choice_index AS choice_index,
    r.reasoning_output_tokens AS reasoning_output_tokens, r.finish_reason AS finish_reason,
    toInt64(r.output_tokens) - toInt64(ifNull(r.reasoning_output_tokens, 0)) AS answer_output_tokens,
    toInt64(if(r.recomputed_preemption_tokens + r.recomputed_eviction_tokens = r.recomputed_tokens,
               r.recomputed_preemption_tokens, r.recomputed_tokens)) AS recomputed_preemption_tokens,
    toInt64(if(r.recomputed_preemption_tokens + r.recomputed_eviction_tokens = r.recomputed_tokens,
               r.recomputed_eviction_tokens, 0)) AS recomputed_eviction_tokens,
    toInt64(r.draft_cut_tokens) AS draft_cut_tokens,
    toInt64(r.draft_unverified_tokens) AS draft_unverified_tokens,
    toInt64(r.window_released_tokens) AS window_released_tokens,
    toInt64(r.evicted_blocks_recomputed) AS evicted_blocks_recomputed,
    recomputed_preemption_tokens + toInt64(r.draft_rejected_tokens) + draft_cut_tokens AS waste_tokens,
    toInt64(least(if(r.engine_cached_tokens >= 0, r.engine_cached_tokens, r.cache_read_tokens), r.prompt_tokens))
        AS list_cached_tokens,
    toInt64(if(r.finish_reason = 'abort',
               least(toInt64(r.prompt_tokens) - list_cached_tokens,
                     toInt64(r.uncached_computed_tokens) + r.recomputed_eviction_tokens),
               toInt64(r.prompt_tokens) - list_cached_tokens)) AS prompt_input_tokens,
    toUInt8(ifNull(pd._pd_joined, 0) = 1 AND r.pd_role IN ('prefill', 'decode')) AS pd_joined,
    toUInt8((r.parent_request_id = '' OR par._p_billed = r.request_uid)
            AND NOT (pd_joined = 1 AND r.pd_role = 'decode')) AS list_prompt_billed,
    toUInt8(NOT (pd_joined = 1 AND r.pd_role = 'prefill')) AS list_output_billed,
    if(list_output_billed = 1, toInt64(r.output_tokens), 0) AS list_output_tokens,
    toInt64(if(pd_joined = 1 AND r.pd_role = 'decode', r.external_kv_tokens, 0)) AS pd_transfer_tokens,
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
        + toInt128(list_output_billed) * (toInt128(answer_output_tokens) * output_price_micro
            + toInt128(ifNull(r.reasoning_output_tokens, 0)) * reasoning_price_micro) AS list_base_pico,
    toInt128(actual_input_tokens) * input_price_micro
        + toInt128(r.cache_read_tokens) * cached_price_micro
        + toInt128(answer_output_tokens) * output_price_micro
        + toInt128(ifNull(r.reasoning_output_tokens, 0)) * reasoning_price_micro AS actual_base_pico,
    intDiv(toInt128(billed_gpu_time_ns) * gpu_hour_price_micro, 3600000) AS gpu_pico,
    intDiv(toInt128(warmup_gpu_time_ns) * gpu_hour_price_micro, 3600000) AS warmup_gpu_pico,
    -- issue 36: the counts, their prices and what they add (docs/cost-model.md, "The bill of 2026")
    r.service_tier AS service_tier, r.priority AS priority, r.cache_ttl AS cache_ttl,
    r.pd_join_id AS pd_join_id, r.pd_role AS pd_role,
    toInt64(r.cache_write_tokens) AS cache_write_tokens,
    toInt64(r.engine_cache_write_tokens) AS engine_cache_write_tokens,
    toInt64(r.cache_read_cpu_offload_tokens) AS cache_read_cpu_offload_tokens,
    toInt64(r.cache_read_host_tokens) AS cache_read_host_tokens,
    toInt64(r.cache_read_storage_tokens) AS cache_read_storage_tokens,
    toInt64(r.external_kv_tokens) AS external_kv_tokens,
    toInt64(r.image_tokens) AS image_tokens, toInt64(r.audio_tokens) AS audio_tokens,
    toInt64(r.video_tokens) AS video_tokens,
    toInt64(r.image_tokens) - toInt64(r.image_cached_tokens) AS image_computed_tokens,
    toInt64(r.audio_tokens) - toInt64(r.audio_cached_tokens) AS audio_computed_tokens,
    toInt64(r.video_tokens) - toInt64(r.video_cached_tokens) AS video_computed_tokens,
    toInt64(r.encoder_compute_tokens) AS encoder_compute_tokens,
    toInt64(r.encoder_cache_hit_tokens) AS encoder_cache_hit_tokens,
    toInt64(if(ifNull(pst.found, 0) = 1, ifNull(pst.price_micro, 0), 1000000)) AS tier_multiplier_micro,
    toInt64(if(ifNull(pttl.found, 0) = 1, ifNull(pttl.price_micro, 0), 1000000)) AS ttl_multiplier_micro,
    toInt64(intDiv(toInt128(if(ifNull(pcw.found, 0) = 1, ifNull(pcw.price_micro, 0), input_price_micro))
                   * ttl_multiplier_micro, 1000000)) AS cache_write_price_micro,
    toInt64(if(ifNull(pcpu.found, 0) = 1, ifNull(pcpu.price_micro, 0), cached_price_micro)) AS cpu_offload_price_micro,
    toInt64(if(ifNull(phost.found, 0) = 1, ifNull(phost.price_micro, 0), cached_price_micro)) AS host_price_micro,
    toInt64(if(ifNull(psto.found, 0) = 1, ifNull(psto.price_micro, 0), cached_price_micro)) AS storage_price_micro,
    toInt64(if(ifNull(pext.found, 0) = 1, ifNull(pext.price_micro, 0), 0)) AS external_price_micro,
    toInt64(if(ifNull(pext.found, 0) = 1, ifNull(pext.price_micro, 0), cached_price_micro)) AS list_external_price_micro,
    toInt64(if(ifNull(pimg.found, 0) = 1, ifNull(pimg.price_micro, 0), input_price_micro)) AS image_price_micro,
    toInt64(if(ifNull(paud.found, 0) = 1, ifNull(paud.price_micro, 0), input_price_micro)) AS audio_price_micro,
    toInt64(if(ifNull(pvid.found, 0) = 1, ifNull(pvid.price_micro, 0), input_price_micro)) AS video_price_micro,
    toInt64(ifNull(penc.price_micro, 0)) AS encoder_compute_price_micro,
    toInt64(ifNull(penh.price_micro, 0)) AS encoder_cache_read_price_micro,
    toInt128(cache_write_tokens) * (cache_write_price_micro - input_price_micro) AS cache_write_premium_pico,
    toInt128(image_computed_tokens) * (image_price_micro - input_price_micro)
        + toInt128(audio_computed_tokens) * (audio_price_micro - input_price_micro)
        + toInt128(video_computed_tokens) * (video_price_micro - input_price_micro) AS modality_premium_pico,
    toInt128(encoder_compute_tokens) * encoder_compute_price_micro
        + toInt128(encoder_cache_hit_tokens) * encoder_cache_read_price_micro AS encoder_pico,
    toInt128(cache_read_cpu_offload_tokens) * cpu_offload_price_micro
        + toInt128(cache_read_host_tokens) * host_price_micro
        + toInt128(cache_read_storage_tokens) * storage_price_micro AS own_tier_read_pico,
    own_tier_read_pico + toInt128(external_kv_tokens) * external_price_micro AS tier_read_pico,
    -- list bills the engine's own hit count (list_billed_cached_tokens, every tier in it): its
    -- tiers beside gpu at their prices, the rest at cached_input
    toInt64(if(list_prompt_billed = 1, least(cache_read_cpu_offload_tokens + cache_read_host_tokens
        + cache_read_storage_tokens + external_kv_tokens, list_billed_cached_tokens), 0)) AS list_tier_tokens,
    if(list_prompt_billed = 1, own_tier_read_pico + toInt128(external_kv_tokens) * list_external_price_micro, 0)
        AS list_tier_read_pico,
    toUInt8(pd_joined = 1 AND r.pd_role = 'decode') AS pd_decode_joined,
    intDiv((list_base_pico - toInt128(list_tier_tokens) * cached_price_micro + list_tier_read_pico
            + if(list_prompt_billed = 1, cache_write_premium_pico, 0)
            + if(pd_decode_joined = 1, 0, modality_premium_pico + encoder_pico)
            + toInt128(pd_transfer_tokens) * external_price_micro)
           * tier_multiplier_micro, 1000000) AS list_pico,
    actual_base_pico + tier_read_pico + cache_write_premium_pico + modality_premium_pico + encoder_pico
        AS actual_untiered_pico,
    intDiv(actual_untiered_pico * tier_multiplier_micro, 1000000) AS actual_pico
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
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cache_write') AS pcw
    ON r.model = pcw.model AND r.finished_ts_ns >= pcw.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input_cpu_offload') AS pcpu
    ON r.model = pcpu.model AND r.finished_ts_ns >= pcpu.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input_host') AS phost
    ON r.model = phost.model AND r.finished_ts_ns >= phost.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input_storage') AS psto
    ON r.model = psto.model AND r.finished_ts_ns >= psto.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input_external') AS pext
    ON r.model = pext.model AND r.finished_ts_ns >= pext.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'image_input') AS pimg
    ON r.model = pimg.model AND r.finished_ts_ns >= pimg.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'audio_input') AS paud
    ON r.model = paud.model AND r.finished_ts_ns >= paud.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'video_input') AS pvid
    ON r.model = pvid.model AND r.finished_ts_ns >= pvid.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'encoder_compute') AS penc
    ON r.model = penc.model AND r.finished_ts_ns >= penc.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'encoder_cache_read') AS penh
    ON r.model = penh.model AND r.finished_ts_ns >= penh.effective_from_ns
ASOF LEFT JOIN (SELECT model, qualifier, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'service_tier_multiplier') AS pst
    ON r.model = pst.model AND r.service_tier = pst.qualifier AND r.finished_ts_ns >= pst.effective_from_ns
ASOF LEFT JOIN (SELECT model, qualifier, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cache_write_ttl_multiplier') AS pttl
    ON r.model = pttl.model AND r.cache_ttl = pttl.qualifier AND r.finished_ts_ns >= pttl.effective_from_ns
LEFT JOIN (SELECT pd_join_id AS _pd_id,
                  toUInt8(countIf(pd_role = 'prefill') > 0 AND countIf(pd_role = 'decode') > 0) AS _pd_joined
           FROM {db}.requests_v WHERE pd_join_id != '' AND pd_role IN ('prefill', 'decode')
           GROUP BY pd_join_id) AS pd
    ON r.pd_join_id = pd._pd_id
LEFT JOIN (SELECT engine_id AS _p_engine, parent_request_id AS _p_parent,
                  argMax(request_uid, (finished_ts_ns, choice_index)) AS _p_billed
           FROM {db}.requests_v WHERE parent_request_id != ''
           GROUP BY engine_id, parent_request_id) AS par
    ON r.engine_id = par._p_engine AND r.parent_request_id = par._p_parent;

-- One bill per disaggregated client request (issue 36 part 3, docs/cost-model.md "P/D"): the
-- prefill row and the decode row that share a pd_join_id, side by side. prompt_tokens once;
-- output_tokens the decode row's (what the client got); prefill_* what the prefill engine did with
-- the prompt (computed, read from its prefix cache); transferred_kv_tokens what the decode engine
-- loaded from it (not billed as a read unless priced); decode_prompt_computed_tokens the prompt
-- positions past the transfer that the decode engine computed again (or read from its own cache:
-- decode_prompt_cached_tokens); discarded_output_tokens the prefill's sampled token. The costs are
-- the sums of the two rows' request_costs_v costs, which bill the pair once (see there). joined =
-- 0: only one of the two rows is stored (yet).
CREATE OR REPLACE VIEW {db}.pd_bills_v{on_cluster} AS
SELECT
    c.pd_join_id AS pd_join_id,
    if(anyIf(c.tenant, c.pd_role = 'decode') != '', anyIf(c.tenant, c.pd_role = 'decode'),
       anyIf(c.tenant, c.pd_role = 'prefill')) AS tenant,
    any(c.model) AS model, max(c.finished_ts_ns) AS finished_ts_ns,
    fromUnixTimestamp64Nano(max(c.finished_ts_ns), 'UTC') AS finished_at,
    anyIf(c.request_uid, c.pd_role = 'prefill') AS prefill_request_uid,
    anyIf(c.request_uid, c.pd_role = 'decode') AS decode_request_uid,
    toUInt8(countIf(c.pd_role = 'prefill') > 0 AND countIf(c.pd_role = 'decode') > 0) AS joined,
    max(c.prompt_tokens) AS prompt_tokens,
    sumIf(c.output_tokens, c.pd_role = 'decode') AS output_tokens,
    sumIf(c.uncached_computed_tokens + c.recomputed_tokens, c.pd_role = 'prefill') AS prefill_computed_tokens,
    sumIf(c.cache_read_tokens, c.pd_role = 'prefill') AS prefill_cached_tokens,
    sumIf(c.external_kv_tokens, c.pd_role = 'decode') AS transferred_kv_tokens,
    sumIf(c.cache_read_tokens, c.pd_role = 'decode') AS decode_prompt_cached_tokens,
    sumIf(greatest(toInt64(c.prompt_tokens) - toInt64(c.cache_read_tokens) - c.external_kv_tokens, 0),
          c.pd_role = 'decode') AS decode_prompt_computed_tokens,
    sumIf(c.output_tokens, c.pd_role = 'prefill') AS discarded_output_tokens,
    sum(c.list_pico) AS list_pico, sum(c.actual_pico) AS actual_pico, sum(c.gpu_pico) AS gpu_pico,
    toUInt8(min(c.tokens_priced)) AS tokens_priced
FROM {db}.request_costs_v AS c
WHERE c.pd_join_id != '' AND c.pd_role IN ('prefill', 'decode')
GROUP BY c.pd_join_id;

-- Amortized attribution: within one cache lifetime (engine_id, block_hash, lifetime_seq) the
-- compute of a block (its computing requests' tokens at their input price) is split equally
-- among every request that used it. Integer shares; the remainder goes one picodollar each to
-- the first users by request_uid, so the shares add up to the pool exactly. delta_pico is what
-- amortized adds to (or takes from) a request's actual cost; the deltas sum to zero.
CREATE OR REPLACE VIEW {db}.amortized_delta_v{on_cluster} AS
WITH
    uses AS (
        SELECT engine_id, block_hash, lifetime_seq, request_uid,
               sumIf(tokens, role != 'cached') AS computed_tokens
        FROM {db}.kv_blocks_v
        WHERE lifetime_seq >= 0
        GROUP BY engine_id, block_hash, lifetime_seq, request_uid
    ),
    priced AS (
        SELECT u.engine_id AS engine_id, u.block_hash AS block_hash, u.lifetime_seq AS lifetime_seq,
               u.request_uid AS request_uid,
               toInt128(u.computed_tokens) * c.input_price_micro AS computed_pico
        FROM uses AS u
        INNER JOIN (SELECT request_uid, input_price_micro FROM {db}.request_costs_v) AS c
            ON u.request_uid = c.request_uid
    ),
    shared AS (
        SELECT request_uid, computed_pico,
               sum(computed_pico) OVER w AS pool,
               toInt128(count() OVER w) AS n,
               toInt128(row_number() OVER (PARTITION BY engine_id, block_hash, lifetime_seq ORDER BY request_uid) - 1) AS k
        FROM priced
        WINDOW w AS (PARTITION BY engine_id, block_hash, lifetime_seq)
    )
SELECT request_uid,
       sum(intDiv(pool, n) + if(k < pool % n, 1, 0) - computed_pico) AS delta_pico,
       sum(intDiv(pool, n) + if(k < pool % n, 1, 0)) AS shared_pico,
       countIf(computed_pico = 0) AS blocks_read,
       countIf(computed_pico > 0) AS blocks_computed
FROM shared
WHERE pool > 0
GROUP BY request_uid;

-- Sparsity regression alerts (issue 15): one row per request with the numerator and denominator
-- of every "did the optimisation fire?" signal, so a window's rate is sum(num) / sum(den) over its
-- requests (sparseety/queries/regressions.py compares a current window with the engine's own
-- baseline). MoE expert balance comes from expert_load (per request counts), not from here.
CREATE OR REPLACE VIEW {db}.sparsity_signals_v{on_cluster} AS
SELECT
    c.request_uid AS request_uid, c.tenant AS tenant, c.model AS model, c.engine_name AS engine_name,
    c.engine_id AS engine_id, c.finished_ts_ns AS finished_ts_ns,
    -- prefix cache: admission hits over prompt positions (the savings query's hit rate)
    toInt64(c.list_cached_tokens) AS cache_hit_tokens, toInt64(c.prompt_tokens) AS prompt_tokens,
    -- speculative decoding: drafts proposed (accepted + rejected + cut) and accepted, per output
    toInt64(c.draft_accepted_tokens) + c.draft_rejected_tokens + c.draft_cut_tokens AS draft_tokens,
    toInt64(c.draft_accepted_tokens) AS draft_accepted_tokens, toInt64(c.output_tokens) AS output_tokens,
    -- sliding window: attention pairs skipped over the pairs full attention would have attended
    toInt64(r.attention_pairs_skipped) AS attention_pairs_skipped,
    toInt64(r.attention_pairs) + r.attention_pairs_skipped AS attention_pairs_full,
    r.attention_window AS attention_window,
    -- eviction: positions recomputed after a prefix-cache eviction over everything computed
    toInt64(c.recomputed_eviction_tokens) AS recomputed_eviction_tokens,
    toInt64(c.scheduled_tokens) AS scheduled_tokens
FROM {db}.request_costs_v AS c
INNER JOIN {db}.requests_v AS r ON c.request_uid = r.request_uid;

-- Usage windows (usage_1m, per adapter: lora_name beside model) are the worker's pre-aggregates:
-- the log's engine emitted windows that include its copies. Each hidden copy is subtracted from
-- the window of its own engine, tenant and model holding its finish time (streams/windows.py:
-- start = finish - finish % window_ns), once that window is stored (a copy whose window has not
-- been emitted yet is not subtracted, so a sum never goes below what was stored). `corrections`
-- counts stored correction rows only.
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
           requests, incomplete_requests, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, recomputed_tokens, draft_accepted_tokens, draft_rejected_tokens, skipped_tokens, gpu_time_ns, est_flops, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_cut_tokens, window_released_tokens, evicted_blocks_recomputed, waste_tokens
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
