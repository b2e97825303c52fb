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

-- The views over these tables are defined in views.sql (issue 34).
