"""KV cache events into the engine-events stream, ordered with the steps.

Two ways in, both ending in :meth:`EngineSession.on_kv_batch` on the scheduler's thread at the
point where vLLM publishes a step's KV events (end of ``update_from_output``), i.e. before that
step's RequestStarted/StepBatch:

* :class:`KvTee` (the default, zero configuration beyond ``enable_kv_cache_events``): the
  patched ``Scheduler.__init__`` wraps whatever publisher vLLM created (``zmq`` keeps serving
  external subscribers; ``null`` publishes nowhere else).
* ``SparseetyEventPublisher`` (:func:`publisher_class`), registered as ``sparseety`` in vLLM's
  ``EventPublisherFactory``. vLLM's config validation only accepts ``null``/``zmq`` by name, so it
  can be selected only with a ``KVEventsConfig`` object whose ``publisher`` is set after
  validation (offline ``LLM(...)``); the CLI cannot name it. When selected, the tee is not added.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("sparseety.producer.vllm")

PUBLISHER_NAME = "sparseety"


class KvTee:
    """Forwards every KV event batch to the session, then to the wrapped vLLM publisher.

    Anything else (``shutdown``, ``get_publisher_config``, attributes) reaches the wrapped
    publisher unchanged. A failure on our side never stops vLLM's own publishing.
    """

    def __init__(self, inner: Any, session: Any) -> None:
        self._inner = inner
        self._session = session

    def publish(self, events: Any) -> None:
        session = self._session
        if session is not None:
            try:
                session.on_kv_batch(events)
            except Exception as exc:
                log.warning("sparseety: KV event tee disabled after an error: %r", exc)
                self._session = None
        self._inner.publish(events)

    def detach(self) -> None:
        """Stop forwarding (the plugin was disabled)."""
        self._session = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_publisher_cls: Any = None


def publisher_class() -> type:
    """vLLM ``EventPublisher`` subclass that hands batches to the session bound by the scheduler
    hook (defined on first use, so importing this module does not import vLLM).

    vLLM builds it inside ``Scheduler.__init__``, before our session exists; batches published
    before ``bind`` (none in practice: publishing starts with the first step) are dropped.
    """
    global _publisher_cls
    if _publisher_cls is not None:
        return _publisher_cls
    from vllm.distributed.kv_events import EventPublisher

    class SparseetyEventPublisher(EventPublisher):  # type: ignore[misc]
        def __init__(self, data_parallel_rank: int = 0, **_config: Any) -> None:
            super().__init__(data_parallel_rank)
            self._session: Any = None

        def bind(self, session: Any) -> None:
            self._session = session

        def publish(self, events: Any) -> None:
            session = self._session
            if session is None:
                return
            try:
                session.on_kv_batch(events)
            except Exception as exc:
                log.warning("sparseety: KV event publisher disabled after an error: %r", exc)
                self._session = None

        def shutdown(self) -> None:
            self._session = None

    _publisher_cls = SparseetyEventPublisher
    return _publisher_cls


def register_publisher() -> None:
    """Register ``sparseety`` in vLLM's EventPublisherFactory (idempotent)."""
    from vllm.distributed.kv_events import EventPublisherFactory

    registry = getattr(EventPublisherFactory, "_registry", {})
    if PUBLISHER_NAME not in registry:
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, publisher_class())


def attach(scheduler: Any, session: Any) -> str:
    """Route the scheduler's KV events to ``session``; returns how (for the log line)."""
    pub: Any = getattr(scheduler, "kv_event_publisher", None)
    if pub is None:
        return "none (no kv_event_publisher on the scheduler)"
    if _publisher_cls is not None and isinstance(pub, _publisher_cls):
        pub.bind(session)
        return "sparseety publisher"
    if isinstance(pub, KvTee):
        pub._session = session
        return "tee"
    scheduler.kv_event_publisher = KvTee(pub, session)
    enabled = bool(getattr(scheduler, "enable_kv_cache_events", False))
    return "tee" if enabled else "tee (inactive: kv_events_config.enable_kv_cache_events is off)"
