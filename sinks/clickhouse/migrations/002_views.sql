-- Views that read the current state: FINAL on the ReplacingMergeTrees, child rows of the
-- request's current version only, and per-request costs in every attribution mode.
-- docs/cost-model.md defines the modes; the query library (queries.py) reads these views.

CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL;

CREATE OR REPLACE VIEW {db}.token_segments_v{on_cluster} AS
SELECT s.*, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name, r.finished_ts_ns AS finished_ts_ns
FROM {db}.token_segments AS s FINAL
INNER JOIN (SELECT request_uid, _version, tenant, model, engine_name, finished_ts_ns FROM {db}.requests FINAL) AS r
    ON s.request_uid = r.request_uid AND s._version = r._version;

CREATE OR REPLACE VIEW {db}.kv_blocks_v{on_cluster} AS
SELECT b.*, r.engine_id AS engine_id, r.tenant AS tenant, r.model AS model, r.engine_name AS engine_name,
       r.finished_ts_ns AS finished_ts_ns
FROM {db}.kv_blocks AS b FINAL
INNER JOIN (SELECT request_uid, _version, engine_id, tenant, model, engine_name, finished_ts_ns
            FROM {db}.requests FINAL) AS r
    ON b.request_uid = r.request_uid AND b._version = r._version;

CREATE OR REPLACE VIEW {db}.usage_v{on_cluster} AS
SELECT
    tenant, model, engine_name, window_start_ns, window_ns,
    fromUnixTimestamp64Nano(window_start_ns, 'UTC') AS window_start,
    countIf(kind = 'correction') AS corrections,
    sum(requests) AS requests, sum(incomplete_requests) AS incomplete_requests,
    sum(prompt_tokens) AS prompt_tokens, sum(output_tokens) AS output_tokens,
    sum(cache_read_tokens) AS cache_read_tokens, sum(uncached_computed_tokens) AS uncached_computed_tokens,
    sum(recomputed_tokens) AS recomputed_tokens, sum(draft_accepted_tokens) AS draft_accepted_tokens,
    sum(draft_rejected_tokens) AS draft_rejected_tokens, sum(skipped_tokens) AS skipped_tokens,
    sum(evicted_tokens) AS evicted_tokens, sum(gpu_time_ns) AS gpu_time_ns, sum(est_flops) AS est_flops
FROM {db}.usage_1m FINAL
GROUP BY tenant, model, engine_name, window_start_ns, window_ns;

-- Per-request cost in picodollars (Int128): tokens x micro-USD per million tokens.
-- Prices apply as of the request's finish time (ASOF: the latest effective_from <= finished).
CREATE OR REPLACE VIEW {db}.request_costs_v{on_cluster} AS
SELECT
    r.request_uid AS request_uid, r.tenant AS tenant, r.model AS model,
    r.engine_name AS engine_name, r.engine_id AS engine_id, r.lora_name AS lora_name,
    r.finished_ts_ns AS finished_ts_ns, fromUnixTimestamp64Nano(r.finished_ts_ns, 'UTC') AS finished_at,
    r.prompt_tokens AS prompt_tokens, r.output_tokens AS output_tokens,
    r.cache_read_tokens AS cache_read_tokens, r.scheduled_tokens AS scheduled_tokens,
    r.recomputed_tokens AS recomputed_tokens, r.draft_accepted_tokens AS draft_accepted_tokens,
    r.draft_rejected_tokens AS draft_rejected_tokens, r.skipped_tokens AS skipped_tokens,
    r.evicted_tokens AS evicted_tokens, r.preemptions AS preemptions, r.gpu_time_ns AS gpu_time_ns,
    r.est_flops AS est_flops, r.complete AS complete,
    toInt64(least(if(r.engine_cached_tokens >= 0, r.engine_cached_tokens, r.cache_read_tokens), r.prompt_tokens))
        AS list_cached_tokens,
    toInt64(r.prompt_tokens) - list_cached_tokens AS list_input_tokens,
    toInt64(if(r.scheduled_tokens > 0, greatest(r.scheduled_tokens - r.output_tokens, 0), list_input_tokens))
        AS actual_input_tokens,
    toInt64(ifNull(pin.price_micro, 0)) AS input_price_micro,
    toInt64(if(ifNull(pca.found, 0) = 1, ifNull(pca.price_micro, 0), input_price_micro)) AS cached_price_micro,
    toInt64(ifNull(pout.price_micro, 0)) AS output_price_micro,
    toInt64(ifNull(pg.price_micro, 0)) AS gpu_hour_price_micro,
    ifNull(pin.found, 0) = 1 AND ifNull(pout.found, 0) = 1 AS tokens_priced,
    ifNull(pg.found, 0) = 1 AS gpu_priced,
    toInt128(list_input_tokens) * input_price_micro
        + toInt128(list_cached_tokens) * cached_price_micro
        + toInt128(r.output_tokens) * output_price_micro AS list_pico,
    toInt128(actual_input_tokens) * input_price_micro
        + toInt128(r.cache_read_tokens) * cached_price_micro
        + toInt128(r.output_tokens) * output_price_micro AS actual_pico,
    intDiv(toInt128(r.gpu_time_ns) * gpu_hour_price_micro, 3600000) AS gpu_pico
