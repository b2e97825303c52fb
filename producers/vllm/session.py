"""One engine epoch in the engine-core process: the hot-path side of the scheduler hooks.

:class:`EngineSession` is attached to a vLLM ``Scheduler`` by the patched ``__init__``. The patched
methods call its ``on_*`` methods, which only read what vLLM mutates later (prefill stats, the
lengths of sampled-token lists before ``update_from_output`` trims them, the finished request's
totals) and hand references to the emitter. Order of one step's events on the ``core`` stream:
KV events published during the step (vLLM publishes them inside ``update_from_output``), then
RequestStarted for requests admitted in the step, the StepBatch, and RequestFinished for
requests that ended in it (a finish outside a step, e.g. an abort, is sent at once).

Under async scheduling (the GPU default) the engine core schedules step N+1 before it updates
step N (``EngineCore.step_with_batch_queue``). Two things follow, both handled here:

* a request that finishes in update N may already be in step N+1, which the GPU computes anyway:
  its RequestFinished waits for the StepBatch of the last step that scheduled it;
* step N+1's ``num_computed_tokens`` counts step N's drafts as if all were accepted. Each step
  records how many steps had been updated when it was scheduled (StepBatch ``updates_before``),
  so the builder can take the rejections of the steps still in flight then out of its positions
  (``records.py``), and the fold knows what vLLM had processed when it freed window blocks.

With Model Runner V2 a request resumed after a preemption is listed in ``scheduled_new_reqs``
(and ``resumed_req_ids`` stays empty): only a first appearance is an admission, a later one is a
resume and is reported as such.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from sparseety.config import Config

from ..emitter import Emitter, new_epoch
from ..plugin_kit import SessionBase, announce, engine_name
from ..privacy import PromptPolicy
from . import facts, routing
from .multimodal import ENCODER_HITS, EncoderHit, watch_encoder_cache
from .reasoning import ReasoningSplit
from .records import Admission, RecordBuilder
from .stamp import STEP_STAMP, routing_enabled

log = logging.getLogger("sparseety.producer.vllm")


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return ""


def default_engine_name(cfg: Config, vllm_config: Any, served: str) -> str:
    """The engine core's name (:func:`~..plugin_kit.engine_name`: the data-parallel rank and size
    are vLLM's)."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1) or 1)
    return engine_name(cfg, served, dp_rank=facts.dp_rank(vllm_config), dp_size=size)


@dataclass(slots=True, frozen=True)
class PendingStep:
    """A step scheduled and not yet updated (under async scheduling, up to two)."""

    start_mono_ns: int  #: when ``schedule()`` began (monotonic clock)
    admitted: list[Admission]  #: requests admitted in it (their RequestStarted precede its StepBatch)
    carried: frozenset[str]  #: preemptions from empty steps before it, reported with it
    resumed: frozenset[str]  #: resumes Model Runner V2 lists in ``scheduled_new_reqs``
    updates_before: int  #: updates completed when it was scheduled
    scheduler_output: Any  #: vLLM's SchedulerOutput (which requests it schedules)


def hit_sources(connector: Any, req: Any, cached: int, external: int) -> dict[str, int] | None:
    """RequestStarted.cached_tokens_by_source of one admission: vLLM's local hit as ``device``,
    then what the KV connector says each tier supplied of its ``external`` tokens
    (``get_external_cache_hit_sources``, vLLM >= 0.32); a part it leaves out is
    ``external_unspecified``, as vLLM's own metric files it. None (not reported) when the engine
    has no such method or it fails: the hook only copies facts, it never breaks the step."""
    local = cached - external
    sources: dict[str, int] = {"device": local} if local > 0 else {}
    if external <= 0:
        return sources
    ask = getattr(connector, "get_external_cache_hit_sources", None)
    if ask is None:
        return None
    try:
        split = {str(getattr(k, "value", k)): int(v) for k, v in ask(req, external).items() if v > 0}
    except Exception:  # a connector's bug must not reach the scheduler
        return None
    rest = external - sum(split.values())
    if rest > 0:
        split["external_unspecified"] = split.get("external_unspecified", 0) + rest
    elif rest < 0:
        return None  # more than it loaded: not a split of this hit
    for k, v in split.items():
        sources[k] = sources.get(k, 0) + v
    return sources


