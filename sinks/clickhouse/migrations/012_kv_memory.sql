-- Issue 23: KV memory-time per request (docs/streams.md, "KV memory-time"; docs/cost-model.md,
-- "kv"). Totals over the request's KV-cache groups of RequestAccounting.kv_groups. NULL: not
-- observed (rows written before, request-level producers), never 0.
--   kv_block_steps / kv_block_ns       blocks held x steps / x ns, own block table (held view)
--   kv_byte_ms[_amortized|_actual]     bytes held x milliseconds: held view, shared prefix
--                                      blocks split among holders, or charged to the first holder
--   kv_peak_bytes                      most bytes held at once
--   kv_slot_steps_used / _allocated    token slots holding KV vs allocated, x steps
--   kv_never_held_blocks               null-filled front of a sliding-window hit (never held)
ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS kv_block_steps Nullable(Int64) AFTER source_history_lost_ts_ns,
    ADD COLUMN IF NOT EXISTS kv_block_ns Nullable(Int64) AFTER kv_block_steps,
    ADD COLUMN IF NOT EXISTS kv_byte_ms Nullable(Int64) AFTER kv_block_ns,
    ADD COLUMN IF NOT EXISTS kv_byte_ms_amortized Nullable(Int64) AFTER kv_byte_ms,
    ADD COLUMN IF NOT EXISTS kv_byte_ms_actual Nullable(Int64) AFTER kv_byte_ms_amortized,
    ADD COLUMN IF NOT EXISTS kv_peak_bytes Nullable(Int64) AFTER kv_byte_ms_actual,
    ADD COLUMN IF NOT EXISTS kv_slot_steps_used Nullable(Int64) AFTER kv_peak_bytes,
    ADD COLUMN IF NOT EXISTS kv_slot_steps_allocated Nullable(Int64) AFTER kv_slot_steps_used,
    ADD COLUMN IF NOT EXISTS kv_never_held_blocks Nullable(Int64) AFTER kv_slot_steps_allocated;

-- A price for memory: USD per GiB-hour of KV cache held (integer micro-USD, as every price).
ALTER TABLE {db}.prices{on_cluster}
    MODIFY COLUMN token_class Enum8('input' = 1, 'cached_input' = 2, 'output' = 3, 'gpu_hour' = 4, 'kv' = 5);

-- The views over these tables are defined in views.sql (issue 34).
