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
    model_config = vllm_config.model_config
    try:
        is_moe = bool(getattr(model_config, "is_moe", False)) or model_config.get_num_experts() > 0
    except Exception:
        is_moe = False
    if not is_moe:
        return False
    if getattr(model_config, "enforce_eager", False):
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
        name = default_engine_name(cfg, vllm_config, started["served_model_name"])
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
            live_session = ref()
            if live_session is not None:
                live_session.stop("exit")

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

    def on_schedule(self, scheduler_output: Any, start_mono_ns: int) -> None:
        """After ``Scheduler.schedule()``: number the step, stamp it, note admissions."""
        if not scheduler_output.total_num_scheduled_tokens:
            if scheduler_output.preempted_req_ids:
                self._carry.update(scheduler_output.preempted_req_ids)
            return
        step = self._step
        self._step = step + 1
        setattr(scheduler_output, STEP_STAMP, (self.engine_name, self.epoch, step))
        new: list[tuple[Any, int]] = []
        if scheduler_output.scheduled_new_reqs:
            requests = self._requests
            live = self._live
            for new_request in scheduler_output.scheduled_new_reqs:
                req = requests.get(new_request.req_id)
                if req is None:
                    continue
                # RequestOutput.num_cached_tokens is PrefillStats.num_cached_tokens, set by
                # this schedule() call; the scheduler hands it out (and drops it) later.
                prefill_stats = req.prefill_stats
                new.append(
                    (
                        req,
                        prefill_stats.num_cached_tokens
                        if prefill_stats is not None
                        else new_request.num_computed_tokens,
                    )
                )
                live.add(new_request.req_id)
        carried = frozenset(self._carry) if self._carry else frozenset()
        self._carry.clear()
        self._pending[step] = (start_mono_ns, new, carried)

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
            start, new, carried = pending
            builder = self.builder
            if new:
                self.emitter.emit_many(len(new), builder.requests_started, new)
            self.emitter.emit(
                builder.step, scheduler_output, outputs, spec, step, start, end_mono_ns, carried
            )
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
