-- Issue 12: a per-request count the worker derives is a sum or product of bounded event counts
-- (sparseety.validate: tokens <= 2**24, preemptions <= 2**16), e.g. recompute over many
-- preemptions, so it can pass Int32 even when every input is in range, and an Int32 column then
-- refuses the whole insert. Every token, step and preemption count of a request is Int64 (as
-- scheduled_tokens and the usage_1m sums already are); the views' sums of them are Int64, the
-- cost products Int128 (002/003). Positions (token_segments) and block
-- sizes (kv_blocks) are single bounded values and stay 32-bit. Changing a column's type rewrites that column, once.

ALTER TABLE {db}.requests{on_cluster}
    MODIFY COLUMN prompt_tokens Int64,
    MODIFY COLUMN output_tokens Int64,
    MODIFY COLUMN cache_read_tokens Int64,
    MODIFY COLUMN uncached_computed_tokens Int64,
    MODIFY COLUMN recomputed_tokens Int64,
    MODIFY COLUMN draft_accepted_tokens Int64,
    MODIFY COLUMN draft_rejected_tokens Int64,
    MODIFY COLUMN skipped_tokens Int64,
    MODIFY COLUMN evicted_tokens Int64,
    MODIFY COLUMN preemptions Int64,
    MODIFY COLUMN steps Int64,
    MODIFY COLUMN engine_prompt_tokens Int64,
    MODIFY COLUMN engine_output_tokens Int64,
    MODIFY COLUMN engine_cached_tokens Int64,
    MODIFY COLUMN recomputed_preemption_tokens Int64 DEFAULT 0,
    MODIFY COLUMN recomputed_eviction_tokens Int64 DEFAULT 0,
    MODIFY COLUMN draft_cut_tokens Int64 DEFAULT 0,
    MODIFY COLUMN window_released_tokens Int64 DEFAULT 0,
    MODIFY COLUMN evicted_blocks_recomputed Int64 DEFAULT 0,
    MODIFY COLUMN waste_tokens Int64 DEFAULT 0;