class EngineSession(SessionBase):
    """The producer of one engine epoch, bound to one ``Scheduler``.

    Args:
        cfg: Frozen configuration (read from the environment when the engine started).
        scheduler: The vLLM scheduler (only its ``requests`` dict is kept).
        emitter: Publisher of the ``core`` stream.
        builder: Payload builders for the emitter thread.
    """

    def __init__(self, cfg: Config, scheduler: Any, emitter: Emitter, builder: RecordBuilder) -> None:
        super().__init__(cfg, emitter)
        self.builder = builder
        self.engine_name = emitter.engine_name
        self.epoch = emitter.epoch
        self._requests: dict[str, Any] = scheduler.requests
        #: The scheduler's KV connector, asked which cache tier served an admission's external
        #: hit (issue 36); None without one.
        self._connector: Any = getattr(scheduler, "connector", None)
        self._step = 0
        self._updates = 0  # stamped steps whose update_from_output completed
        #: Steps scheduled and not yet updated, by step number.
        self._pending: dict[int, PendingStep] = {}
        #: Finishes held for an in-flight step that still schedules the request.
        self._held: dict[int, list[Any]] = {}
        #: KV events in vLLM's queue when each step not yet drained was scheduled: a drain
        #: (inside update_from_output) is split at these marks (see ``on_kv_batch``).
        pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
        self._kv_queue_owner = pool if hasattr(pool, "kv_event_queue") else None
        self._kv_marks: list[tuple[int, int]] = []
        #: Per step: KV events from before its admissions' lookup, and from after it.
        self._kv_held: dict[int, tuple[list[Any], list[Any]]] = {}
        self._carry: set[str] = set()
        self._live: set[str] = set()
        self._in_update = False
        self._deferred: list[Any] = []
        #: (request id, item index) of each encoder-cache hit since the last stamped step
        #: (appended by the wrapped EncoderCacheManager.check_and_update_cache, multimodal only).
        self._encoder_hits: list[EncoderHit] = []
        model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
        if getattr(model_config, "is_multimodal_model", False):
            watch_encoder_cache(scheduler, self._encoder_hits)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: Config, scheduler: Any) -> EngineSession:
        """Create the emitter, send EngineStarted and attach to ``scheduler``."""
        vllm_config = scheduler.vllm_config
        routing = routing_enabled(cfg, vllm_config)
        started = facts.engine_started(
            vllm_config,
            scheduler.kv_cache_config,
            block_size=int(getattr(scheduler, "block_size", 0) or 0),
            privacy_mode=cfg.privacy.mode,
            routing_capture=routing,
            engine_version=vllm_version(),
        )
        reasoning = ReasoningSplit.of_scheduler(scheduler)
        started["reasoning_parser"] = reasoning.name
        name = default_engine_name(cfg, vllm_config, started["served_model_name"])
        emitter = Emitter(cfg, engine_name=name, epoch=new_epoch())
        builder = RecordBuilder(
            policy=PromptPolicy(cfg.privacy),
            served_model_name=started["served_model_name"],
            block_size=started["block_size"],
            hash_block_size=int(getattr(scheduler, "hash_block_size", 0) or started["block_size"]),
            group_kinds=[g["kind"] for g in started["kv_cache_groups"]],
            spec_enabled=started["spec_method"] is not None and started["spec_num_tokens"] > 0,
            reasoning=reasoning,
            kv_role=facts.kv_role(vllm_config),
        )
        session = cls(cfg, scheduler, emitter, builder)
        announce(session, started)
        log.info(
            "sparseety: publishing engine %s to %s (topic %s, privacy %s, routing capture %s)",
            emitter.engine_id,
            cfg.kafka.bootstrap,
            cfg.topics.engine_events,
            cfg.privacy.mode,
            "on" if routing else "off",
        )
        return session

    # --- hot path ----------------------------------------------------------------------------

    def on_schedule(self, scheduler_output: Any, start_mono_ns: int) -> None:
        """After ``Scheduler.schedule()``: number the step, stamp it, note admissions."""
        if not scheduler_output.total_num_scheduled_tokens:
            if scheduler_output.preempted_req_ids:
                self._carry.update(scheduler_output.preempted_req_ids)
            return
        step = self._step
        self._step = step + 1
        setattr(scheduler_output, STEP_STAMP, (self.engine_name, self.epoch, step))
        if self._encoder_hits:
            setattr(scheduler_output, ENCODER_HITS, self._encoder_hits[:])
            self._encoder_hits.clear()
        owner = self._kv_queue_owner
        if owner is not None:
            self._kv_marks.append((step, len(owner.kv_event_queue)))
        new: list[Admission] = []
        resumed: set[str] | None = None
        if scheduler_output.scheduled_new_reqs:
            requests = self._requests
            live = self._live
            for new_request in scheduler_output.scheduled_new_reqs:
                req = requests.get(new_request.req_id)
                if req is None:
                    continue
                if new_request.req_id in live:
                    # Model Runner V2 lists a resumed request here: a resume, not an admission.
                    if resumed is None:
                        resumed = set()
                    resumed.add(new_request.req_id)
                    continue
                # RequestOutput.num_cached_tokens is PrefillStats.num_cached_tokens, set by
                # this schedule() call; the scheduler hands it out (and drops it) later.
                prefill_stats = req.prefill_stats
                if prefill_stats is not None:
                    # vLLM < 0.32 has no split of local and external hits
                    external = getattr(prefill_stats, "num_external_cached_tokens", 0) or 0
                    cached = prefill_stats.num_cached_tokens
                    sources = hit_sources(self._connector, req, cached, external)
                    new.append(Admission(req, cached, external, sources))
                else:
                    new.append(Admission(req, new_request.num_computed_tokens))
                live.add(new_request.req_id)
        carried = frozenset(self._carry) if self._carry else frozenset()
        self._carry.clear()
        self._pending[step] = PendingStep(
            start_mono_ns,
            new,
            carried,
            frozenset(resumed) if resumed else frozenset(),
            self._updates,
            scheduler_output,
        )

    def before_update(
        self, scheduler_output: Any, model_runner_output: Any
    ) -> dict[str, tuple[int, int]] | None:
        """Before ``update_from_output``: draft counts, read before vLLM trims the token lists."""
        self._in_update = True
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if not drafts:
            return None
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        requests = self._requests
        out: dict[str, tuple[int, int]] = {}
        for rid, draft_ids in drafts.items():
            req = requests.get(rid)
            row = index.get(rid)
            if req is None or row is None or not sampled or req.is_finished():
                out[rid] = (len(draft_ids), 0)  # vLLM does not count these either
                continue
            tokens_sampled = len(sampled[row])
            out[rid] = (len(draft_ids), tokens_sampled - 1 if tokens_sampled > 1 else 0)
        return out

    def after_update(
        self, scheduler_output: Any, outputs: Any, spec: dict[str, tuple[int, int]] | None, end_mono_ns: int
    ) -> None:
        """After ``update_from_output``: admissions, the StepBatch, then this step's finishes."""
        self._in_update = False
        stamp: tuple[str, str, int] | None = getattr(scheduler_output, STEP_STAMP, None)
        step = stamp[2] if stamp is not None else -1
        pending = self._pending.pop(step, None)
        if pending is not None:
            # Steps are updated in the order they were scheduled (the batch queue is FIFO), so
            # this count is also the number of the next step to be updated.
            self._updates += 1
            new = pending.admitted
            builder = self.builder
            kv = self._kv_held.pop(step, None)
            if kv is not None and kv[0]:
                self.emitter.emit_many(len(kv[0]), builder.kv_events, kv[0])
            if new:
                self.emitter.emit_many(len(new), builder.requests_started, new)
            if kv is not None and kv[1]:
                self.emitter.emit_many(len(kv[1]), builder.kv_events, kv[1])
            self.emitter.emit(
                builder.step,
                scheduler_output,
                outputs,
                spec,
                step,
                pending.start_mono_ns,
                end_mono_ns,
                pending.carried,
                pending.resumed,
                pending.updates_before,
            )
        if self._deferred:
            self._flush_deferred()
        if self._held:
            self._release_held(step)

    def update_aborted(self) -> None:
        """``update_from_output`` raised: do not keep finishes waiting for a StepBatch."""
        self._in_update = False
        if self._deferred:
            self._flush_deferred()
        if self._held:
            self._release_held(max(self._held))

    def on_free(self, req: Any) -> None:
        """In ``Scheduler._free_request``: the request left the engine (any reason).

        Only the reference is kept: a freed request is final (status, counts, block hashes), so
        the emitter thread reads it.
        """
        live = self._live
        rid = req.request_id
        if rid not in live:
            return  # never admitted: nothing was computed for it
        live.discard(rid)
        # vLLM frees the KV blocks now: they were held in every step scheduled so far (under
        # async scheduling that includes a step scheduled before this update).
        self.builder.freed[rid] = (self._step, time.time_ns())
        if self._pending:
            # Async scheduling: a step already scheduled (not the one being updated) may still
            # compute for it; its finish follows that step's StepBatch.
            last = -1
            for step, pending in self._pending.items():
                scheduled = pending.scheduler_output.num_scheduled_tokens
                if step > last and rid in scheduled and not self._updating(step):
                    last = step
            if last >= 0:
                self._held.setdefault(last, []).append(req)
                return
        if self._in_update or self._pending:
            self._deferred.append(req)  # after the StepBatch that carries its last tokens
        else:
            self.emitter.emit(self.builder.request_finished, req)

    def _updating(self, step: int) -> bool:
        """Whether ``step`` is the step whose update is running now (the oldest pending)."""
        return self._in_update and step == min(self._pending)

    def _release_held(self, updated: int) -> None:
        for step in [s for s in self._held if s <= updated or s not in self._pending]:
            items = self._held.pop(step)
            self.emitter.emit_many(len(items), self.builder.requests_finished, items)

    def on_kv_batch(self, batch: Any) -> None:
        """From the KV-event tee (inside ``update_from_output``): one event per KV event.

        vLLM drains its KV-event queue in every update. Under async scheduling the drain of
        update N-1 holds what schedule N did (its lookups' evictions, allocations and caching)
        and what update N-1 then cached. Each part is placed as on the plain scheduler: the
        events up to a step's schedule go just before that step's admissions, the ones after
        it just after them, both before its StepBatch (the fold's lookup rule relies on that
        order, ``streams/prefix_index.live_at_lookup``).
        """
        events = batch.events
        if not events:
            return
        marks, self._kv_marks = self._kv_marks, []
        if not marks:
            self.emitter.emit_many(len(events), self.builder.kv_events, events)
            return
        lo = 0
        for i, (step, mark) in enumerate(marks):
            pre = list(events[lo:mark])
            lo = max(lo, mark)
            post = list(events[lo:]) if i == len(marks) - 1 else []
            held = self._kv_held.get(step)
            if held is None:
                self._kv_held[step] = (pre, post)
            else:
                held[0].extend(pre)
                held[1].extend(post)
        if self._stopped:
            self._flush_kv()

    def _flush_kv(self) -> None:
        for step in sorted(self._kv_held):
            pre, post = self._kv_held.pop(step)
            both = pre + post
            if both:
                self.emitter.emit_many(len(both), self.builder.kv_events, both)

    def _flush_deferred(self) -> None:
        items, self._deferred = self._deferred, []
        self.emitter.emit_many(len(items), self.builder.requests_finished, items)

    # --- lifecycle ---------------------------------------------------------------------------

    def _release(self) -> None:
        """At stop, before EngineStopped: the finishes and KV events still held, and the
        routing captured in this process."""
        if self._deferred:
            self._flush_deferred()
        if self._kv_held:
            self._flush_kv()
        if self._held:
            self._release_held(max(self._held))
        routing.flush_in_process(2.0)
