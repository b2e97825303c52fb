"""Engines as ``sparseety status`` sees them: the producers' spill journals under the data dir,
and the engines the store has requests of.

An engine whose producer cannot reach Kafka (a wrong ``kafka.bootstrap``, a broker down) keeps
serving; within seconds its producer says so in the state file of its stream
(``delivery.json``, :mod:`sparseety.producers.delivery`), and past its memory budget it writes
its events to its disk journal, ``<spill dir>/<engine>/<stream>/``; with
``SPARSEETY_DATA_DIR`` set to the stack's data dir (the default spill dir is ``<data_dir>/spill``)
that journal is where ``sparseety status`` looks. A journal with undelivered segments is an engine
that is not reporting, whatever the store says; its lock tells whether the engine process still
runs. The store adds each engine's newest finished request, flagged when it is older than
``silent_after_s`` (which cannot tell an idle engine from a broken one: the journals and the
``SparseetyEngineSilent`` alert on the workers' heartbeat gauge can).
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseety.lifecycle import pid_alive
from sparseety.producers.delivery import DeliveryState

#: A store-side engine whose newest request finished longer ago than this is listed as silent.
SILENT_AFTER_S = 15 * 60.0


@dataclass(frozen=True)
class Journal:
    """One producer journal on disk."""

    engine: str
    stream: str
    pending_bytes: int
    oldest_ns: int  # the oldest segment's modification time: undelivered since about then
    newest_ns: int
    process_alive: bool  # a process holds the journal's lock (the engine still runs)


def _held(lock: Path) -> bool:
    """Whether a live process holds the journal's ``flock`` (taken and released here if not)."""
    try:
        with open(lock, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def journals(spill_path: Path) -> list[Journal]:
    """Every journal under ``spill_path`` that holds undelivered segments (``_unbound``, the
    journal of a producer that never learnt its engine's name, included)."""
    out: list[Journal] = []
    if not spill_path.is_dir():
        return out
    for stream_dir in sorted(p for p in spill_path.glob("*/*") if p.is_dir()):
        segments = list(stream_dir.glob("*.seg"))
        stats = []
        for seg in segments:
            with contextlib.suppress(OSError):
                stats.append(seg.stat())
        pending = sum(s.st_size for s in stats)
        if not pending:
            continue
        out.append(
            Journal(
                engine=stream_dir.parent.name,
                stream=stream_dir.name,
                pending_bytes=pending,
                oldest_ns=min(s.st_mtime_ns for s in stats),
                newest_ns=max(s.st_mtime_ns for s in stats),
                process_alive=_held(stream_dir / ".lock"),
            )
        )
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _ago(ns: int, now_ns: int) -> str:
    s = max(0.0, (now_ns - ns) / 1e9)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns / 1e9))


def engine_rows(
    journal_list: list[Journal],
    stored: list[dict[str, Any]],
    *,
    bootstrap: str,
    now_ns: int,
    silent_after_s: float = SILENT_AFTER_S,
    deliveries: Sequence[DeliveryState] = (),
) -> list[dict[str, str]]:
    """The engines table of ``sparseety status``: one row per engine (delivery problems first:
    journals, then the running engines' own states, then the store's view).

    ``bootstrap`` is the stack's own broker (what an engine that does not deliver should name).
    ``deliveries``: the running engines' own delivery states (:mod:`sparseety.producers.delivery`):
    one that is not delivering is listed as such within seconds, before anything spills.
    """
    rows: list[dict[str, str]] = []
    spilling = set()
    for j in journal_list:
        spilling.add(j.engine)
        alive = "its process runs" if j.process_alive else "no process holds it (drains at its next start)"
        rows.append(
            {
                "engine": j.engine,
                "state": "silent: not delivering",
                "last seen": f"spilling since {_when(j.oldest_ns)} ({_ago(j.oldest_ns, now_ns)})",
                "detail": f"{_size(j.pending_bytes)} undelivered in its {j.stream} journal; {alive}; "
                f"check that its SPARSEETY_KAFKA_BOOTSTRAP is this stack's broker, {bootstrap}",
            }
        )
    for d in deliveries:
        if d.delivering or not pid_alive(d.pid) or d.engine in spilling:
            continue  # a dead process's state is stale: its journal (below) says what is left
        spilling.add(d.engine)
        rows.append(
            {
                "engine": d.engine,
                "state": "silent: not delivering",
                "last seen": f"last acknowledged {_when(d.last_ack_ns)} ({_ago(d.last_ack_ns, now_ns)})",
                "detail": f"{d.waiting} events waiting in its {d.stream} stream; Kafka at {d.bootstrap} "
                f"takes none ({d.error or 'no answer'}); check that its SPARSEETY_KAFKA_BOOTSTRAP is "
                f"this stack's broker, {bootstrap}",
            }
        )
    for e in stored:
        name = str(e["engine"])
        last = int(e["last_finished_ts_ns"])
        quiet = (now_ns - last) / 1e9 > silent_after_s
        if name in spilling:
            continue
        rows.append(
            {
                "engine": name,
                "state": "silent" if quiet else "reporting",
                "last seen": f"request finished {_when(last)} ({_ago(last, now_ns)})",
                "detail": f"{e['requests']} requests stored, {e['epochs']} epoch(s)"
                + ("; idle, or stopped reporting (see its log and journal)" if quiet else ""),
            }
        )
    return rows
