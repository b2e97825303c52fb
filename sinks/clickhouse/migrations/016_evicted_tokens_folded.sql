-- Issue 34: `evicted_tokens` is gone from the store; its meaning moved to `window_released_tokens`.
--
-- Schema v1 put the positions a sliding window or attention chunk released in `evicted_tokens`;
-- schema v2 (migration 003) counts them in `window_released_tokens`, and the fold has written
-- evicted_tokens = 0 since, while the views added the two. Old rows of `requests` and `usage_1m`
-- have their evicted_tokens folded into window_released_tokens here, so every answer stays what it
-- was, and the column is dropped. The sink folds a nonzero evicted_tokens of a record written with
-- schema v1 (a replay of an old topic range) the same way (sparseety.events.MOVED_FIELDS); the Avro
-- field stays, deprecated (docs/streams.md).
--
-- Idempotent, a migration interrupted half-way being applied again: the column is added back
-- (zeros) where an earlier run dropped it already, the one mutation that adds it to
-- window_released_tokens also sets it to 0 (a second run finds no row to update, never adds
-- twice), then it is dropped. Updating a non-key column of a ReplacingMergeTree is safe: every
-- version of a row gets the same change.
ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS evicted_tokens Int64 DEFAULT 0 AFTER skipped_tokens;

ALTER TABLE {db}.requests{on_cluster}
    UPDATE window_released_tokens = window_released_tokens + evicted_tokens, evicted_tokens = 0
    WHERE evicted_tokens != 0
    SETTINGS mutations_sync = 2;

ALTER TABLE {db}.requests{on_cluster} DROP COLUMN IF EXISTS evicted_tokens;

ALTER TABLE {db}.usage_1m{on_cluster}
    ADD COLUMN IF NOT EXISTS evicted_tokens Int64 DEFAULT 0 AFTER skipped_tokens;

ALTER TABLE {db}.usage_1m{on_cluster}
    UPDATE window_released_tokens = window_released_tokens + evicted_tokens, evicted_tokens = 0
    WHERE evicted_tokens != 0
    SETTINGS mutations_sync = 2;

ALTER TABLE {db}.usage_1m{on_cluster} DROP COLUMN IF EXISTS evicted_tokens;

-- The views stop reading it in views.sql (issue 34), applied again after this migration.
