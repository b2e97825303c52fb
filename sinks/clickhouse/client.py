"""One store client for both targets, through clickhouse-connect.

* ``chdb:///abs/path``: the real ClickHouse engine embedded in this process (chDB). chDB allows
  one process per data path and one path per process, and its sessions are not thread-safe, so a
  :class:`Store` runs every call on one thread that it owns, and stores of one process opened on
  the same path share that thread and engine. A path held by another process becomes a
  :class:`~sparseety.errors.StoreLockedError` that names the owner (recorded in
  ``<path>/sparseety-owner.json`` when a SparSEEty process opens it).
* ``http(s)://host:port``: a ClickHouse server or cluster. Same DDL, same SQL.

Tables are always named with their database (``db.table``), so one client serves every database.
The :class:`Store` is what a process that owns the embedded path shares between the sink and the
query library (and later the HTTP API): open it once, hand it to both.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from sparseety.config import Config
from sparseety.errors import StoreError, StoreLockedError
from sparseety.lifecycle import pid_alive

T = TypeVar("T")
OWNER_FILE = "sparseety-owner.json"
_CODE = re.compile(r"Code: (\d+)")


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


def error_code(exc: BaseException) -> int | None:
    """ClickHouse's numeric error code in an exception message, when there is one."""
    m = _CODE.search(str(exc))
    return int(m.group(1)) if m else None


def read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record of a chDB path, if a SparSEEty process left one."""
    try:
        data = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def locked_error(path: Path, cause: BaseException | None = None) -> StoreLockedError:
    """The error for a chDB path another process holds, naming that process when known."""
    owner = read_owner(path)
    pid = owner.get("pid") if owner else None
    if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
        who = f"process {pid} ({owner.get('command', '?') if owner else '?'})"
    else:
        who = "another process"
    return StoreLockedError(
        f"the embedded ClickHouse store at {path} is open in {who}. chDB lets one process own a "
        f"data path: in the embedded stack the store process (`sparseety store`, started by "
        f"`sparseety up`) owns it and serves queries; stop it to open the path directly, or point "
        f"clickhouse.dsn at a ClickHouse server (http://...)." + (f" ({cause})" if cause else ""),
        path=str(path),
        owner_pid=pid if isinstance(pid, int) else None,
        owner_command=str(owner["command"]) if owner and "command" in owner else None,
    )


def _check_unlocked(path: Path) -> None:
    """Raise StoreLockedError if another process holds the chDB path.

    ClickHouse takes an exclusive ``flock`` on ``<path>/status`` for as long as it runs; asking
    for the same lock first spares the user chDB's own error text on stderr.
    """
    status = path / "status"
    if not status.exists():
        return
    with open(status, "rb") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise locked_error(path) from None
        fcntl.flock(fh, fcntl.LOCK_UN)


class _Engine:
    """A clickhouse-connect client and the single thread every call on it runs on."""

    def __init__(self, target: Target, connect: Callable[[], Any], owner: str) -> None:
        self.target = target
        self.refs = 0
        self.owner = owner
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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.executor.submit(self.client.close).result()
        self.executor.shutdown(wait=True)


_engines: dict[str, _Engine] = {}
_engines_lock = threading.Lock()


def _open_engine(target: Target, cfg: Config, owner: str) -> _Engine:
    import clickhouse_connect

    if target.kind == "chdb":
        assert target.path is not None
        key = str(target.path)
        with _engines_lock:
            engine = _engines.get(key)
            if engine is None:
                other = next(iter(_engines), None)
                if other is not None:
                    raise StoreError(
                        f"this process already has the embedded store at {other} open; chDB allows one "
                        f"data path per process (asked for {key})",
                        path=key,
                        open_path=other,
                    )
                path = target.path
                path.mkdir(parents=True, exist_ok=True)

                def connect() -> Any:
                    _check_unlocked(path)
                    try:
                        return clickhouse_connect.get_client(dsn=f"chdb://{key}")
                    except Exception as exc:
                        if "Error initializing EmbeddedServer" in str(exc):
                            raise locked_error(path, exc) from exc
                        raise StoreError(f"cannot open the embedded store at {key}: {exc}", path=key) from exc

                engine = _Engine(target, connect, owner)
                _write_owner(path, owner)
                _engines[key] = engine
            engine.refs += 1
            return engine

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

    engine = _Engine(target, connect_http, owner)
    engine.refs = 1
    return engine


def _redact(dsn: str) -> str:
    return re.sub(r"//[^@/]*@", "//***@", dsn)


def _write_owner(path: Path, owner: str) -> None:
    record = {"pid": os.getpid(), "command": owner or " ".join(sys.argv[:3]), "opened_ns": time.time_ns()}
    with contextlib.suppress(OSError):
        (path / OWNER_FILE).write_text(json.dumps(record))


def _release_engine(engine: _Engine) -> None:
    with _engines_lock:
        engine.refs -= 1
        if engine.refs > 0:
            return
        if engine.target.kind == "chdb" and engine.target.path is not None:
            _engines.pop(str(engine.target.path), None)
            owner = read_owner(engine.target.path)
            if owner and owner.get("pid") == os.getpid():
                with contextlib.suppress(OSError):
                    (engine.target.path / OWNER_FILE).unlink()
    engine.close()


class Store:
    """A ClickHouse database reached through one client on one thread.

    Use :meth:`open`; close when done (or use it as a context manager). Every method may be
    called from any thread; async code uses :meth:`arun`.

    Attributes:
        database: The database every table lives in.
        cluster: Cluster name for ``ON CLUSTER`` DDL ('' for none).
        target: Where the store is.
    """

    def __init__(self, engine: _Engine, database: str, cluster: str) -> None:
        self._engine: _Engine | None = engine
        self.database = database
        self.cluster = cluster
        self.target = engine.target

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
    def engine(self) -> _Engine:
        if self._engine is None:
            raise StoreError("the store is closed")
        return self._engine

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(client, *args)`` on the store's thread and return its result."""
        return self.engine.call(fn, *args)

    async def arun(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`run` for async callers: the event loop is not blocked."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(engine.executor, lambda: fn(engine.client, *args))

    def command(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        """Run a statement that returns no rows (DDL, mutations)."""
        try:
            return self.run(lambda c: c.command(sql, parameters=parameters))
        except StoreError:
            raise
        except Exception as exc:
            raise _store_error(exc, sql) from exc

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows as dicts (server-side ``{name:Type}`` parameters)."""
        names, rows = self.query_rows(sql, parameters)
        return [dict(zip(names, row, strict=True)) for row in rows]

    def query_rows(
        self, sql: str, parameters: dict[str, Any] | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and rows as tuples."""

        def q(c: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
            result = c.query(sql, parameters=parameters)
            return list(result.column_names), [tuple(r) for r in result.result_rows]

        try:
            return self.run(q)
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
            _release_engine(engine)

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
