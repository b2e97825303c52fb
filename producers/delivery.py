"""Whether a stream's events reach Kafka: said in the engine's own log within seconds, and left in
a small file that ``sparseety status`` reads (issue 31).

Observed: with ``SPARSEETY_KAFKA_BOOTSTRAP`` pointing at a wrong port, an engine kept serving, its
events waited in librdkafka's memory (they spill to the journal only past the memory budget), the
producer logged nothing above INFO, and ``sparseety status`` said "reporting" for minutes. Now the
supervisor's loop calls :meth:`DeliveryWatch.update` once a second: events waiting and none
acknowledged for :data:`NOT_DELIVERING_AFTER_S` (or the Kafka client saying every broker is down)
is "not delivering", logged once as a WARNING (and "delivering again" once it recovers), and
written to ``<spill dir>/<engine>/<stream>/delivery.json`` (:class:`DeliveryState`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("sparseety.producer")

#: Events waiting and none acknowledged for this long: the stream is not delivering.
NOT_DELIVERING_AFTER_S = 10.0
#: The state file in a stream's journal folder.
STATE_FILE = "delivery.json"
#: The file is rewritten at least this often while nothing changes (its age shows the process lives).
REWRITE_S = 5.0


@dataclass(frozen=True)
class DeliveryState:
    """One stream's delivery, as its engine process last wrote it.

    Attributes:
        pid: The engine process.
        engine, stream: Whose events.
        delivering: Kafka acknowledges them (False: waiting ones and no acknowledgement for
            :data:`NOT_DELIVERING_AFTER_S`, or every broker down).
        waiting: Events handed over and not acknowledged yet (in flight and queued; the journal's
            are in its segments).
        last_ack_ns: Wall time of the last acknowledgement (of the stream's start before any).
        error: The Kafka client's last error ('' when none).
        bootstrap: The brokers it was told to use.
        updated_ns: When the process wrote this.
    """

    pid: int
    engine: str
    stream: str
    delivering: bool
    waiting: int
    last_ack_ns: int
    error: str
    bootstrap: str
    updated_ns: int


class DeliveryWatch:
    """Decides, from the supervisor's loop, whether one stream delivers; logs each change once
    and keeps the state file current.

    Args:
        stream: The stream's name.
        bootstrap: The Kafka brokers it produces to (named in the warning).
        clock, wall: Monotonic seconds and wall ns (tests pass their own).
    """

    def __init__(
        self,
        stream: str,
        bootstrap: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], int] = time.time_ns,
    ) -> None:
        self.stream = stream
        self.bootstrap = bootstrap
        self._clock, self._wall = clock, wall
        self.delivering = True
        self._last_ack_ns = wall()
        self._written: tuple[object, ...] = ()
        self._written_at = float("-inf")

    def update(
        self,
        *,
        engine: str,
        journal_dir: Path | None,
        waiting: int,
        last_progress: float,
        acked: bool,
        error: str = "",
        brokers_down: bool = False,
    ) -> bool:
        """Note the stream's state now; returns whether it delivers.

        Args:
            engine: The engine's name ('' before the stream is named: nothing is written).
            journal_dir: The stream's journal folder (the state file goes there).
            waiting: Events not yet acknowledged.
            last_progress: Monotonic time of the last acknowledgement (or the link's birth).
            acked: Something was acknowledged since the last call.
            error: The Kafka client's last error.
            brokers_down: The client reported every broker down since the last acknowledgement.
        """
        now = self._clock()
        if acked:
            self._last_ack_ns = self._wall()
        stalled = waiting > 0 and (brokers_down or now - last_progress > NOT_DELIVERING_AFTER_S)
        if stalled and self.delivering:
            why = (
                "its client reports every broker down"
                if brokers_down and now - last_progress <= NOT_DELIVERING_AFTER_S
                else f"none acknowledged for {now - last_progress:.0f} s"
            )
            log.warning(
                "sparseety producer %s/%s: Kafka at %s takes no events (%d waiting, %s%s); they are "
                "kept (memory, then the journal %s) and sent when it does. Check "
                "SPARSEETY_KAFKA_BOOTSTRAP; `sparseety status` lists this engine as not delivering.",
                engine or "?",
                self.stream,
                self.bootstrap,
                waiting,
                why,
                f"; {error}" if error else "",
                journal_dir or "(not named yet)",
            )
        elif not stalled and not self.delivering:
            log.warning("sparseety producer %s/%s: Kafka takes events again", engine or "?", self.stream)
        self.delivering = not stalled
        if engine and journal_dir is not None:
            self._write(engine, journal_dir, waiting, error, now)
        return self.delivering

    def _write(self, engine: str, journal_dir: Path, waiting: int, error: str, now: float) -> None:
        key = (self.delivering, waiting > 0, error)
        if key == self._written and now - self._written_at < REWRITE_S:
            return
        state = DeliveryState(
            pid=os.getpid(),
            engine=engine,
            stream=self.stream,
            delivering=self.delivering,
            waiting=waiting,
            last_ack_ns=self._last_ack_ns,
            error=error[:500],
            bootstrap=self.bootstrap,
            updated_ns=self._wall(),
        )
        with contextlib.suppress(OSError):  # the engine never fails for its status file
            journal_dir.mkdir(parents=True, exist_ok=True)
            tmp = journal_dir / f".{STATE_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps(asdict(state)))
            os.replace(tmp, journal_dir / STATE_FILE)
            self._written, self._written_at = key, now

    def close(self, journal_dir: Path | None) -> None:
        """The stream stopped: its state file goes (what it left undelivered is in its journal)."""
        if journal_dir is not None:
            with contextlib.suppress(OSError):
                (journal_dir / STATE_FILE).unlink()


def read_states(spill_path: Path) -> list[DeliveryState]:
    """Every stream's last written state under a spill folder (unreadable files are skipped)."""
    out: list[DeliveryState] = []
    if not spill_path.is_dir():
        return out
    for path in sorted(spill_path.glob(f"*/*/{STATE_FILE}")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            out.append(DeliveryState(**json.loads(path.read_text())))
    return out
