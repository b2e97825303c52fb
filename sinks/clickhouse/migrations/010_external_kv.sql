-- Issue 20: tokens a KV connector loaded from outside the engine at admission (the decode side of
-- prefill/decode disaggregation, a KV offload tier). vLLM counts them in its cached tokens
-- (PrefillStats.num_cached_tokens = local + external); SparSEEty keeps them apart: they are
-- neither read from this engine's prefix cache (cache_read_tokens) nor computed here. Rows
-- written before read 0 (no connector was accounted).

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS external_kv_tokens Int32 DEFAULT 0 AFTER choice_index;

-- Enum values are appended (old rows keep theirs).
ALTER TABLE {db}.token_segments{on_cluster}
    MODIFY COLUMN status Enum8('computed' = 1, 'cached' = 2, 'recomputed' = 3, 'skipped' = 4, 'evicted' = 5,
                               'recomputed_after_preemption' = 6, 'recomputed_after_eviction' = 7,
                               'not_computed' = 8, 'external_kv' = 9);

-- The views over these tables are defined in views.sql (issue 34).
