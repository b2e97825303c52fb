"""One store client for both targets, through clickhouse-connect.

* ``chdb:///abs/path``: the real ClickHouse engine embedded in this process (chDB). Its
  one-process-per-path rule (shared engine per path, owner record, lock check) lives in
  :mod:`~sparseety.sinks.clickhouse.embedded`, which only a chDB DSN imports.
* ``http(s)://host:port``: a ClickHouse server or cluster. Same DDL, same SQL.

chDB sessions are not thread-safe, so every call on an :class:`Engine` runs on one thread that it
owns (a server's engine works the same way). Reads that must not wait behind the sink's writes,
or behind each other (the API's), run on a :class:`ReaderPool` of the same store: read-only
clients, one thread each.

Tables are always named with their database (``db.table``), so one client serves every database.
The :class:`Store` is what a process that owns the embedded path shares between the sink and the
query library (and later the HTTP API): open it once, hand it to both.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from sparseety.config import Config
from sparseety.errors import StoreError

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """A parsed DSN: where the store is."""

    kind: Literal["chdb", "http"]
    dsn: str
    path: Path | None = None


def parse_dsn(dsn: str) -> Target:
    """Parse ``chdb:///abs/path`` or ``http(s)://...``.

    Raises:
        StoreError: any other scheme, or a chDB path that is not absolute.
    """
    if dsn.startswith("chdb://"):
        raw = dsn[len("chdb://") :]
        if not raw.startswith("/"):
            raise StoreError(f"chDB DSN needs an absolute path (chdb:///abs/path), got {dsn!r}", dsn=dsn)
        return Target("chdb", dsn, Path(raw))
    if dsn.startswith(("http://", "https://")):
        return Target("http", dsn)
    raise StoreError(f"unsupported ClickHouse DSN {dsn!r}: use chdb:///path or http(s)://", dsn=dsn)


def require_store(cfg: Config) -> None:
    """Refuse to read an embedded store that was never created: a data dir no stack has used.

    Opening a chDB path creates it, so a reader pointed at the wrong ``--data-dir`` would get a
    fresh empty store and a hint to migrate it; it gets this instead. (``db migrate`` and the
    store process create the store on purpose and do not call this.)

    Raises:
        StoreError: the embedded store's directory does not exist.
    """
    target = parse_dsn(cfg.clickhouse_dsn)
    if target.kind == "chdb" and target.path is not None and not target.path.exists():
        raise StoreError(
            f"no store at {target.path}: no stack has run with the data dir {cfg.data_path} "
            "(start one with `sparseety up`, or point --data-dir / SPARSEETY_DATA_DIR at the stack's)",
            path=str(target.path),
        )


def error_code(exc: BaseException) -> int | None:
    """ClickHouse's numeric error code, as clickhouse-connect's exception carries it (the server's,
    or chDB's); None for any other failure (a transport error, a value Python could not encode)."""
    from clickhouse_connect.driver.exceptions import Error

    return exc.code if isinstance(exc, Error) else None


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


def _open_engine(target: Target, cfg: Config, owner: str) -> Engine:
    """The engine behind ``target``: a chDB path goes through the one-owner rule (its own
    module, imported only then), a server gets a plain client of its own."""
    if target.kind == "chdb":
        from .embedded import open_embedded

        return open_embedded(target, owner)
    import clickhouse_connect

    password = cfg.clickhouse.password.get_secret_value() if cfg.clickhouse.password else ""

    def connect_http() -> Any:
        try:
            return clickhouse_connect.get_client(
                dsn=target.dsn, username=cfg.clickhouse.username, password=password
            )
        except Exception as exc:
            raise StoreError(
                f"cannot reach ClickHouse at {_redact(target.dsn)}: {exc}", dsn=_redact(target.dsn)
            ) from exc

    return Engine(target, connect_http, owner)


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

    def __init__(self, engine: Engine, size: int, database: str, cluster: str = "") -> None:
        if size < 1:
            raise StoreError(f"a reader pool needs at least one client (got {size})", size=size)
        self.target = engine.target
        self.database, self.cluster = database, cluster
        self._engine = engine
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

    def store(self, settings: dict[str, Any] | None = None) -> Store:
        """A store whose statements run on this pool's clients with ``settings`` (the caller's
        limits) added to each."""
        return Store(self, self.database, self.cluster, settings=settings)

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


def _redact(dsn: str) -> str:
    return re.sub(r"//[^@/]*@", "//***@", dsn)


class Store:
    """A ClickHouse database reached through one client on one thread.

    Use :meth:`open`; close when done (or use it as a context manager). Every method may be
    called from any thread; async code uses :meth:`arun`.

    Attributes:
        database: The database every table lives in.
        cluster: Cluster name for ``ON CLUSTER`` DDL ('' for none).
        target: Where the store is.
        settings: ClickHouse settings added to every query it runs (a reader's limits).
    """

    def __init__(
        self,
        engine: Engine | ReaderPool,
        database: str,
        cluster: str,
        *,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self._engine: Engine | ReaderPool | None = engine
        self.database = database
        self.cluster = cluster
        self.target = engine.target
        self.settings: dict[str, Any] = dict(settings or {})

    @classmethod
    def open(cls, cfg: Config, *, owner: str = "", database: str | None = None) -> Store:
        """Open the store ``cfg`` names (``clickhouse.dsn``, default the embedded path).

        Args:
            cfg: Configuration.
            owner: What this process is (recorded as the owner of an embedded path).
            database: Override ``clickhouse.database``.

        Raises:
            StoreLockedError: the embedded path is open in another process.
            StoreError: the DSN is invalid or the server cannot be reached.
        """
        target = parse_dsn(cfg.clickhouse_dsn)
        engine = _open_engine(target, cfg, owner)
        return cls(engine, database or cfg.clickhouse.database, cfg.clickhouse.cluster)

    @property
    def engine(self) -> Engine | ReaderPool:
        if self._engine is None:
            raise StoreError("the store is closed")
        return self._engine

    @property
    def read_only(self) -> bool:
        """Its statements run on read-only clients (a :class:`ReaderPool`'s)."""
        return isinstance(self._engine, ReaderPool)

    def readers(self, size: int) -> ReaderPool:
        """A pool of ``size`` read-only clients of this store (the caller closes it)."""
        engine = self.engine
        if isinstance(engine, ReaderPool):
            raise StoreError("a reader pool is opened from the store's own engine")
        return ReaderPool(engine, size, self.database, self.cluster)

    def _settings(self, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        merged = {**self.settings, **(extra or {})}
        return merged or None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(client, *args)`` on the store's thread and return its result."""
        return self.engine.call(fn, *args)

    async def arun(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`run` for async callers: the event loop is not blocked."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(engine.executor, lambda: engine.call(fn, *args))

    def command(
        self, sql: str, parameters: dict[str, Any] | None = None, *, settings: dict[str, Any] | None = None
    ) -> Any:
        """Run a statement that returns no rows (DDL, mutations, ``INSERT ... SELECT``)."""
        try:
            return self.run(lambda c: c.command(sql, parameters=parameters, settings=settings))
        except StoreError:
            raise
        except Exception as exc:
            raise _store_error(exc, sql) from exc

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows as dicts (server-side ``{name:Type}`` parameters)."""
        names, rows = self.query_rows(sql, parameters)
        return [dict(zip(names, row, strict=True)) for row in rows]

    def query_rows(
        self,
        sql: str,
        parameters: dict[str, Any] | None = None,
        *,
        settings: dict[str, Any] | None = None,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and rows as tuples (``settings`` added to the store's own)."""
        merged = self._settings(settings)

        def q(c: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
            result = c.query(sql, parameters=parameters, settings=merged)
            return list(result.column_names), [tuple(r) for r in result.result_rows]

        try:
            return self.run(q)
        except StoreError:
            raise
        except Exception as exc:
            raise _store_error(exc, sql) from exc

    def raw(
        self, sql: str, parameters: dict[str, Any] | None, fmt: str, settings: dict[str, Any] | None = None
    ) -> bytes:
        """The result in one of ClickHouse's own output formats (``Parquet``, ``CSVWithNames``)."""
        merged = self._settings(settings)
        try:
            return self.run(
                lambda c: bytes(c.raw_query(sql, parameters=parameters, fmt=fmt, settings=merged))
            )
        except StoreError:
            raise
        except Exception as exc:
            raise _store_error(exc, sql) from exc

    def insert(
        self,
        table: str,
        columns: Sequence[Sequence[Any]],
        column_names: Sequence[str],
        *,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """Insert column-oriented data into ``table`` (``db.table``)."""

        def ins(c: Any) -> None:
            c.insert(
                table,
                columns,
                column_names=list(column_names),
                column_oriented=True,
                settings=settings or {},
            )

        try:
            self.run(ins)
        except StoreError:
            raise
        except Exception as exc:
            raise _store_error(exc, f"INSERT INTO {table}") from exc

    def table(self, name: str) -> str:
        """``database.name``."""
        return f"{self.database}.{name}"

    def close(self) -> None:
        """Release the client (the last store of an embedded path closes the engine)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.target.path if self.target.kind == "chdb" else _redact(self.target.dsn)
        return f"Store({self.target.kind}:{where}, database={self.database})"


def _store_error(exc: BaseException, sql: str) -> StoreError:
    code = error_code(exc)
    return StoreError(f"ClickHouse error: {exc}", code=code, sql=sql[:200], cause=type(exc).__name__)
