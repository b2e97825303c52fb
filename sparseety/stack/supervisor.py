"""The embedded stack on one machine: broker, assembler worker(s), store process (sink + API).

``Stack.up()`` starts what is not running, in dependency order, and waits until each part is
healthy (each writes ``<data dir>/run/<role>-<pid>.ready`` once ready); ``down()`` stops them in
reverse order (the store last, so it flushes what the workers sent); ``status()`` says what runs.
Every part is a separate process with a pid file under ``<data dir>/run`` and a log under
``<data dir>/logs``; children get the configuration through ``SPARSEETY_*`` variables, so ``up``,
``status`` and ``down`` from different shells agree as long as they use the same configuration
(data dir).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sparseety.broker import EmbeddedBroker, port_is_free
from sparseety.config import Config, to_env
from sparseety.errors import SparseetyError
from sparseety.lifecycle import clear_ready, pid_alive, ready_file, terminate
from sparseety.waiting import Readiness

Progress = Callable[[str], None]

#: How long a worker or store that outlived the broker gets to stop (it cannot reach Kafka, so
#: its shutdown only flushes what it holds locally).
ORPHAN_STOP_S = 20.0


class StackError(SparseetyError):
    """A part of the embedded stack did not start, or is unhealthy."""


@dataclass(frozen=True)
class PartStatus:
    """One row of ``sparseety status``."""

    name: str
    state: str  # running, ready, stopped, unhealthy
    pid: int | None
    endpoint: str
    log: Path


class Stack:
    """The embedded stack described by ``cfg`` (its data dir holds pids, logs and the store).

    Args:
        cfg: Configuration; ``kafka.bootstrap`` is replaced by the embedded broker's address.
        workers: How many assembler workers ``up`` runs (one consumer group).
    """

    def __init__(self, cfg: Config, workers: int = 1) -> None:
        broker = EmbeddedBroker(cfg)
        self.broker = broker
        self.cfg = broker.client_config()
        self.workers = workers
        self.run_dir = self.cfg.data_path / "run"
        self.log_dir = self.cfg.data_path / "logs"

    # --- parts ----------------------------------------------------------------------------

    def _worker_names(self) -> list[str]:
        known = sorted(p.stem for p in self.run_dir.glob("worker-*.pid")) if self.run_dir.exists() else []
        wanted = [f"worker-{i}" for i in range(self.workers)]
        return sorted(set(known) | set(wanted))

    def started_parts(self) -> list[str]:
        """The workers and store that ``up`` started and no ``down`` stopped (their pid files),
        alive or not: the parts a broker restart leaves on a log that no longer exists."""
        return [n for n in [*self._worker_names(), "store"] if self._pid_file(n).exists()]

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _pid(self, name: str) -> int | None:
        try:
            pid = int(self._pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    @property
    def api_url(self) -> str:
        host = self.cfg.api.host if self.cfg.api.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.cfg.api.port}"

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update(to_env(self.cfg))
        env.update(extra_env or {})
        with open(self._log(name), "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "sparseety.cli", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives the `sparseety up` that started it
            )
        self._pid_file(name).write_text(str(proc.pid))
        return proc.pid

    def _ready(self, role: str, pid: int) -> bool:
        """Whether process ``pid`` announced readiness (``sparseety.lifecycle.ready_file``)."""
        return ready_file(self.cfg.data_path, role, pid).exists()

    def _store_ready(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.api_url}/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        def failed(how: str) -> StackError:
            return StackError(
                f"{name} {how}; see {self._log(name)}, then run `sparseety down && sparseety up`",
                part=name,
            )

        Readiness(
            ready,
            timeout_s=timeout_s,
            interval_s=0.3,
            exited=lambda: self._pid(name) is None,
            on_exit=lambda: failed("exited during start"),
            on_timeout=lambda: failed(f"not ready after {timeout_s:.0f} s"),
        ).wait()

    # --- lifecycle ---------------------------------------------------------------------------

    def up(self, progress: Progress = lambda _: None, timeout_s: float = 180.0) -> list[PartStatus]:
        """Start every part that is not running and wait until all are healthy.

        Raises:
            StackError: a part exited or stayed unhealthy (its log path is in the message).
            BrokerError, PortInUseError: the broker could not start.
        """
        if self.broker.pid() is None:
            self._stop_orphans(progress)
        already = self.broker.status().ready
        progress(f"broker: {'already running' if already else 'starting'} on {self.broker.bootstrap}")
        self.broker.start()
        if self._pid("store") is None:
            if not port_is_free(self.cfg.api.host, self.cfg.api.port):
                raise StackError(
                    f"port {self.cfg.api.port} (API) is taken by another process; set api.port",
                    port=self.cfg.api.port,
                )
            progress("store: starting the sink and the HTTP API (owns the ClickHouse store)")
            pid = self._spawn("store", ["store"])
            self._wait("store", lambda: self._ready("store", pid) and self._store_ready(), timeout_s)
        for name in [f"worker-{i}" for i in range(self.workers)]:
            if self._pid(name) is not None:
                continue
            progress(f"{name}: starting the assembler")
            port = self.cfg.worker.metrics_port
            extra = {"SPARSEETY_WORKER_METRICS_PORT": str(port + int(name.split("-")[1]))} if port else {}
            pid = self._spawn(name, ["worker"], extra)
            self._wait(name, lambda p=pid: self._ready("worker", p), timeout_s)  # type: ignore[misc]
        return self.status()

    def _stop_orphans(self, progress: Progress) -> None:
        """Stop workers and the store that outlived the broker, before a new one starts.

        The embedded broker keeps topics, committed offsets and the workers' changelogs in memory
        (``sparseety.broker``), so a new one starts empty. A worker or store still running holds
        positions and state for a log that no longer exists: left alone, the worker hung on its
        lost changelog and folded nothing more (issue 12). Stopped now, while no
        broker runs, they cannot commit their old positions into the new one; started afresh
        below, they read the new log from its start, which is where the producers' journals
        drain. The store flushes what it buffered to ClickHouse on the way out.
        """
        stale = [n for n in [*self._worker_names(), "store"] if self._pid(n) is not None]
        if not stale:
            return
        progress(
            "broker: not running, and its in-memory topics, offsets and changelogs are gone; "
            f"restarting {', '.join(stale)} so they start on the new broker's log"
        )
        pids = {name: pid for name in stale if (pid := self._pid(name)) is not None}
        # all at once: none can reach Kafka, so no order matters and the waits overlap
        with ThreadPoolExecutor(max_workers=len(pids) or 1) as pool:
            outcomes = pool.map(lambda pid: terminate(pid, ORPHAN_STOP_S, group=True), pids.values())
            stopped = dict(zip(pids, outcomes, strict=True))
        for name, pid in pids.items():
            if not stopped[name]:
                progress(f"{name}: did not stop in {ORPHAN_STOP_S:.0f} s, killed it")
                # a killed process leaves its readiness file behind
                clear_ready(ready_file(self.cfg.data_path, name.split("-")[0], pid))
        for name in stale:
            self._pid_file(name).unlink(missing_ok=True)

    def down(self, progress: Progress = lambda _: None, timeout_s: float = 30.0) -> list[str]:
        """Stop every part (workers, then the store, then the broker); return what was stopped."""
        stopped = []
        for name in [*self._worker_names(), "store"]:
            pid = self._pid(name)
            if pid is None:
                self._pid_file(name).unlink(missing_ok=True)
                continue
            progress(f"{name}: stopping (pid {pid})")
            if not terminate(pid, timeout_s, group=True):
                progress(f"{name}: did not stop in {timeout_s:.0f} s, killed it")
            self._pid_file(name).unlink(missing_ok=True)
            stopped.append(name)
        progress("broker: stopping (its in-memory topics are gone afterwards)")
        if self.broker.stop():
            stopped.append("broker")
        return stopped

    def status(self) -> list[PartStatus]:
        """What runs and whether it is healthy."""
        b = self.broker.status()
        rows = [
            PartStatus(
                "broker",
                "ready" if b.ready else ("unhealthy" if b.running else "stopped"),
                b.pid,
                f"kafka://{b.bootstrap}",
                b.log,
            )
        ]
        pid = self._pid("store")
        state = "stopped" if pid is None else ("ready" if self._store_ready() else "unhealthy")
        rows.append(
            PartStatus("store", state, pid, f"{self.api_url} ({self.cfg.clickhouse_dsn})", self._log("store"))
        )
        for name in self._worker_names():
            pid = self._pid(name)
            rows.append(
                PartStatus(
                    name,
                    # ready: its Faust worker started and consumes (its readiness file); a live
                    # worker without one is starting, or lost its broker and is about to exit
                    "stopped" if pid is None else ("ready" if self._ready("worker", pid) else "unhealthy"),
                    pid,
                    f"group {self.cfg.worker.app_id}",
                    self._log(name),
                )
            )
        return rows
