-- Issue 21: what a client can name a request by, and n > 1 billed as the invoice bills it.
--
-- external_request_id is the id the serving front end gave the engine (vLLM's external_req_id:
-- chatcmpl-<id>, cmpl-<id>-<prompt index>), so `sparseety query request chatcmpl-...` finds the
-- request without vLLM's random suffix. parent_request_id and choice_index say which API request
-- a request is one of the n choices of (RequestStarted; docs/cost-model.md). Rows written before
-- read '' and 0: each is its own API request, as before.

ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS external_request_id String DEFAULT '' AFTER session_id,
    ADD COLUMN IF NOT EXISTS parent_request_id String DEFAULT '' AFTER external_request_id,
    ADD COLUMN IF NOT EXISTS choice_index Int32 DEFAULT 0 AFTER parent_request_id;

-- The views over these tables are defined in views.sql (issue 34).
