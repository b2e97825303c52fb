-- Issue 14 part 2, sessions (docs/sessions.md): the session id a client sent with a request
-- (RequestAccounting.session_id, empty when none). Sessions inferred from prefix chains are not
-- stored: the query library computes them from kv_blocks (sinks/clickhouse/sessions.py), so a
-- rule change needs no rewrite and rows written before this migration (session_id '') take part.

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS session_id String DEFAULT '' AFTER waste_tokens;

-- The views over these tables are defined in views.sql (issue 34).
