-- Issue 11, the two-axis position model (docs/streams.md): how a position was obtained and what
-- became of its KV are separate columns; recompute is split into its two senses; waste means
-- preemption recompute + rejected drafts + drafts cut by stop. Rows written before this
-- migration read 0 in the new columns (see request_costs_v in views.sql for how they are read).

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

-- The views over these tables are defined in views.sql (issue 34).
