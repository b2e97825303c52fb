"""Patches SGLang's scheduler process (loaded by ``autoload.py`` only when configured).

Seams (SGLang 0.5.23, checked against a running CPU engine):

* ``Scheduler.__init__``: after it, on tensor/pipeline-parallel rank 0 only (every rank runs the
  same schedule), start the session: emitter, EngineStarted;
* ``Scheduler.run_batch`` / ``Scheduler.process_batch_result``: one step per forward batch, held
  in flight from launch to its result (keyed by the result object: the overlap scheduler launches
  batch N+1 before it processes batch N, and hands ``process_batch_result`` a copy of the batch);
* ``ScheduleBatch.retract_decode``: retractions (SGLang's preemption);
* ``KVCacheEventRecorder.record_store`` / ``record_remove`` / ``record_all_cleared``: the radix
  cache's inserts, evictions and resets (SGLang calls them whether or not its KV events are on);
* ``Scheduler.abort_request``: a retracted request aborted while it waits ends outside a step.

A missing seam disables the producer (one log line) and SGLang runs untouched; an object of an
unexpected shape at run time stops publishing for that engine, never the engine.

The post-import callbacks below also run in SGLang's launcher, which imports the scheduler module
(``sglang.srt.entrypoints.engine``) *before* it sets ``PROMETHEUS_MULTIPROC_DIR``. They must not
import the session (``.session`` loads ``prometheus_client`` through the producer's metrics):
``prometheus_client`` picks its value class when first imported, and one loaded before that
variable keeps the launcher's tokenizer metrics out of SGLang's multiprocess ``/metrics``
(``sglang:prompt_tokens_total`` and the other tokenizer-manager series disappeared). The session
is imported only in ``Scheduler.__init__``, in the scheduler process.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from sparseety.config import load_config

from ..plugin_kit import (
    Once,
    after_import,
    check_scheduler,
    installed_version,
    missing_seams,
    stop_publishing,
)

log = logging.getLogger("sparseety.producer.sglang")

TESTED_VERSIONS = ("0.5.23",)
SCHEDULER_SEAMS = ("__init__", "run_batch", "process_batch_result", "abort_request")
RECORDER_SEAMS = ("record_store", "record_remove", "record_all_cleared")

_installed = Once()
#: The session of this process's scheduler (one scheduler per SGLang scheduler process).
_session: Any = None
#: Whether the Rust TreeCore adapter's KV event conversion is teed in this process.
_rust_tee = False


def install() -> None:
    """Arrange for SGLang's classes to be patched when SGLang imports them (idempotent)."""
    if not _installed.first():
        return
    after_import("sglang.srt.managers.scheduler", _on_scheduler_module, log)
    after_import("sglang.srt.managers.schedule_batch", _on_schedule_batch_module, log)
    after_import("sglang.srt.mem_cache.events", _on_events_module, log)
    after_import("sglang.srt.mem_cache.rust_tree_core.adapter", _on_rust_adapter_module, log)


