-- Issue 36: the bill of 2026. Cache writes, cache tiers, P/D as one request, multimodal tokens,
-- service tiers (RequestAccounting schema v7; the meaning of each column is its field's doc in
-- schemas/RequestAccounting.avsc, the tiers and roles are named in sparseety/billing.py, the
-- prices in docs/cost-model.md). Every column has a default that is what a row written before
-- means: no cache write counted (engine's own count -1: not reported), no tier but gpu and
-- external, priority 0, no service tier or cache TTL asked, not disaggregated (pd_role 'none'),
-- a text prompt, no encoder work. A replay of the topics fills them from the events.
ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS cache_write_tokens Int32 DEFAULT 0 AFTER draft_unverified_tokens,
    ADD COLUMN IF NOT EXISTS engine_cache_write_tokens Int32 DEFAULT -1 AFTER cache_write_tokens,
    ADD COLUMN IF NOT EXISTS cache_read_cpu_offload_tokens Int32 DEFAULT 0 AFTER engine_cache_write_tokens,
    ADD COLUMN IF NOT EXISTS cache_read_host_tokens Int32 DEFAULT 0 AFTER cache_read_cpu_offload_tokens,
    ADD COLUMN IF NOT EXISTS cache_read_storage_tokens Int32 DEFAULT 0 AFTER cache_read_host_tokens,
    ADD COLUMN IF NOT EXISTS priority Int32 DEFAULT 0 AFTER cache_read_storage_tokens,
    ADD COLUMN IF NOT EXISTS service_tier LowCardinality(String) DEFAULT '' AFTER priority,
    ADD COLUMN IF NOT EXISTS cache_ttl LowCardinality(String) DEFAULT '' AFTER service_tier,
    ADD COLUMN IF NOT EXISTS pd_join_id String DEFAULT '' AFTER cache_ttl,
    ADD COLUMN IF NOT EXISTS pd_role LowCardinality(String) DEFAULT 'none' AFTER pd_join_id,
    ADD COLUMN IF NOT EXISTS image_tokens Int32 DEFAULT 0 AFTER pd_role,
    ADD COLUMN IF NOT EXISTS audio_tokens Int32 DEFAULT 0 AFTER image_tokens,
    ADD COLUMN IF NOT EXISTS video_tokens Int32 DEFAULT 0 AFTER audio_tokens,
    ADD COLUMN IF NOT EXISTS image_cached_tokens Int32 DEFAULT 0 AFTER video_tokens,
    ADD COLUMN IF NOT EXISTS audio_cached_tokens Int32 DEFAULT 0 AFTER image_cached_tokens,
    ADD COLUMN IF NOT EXISTS video_cached_tokens Int32 DEFAULT 0 AFTER audio_cached_tokens,
    ADD COLUMN IF NOT EXISTS encoder_compute_tokens Int32 DEFAULT 0 AFTER video_cached_tokens,
    ADD COLUMN IF NOT EXISTS encoder_cache_hit_tokens Int32 DEFAULT 0 AFTER encoder_compute_tokens;

-- The cache tiers' timeline statuses. Enum values are appended (old rows keep theirs).
ALTER TABLE {db}.token_segments{on_cluster}
    MODIFY COLUMN status Enum8('computed' = 1, 'cached' = 2, 'recomputed' = 3, 'skipped' = 4, 'evicted' = 5,
                               'recomputed_after_preemption' = 6, 'recomputed_after_eviction' = 7,
                               'not_computed' = 8, 'external_kv' = 9, 'cached_cpu_offload' = 10,
                               'cached_host' = 11, 'cached_storage' = 12);

-- The new price classes (appended). The two *_multiplier classes hold a factor, not USD (stored
-- in micro-units as every price: 1.25x = 1250000), for the value named in `qualifier`: the
-- service tier (service_tier_multiplier) or the cache TTL (cache_write_ttl_multiplier). Every
-- other class has qualifier ''. The qualifier is part of a price's identity, so it joins the
-- sorting key (a column added in the same statement may be appended to it).
ALTER TABLE {db}.prices{on_cluster}
    MODIFY COLUMN token_class Enum8('input' = 1, 'cached_input' = 2, 'output' = 3, 'gpu_hour' = 4,
                                    'kv' = 5, 'reasoning_output' = 6, 'cache_write' = 7,
                                    'cached_input_cpu_offload' = 8, 'cached_input_external' = 9,
                                    'cached_input_host' = 10, 'cached_input_storage' = 11,
                                    'image_input' = 12, 'audio_input' = 13, 'video_input' = 14,
                                    'encoder_compute' = 15, 'encoder_cache_read' = 16,
                                    'service_tier_multiplier' = 17, 'cache_write_ttl_multiplier' = 18);

ALTER TABLE {db}.prices{on_cluster}
    ADD COLUMN IF NOT EXISTS qualifier LowCardinality(String),
    MODIFY ORDER BY (model, token_class, effective_from_ns, qualifier);

-- The views over these tables are defined in views.sql (issue 34).
