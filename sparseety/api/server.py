"""Serving the API on the caller's event loop, and the endpoint file local clients read.

:class:`ApiServer` runs uvicorn as a task of the running loop — beside the sink loop in
``sparseety store``, or alone in ``sparseety api`` — and leaves signal handling to its host. It
binds its socket itself, so port 0 works (tests), and then records where it listens in
``<data_dir>/api/endpoint.json`` for the CLI (:mod:`sparseety.api.client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from sparseety.api.auth import api_dir, is_loopback
from sparseety.api.guard import install_redaction
from sparseety.errors import SparseetyError
from sparseety.waiting import Readiness

log = logging.getLogger("sparseety.api")
ENDPOINT_FILE = "endpoint.json"


class ApiServerError(SparseetyError):
    """The API could not start (address in use, startup failed)."""


class _HostedServer(uvicorn.Server):
    """uvicorn inside a host that owns the signals (:func:`sparseety.sinks.consumer.serve` in
    ``sparseety store``, or :func:`run_api`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ApiServerError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", host=host, port=port
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def client_url(host: str, port: int) -> str:
    """Where a local client reaches a server bound to ``host`` (wildcards -> loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def write_endpoint(data_path: Path, url: str) -> None:
    """Record where this process serves the API."""
    folder = api_dir(data_path)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"url": url, "pid": os.getpid(), "started_ns": time.time_ns()}
    tmp = folder / f".{ENDPOINT_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / ENDPOINT_FILE)


def read_endpoint(data_path: Path) -> dict[str, Any] | None:
    """The endpoint record of the data dir's API process, if one was left."""
    try:
        data = json.loads((api_dir(data_path) / ENDPOINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("url"), str) else None


def remove_endpoint(data_path: Path) -> None:
    """Remove the endpoint record if this process wrote it."""
    found = read_endpoint(data_path)
    if found and found.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            (api_dir(data_path) / ENDPOINT_FILE).unlink()


class ApiServer:
    """The API app served on the running loop.

    Args:
        app: The ASGI app (:func:`sparseety.api.app.create_api`).
        host, port: Where to listen (port 0: any free port).
        data_path: Data directory for the endpoint record (None: write none).
        log_level: uvicorn's log level.
        access_log: Log every request (paths and status; never headers, and credentials in
            the query string as ``***``).
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str,
        port: int,
        data_path: Path | None = None,
        log_level: str = "warning",
        access_log: bool = False,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.data_path = data_path
        if access_log:
            install_redaction()  # paths carry ?password= for ClickHouse clients
        self.config = uvicorn.Config(
            app, lifespan="off", log_level=log_level, access_log=access_log, log_config=None
        )
        self.server = _HostedServer(self.config)
        self._task: asyncio.Task[None] | None = None
        self.url = ""

    async def start(self, timeout_s: float = 30.0) -> str:
        """Listen and serve; returns the URL once requests are accepted.

        Raises:
            ApiServerError: the address is taken, or uvicorn did not start.
        """
        sock = _bind(self.host, self.port)
        port = sock.getsockname()[1]
        task = self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name="sparseety-api")

        def failed() -> ApiServerError:
            sock.close()
            exc = task.exception() if not task.cancelled() else None
            return ApiServerError(f"the API did not start: {exc!r}")

        await Readiness(
            lambda: self.server.started,
            timeout_s=timeout_s,
            interval_s=0.02,
            exited=task.done,
            on_exit=failed,
            on_timeout=lambda: ApiServerError(f"the API did not start within {timeout_s:.0f} s"),
        ).wait_async()
        self.url = client_url(self.host, port)
        if self.data_path is not None:
            write_endpoint(self.data_path, self.url)
        exposure = "loopback only" if is_loopback(self.host) else "on the network"
        log.warning("sparseety api: serving on %s (%s); docs at %s/docs", self.url, exposure, self.url)
        return self.url

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, finish open requests (up to ``timeout_s``), forget the endpoint."""
        if self.data_path is not None:
            remove_endpoint(self.data_path)
        task, self._task = self._task, None
        if task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            self.server.force_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 2.0)
