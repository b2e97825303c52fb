"""The engine side of the relay: one thread per stream that builds the hand-off's payloads and
writes them, as :mod:`.wire` batches, to the stream's relay (:mod:`.relay`).

What stays in the engine process is what has to read the engine's objects: the builders
(``records.py``), which turn the references the hooks handed over into payload dicts whose
integer columns are already packed. Envelopes, validation, Avro encoding, librdkafka, the
ledger and the journal run in the relay. The thread sleeps on the hand-off's ``ready`` event
(no polling loop) and wakes for a heartbeat every ``producer.heartbeat_interval_s``.

Faults: a relay that dies is started again (child mode, with a growing pause when it keeps
dying) or reconnected (sidecar); a batch that could not be written is counted as dropped
(``relay_lost``), and the events a dead relay held but had not delivered leave seq gaps that
the fold marks as lost. A relay that stops reading makes the write wait, outside the GIL, while
the bounded hand-off refuses what the engine hands over (``queue_full``). The engine never waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sparseety import events as ev
from sparseety.lifecycle import name_os_thread

from . import wire
from .handoff import Handoff, Item
from .kafka_client import WarnOnce
from .ledger import EmitterStats

log = logging.getLogger("sparseety.producer")

#: Linux's fcntl to size a pipe's buffer (not in Python's fcntl module before 3.10's constant
#: is exposed on every build): a 1 MiB pipe holds a few hundred batch-256 steps.
F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20
#: How long the thread lets hand-offs gather after it wakes (bench_engine_sim.py: per-step
#: wake-ups and frames cost the engine thread more than the frames' contents at small batches).
LINGER_S = 0.005


def heartbeat_marker() -> tuple[str, None]:
    """A heartbeat whose counters the relay fills in (it knows them)."""
    return ev.HEARTBEAT, None


def _announced(payload_type: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return payload_type, payload


OnReport = Callable[[wire.Report], None]


class Relay(Protocol):
    """One connection to a relay."""

    fd: int

    @property
    def alive(self) -> bool: ...

    def finish(self, timeout: float) -> None:
        """End the stream (the relay delivers or journals the rest) and wait up to ``timeout``."""


def _read_reports(rfile: Any, on_report: OnReport, name: str) -> None:
    name_os_thread(name)
    with contextlib.suppress(OSError, ValueError, wire.WireError):
        while True:
            frame = wire.read(rfile)
            if frame is None:
                return
            if isinstance(frame, wire.Report):
                on_report(frame)


class ChildRelay:
    """A relay child process (``python -m sparseety.producers.relay``) for one stream."""

    def __init__(self, on_report: OnReport, stream: str) -> None:
        # An explicit environment, never the inherited one (env=None): the child then execs with
        # the C ``environ`` as it is at that moment, and the engine's other threads set variables
        # while it starts (vLLM does at init), which can free the array the exec is reading.
        # Observed in CI: Popen raised "[Errno 14] Bad address" for sys.executable (EFAULT from
        # execve) while a vLLM engine initialised beside the first event's shipper thread.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparseety.producers.relay"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env=dict(os.environ),
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd = self.proc.stdin.fileno()
        with contextlib.suppress(OSError):
            import fcntl

            fcntl.fcntl(self.fd, F_SETPIPE_SZ, PIPE_BYTES)
        self.reader = threading.Thread(
            target=_read_reports,
            args=(self.proc.stdout, on_report, f"sparseety-relay-in-{stream}"),
            name=f"sparseety-relay-in-{stream}",
            daemon=True,
        )
        self.reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("sparseety relay pid %d did not end in %.0f s: killed", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait(5)
        self.reader.join(2.0)


class SocketRelay:
    """A stream on a sidecar relay's Unix socket (``sparseety relay --socket``)."""

    def __init__(self, path: str, on_report: OnReport, stream: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.fd = self.sock.fileno()
        self._rfile = self.sock.makefile("rb")
        self._closed = False
        self.reader = threading.Thread(
            target=_read_reports,
            args=(self._rfile, on_report, f"sparseety-relay-in-{stream}"),
            name=f"sparseety-relay-in-{stream}",
            daemon=True,
        )
        self.reader.start()

    @property
    def alive(self) -> bool:
        return not self._closed and self.reader.is_alive()

    def finish(self, timeout: float) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        self.reader.join(timeout)  # the relay's final report, then its end of the socket
        self._closed = True
        with contextlib.suppress(OSError):
            self._rfile.close()
            self.sock.close()


def relay_factory(target: str, stream: str) -> Callable[[OnReport], Relay]:
    """How to reach the stream's relay: ``process`` (a child) or ``unix:<path>`` (a sidecar)."""
    if target.startswith("unix:"):
        path = target.removeprefix("unix:")
        return lambda on_report: SocketRelay(path, on_report, stream)
    return lambda on_report: ChildRelay(on_report, stream)


class Shipper:
    """The engine side of one stream (see the module docstring).

    Args:
        handoff: The engine thread's hand-off.
        stream: ``core`` or ``worker-<rank>``.
        connect: Opens a relay connection that calls back with its reports.
        config: The engine's configuration as a dict (a child relay uses it).
        heartbeat_s: Heartbeat interval.
        announce_s: How often :attr:`announcement` is handed over again (also after a relay
            restart, and when the relay reports that Kafka recovered).
        flush_timeout_s: How long the relay may take to deliver or journal at shutdown.
    """

    def __init__(
        self,
        handoff: Handoff,
        *,
        stream: str,
        connect: Callable[[OnReport], Relay],
        config: dict[str, Any],
        heartbeat_s: float,
        announce_s: float,
        flush_timeout_s: float,
    ) -> None:
        self.handoff = handoff
        self.stream = stream
        self._connect_fn = connect
        self._config = config
        self._hb_s = heartbeat_s
        self._announce_s = announce_s
        self.announcement: tuple[str, dict[str, Any]] | None = None
        self._announce_now = False
        self._recoveries_seen = 0
        self.flush_timeout = flush_timeout_s
        self._warn_once = WarnOnce(stream)
        self.engine_name = ""
        self.engine_id = ""
        self.report: wire.Report | None = None
        self._totals = wire.Totals()  # of the last report: a new relay's baseline
        self.relay_lost = 0
        self.relays_started = 0
        self.shipped_next = 0  # one past the highest seq written to a relay
        self.handling = False
        self._relay: Relay | None = None
        self._retry_at = 0.0
        self._backoff = 1.0
        self._started_at = 0.0
        self.bound = threading.Event()
        self.stopping = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"sparseety-shipper-{stream}", daemon=True)

    # --- called from other threads -------------------------------------------------------

    def bind(self, engine_name: str, engine_id: str) -> None:
        self.engine_name, self.engine_id = engine_name, engine_id
        self.bound.set()

    def stop(self, timeout: float | None) -> None:
        if timeout is not None:
            self.flush_timeout = timeout
        self.stopping.set()
        self.handoff.ready.set()
        self.thread.join(self.flush_timeout + 15.0)

    def _on_report(self, report: wire.Report) -> None:
        self.report = report
        self._totals = report.totals
        if report.recoveries > self._recoveries_seen:  # Kafka is back: it may have lost the log
            self._recoveries_seen = report.recoveries
            self._announce_now = True
            self.handoff.ready.set()

    @property
    def dropped_by(self) -> dict[str, int]:
        """Events lost on the engine side, by reason."""
        out = dict(self.handoff.dropped_by)
        if self.relay_lost:
            out["relay_lost"] = self.relay_lost
        return out

    @property
    def stats(self) -> EmitterStats:
        """The relay's last reported totals and the engine side's losses."""
        t = self._totals
        return EmitterStats(t.produced, t.spilled, t.drained, t.restarts, {**t.dropped_by, **self.dropped_by})

    @property
    def idle(self) -> bool:
        r = self.report
        return (
            not self.handoff
            and not self.handling
            and r is not None
            and r.idle
            and r.next_seq >= self.shipped_next
        )

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread(self.thread.name)
        handoff = self.handoff
        try:
            while not self.bound.wait(0.5):
                if self.stopping.is_set():
                    return
            next_hb = time.monotonic() + self._hb_s
            next_announce = time.monotonic() + self._announce_s
            while True:
                if not handoff:
                    handoff.ready.wait(max(0.0, min(next_hb, next_announce) - time.monotonic()))
                    # let a few steps gather: one frame, one wake-up and one write for all
                    # of them instead of one per step (the sleep holds no GIL)
                    if LINGER_S and not self.stopping.is_set():
                        time.sleep(LINGER_S)
                now = time.monotonic()
                if now >= next_hb and not self.stopping.is_set():
                    next_hb = now + self._hb_s
                    handoff.emit(heartbeat_marker)
                if (self._announce_now or now >= next_announce) and not self.stopping.is_set():
                    self._announce_now = False
                    next_announce = now + self._announce_s
                    if self.announcement is not None:
                        handoff.emit(_announced, *self.announcement)
                relay = self._relay if self._relay is not None and self._relay.alive else None
                if relay is None:
                    relay = self._reconnect()
                if relay is None:  # no relay now: the hand-off holds (and, full, refuses) events
                    if self.stopping.is_set():
                        self._lose(handoff.take(1 << 30))
                        break
                    self.stopping.wait(0.2)
                    continue
                self.handling = True
                items = handoff.take(1024)
                if items:
                    self._ship(relay, items)
                self.handling = False
                if self.stopping.is_set() and not handoff:
                    break
        except Exception:  # the thread must never die silently; events would pile up
            log.exception("sparseety producer %s/%s: shipper thread failed", self.engine_id, self.stream)
        finally:
            self.handling = False
            self._finish()
            self.done.set()

    def _reconnect(self) -> Relay | None:
        now = time.monotonic()
        if self._relay is not None:  # it died; one that keeps dying is restarted less often
            self._relay = None
            if now - self._started_at < 10.0:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 30.0)
            else:
                self._backoff = 1.0
            log.warning(
                "sparseety producer %s/%s: its relay ended; starting another in %.0f s",
                self.engine_id,
                self.stream,
                max(0.0, self._retry_at - now),
            )
        if now < self._retry_at:
            return None
        hello = wire.Hello(self.engine_name, self.engine_id, self.stream, self._config, self._totals)
        try:
            relay = self._connect_fn(self._on_report)
            wire.write_fd(relay.fd, hello)
        except OSError as exc:
            self._warn_once("relay-connect", "cannot reach the relay (retrying): %s", exc)
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            return None
        self.relays_started += 1
        self._started_at = now
        self._relay = relay
        if self.relays_started > 1:  # the dead relay may have held the announcement undelivered
            self._announce_now = True
        return relay

    def _ship(self, relay: Relay, items: list[Item]) -> None:
        seqs: list[int] = []
        counts: list[int] = []
        ts: list[int] = []
        mono: list[int] = []
        payloads: list[Any] = []
        for seq, many, ts_ns, mono_ns, build, args in items:
            try:
                built: Any = list(build(*args)) if many else build(*args)
            except Exception as exc:
                name = getattr(build, "__name__", build)
                self._warn_once(f"build:{name}", "could not build events: %r", exc)
                built = [] if many else (wire.FAILED, None)
            seqs.append(seq)
            counts.append(many)
            ts.append(ts_ns)
            mono.append(mono_ns)
            payloads.append(built)
        batch = wire.Batch(seqs, counts, ts, mono, payloads, self.handoff.queued, self.dropped_by)
        try:
            wire.write_fd(relay.fd, batch)
        except OSError:
            self._lose(items)
            return
        self.shipped_next = seqs[-1] + (counts[-1] or 1)

    def _lose(self, items: list[Item]) -> None:
        if items:
            self.relay_lost += sum(item[1] or 1 for item in items)

    def _finish(self) -> None:
        relay = self._relay
        self._relay = None
        if relay is not None:
            relay.finish(self.flush_timeout + 10.0)
