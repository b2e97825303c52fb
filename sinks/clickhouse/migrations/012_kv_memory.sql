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

-- requests_v selects *: recreated so that it reads the new columns (definition as in 010).
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);

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
