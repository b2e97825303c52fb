"""One store client for both targets, through clickhouse-connect.

* ``chdb:///abs/path``: the real ClickHouse engine embedded in this process (chDB). Its
  one-process-per-path rule (shared engine per path, owner record, lock check) lives in
  :mod:`~sparseety.sinks.clickhouse.embedded`, which only a chDB DSN imports.
* ``http(s)://host:port``: a ClickHouse server or cluster. Same DDL, same SQL.

Every call on an :class:`~.engine.Engine` runs on the one thread it owns (:mod:`.engine`). Reads
that must not wait behind the sink's writes, or behind each other (the API's), run on a
:class:`~.engine.ReaderPool` of the same store: read-only clients, one thread each.

Tables are always named with their database (``db.table``), so one client serves every database.
The :class:`Store` is what a process that owns the embedded path shares between the sink and the
query library (and later the HTTP API): open it once, hand it to both.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sparseety.config import Config
from sparseety.errors import StoreError

from .engine import Engine, ReaderPool, Target

T = TypeVar("T")


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
        return ReaderPool(
            engine,
            size,
            self.database,
            self.cluster,
            make_store=lambda pool, settings: Store(pool, self.database, self.cluster, settings=settings),
        )

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