FROM {db}.requests AS r FINAL
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'input') AS pin
    ON r.model = pin.model AND r.finished_ts_ns >= pin.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'cached_input') AS pca
    ON r.model = pca.model AND r.finished_ts_ns >= pca.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'output') AS pout
    ON r.model = pout.model AND r.finished_ts_ns >= pout.effective_from_ns
ASOF LEFT JOIN (SELECT model, effective_from_ns, price_micro, toUInt8(1) AS found
                FROM {db}.prices FINAL WHERE token_class = 'gpu_hour') AS pg
    ON r.model = pg.model AND r.finished_ts_ns >= pg.effective_from_ns;

-- Amortized attribution: within one cache lifetime (engine_id, block_hash, lifetime_seq) the
-- compute of a block (its computing requests' tokens at their input price) is split equally
-- among every request that used it. Integer shares; the remainder goes one picodollar each to
-- the first users by request_uid, so the shares add up to the pool exactly. delta_pico is what
-- amortized adds to (or takes from) a request's actual cost; the deltas sum to zero.
CREATE OR REPLACE VIEW {db}.amortized_delta_v{on_cluster} AS
WITH
    uses AS (
        SELECT engine_id, block_hash, lifetime_seq, request_uid,
               sumIf(tokens, role != 'cached') AS computed_tokens
        FROM {db}.kv_blocks_v
        WHERE lifetime_seq >= 0
        GROUP BY engine_id, block_hash, lifetime_seq, request_uid
    ),
    priced AS (
        SELECT u.engine_id AS engine_id, u.block_hash AS block_hash, u.lifetime_seq AS lifetime_seq,
               u.request_uid AS request_uid,
               toInt128(u.computed_tokens) * c.input_price_micro AS computed_pico
        FROM uses AS u
        INNER JOIN (SELECT request_uid, input_price_micro FROM {db}.request_costs_v) AS c
            ON u.request_uid = c.request_uid
    ),
    shared AS (
        SELECT request_uid, computed_pico,
               sum(computed_pico) OVER w AS pool,
               toInt128(count() OVER w) AS n,
               toInt128(row_number() OVER (PARTITION BY engine_id, block_hash, lifetime_seq ORDER BY request_uid) - 1) AS k
        FROM priced
        WINDOW w AS (PARTITION BY engine_id, block_hash, lifetime_seq)
    )
SELECT request_uid,
       sum(intDiv(pool, n) + if(k < pool % n, 1, 0) - computed_pico) AS delta_pico,
       sum(intDiv(pool, n) + if(k < pool % n, 1, 0)) AS shared_pico,
       countIf(computed_pico = 0) AS blocks_read,
       countIf(computed_pico > 0) AS blocks_computed
FROM shared
WHERE pool > 0
GROUP BY request_uid;
