-- Issue 14 part 2, sessions (docs/sessions.md): the session id a client sent with a request
-- (RequestAccounting.session_id, empty when none). Sessions inferred from prefix chains are not
-- stored: the query library computes them from kv_blocks (sinks/clickhouse/sessions.py), so a
-- rule change needs no rewrite and rows written before this migration (session_id '') take part.

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS session_id String DEFAULT '' AFTER waste_tokens;

-- requests_v selects *: recreated so that it reads the new column.
CREATE OR REPLACE VIEW {db}.requests_v{on_cluster} AS
SELECT *, finished_at FROM {db}.requests FINAL;
