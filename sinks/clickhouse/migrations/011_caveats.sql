-- Issue 21: two caveats of a request's accounting (streams/caveats.py).
--
-- warmup_gpu_time_ns is the part of gpu_time_ns that came from the request's engine epoch's first
-- step (the cold start), flagged so a reader can see and subtract it. source_history_lost_ts_ns says that cached positions of the request have no source
-- because the fold lost the engine's KV history at that time (a seq gap on the core stream):
-- shown as "source unknown (history lost at ...)", and amortized falls back to the cache-read
-- price for them. Rows written before read 0 (not flagged).

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS warmup_gpu_time_ns Int64 DEFAULT 0 AFTER external_kv_tokens,
    ADD COLUMN IF NOT EXISTS source_history_lost_ts_ns Int64 DEFAULT 0 AFTER warmup_gpu_time_ns;

-- requests_v selects *: recreated so that it reads the new columns (definition as in 010).
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL
WHERE engine_kind != 'vllm_log' OR request_uid NOT IN (SELECT request_uid FROM {db}.log_duplicates_v);
