-- Issue 14 part 1: token records. One row per request version with the token ids (or keyed
-- hashes) its engine's privacy mode let out: raw = ids, hashed = keyed prompt hashes, none =
-- empty arrays, so an answer can say "not stored because of privacy mode none" rather than guess.
-- Arrays compress well with ZSTD; token ids are small integers (T64 first packs their bits).
-- Retention: a TTL on finished_at, 30 days by default; `clickhouse.ttl_days` changes it at
-- migrate time (docs/clickhouse.md). The row's identity is the request (ReplacingMergeTree on
-- _version, as token_segments), read through request_tokens_v (views.sql), which joins the
-- current version.
CREATE TABLE IF NOT EXISTS {db}.request_tokens{on_cluster}
(
    request_uid String,
    _version UInt64,
    finished_ts_ns Int64,
    privacy LowCardinality(String),
    prompt_token_ids Array(Int32) CODEC(T64, ZSTD(3)),
    prompt_token_hashes Array(Int64) CODEC(ZSTD(3)),
    output_token_ids Array(Int32) CODEC(T64, ZSTD(3)),
    finished_at DateTime('UTC') MATERIALIZED toDateTime(intDiv(finished_ts_ns, 1000000000), 'UTC')
)
ENGINE = ReplacingMergeTree(_version)
ORDER BY request_uid
TTL finished_at + toIntervalDay(30)
SETTINGS non_replicated_deduplication_window = 1000;

-- The views over these tables are defined in views.sql (issue 34).
