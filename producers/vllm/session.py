"""One engine epoch in the engine-core process: the hot-path side of the scheduler hooks.

:class:`EngineSession` is attached to a vLLM ``Scheduler`` by the patched ``__init__``. The patched
methods call its ``on_*`` methods, which only read what vLLM mutates later (prefill stats, the
lengths of sampled-token lists before ``update_from_output`` trims them, the finished request's
totals) and hand references to the emitter. Order of one step's events on the ``core`` stream:
KV events published during the step (vLLM publishes them inside ``update_from_output``), then
RequestStarted for requests admitted in the step, the StepBatch, and RequestFinished for
requests that ended in it (a finish outside a step, e.g. an abort, is sent at once).
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
import weakref
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.producers.emitter import Emitter, new_epoch
from sparseety.producers.privacy import PromptPolicy
from sparseety.producers.vllm import facts
from sparseety.producers.vllm.records import RecordBuilder

log = logging.getLogger("sparseety.producer.vllm")

#: Attribute set on every SchedulerOutput: ``(engine_name, epoch, step)``. It is pickled to the
#: worker processes with the output and joins worker-side captures (MoE routing) to the step.
STEP_STAMP = "sparseety_step"


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return ""


def routing_enabled(cfg: Config, vllm_config: Any) -> bool:
    """Whether MoE routing is captured for this engine (both processes decide the same way)."""
    if not cfg.producer.routing_capture:
        return False
    mc = vllm_config.model_config
    try:
        is_moe = bool(getattr(mc, "is_moe", False)) or mc.get_num_experts() > 0
    except Exception:
        is_moe = False
    if not is_moe:
        return False
    if getattr(mc, "enforce_eager", False):
        return True
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return True  # torch.compile without CUDA graphs: the custom-op hook runs per step
    except Exception:
        pass
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is None or str(getattr(mode, "name", mode)).upper() == "NONE"


def default_engine_name(cfg: Config, vllm_config: Any, served: str) -> str:
    """Configured name, else ``<host>-<served model>-dp<rank>`` (stable across restarts)."""
    hint = re.sub(r"[^A-Za-z0-9._-]+", "_", served.rsplit("/", 1)[-1]) or "model"
    return cfg.engine_name(f"{hint}-dp{facts.dp_rank(vllm_config)}")


class EngineSession:
    """The producer of one engine epoch, bound to one ``Scheduler``.

    Args:
        cfg: Frozen configuration (read from the environment when the engine started).
        scheduler: The vLLM scheduler (only its ``requests`` dict is kept).
        emitter: Publisher of the ``core`` stream.
        builder: Payload builders for the emitter thread.
    """

    def __init__(self, cfg: Config, scheduler: Any, emitter: Emitter, builder: RecordBuilder) -> None:
        self.cfg = cfg
        self.emitter = emitter
        self.builder = builder
        self.engine_name = emitter.engine_name
        self.epoch = emitter.epoch
        self._requests: dict[str, Any] = scheduler.requests
        self._step = 0
        self._pending: dict[int, tuple[int, list[tuple[Any, int]], frozenset[str]]] = {}
        self._carry: set[str] = set()
        self._live: set[str] = set()
        self._in_update = False
        self._deferred: list[Any] = []
        self._stopped = False
        self._stop_lock = threading.Lock()

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: Config, scheduler: Any) -> EngineSession:
        """Create the emitter, send EngineStarted and attach to ``scheduler``."""
        vc = scheduler.vllm_config
        routing = routing_enabled(cfg, vc)
        started = facts.engine_started(
            vc,
            scheduler.kv_cache_config,
            block_size=int(getattr(scheduler, "block_size", 0) or 0),
            privacy_mode=cfg.privacy.mode,
            routing_capture=routing,
            engine_version=vllm_version(),
        )
        name = default_engine_name(cfg, vc, started["served_model_name"])
        emitter = Emitter(cfg, engine_name=name, epoch=new_epoch())
        builder = RecordBuilder(
            policy=PromptPolicy(cfg.privacy),
            served_model_name=started["served_model_name"],
            block_size=started["block_size"],
            hash_block_size=int(getattr(scheduler, "hash_block_size", 0) or started["block_size"]),
            group_kinds=[g["kind"] for g in started["kv_cache_groups"]],
            spec_enabled=started["spec_method"] is not None and started["spec_num_tokens"] > 0,
        )
        session = cls(cfg, scheduler, emitter, builder)
        emitter.emit_record(ev.ENGINE_STARTED, started)
        ref = weakref.ref(session)

        def at_exit() -> None:
            s = ref()
            if s is not None:
                s.stop("exit")

        atexit.register(at_exit)
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

    def on_schedule(self, so: Any, start_mono_ns: int) -> None:
        """After ``Scheduler.schedule()``: number the step, stamp it, note admissions."""
        if not so.total_num_scheduled_tokens:
            if so.preempted_req_ids:
                self._carry.update(so.preempted_req_ids)
            return
        step = self._step
        self._step = step + 1
        setattr(so, STEP_STAMP, (self.engine_name, self.epoch, step))
        new: list[tuple[Any, int]] = []
        if so.scheduled_new_reqs:
            reqs = self._requests
            live = self._live
            for nr in so.scheduled_new_reqs:
                req = reqs.get(nr.req_id)
                if req is None:
                    continue
                # RequestOutput.num_cached_tokens is PrefillStats.num_cached_tokens, set by
                # this schedule() call; the scheduler hands it out (and drops it) later.
                ps = req.prefill_stats
                new.append((req, ps.num_cached_tokens if ps is not None else nr.num_computed_tokens))
                live.add(nr.req_id)
        carried = frozenset(self._carry) if self._carry else frozenset()
        self._carry.clear()
        self._pending[step] = (start_mono_ns, new, carried)

    def before_update(self, so: Any, mro: Any) -> dict[str, tuple[int, int]] | None:
        """Before ``update_from_output``: draft counts, read before vLLM trims the token lists."""
        self._in_update = True
        drafts = so.scheduled_spec_decode_tokens
        if not drafts:
            return None
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        reqs = self._requests
        out: dict[str, tuple[int, int]] = {}
        for rid, ids in drafts.items():
            req = reqs.get(rid)
            i = index.get(rid)
            if req is None or i is None or not sampled or req.is_finished():
                out[rid] = (len(ids), 0)  # vLLM does not count these either
                continue
            n = len(sampled[i])
            out[rid] = (len(ids), n - 1 if n > 1 else 0)
        return out

    def after_update(
        self, so: Any, outputs: Any, spec: dict[str, tuple[int, int]] | None, end_mono_ns: int
    ) -> None:
        """After ``update_from_output``: admissions, the StepBatch, then this step's finishes."""
        self._in_update = False
        stamp: tuple[str, str, int] | None = getattr(so, STEP_STAMP, None)
        step = stamp[2] if stamp is not None else -1
        pending = self._pending.pop(step, None)
        if pending is not None:
            start, new, carried = pending
            b = self.builder
            if new:
                self.emitter.emit_many(len(new), b.requests_started, new)
            self.emitter.emit(b.step, so, outputs, spec, step, start, end_mono_ns, carried)
        if self._deferred:
            self._flush_deferred()

    def update_aborted(self) -> None:
        """``update_from_output`` raised: do not keep finishes waiting for a StepBatch."""
        self._in_update = False
        if self._deferred:
            self._flush_deferred()

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
        if self._in_update or self._pending:
            self._deferred.append(req)  # after the StepBatch that carries its last tokens
        else:
            self.emitter.emit(self.builder.request_finished, req)

    def on_kv_batch(self, batch: Any) -> None:
        """From the KV-event tee (inside ``update_from_output``): one event per KV event."""
        events = batch.events
        if events:
            self.emitter.emit_many(len(events), self.builder.kv_events, events)

    def _flush_deferred(self) -> None:
        items, self._deferred = self._deferred, []
        self.emitter.emit_many(len(items), self.builder.requests_finished, items)

    # --- lifecycle ---------------------------------------------------------------------------

    def stop(self, reason: str = "shutdown", timeout: float | None = None) -> None:
        """Send EngineStopped, flush (bounded), log the producer's totals. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self._deferred:
            self._flush_deferred()
        from sparseety.producers.vllm import routing

        routing.flush_in_process(2.0)
        self.emitter.emit_record(ev.ENGINE_STOPPED, {"reason": reason})
        t0 = time.monotonic()
        self.emitter.close(timeout)
        log.debug("sparseety: producer flushed in %.2f s", time.monotonic() - t0)
