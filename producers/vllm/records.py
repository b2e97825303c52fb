"""Background-thread builders: vLLM objects captured by the hooks -> SparSEEty payloads.

The hooks hand over references (``SchedulerOutput``, the ``EngineCoreOutputs`` returned by
``update_from_output``, ``Request`` objects, KV events) plus the few values vLLM mutates later
(read on the hot path). Everything here runs on the emitter's thread, in the order the events
were emitted, so the small per-request memos below need no lock.

Block hashes have ONE byte form everywhere (RequestStarted, RequestFinished, KV events): the low
64 bits of vLLM's block hash, 8 bytes big-endian. That is exactly vLLM's integer form of an
``ExternalBlockHash`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) written out, and
the last 8 bytes of its bytes form, so it does not depend on that switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any

from sparseety import events as ev
from sparseety.tenants import engine_tenant

from ..privacy import PromptPolicy
from .multimodal import EncoderTally, mm_inputs
from .reasoning import ReasoningSplit
from .request_ids import pd_fields, request_identity

_MASK64 = (1 << 64) - 1


def block_hash_bytes(h: Any) -> bytes:
    """The canonical 8-byte form of a vLLM block hash (``bytes`` or ``int``)."""
    if isinstance(h, int):
        return (h & _MASK64).to_bytes(8, "big")
    b = bytes(h)
    return b[-8:] if len(b) >= 8 else b.rjust(8, b"\0")


def _finish_reason(reason: Any) -> str:
    text = str(reason) if reason is not None else "abort"
    return text.rsplit(".", 1)[-1].lower()


@dataclass(slots=True, frozen=True)
class Admission:
    """One request admitted in a step, as the engine thread saw it at ``schedule()``; the
    emitter thread builds its RequestStarted from it."""

    req: Any  #: vLLM's ``Request`` (read on the emitter thread only for fields fixed at admission)
    num_cached: int  #: prompt tokens already computed at admission (PrefillStats.num_cached_tokens)
    num_external: int = 0  #: of them, loaded by a KV connector from outside this engine
    #: RequestStarted.cached_tokens_by_source (the engine's source names); None: not reported
    sources: dict[str, int] | None = None


class RecordBuilder:
    """Builds the payloads of one engine epoch (emitter thread only).

    Args:
        policy: Prompt privacy policy.
        served_model_name: Model name for requests without a LoRA adapter.
        block_size: Scheduler block size (the granularity of KV events).
        hash_block_size: Granularity of ``Request.block_hashes``.
        group_kinds: KV cache group kinds by group index (BlockRemoved carries only the index).
        spec_enabled: Whether the engine runs speculative decoding (spec columns are filled).
        reasoning: The engine's reasoning parser (which output positions are reasoning); None:
            the engine runs none.
        kv_role: The engine's KV connector role (``kv_producer``, ``kv_consumer``, ``kv_both``;
            None without a connector): a request's P/D role when its ``kv_transfer_params`` say none.
    """

    def __init__(
        self,
        *,
        policy: PromptPolicy,
        served_model_name: str,
        block_size: int,
        hash_block_size: int,
        group_kinds: list[str],
        spec_enabled: bool,
        reasoning: ReasoningSplit | None = None,
        kv_role: str | None = None,
    ) -> None:
        self.policy = policy
        self.served = served_model_name
        self.block_size = block_size or hash_block_size or 1
        self.hash_block_size = hash_block_size or self.block_size
        self.group_kinds = group_kinds or ["full_attention"]
        self.spec_enabled = spec_enabled
        self.reasoning = reasoning or ReasoningSplit(None, None)
        self.kv_role = kv_role
        self.encoders = EncoderTally()
        self._admitted_cached: dict[str, int] = {}
        #: (steps scheduled, wall clock) when each request's KV blocks were freed (set in
        #: on_free, read once).
        self.freed: dict[str, tuple[int, int]] = {}
        self._reported_cached: dict[str, int] = {}
        #: The engine's own cache-write count per request (PrefillStats.num_cache_creation_tokens,
        #: finalized when its first output is emitted), until its RequestFinished.
        self._reported_created: dict[str, int] = {}
        #: ``(step, {request: drafts rejected})`` of the last steps with rejections:
        #: the steps scheduled while they were in flight counted those drafts as computed.
        self._rejections: list[tuple[int, dict[str, int]]] = []

    # --- requests ------------------------------------------------------------------------------

    def _block_hashes(self, req: Any, start_tokens: int, end_tokens: int | None) -> list[bytes]:
        hashes = getattr(req, "block_hashes", None) or []
        if self.hash_block_size == self.block_size:
            lo = start_tokens // self.block_size
            hi = None if end_tokens is None else end_tokens // self.block_size
            return [block_hash_bytes(h) for h in hashes[lo:hi]]
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        view = resolve_block_hashes(list(hashes), self.hash_block_size, self.block_size)
        n = len(view)
        lo = start_tokens // self.block_size
        hi = n if end_tokens is None else min(n, end_tokens // self.block_size)
        return [block_hash_bytes(view[i]) for i in range(lo, hi)]

    def request_started(
        self, req: Any, num_cached: int, num_external: int = 0, sources: dict[str, int] | None = None
    ) -> tuple[str, dict[str, Any]]:
        rid = req.request_id
        prompt_len = int(req.num_prompt_tokens)
        self._admitted_cached[rid] = num_cached
        ids, hashes = self.policy.fields(req.prompt_token_ids)
        sampling = req.sampling_params
        extra = getattr(sampling, "extra_args", None) if sampling is not None else None
        tenant = engine_tenant(extra.get("tenant", "")) if isinstance(extra, dict) else ""
        # vLLM's own session id (body ``session_id``, ``X-Session-ID``, ``vllm_xargs.session_id``;
        # vLLM >= 0.32), else ours (``vllm_xargs.session``, the X-Sparseety-Session middleware)
        ours = extra.get("session") if isinstance(extra, dict) else ""
        session = getattr(req, "session_id", None) or ours
        lora = getattr(req, "lora_request", None)
        lora_name = getattr(lora, "lora_name", None) if lora is not None else None
        # read at the API edge (the middleware copies the body's fields into vllm_xargs)
        tier = extra.get("service_tier") if isinstance(extra, dict) else ""
        ttl = extra.get("cache_ttl") if isinstance(extra, dict) else ""
        identity = request_identity(rid)
        transfer = getattr(req, "kv_transfer_params", None)
        pd = pd_fields(str(identity["external_request_id"]), transfer, self.kv_role)
        items = mm_inputs(req)
        self.encoders.admitted(rid, items)
        return ev.REQUEST_STARTED, {
            "request_id": rid,
            "arrival_ts_ns": int((req.arrival_time or 0) * 1e9),
            "prompt_len": prompt_len,
            "prompt_token_ids": ids,
            "prompt_token_hashes": hashes,
            "num_cached_tokens": int(num_cached),
            "num_external_cached_tokens": int(num_external),
            "block_hashes": self._block_hashes(req, 0, prompt_len),
            "max_tokens": getattr(sampling, "max_tokens", None) if sampling is not None else None,
            "tenant": str(tenant) if tenant is not None else "",
            # the base model; the adapter is its own column (until issue 23 model held the adapter)
            "model": self.served,
            "lora_name": lora_name,
            "priority": int(getattr(req, "priority", 0) or 0),
            "session_id": str(session) if session else "",
            "service_tier": tier if isinstance(tier, str) else "",
            "cache_ttl": ttl if isinstance(ttl, str) else "",
            "cached_tokens_by_source": dict(sources) if sources else {},
            **identity,  # the client's response id, the n choices' parent
            **pd,
            "mm_inputs": items,
        }

    def requests_started(self, items: list[Admission]) -> list[tuple[str, dict[str, Any]]]:
        """RequestStarted for each request admitted in one step."""
        return [self.request_started(a.req, a.num_cached, a.num_external, a.sources) for a in items]

    def requests_finished(self, reqs: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        """RequestFinished for each request freed in one step."""
        return [self.request_finished(req) for req in reqs]

    def request_finished(self, req: Any) -> tuple[str, dict[str, Any]]:
        """From a freed (hence final) ``Request``: the engine's own totals."""
        rid = req.request_id
        reason = req.get_finished_reason()
        stop_reason = req.stop_reason
        num_prompt = req.num_prompt_tokens
        num_output = req.num_output_tokens
        num_preemptions = req.num_preemptions
        admitted = self._admitted_cached.pop(rid, 0)
        cached = self._reported_cached.pop(rid, admitted)
        created = self._reported_created.pop(rid, -1)
        freed = self.freed.pop(rid, (-1, 0))
        return ev.REQUEST_FINISHED, {
            "request_id": rid,
            "finish_reason": _finish_reason(reason),
            "stop_reason": None if stop_reason is None else str(stop_reason),
            "num_prompt_tokens": int(num_prompt),
            "num_output_tokens": int(num_output),
            "num_cached_tokens": int(cached),
            "num_preemptions": int(num_preemptions),
            "output_block_hashes": self._block_hashes(
                req, num_prompt // self.block_size * self.block_size, None
            ),
            "first_token_ts_ns": 0,
            "chunk_arrival_ns": [],
            "reasoning_spans": self.reasoning.spans(req),
            "kv_freed_before_step": freed[0],
            "kv_freed_ts_ns": freed[1],
            "num_cache_creation_tokens": int(created),
            **self.encoders.finished(rid),
        }

    # --- steps ---------------------------------------------------------------------------------

    def step(
        self,
        scheduler_output: Any,
        outputs: Any,
        spec: dict[str, tuple[int, int]] | None,
        step: int,
        start_mono_ns: int,
        end_mono_ns: int,
        preempted_before: frozenset[str],
        resumed_new: frozenset[str] = frozenset(),
        updates_before: int = -1,
    ) -> tuple[str, dict[str, Any]]:
        """The StepBatch of one updated step.

        ``resumed_new`` are requests listed in ``scheduled_new_reqs`` that had been admitted
        before (Model Runner V2's resumes). ``updates_before`` is how many steps had been
        updated when this one was scheduled: steps ``updates_before .. step - 1`` were in flight,
        and their rejected drafts are taken out of this step's ``num_computed_before`` (async
        scheduling counts them as computed).
        """
        # Emitter thread, once per step: the steady decode state skips the computed-before map
        # (a third of a decode step's build), the draft columns read each entry once.
        scheduled_tokens = scheduler_output.num_scheduled_tokens
        rids = list(scheduled_tokens)
        n = len(rids)
        new_reqs = scheduler_output.scheduled_new_reqs
        cached_reqs = scheduler_output.scheduled_cached_reqs
        cached_ids = cached_reqs.req_ids
        cached_computed = cached_reqs.num_computed_tokens
        if not new_reqs and len(cached_computed) == n and cached_ids == rids:
            # The steady state: only running requests, listed in the order they were scheduled.
            computed_before = list(cached_computed)
        else:
            before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in new_reqs}
            before.update(zip(cached_ids, cached_computed, strict=False))
            computed_before = [before.get(r, 0) for r in rids]
        self.encoders.step(scheduler_output)
        if self._rejections and updates_before >= 0:
            self._correct_in_flight(computed_before, rids, cached_reqs, updates_before, step)
        new_tokens: dict[str, list[int]] = {}
        reported = self._reported_cached
        created = self._reported_created
        for core_outputs in (outputs or {}).values():
            for output in core_outputs.outputs:
                if output.new_token_ids:
                    new_tokens[output.request_id] = output.new_token_ids
                prefill_stats = output.prefill_stats
                if prefill_stats is not None:
                    reported[output.request_id] = int(prefill_stats.num_cached_tokens)
                    # vLLM < 0.32 has no cache-creation count: not reported
                    created[output.request_id] = int(getattr(prefill_stats, "num_cache_creation_tokens", -1))
        num_new: list[int] = []
        token_ids: list[int] = []
        for rid in rids:
            tokens = new_tokens.get(rid)
            if tokens:
                num_new.append(len(tokens))
                token_ids.extend(tokens)
            else:
                num_new.append(0)
        if self.spec_enabled:
            pairs = list(map((spec or {}).get, rids, repeat((0, 0), n)))
            proposed = [p for p, _ in pairs]
            accepted = [a for _, a in pairs]
        else:
            proposed, accepted = [], []
        if spec and self.spec_enabled:
            rejected = {rid: p - a for rid, (p, a) in spec.items() if p > a}
            if rejected:
                self._rejections.append((step, rejected))
                if len(self._rejections) > 8:  # the batch queue is at most pp_size + 1 deep
                    del self._rejections[0]
        preempted = set(scheduler_output.preempted_req_ids or ()) | preempted_before
        resumed = getattr(cached_reqs, "resumed_req_ids", None)
        if resumed is None:  # vLLM < 0.11: a flag per cached request
            flags = getattr(cached_reqs, "resumed_from_preemption", [])
            resumed = {r for r, f in zip(cached_reqs.req_ids, flags, strict=False) if f}
        if resumed_new:
            resumed = set(resumed) | resumed_new
        return ev.STEP_BATCH, {
            "step": step,
            "start_mono_ns": start_mono_ns,
            "duration_ns": max(0, end_mono_ns - start_mono_ns),
            "req_ids": rids,
            "num_scheduled_tokens": list(scheduled_tokens.values()),
            "num_computed_before": computed_before,
            "num_new_tokens": num_new,
            # Output ids are content: only the raw privacy mode lets them leave the engine.
            "new_token_ids": token_ids if self.policy.mode == "raw" else [],
            "spec_proposed": proposed,
            "spec_accepted": accepted,
            "preempted_req_ids": sorted(preempted),
            "resumed_req_ids": sorted(resumed),
            "updates_before": updates_before,
        }

    def _correct_in_flight(
        self,
        computed_before: list[int],
        rids: list[str],
        cached_reqs: Any,
        updates_before: int,
        step: int,
    ) -> None:
        """Take the drafts rejected by steps in flight at schedule time out of the positions of
        running requests (new and resumed requests start from the prefix-cache hit)."""
        in_flight = [r for idx, r in self._rejections if updates_before <= idx < step]
        self._rejections = [(idx, r) for idx, r in self._rejections if idx >= updates_before]
        if not in_flight:
            return
        running = set(cached_reqs.req_ids) - set(getattr(cached_reqs, "resumed_req_ids", ()) or ())
        for i, rid in enumerate(rids):
            if rid in running:
                computed_before[i] -= sum(r.get(rid, 0) for r in in_flight)

    # --- KV events -------------------------------------------------------------------------------

    def kv_events(self, events: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        """One payload per vLLM KV event of a published batch."""
        return [self.kv_event(e) for e in events]

    def kv_event(self, event: Any) -> tuple[str, dict[str, Any]]:
        name = type(event).__name__
        if name == "BlockStored":
            parent = event.parent_block_hash
            kind = getattr(event, "kv_cache_spec_kind", None) or self._kind(getattr(event, "group_idx", None))
            return ev.KV_STORED, {
                "block_hashes": [block_hash_bytes(h) for h in event.block_hashes],
                "parent_block_hash": None if parent is None else block_hash_bytes(parent),
                "block_size": int(event.block_size),
                "num_tokens": len(event.token_ids or ()),
                "lora_id": event.lora_id,
                "medium": event.medium,
                "group_kind": str(kind),
                "sliding_window": getattr(event, "kv_cache_spec_sliding_window", None),
            }
        if name == "BlockRemoved":
            return ev.KV_REMOVED, {
                "block_hashes": [block_hash_bytes(h) for h in event.block_hashes],
                "medium": event.medium,
                "group_kind": self._kind(getattr(event, "group_idx", None)),
            }
        if name == "AllBlocksCleared":
            return ev.KV_CLEARED, {"medium": getattr(event, "medium", None)}
        raise TypeError(f"unknown KV event {name}")

    def _kind(self, group_idx: int | None) -> str:
        if group_idx is None or not 0 <= group_idx < len(self.group_kinds):
            return self.group_kinds[0]
        return self.group_kinds[group_idx]
