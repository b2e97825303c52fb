-- Base tables. Every table is a ReplacingMergeTree whose sorting key is a deterministic id of
-- what a row describes, so writing the same record twice (a retry, a crash between write and
-- offset commit, a replay) replaces instead of adding. Read with FINAL (or the *_v views).
--
-- {db} is the database, {on_cluster} is empty or ON CLUSTER '<name>'; engines are rewritten to
-- their Replicated* form in cluster mode (see migrate.py and docs/clickhouse.md).

CREATE DATABASE IF NOT EXISTS {db}{on_cluster};

-- One row per request (RequestAccounting minus its nested arrays). _version orders versions of
-- one request by content, not by arrival: (complete << 63) | finished_ts_ns, so a replay of an
-- older range never regresses a newer record and identical content gives an identical version.
CREATE TABLE IF NOT EXISTS {db}.requests{on_cluster}
(
    request_uid String,
    engine_name LowCardinality(String),
    engine_id LowCardinality(String),
    request_id String,
    tenant LowCardinality(String),
    model LowCardinality(String),
    lora_name Nullable(String),
    engine_kind LowCardinality(String),
    arrival_ts_ns Int64,
    first_scheduled_ts_ns Int64,
    first_token_ts_ns Int64,
    finished_ts_ns Int64,
    finish_reason LowCardinality(String),
    complete Bool,
    incomplete_reason Nullable(String),
    seq_gap Bool,
    prompt_tokens Int32,
    output_tokens Int32,
    cache_read_tokens Int32,
    uncached_computed_tokens Int32,
    recomputed_tokens Int32,
    draft_accepted_tokens Int32,
    draft_rejected_tokens Int32,
    skipped_tokens Int32,
    evicted_tokens Int32,
    scheduled_tokens Int64,
    preemptions Int32,
    steps Int32,
    attention_pairs Int64,
    attention_pairs_skipped Int64,
    gpu_time_ns Int64,
    est_flops Float64,
    engine_prompt_tokens Int32,
    engine_output_tokens Int32,
    engine_cached_tokens Int32,
    consistent Bool,
    expert_num_layers Int32,
    expert_num_experts Int32,
    attention_window Nullable(Int32),
    segment_count UInt32,
    block_use_count UInt32,
    _version UInt64,
    finished_at DateTime64(9, 'UTC') MATERIALIZED fromUnixTimestamp64Nano(finished_ts_ns, 'UTC')
)
ENGINE = ReplacingMergeTree(_version)
ORDER BY (tenant, model, request_uid)
SETTINGS non_replicated_deduplication_window = 1000;

-- Timeline segments, one row per run of positions. A newer version of a request may have fewer
-- segments: rows are joined to the request's current _version (see token_segments_v), which
-- also supplies tenant, model and time, so the child tables stay narrow (cheap to insert).
CREATE TABLE IF NOT EXISTS {db}.token_segments{on_cluster}
(
    request_uid String,
    idx UInt32,
    _version UInt64,
    start Int32,
    end Int32,
    kind Enum8('prompt' = 1, 'output' = 2),
    status Enum8('computed' = 1, 'cached' = 2, 'recomputed' = 3, 'skipped' = 4, 'evicted' = 5),
    draft_accepted Bool,
    source_request_uid Nullable(String)
)
ENGINE = ReplacingMergeTree(_version)
ORDER BY (request_uid, idx)
SETTINGS non_replicated_deduplication_window = 1000;

-- Full KV blocks each request computed or read: the input of amortized attribution and of
-- fleet prefix duplication. A cache lifetime is (engine_id, block_hash, lifetime_seq), engine_id
-- coming from the request (kv_blocks_v). Rows are sorted by request like the segments: sorting
-- inserts by block hash cost 2.5x the insert time here, and lifetime queries aggregate by hash.
CREATE TABLE IF NOT EXISTS {db}.kv_blocks{on_cluster}
(
    request_uid String,
    idx UInt32,
    _version UInt64,
    block_hash String,
    lifetime_seq Int64,
    role Enum8('computed' = 1, 'cached' = 2, 'recomputed' = 3),
    tokens UInt32
)
ENGINE = ReplacingMergeTree(_version)
ORDER BY (request_uid, idx)
SETTINGS non_replicated_deduplication_window = 1000;

-- Token-to-expert assignments per request, layer-major (counts[layer * num_experts + expert]).
CREATE TABLE IF NOT EXISTS {db}.expert_load{on_cluster}
(
    model LowCardinality(String),
    request_uid String,
    _version UInt64,
    tenant LowCardinality(String),
    engine_name LowCardinality(String),
    finished_ts_ns Int64,
    num_layers UInt32,
    num_experts UInt32,
    counts Array(UInt64)
)
ENGINE = ReplacingMergeTree(_version)
ORDER BY (model, request_uid)
SETTINGS non_replicated_deduplication_window = 1000;

-- Windowed usage (topic usage): one final row per window and key, plus one correction row per
-- late request. usage_id is deterministic, so a re-emitted window replaces itself.
CREATE TABLE IF NOT EXISTS {db}.usage_1m{on_cluster}
(
    tenant LowCardinality(String),
    model LowCardinality(String),
    window_start_ns Int64,
    engine_name LowCardinality(String),
    usage_id String,
    kind Enum8('final' = 1, 'correction' = 2),
    window_ns Int64,
    requests Int64,
    incomplete_requests Int64,
    prompt_tokens Int64,
    output_tokens Int64,
    cache_read_tokens Int64,
    uncached_computed_tokens Int64,
    recomputed_tokens Int64,
    draft_accepted_tokens Int64,
    draft_rejected_tokens Int64,
    skipped_tokens Int64,
    evicted_tokens Int64,
    gpu_time_ns Int64,
    est_flops Float64,
    window_start DateTime64(9, 'UTC') MATERIALIZED fromUnixTimestamp64Nano(window_start_ns, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY (tenant, model, window_start_ns, engine_name, usage_id)
SETTINGS non_replicated_deduplication_window = 1000;

-- Prices per model and class, effective from a time on. Money is an integer: micro-USD per
-- million tokens (input, cached_input, output) or per GPU-hour (gpu_hour). Never Float.
CREATE TABLE IF NOT EXISTS {db}.prices{on_cluster}
(
    model LowCardinality(String),
    token_class Enum8('input' = 1, 'cached_input' = 2, 'output' = 3, 'gpu_hour' = 4),
    effective_from_ns Int64,
    price_micro Int64,
    note String,
    set_ns Int64,
    effective_from DateTime64(9, 'UTC') MATERIALIZED fromUnixTimestamp64Nano(effective_from_ns, 'UTC')
)
ENGINE = ReplacingMergeTree(set_ns)
ORDER BY (model, token_class, effective_from_ns);

-- Dead letters (topic dlq), keyed by their own position in the dlq topic.
CREATE TABLE IF NOT EXISTS {db}.dead_letters{on_cluster}
(
    dlq_topic LowCardinality(String),
    dlq_partition Int32,
    dlq_offset Int64,
    error_type LowCardinality(String),
    reason String,
    component LowCardinality(String),
    topic String,
    partition Int32,
    offset Int64,
    key Nullable(String),
    value Nullable(String),
    ts_ns Int64
)
ENGINE = ReplacingMergeTree
ORDER BY (dlq_topic, dlq_partition, dlq_offset)
SETTINGS non_replicated_deduplication_window = 1000;
