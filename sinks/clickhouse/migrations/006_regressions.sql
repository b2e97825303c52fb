-- Issue 15, sparsity regression alerts: one row per request with the numerator and denominator
-- of every "did the optimisation fire?" signal, so a window's rate is sum(num) / sum(den) over its
-- requests (sinks/clickhouse/regressions.py compares a current window with the engine's own
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
