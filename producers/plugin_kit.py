"""What the vLLM and SGLang plugins share: the entry point's guard, post-import hooks, the seam
and version checks, the engine's name, and the start and end of an engine session (the log
handler is :mod:`.plugin_log`'s).

The engine-specific parts stay with each producer: which classes are patched and how (the hot
paths), the EngineStarted facts, the records. What is here runs in every process the engine
starts (the entry point, the hooks' registration) and imports nothing heavy; the session side
(:func:`engine_name`, :func:`announce`, :class:`SessionBase`) runs in the scheduler process.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sparseety.config import Config, is_configured

from .plugin_log import ensure_log_handler

if TYPE_CHECKING:
    from .emitter import Emitter

log = logging.getLogger("sparseety.producer")


# --- the plugin side: every process the engine starts --------------------------------------


def register_when_configured(install: Callable[[], object], logger: logging.Logger, failed: str) -> None:
    """An entry point's body: ``install()`` when SparSEEty is configured (``SPARSEETY_CONFIG`` or
    ``SPARSEETY_KAFKA_BOOTSTRAP``), else nothing. Never raises: a failure is one warning,
    ``failed`` with the exception for ``%s``/``%r``, and the engine runs without the producer."""
    try:
        if not is_configured(os.environ):
            return
        ensure_log_handler()
        install()
    except Exception as exc:
        logger.warning(failed, exc)


class Once:
    """A flag that lets the first caller through, once per process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def first(self) -> bool:
        """True for the first call only."""
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True


def _run_callback(name: str, callback: Callable[[Any], Any], logger: logging.Logger, module: Any) -> None:
    try:
        patched = callback(module)
        logger.debug("sparseety: patched %s", ", ".join(patched or []))
    except Exception as exc:  # never break the engine's import
        logger.warning("sparseety: could not hook %s (%r); the engine runs without that part", name, exc)


def after_import(name: str, callback: Callable[[Any], Any], logger: logging.Logger = log) -> None:
    """``callback(module)`` once ``name`` is imported: now if it already is, else right after.

    wrapt's post-import hooks (PEP 369 style): one finder on ``sys.meta_path`` that wraps the
    target module's loader and fires each hook once. A failing hook is one warning on ``logger``
    and never breaks the engine's import. ``callback`` returns the names of what it patched.
    """
    import wrapt

    wrapt.register_post_import_hook(functools.partial(_run_callback, name, callback, logger), name)


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("" when unknown), read from its metadata only:
    the hooks' registration calls this in the engine's launcher, where nothing heavy may load."""
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:
        return ""


def missing_seams(cls: Any, seams: tuple[str, ...]) -> list[str]:
    """The methods of ``seams`` that ``cls`` lacks (or has as something not callable)."""
    return [m for m in seams if not callable(getattr(cls, m, None))]


def check_scheduler(
    cls: Any,
    seams: tuple[str, ...],
    *,
    logger: logging.Logger,
    engine: str,
    version: str,
    tested: tuple[str, ...],
) -> bool:
    """Whether the engine's ``Scheduler`` has every seam the hooks patch.

    When one is missing: one warning (the producer stays off, the engine runs untouched) and
    False. When all are there but ``version`` is not a tested one: one warning (the hooks stop
    themselves at run time if the engine's objects differ) and True.
    """
    missing = missing_seams(cls, seams)
    if missing:
        logger.warning(
            "sparseety: %s plugin disabled, the engine runs without it: %s %s has no Scheduler.%s; "
            "this plugin covers %s %s",
            engine,
            engine,
            version,
            ", Scheduler.".join(missing),
            engine,
            ", ".join(tested),
        )
        return False
    if not version.startswith(tested):
        logger.warning(
            "sparseety: %s %s is not a tested version (%s); the hooks will stop themselves "
            "if %s's objects differ",
            engine,
            version,
            ", ".join(tested),
            engine,
        )
    return True


# --- the session side: the engine's scheduler process ---------------------------------------


def engine_name(cfg: Config, served: str, *, dp_rank: int, dp_size: int) -> str:
    """Configured name, else ``<host>-<served model>-dp<rank>`` (stable across restarts).

    Under data parallelism every rank's scheduler reads the same configuration, so a configured
    name gets ``-dp<rank>`` too: one name per engine, or the ranks would take each other's epochs
    for restarts (and close each other's requests).
    """
    if cfg.producer.engine_name:
        return f"{cfg.producer.engine_name}-dp{dp_rank}" if dp_size > 1 else cfg.producer.engine_name
    hint = re.sub(r"[^A-Za-z0-9._-]+", "_", served.rsplit("/", 1)[-1]) or "model"
    return cfg.engine_name(f"{hint}-dp{dp_rank}")


class Session(Protocol):
    """What :func:`announce` and :func:`stop_publishing` need of an engine session."""

    @property
    def emitter(self) -> Emitter: ...

    def stop(self, reason: str = "shutdown", timeout: float | None = None) -> None: ...


def announce(session: Session, started: dict[str, Any]) -> None:
    """Send ``session``'s EngineStarted (``started``) and stop it at interpreter exit, unless it
    was collected first."""
    from sparseety import events as ev  # the session side only: the entry point never loads it

    session.emitter.announce(ev.ENGINE_STARTED, started)
    ref = weakref.ref(session)

    def at_exit() -> None:
        live = ref()
        if live is not None:
            live.stop("exit")

    atexit.register(at_exit)


def stop_publishing(session: Session, exc: BaseException, *, logger: logging.Logger, engine: str) -> None:
    """Stop publishing after an object of unexpected shape (``exc``): one error line naming
    ``engine`` (the engine and its version, "vLLM 0.32"), and the session's stop (EngineStopped,
    the flush) on a thread of its own; the engine goes on."""
    logger.error(
        "sparseety: stopped publishing engine %s: %s changed an object the hooks read (%r); "
        "the engine keeps running",
        session.emitter.engine_id,
        engine,
        exc,
    )
    threading.Thread(target=session.stop, args=("producer_error",), daemon=True).start()


class SessionBase:
    """The start-to-stop frame of one engine epoch's producer.

    Args:
        cfg: Frozen configuration (read from the environment when the engine started).
        emitter: Publisher of the ``core`` stream.
    """

    def __init__(self, cfg: Config, emitter: Emitter) -> None:
        self.cfg = cfg
        self.emitter = emitter
        self._stopped = False
        self._stop_lock = threading.Lock()

    def _release(self) -> None:
        """Send what the session still holds for a later step (before EngineStopped)."""

    def stop(self, reason: str = "shutdown", timeout: float | None = None) -> None:
        """Send what is held, EngineStopped, flush (bounded). Idempotent."""
        from sparseety import events as ev  # as in announce

        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._release()
        self.emitter.emit_record(ev.ENGINE_STOPPED, {"reason": reason})
        t0 = time.monotonic()
        self.emitter.close(timeout)
        log.debug("sparseety: producer flushed in %.2f s", time.monotonic() - t0)
