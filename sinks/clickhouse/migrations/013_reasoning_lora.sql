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
-- (issue 23), listed here too so that this list never drops it, whichever lands first; 7-18 are
-- migration 017's classes (issue 36), listed for the same reason: the enum is part of the sorting
-- key, so applying this statement again on a newer store must not shrink it.
ALTER TABLE {db}.prices{on_cluster}
    MODIFY COLUMN token_class Enum8('input' = 1, 'cached_input' = 2, 'output' = 3, 'gpu_hour' = 4,
                                    'kv' = 5, 'reasoning_output' = 6, 'cache_write' = 7,
                                    'cached_input_cpu_offload' = 8, 'cached_input_external' = 9,
                                    'cached_input_host' = 10, 'cached_input_storage' = 11,
                                    'image_input' = 12, 'audio_input' = 13, 'video_input' = 14,
                                    'encoder_compute' = 15, 'encoder_cache_read' = 16,
                                    'service_tier_multiplier' = 17, 'cache_write_ttl_multiplier' = 18);

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

-- The views over these tables are defined in views.sql (issue 34).
