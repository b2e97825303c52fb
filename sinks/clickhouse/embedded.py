"""chDB's one-process-per-path rule, paid only by a ``chdb:///abs/path`` DSN.

chDB allows one process per data path and one path per process. So:

* stores of one process opened on the same path share one :class:`EmbeddedEngine` (reference
  counted), and a second path in the same process is refused;
* a path held by another process becomes a :class:`~sparseety.errors.StoreLockedError` that names
  the owner, recorded in ``<path>/sparseety-owner.json`` when a SparSEEty process opens it. In the
  embedded stack that owner is the store process (``sparseety store``), and everything else reaches
  the data through its HTTP API (:func:`sparseety.api.client.open_queries`).

:func:`sparseety.sinks.clickhouse.client.Store.open` imports this module only for a chDB DSN.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sparseety.errors import StoreError, StoreLockedError
from sparseety.lifecycle import pid_alive

from .engine import Engine, Target

OWNER_FILE = "sparseety-owner.json"


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


class EmbeddedEngine(Engine):
    """The one engine of a chDB path in this process, shared by every store opened on it."""

    def __init__(self, target: Target, owner: str) -> None:
        import clickhouse_connect

        assert target.path is not None
        path = target.path
        self.refs = 0

        def connect() -> Any:
            _check_unlocked(path)
            try:
                return clickhouse_connect.get_client(dsn=f"chdb://{path}")
            except Exception as exc:
                if "Error initializing EmbeddedServer" in str(exc):
                    raise locked_error(path, exc) from exc
                raise StoreError(f"cannot open the embedded store at {path}: {exc}", path=str(path)) from exc

        def reader() -> Any:
            # another handle of the engine this process already runs: no lock to check
            return clickhouse_connect.get_client(dsn=f"chdb://{path}")

        super().__init__(target, connect, owner, reader=reader)

    def release(self) -> None:
        """The last store of the path closes the engine and removes this process's owner record."""
        assert self.target.path is not None
        with _engines_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            _engines.pop(str(self.target.path), None)
            owner = read_owner(self.target.path)
            if owner and owner.get("pid") == os.getpid():
                with contextlib.suppress(OSError):
                    (self.target.path / OWNER_FILE).unlink()
        self.close()


_engines: dict[str, EmbeddedEngine] = {}
_engines_lock = threading.Lock()


def open_embedded(target: Target, owner: str) -> EmbeddedEngine:
    """The engine of ``target``'s path: this process's open one, or a new one it now owns.

    Raises:
        StoreLockedError: another process holds the path.
        StoreError: this process already has another path open, or chDB failed to start.
    """
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
            target.path.mkdir(parents=True, exist_ok=True)
            engine = EmbeddedEngine(target, owner)
            _write_owner(target.path, owner)
            _engines[key] = engine
        engine.refs += 1
        return engine


def _write_owner(path: Path, owner: str) -> None:
    record = {"pid": os.getpid(), "command": owner or " ".join(sys.argv[:3]), "opened_ns": time.time_ns()}
    with contextlib.suppress(OSError):
        (path / OWNER_FILE).write_text(json.dumps(record))
