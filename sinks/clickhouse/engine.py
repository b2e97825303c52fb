"""Where the store is and the threads that talk to it: a parsed DSN (:class:`Target`), the one
client and thread of an engine (:class:`Engine`), and the read-only clients of a
:class:`ReaderPool`. :mod:`.client` builds its :class:`~.client.Store` on these, and
:mod:`.embedded` its chDB engine; neither is imported here.

chDB sessions are not thread-safe, so every call on an :class:`Engine` runs on one thread that it
owns (a server's engine works the same way).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from sparseety.errors import StoreError

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """A parsed DSN: where the store is."""

    kind: Literal["chdb", "http"]
    dsn: str
    path: Path | None = None


class Engine:
    """A clickhouse-connect client and the single thread every call on it runs on.

    Args:
        target: Where the store is.
        connect: Opens the engine's client.
        owner: What this process is.
        reader: Opens one more client of the same store, for a :class:`ReaderPool` (default
            ``connect``).
    """

    def __init__(
        self,
        target: Target,
        connect: Callable[[], Any],
        owner: str,
        reader: Callable[[], Any] | None = None,
    ) -> None:
        self.target = target
        self.owner = owner
        self.open_client = reader or connect
        self.pools: list[ReaderPool] = []  # closed with the engine: no reader outlives it
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseety-store")
        self._thread: threading.Thread | None = None
        try:
            self.client: Any = self.executor.submit(self._connect, connect).result()
        except BaseException:
            self.executor.shutdown(wait=True)
            raise

    def _connect(self, connect: Callable[[], Any]) -> Any:
        self._thread = threading.current_thread()
        return connect()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.on_thread():
            return fn(self.client, *args)
        return self.executor.submit(fn, self.client, *args).result()

    def release(self) -> None:
        """One :class:`Store` on this engine closed (a server's engine has one store)."""
        self.close()

    def close(self) -> None:
        for pool in list(self.pools):
            pool.close()
        with contextlib.suppress(Exception):
            self.executor.submit(self.client.close).result()
        self.executor.shutdown(wait=True)


#: A reader's read-only mode: no statement writes, and none can lift it (``readonly = 1`` would
#: also refuse the per-query limits the reader sets; 2 allows them, never ``readonly`` itself).
READ_ONLY = 2


class ReaderPool:
    """``size`` read-only clients of one store, each used by one thread at a time.

    The API's reads run here, never on the store's own thread, which serves the sink's writes
    and ``/healthz``: a slow query delays its own caller only (a chDB path serves any number of
    clients in its one process, concurrently). Each client is read-only for its whole life: on
    chDB its handle runs ``SET readonly = 2`` once, which no later statement can undo; on a
    server every query carries ``readonly = 2``.

    Use :meth:`store` for a :class:`Store` whose calls run on a pooled client, from any thread;
    :attr:`executor` (``size`` threads) is where async callers run them.
    """

    def __init__(
        self,
        engine: Engine,
        size: int,
        database: str,
        cluster: str = "",
        *,
        make_store: Callable[[ReaderPool, dict[str, Any] | None], Any],
    ) -> None:
        if size < 1:
            raise StoreError(f"a reader pool needs at least one client (got {size})", size=size)
        self.target = engine.target
        self.database, self.cluster = database, cluster
        self._engine = engine
        self._make_store = make_store  # the client module's Store (it imports this module, not back)
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._clients: list[Any] = []
        try:
            for _ in range(size):
                client = engine.open_client()
                self._clients.append(client)
                if self.target.kind == "chdb":
                    client.command(f"SET readonly = {READ_ONLY}")
                else:
                    client.set_client_setting("readonly", str(READ_ONLY))
                self._idle.put(client)
        except BaseException:
            self.close()
            raise
        self.executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="sparseety-read")
        engine.pools.append(self)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(client, *args)`` on this thread with an idle client (waits for one)."""
        client = self._idle.get()
        try:
            return fn(client, *args)
        finally:
            self._idle.put(client)

    def store(self, settings: dict[str, Any] | None = None) -> Any:
        """A :class:`~.client.Store` whose statements run on this pool's clients with ``settings``
        (the caller's limits) added to each."""
        return self._make_store(self, settings)

    def release(self) -> None:
        """A store of the pool closed: the pool stays open (its owner closes it)."""

    def close(self) -> None:
        """Close every client (after the executor's threads have finished)."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown(wait=True)
        with contextlib.suppress(ValueError):
            self._engine.pools.remove(self)
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients.clear()

    def __enter__(self) -> ReaderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
