-- Issue 31: drafts reconcile with vLLM's counters, aborts included.
--
-- draft_unverified_tokens: of draft_cut_tokens, the drafts of a step in which the request ended
-- before the verifier judged them (an abort while the step ran; under async scheduling a finish
-- in the step before). vLLM's spec-decode counters leave them out, so its num_draft_tokens is
-- draft_accepted + draft_rejected + draft_cut - draft_unverified (docs/streams.md, Drafts).
-- 0 in rows written before (their cut drafts were not split); a replay of the topics fills it.
ALTER TABLE {db}.requests{on_cluster}
    ADD COLUMN IF NOT EXISTS draft_unverified_tokens Int32 DEFAULT 0 AFTER reasoning_spans;
