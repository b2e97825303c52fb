"""The hot-path hand-off between the engine thread and the emitter's background thread: seq
numbering and a bounded queue of not-yet-built events (the design: :mod:`.emitter`'s docstring)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

Builder = Callable[..., Any]
#: (first seq, 0 or the emit_many count, wall ns, monotonic ns, builder, builder args)
Item = tuple[int, int, int, int, Builder, tuple[Any, ...]]


class Source(Protocol):
    """Where a :class:`~.supervisor.Supervisor` takes its items: the engine's :class:`Handoff`
    in-process, or the relay's inbox (:mod:`.relay`)."""

    @property
    def queued(self) -> int: ...

    @property
    def dropped_by(self) -> dict[str, int]: ...

    def __bool__(self) -> bool: ...

    def take(self, limit: int) -> list[Item]: ...


class Handoff:
    """Seq numbering and a bounded queue of not-yet-built events; refuses events until
    :meth:`open` and after :meth:`close`."""

    def __init__(self, max_events: int) -> None:
        self._max_events = max_events
        # any thread: guarded by _lock
        self._lock = threading.Lock()
        self._items: deque[Item] = deque()
        self._seq = 0
        self._queued = 0  # events (not hand-offs) in _items
        self._queue_full = 0
        self._open = False
        self._closed = False
        #: set when an item lands in an empty queue: a consumer waits on it instead of polling
        self.ready = threading.Event()

    def open(self) -> None:
        """Start accepting events (the stream has its name now)."""
        self._open = True

    def close(self) -> None:
        """Refuse every event from now on (their seqs are still taken and counted)."""
        with self._lock:
            self._closed = True
        self.ready.set()  # a consumer waiting on it sees the end

    @property
    def queued(self) -> int:
        """Events waiting to be taken."""
        return self._queued

    @property
    def dropped(self) -> int:
        """Events refused: queue full, not open yet, or closed."""
        return self._queue_full

    @property
    def dropped_by(self) -> dict[str, int]:
        return {"queue_full": self._queue_full} if self._queue_full else {}

    def __bool__(self) -> bool:
        return bool(self._items)

    def _refuses(self, count: int) -> bool:
        return self._queued + count > self._max_events or self._closed or not self._open

    def emit(self, build: Builder, *args: Any) -> None:
        """Hand one event over; ``build(*args)`` makes its payload on the background thread."""
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            if self._refuses(1):
                self._queue_full += 1
                return
            self._queued += 1
            self._items.append((seq, 0, time.time_ns(), time.monotonic_ns(), build, args))
            if not self.ready.is_set():
                self.ready.set()

    def emit_many(self, count: int, build: Builder, *args: Any) -> None:
        """Hand ``count`` events of one moment over at once: ``build(*args)`` returns their
        ``count`` payloads. Seqs are consecutive; a dropped batch leaves ``count`` gaps."""
        if count <= 0:
            return
        with self._lock:
            seq = self._seq
            self._seq = seq + count
            if self._refuses(count):
                self._queue_full += count
                return
            self._queued += count
            self._items.append((seq, count, time.time_ns(), time.monotonic_ns(), build, args))
            if not self.ready.is_set():
                self.ready.set()

    @property
    def next_seq(self) -> int:
        """The seq the next event will take."""
        return self._seq

    def take(self, limit: int) -> list[Item]:
        """Up to ``limit`` hand-offs, oldest first (background thread only)."""
        items = self._items
        taken: list[Item] = []
        with contextlib.suppress(IndexError):
            for _ in range(limit):
                taken.append(items.popleft())
        events = sum(item[1] or 1 for item in taken)
        with self._lock:
            self._queued -= events
            # under the lock, as appends set it: cleared only when nothing is left to take
            if not items:
                self.ready.clear()
        return taken
