"""A model server as a child process: ``<python> -m <module> --port N ...`` in its own process
group, ready when its ``/health`` answers 200, stopped with SIGINT (the engine drains and the
SparSEEty producer flushes) and then its whole group killed. The SGLang server of
``sparseety demo --engine sglang`` (:mod:`.sglang_engine`) is one; the e2e tests start vLLM's
and SGLang's servers through it too."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import httpx

from sparseety.errors import ModelServerError
from sparseety.waiting import Readiness


def _free_port() -> int:
    """A TCP port nothing on loopback listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """Start ``command`` with ``--port <free port>`` appended and wait until it is healthy.

    Args:
        command: The server command (its arguments may follow ``--port``).
        env: The child's whole environment.
        log: Where its output goes (appended).
        what: Its name in errors ("the SGLang server").
        cwd: Its working directory.
        timeout_s: How long it may take to answer ``/health``.

    Raises:
        ModelServerError: it exited, or was not healthy in time (the message ends with its log's
            tail).
    """

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        log: Path,
        *,
        what: str,
        cwd: Path | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.what = what
        cmd = [*command, "--port", str(self.port)]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )

        def exited() -> ModelServerError:
            return ModelServerError(
                f"{what} exited with {self.proc.returncode}; see {log}:\n{self.tail()}",
                what=what,
                log=str(log),
                returncode=self.proc.returncode,
            )

        def not_ready() -> ModelServerError:
            self.close()
            return ModelServerError(
                f"{what} was not ready after {timeout_s:.0f} s; see {log}:\n{self.tail()}",
                what=what,
                log=str(log),
                returncode=None,
            )

        Readiness(
            self.healthy,
            timeout_s=timeout_s,
            interval_s=1.0,
            exited=lambda: self.proc.poll() is not None,
            on_exit=exited,
            on_timeout=not_ready,
        ).wait()

    def healthy(self) -> bool:
        """Whether its ``/health`` answers 200."""
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        return False

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of its log."""
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    #: The signal that asks this server for its graceful shutdown (its engine drains and the
    #: SparSEEty producer sends EngineStopped and flushes).
    stop_signal = signal.SIGINT

    def close(self, timeout_s: float = 40.0) -> None:
        """:attr:`stop_signal`, then the process group is killed."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, self.stop_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
