-- Issue 30: one dead letter per input it refused, however often that input is refused again.
--
-- A dead letter was keyed by its own position in the dlq topic, so re-ingesting a file (or
-- replaying a topic through the worker) stored every refused line again under a new dlq offset:
-- 552 -> 1,104 rows for the same file. Its identity is now the input's: the component that
-- refused it and where the input was (`topic`, `partition`, `offset`: the source topic's
-- position, or `file:<path>`, -1, <line> for a line of an ingested file). A dead letter whose
-- input had no position (offset -1) keeps its dlq position as identity. ReplacingMergeTree keeps
-- the newest copy; readers use FINAL. The table is rebuilt (a sorting key cannot be altered) and
-- its rows copied, then exchanged for the old one.
CREATE TABLE IF NOT EXISTS {db}.dead_letters_014{on_cluster}
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
    ts_ns Int64,
    letter_key String MATERIALIZED if(offset >= 0,
        concat(component, '|', topic, '|', toString(partition), '|', toString(offset)),
        concat('dlq|', dlq_topic, '|', toString(dlq_partition), '|', toString(dlq_offset)))
)
ENGINE = ReplacingMergeTree
ORDER BY letter_key
SETTINGS non_replicated_deduplication_window = 1000;

INSERT INTO {db}.dead_letters_014
    (dlq_topic, dlq_partition, dlq_offset, error_type, reason, component, topic, partition, offset, key, value, ts_ns)
SELECT dlq_topic, dlq_partition, dlq_offset, error_type, reason, component, topic, partition, offset, key, value, ts_ns
FROM {db}.dead_letters;

EXCHANGE TABLES {db}.dead_letters AND {db}.dead_letters_014{on_cluster};

DROP TABLE {db}.dead_letters_014{on_cluster};