def _disable(exc: BaseException) -> None:
    """Stop publishing after an unexpected object shape; SGLang goes on."""
    global _session
    session, _session = _session, None
    if session is None:
        return
    stop_publishing(session, exc, logger=log, engine=f"SGLang {installed_version('sglang')}")


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Call a session method; any exception disables the producer, never the engine."""

    def call(*args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:
            _disable(exc)

    return call


def _on_scheduler_module(module: Any) -> list[str]:
    cls = module.Scheduler
    version = installed_version("sglang")
    if not check_scheduler(
        cls, SCHEDULER_SEAMS, logger=log, engine="SGLang", version=version, tested=TESTED_VERSIONS
    ):
        return []
    orig_init, orig_run, orig_result, orig_abort = (
        cls.__init__,
        cls.run_batch,
        cls.process_batch_result,
        cls.abort_request,
    )

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _session
        orig_init(self, *args, **kwargs)
        try:
            if int(getattr(self, "tp_rank", 0) or 0) != 0 or int(getattr(self, "pp_rank", 0) or 0) != 0:
                return  # every rank runs the same schedule: rank 0 publishes it
            from .session import SglangSession, kv_events_observed

            _session = SglangSession.start(load_config(env=os.environ), self, rust_tee=_rust_tee)
            log.info(
                "sparseety: SGLang engine %s hooked (tree cache %s)",
                _session.emitter.engine_id,
                type(getattr(self, "tree_cache", None)).__name__,
            )
            if not kv_events_observed(getattr(self, "tree_cache", None)):
                log.warning(
                    "sparseety: SGLang runs the Rust radix-tree core without its KV events, so the "
                    "producer cannot see its inserts and evictions: cached-token sources and "
                    "recompute after eviction are not observed (EngineStarted.kv_events_observed "
                    "false). SGLang's --kv-events-config (a zmq publisher) makes them visible, or "
                    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python (docs/sglang.md)"
                )
        except Exception as exc:
            log.warning("sparseety: not publishing this SGLang engine: %r", exc)

    @functools.wraps(orig_run)
    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is not None:
            if session.rust_publisher is not None:
                _guarded(session.drain_rust_events)()
            _guarded(session.before_run)(batch)
        result = orig_run(self, batch, *args, **kwargs)
        if session is not None:
            _guarded(session.launched)(result)
        return result

    @functools.wraps(orig_result)
    def process_batch_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is not None:
            _guarded(session.before_result)(args[1] if len(args) > 1 else kwargs.get("result"))
        out = orig_result(self, *args, **kwargs)
        session = _session
        if session is not None:
            _guarded(session.after_result)()
        return out

    @functools.wraps(orig_abort)
    def abort_request(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        waiting = list(getattr(self, "waiting_queue", ()) or ()) if session is not None else []
        out = orig_abort(self, recv_req, *args, **kwargs)
        if session is not None and waiting:
            still = {id(r) for r in getattr(self, "waiting_queue", ()) or ()}
            for req in waiting:
                if id(req) not in still:
                    _guarded(session.on_finished_outside_step)(req)
        return out

    cls.__init__ = __init__
    cls.run_batch = run_batch
    cls.process_batch_result = process_batch_result
    cls.abort_request = abort_request
    return [f"Scheduler.{s}" for s in SCHEDULER_SEAMS]


def _on_schedule_batch_module(module: Any) -> list[str]:
    cls = module.ScheduleBatch
    orig = getattr(cls, "retract_decode", None)
    if not callable(orig):
        log.warning("sparseety: SGLang has no ScheduleBatch.retract_decode; retractions not reported")
        return []

    @functools.wraps(orig)
    def retract_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        session = _session
        if session is not None:
            _guarded(session.on_retract)(out[0])
        return out

    cls.retract_decode = retract_decode
    return ["ScheduleBatch.retract_decode"]


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a recorder call is about the device tier (``medium`` None or StorageMedium.GPU)."""
    medium = args[0] if args else kwargs.get("medium")
    return medium is None or getattr(medium, "name", str(medium)) == "GPU"


def _on_events_module(module: Any) -> list[str]:
    cls = module.KVCacheEventRecorder
    missing = missing_seams(cls, RECORDER_SEAMS)
    if missing:
        log.warning("sparseety: SGLang has no KVCacheEventRecorder.%s; no KV events", ", ".join(missing))
        return []
    orig_store, orig_remove, orig_cleared = cls.record_store, cls.record_remove, cls.record_all_cleared

    @functools.wraps(orig_store)
    def record_store(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is not None and _device(args, kwargs):  # device tier only (host tiers: not yet)
            _guarded(session.on_store)(node)
        return orig_store(self, node, *args, **kwargs)

    @functools.wraps(orig_remove)
    def record_remove(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is not None and _device(args, kwargs):
            _guarded(session.on_remove)(node)
        return orig_remove(self, node, *args, **kwargs)

    @functools.wraps(orig_cleared)
    def record_all_cleared(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is not None:
            _guarded(session.on_cleared)()
        return orig_cleared(self, *args, **kwargs)

    cls.record_store = record_store
    cls.record_remove = record_remove
    cls.record_all_cleared = record_all_cleared
    return [f"KVCacheEventRecorder.{s}" for s in RECORDER_SEAMS]


def _on_rust_adapter_module(module: Any) -> list[str]:
    """Tee the Rust TreeCore's KV events: SGLang converts each tagged tuple the Rust core queued
    with the adapter's ``_kv_event_from_tagged`` when it takes them for its own publisher
    (``_RustKVCacheEventRecorder.take``, called only with ``--kv-events-config``); the wrapper
    hands the same tuple to the session and returns SGLang's conversion unchanged."""
    global _rust_tee
    orig = getattr(module, "_kv_event_from_tagged", None)
    if not callable(orig):
        log.warning(
            "sparseety: SGLang's Rust TreeCore adapter has no _kv_event_from_tagged: KV events not teed"
        )
        return []

    @functools.wraps(orig)
    def _kv_event_from_tagged(event: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(event, *args, **kwargs)
        session = _session
        if session is not None:
            _guarded(session.on_rust_event)(event)
        return out

    module._kv_event_from_tagged = _kv_event_from_tagged
    _rust_tee = True
    return ["rust_tree_core.adapter._kv_event_from_tagged"]
