"""The harness's ground truth: what vLLM's scheduler and KV manager decided, and what the
simulated GPU computed, per request.

:class:`HarnessTruth` extends the e2e recorder (``tests/e2e/ground_truth.py``: prefix-cache
lookups, cache lifetimes and their owners, evictions, window releases at free time, draft
verification at update time) with the two things that differ on a GPU host:

* positions come from the executor (the model runner's own KV length), not from the scheduler
  output: under async scheduling ``num_computed_tokens`` in the scheduler output already counts
  the drafts of the step still in flight, some of which the GPU will reject;
* admissions and resumes are told apart by whether the request was admitted before, not by
  ``resumed_req_ids``: with Model Runner V2 a resumed request is in ``scheduled_new_reqs``.

It also records, from the KV connector, the tokens a decode-side engine loaded from elsewhere.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.ground_truth import EngineTruth


class HarnessTruth(EngineTruth):
    """Attached to the scheduler (KV manager, block pool) and fed by the simulated executor."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.admitted: set[str] = set()
        self.external: dict[str, int] = {}
        self._starts: dict[str, int] = {}
        connector = getattr(scheduler, "connector", None)
        if connector is not None:
            matched = connector.get_num_new_matched_tokens

            def get_num_new_matched_tokens(request: Any, num_computed: int) -> Any:
                out = matched(request, num_computed)
                self._pending_external = (request.request_id, int(out[0] or 0))
                return out

            connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        self._pending_external: tuple[str, int] | None = None

    # --- scheduler side -------------------------------------------------------------------------

    def _on_schedule(self, so: Any) -> None:
        # Positions are taken when the executor runs the step (on_execute); here only the
        # preemptions this schedule() made.
        for rid in so.preempted_req_ids or ():
            self.requests[rid].preemptions += 1
        if so.total_num_scheduled_tokens:
            self.steps += 1

    def _on_lookup(self, request: Any, hit: int) -> None:
        super()._on_lookup(request, hit)
        self._pending_external = None

    def _computed_up_to(self, rt: Any, req: Any) -> None:
        # Under async scheduling num_computed_tokens is optimistic: positions come from the
        # executor (on_sample).
        pass

    # --- executor side (the simulated GPU) -------------------------------------------------------

    def on_execute(self, so: Any, starts: dict[str, int]) -> None:
        reqs = self.scheduler.requests
        cached = so.scheduled_cached_reqs
        for nr in so.scheduled_new_reqs:
            first = nr.req_id not in self.admitted
            self.admitted.add(nr.req_id)
            self._admit(nr.req_id, reqs.get(nr.req_id), first=first)
            rt = self.requests[nr.req_id]
            external = int(nr.num_computed_tokens) - (rt.cache_read if first else 0)
            if first and external > 0:
                # A decode-side engine: the connector loaded these tokens from elsewhere.
                self.external[nr.req_id] = external
        for rid in cached.resumed_req_ids:
            self._admit(rid, reqs.get(rid), first=False)
        self._starts = dict(starts)
        spec = so.scheduled_spec_decode_tokens or {}
        for rid, n in so.num_scheduled_tokens.items():
            self._count_step(
                self.requests[rid], starts[rid], n, len(spec.get(rid, ())), self.attention_groups
            )

    def on_sample(self, so: Any, accepted: dict[str, int], sampled: dict[str, int]) -> None:
        spec = so.scheduled_spec_decode_tokens or {}
        for rid, n in so.num_scheduled_tokens.items():
            k = len(spec.get(rid, ()))
            end = self._starts[rid] + n - k + accepted.get(rid, 0)
            rt = self.requests[rid]
            rt.high = max(rt.high, end)

    # --- derived --------------------------------------------------------------------------------

    @property
    def attention_groups(self) -> list[dict[str, Any]]:
        """Attention reach per layer, as the model computes it (set by the harness from the
        executor's layer specs: with the hybrid KV-cache manager off vLLM merges every layer
        into one full-attention group, but each layer still attends its own window)."""
        return getattr(self, "_attention_groups", None) or self.groups

    @attention_groups.setter
    def attention_groups(self, value: list[dict[str, Any]]) -> None:
        self._attention_groups = value

    def summary(self, rid: str) -> dict[str, int]:
        out = super().summary(rid)
        out["external_kv_tokens"] = self.external.get(rid, 0)
        return out
