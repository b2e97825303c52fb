"""What crosses between an engine process and its relay (:mod:`.relay`): named frames on a byte
stream (a pipe to a child relay, or a Unix socket to a sidecar).

A frame is a 4-byte little-endian length and a pickle of one of this module's dataclasses. Both
ends run this package, so pickle is the format; the relay only ever reads frames from the engine
that started it or connected to it (a pipe, or a socket whose directory the operator owns), never
from the network.

Engine to relay: one :class:`Hello`, then :class:`Batch` frames. A batch is columnar (one list
per field) so that pickling it costs a few C-level list copies, not one Python object per event.
Relay to engine: :class:`Report` frames, about once a second and once more when the relay ends.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from sparseety.errors import SparseetyError

_LEN = struct.Struct("<I")
#: The largest frame either side accepts (a batch holds at most 1,024 hand-offs).
MAX_FRAME_BYTES = 256 * 1024 * 1024

#: payload_type of a hand-off whose builder failed in the engine (the relay drops it as
#: ``unencodable``, as the in-process emitter does).
FAILED = ""


class WireError(SparseetyError):
    """A frame that could not be read: the other side went away mid-frame or sent garbage."""


@dataclass(frozen=True, slots=True)
class Totals:
    """A stream's delivery totals since its epoch started (the Heartbeat's counters)."""

    produced: int = 0
    spilled: int = 0
    drained: int = 0
    restarts: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame of a connection: whose stream this is.

    Args:
        engine_name: The Kafka key.
        engine_id: ``engine_name@epoch``.
        stream: ``core`` or ``worker-<rank>``.
        config: The engine's configuration (``Config.model_dump()``); a child relay uses it, a
            sidecar keeps its own.
        baseline: Totals an earlier relay of this stream reached (a relay restart), so that
            heartbeats keep counting since the epoch started.
    """

    engine_name: str
    engine_id: str
    stream: str
    config: dict[str, Any]
    baseline: Totals = Totals()


@dataclass(frozen=True, slots=True)
class Batch:
    """Hand-offs built in the engine, one list per field (index ``i`` is one hand-off).

    ``counts[i]`` is 0 for a single event (``payloads[i]`` is one ``(payload_type, payload)``)
    or the number of events of an ``emit_many`` (``payloads[i]`` is a list of them). A
    ``(HEARTBEAT, None)`` payload asks the relay to fill in its counters; ``(FAILED, None)`` is
    an event whose builder raised. ``queued`` is the engine-side hand-off's events waiting;
    ``dropped_by`` the events the engine side lost so far, by reason (``queue_full``: refused
    by its hand-off; ``relay_lost``: handed to a relay that died).
    """

    seqs: list[int]
    counts: list[int]
    ts_ns: list[int]
    mono_ns: list[int]
    payloads: list[Any]
    queued: int
    dropped_by: dict[str, int]


@dataclass(frozen=True, slots=True)
class Report:
    """The relay's state, sent back to the engine.

    Args:
        next_seq: One past the highest seq the relay has routed (encoded and owed to Kafka or
            the journal, or dropped with a reason).
        idle: Everything routed so far is acknowledged by Kafka.
        totals: Delivery totals since the epoch started.
        memory_bytes / journal_bytes: What the relay holds for Kafka, in memory and on disk.
        final: The relay is ending (its last report).
        recoveries: Times Kafka took events again after the link was down or stalled (the
            engine side then announces its configuration again).
    """

    next_seq: int
    idle: bool
    totals: Totals
    memory_bytes: int = 0
    journal_bytes: int = 0
    final: bool = False
    recoveries: int = 0


Frame = Hello | Batch | Report


def encode(frame: Frame) -> bytes:
    """One frame's bytes: length prefix and pickle."""
    body = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def write_fd(fd: int, frame: Frame) -> None:
    """Write one whole frame to a blocking file descriptor (the GIL is released while the pipe
    is full). Raises ``BrokenPipeError`` or ``OSError`` when the other side is gone."""
    view = memoryview(encode(frame))
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read(stream: BinaryIO) -> Frame | None:
    """The next frame, or None at a clean end of stream (between frames)."""
    head = stream.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        raise WireError("stream ended inside a frame header")
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise WireError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte bound")
    body = stream.read(size)
    if len(body) < size:
        raise WireError(f"stream ended inside a {size}-byte frame ({len(body)} read)")
    frame = pickle.loads(body)
    if not isinstance(frame, Hello | Batch | Report):
        raise WireError(f"not a relay frame: {type(frame).__name__}")
    return frame
