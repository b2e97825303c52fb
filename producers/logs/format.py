"""Trace file formats: SparSEEty event recordings (length-prefixed) and format detection.

A *recording* is what ``scripts/record_fixtures.py`` writes to ``tests/data/<scenario>/events.bin``
(and ``tests/recorded.py`` reads): the engine-events topic's message values exactly as the
producers sent them (an EngineEvent each, Avro single-object encoding ``C3 01`` + fingerprint, or
Confluent registry framing ``00`` + schema id), each preceded by its length as a 4-byte big-endian
unsigned integer, in topic order. No header, no trailer; an empty file holds no events.

A *JSONL* log holds one JSON object per line (:mod:`sparseety.producers.logs.jsonl`); a *vLLM
log* is an API server's output with request logging (:mod:`sparseety.producers.logs.vllm_log`).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from sparseety import events as ev
from sparseety.errors import DecodeError

from .errors import BadTraceLineError, TraceError

if TYPE_CHECKING:
    from sparseety.serde import Decoder

Format = Literal["recording", "jsonl", "vllm-log"]
FORMATS: tuple[str, ...] = ("auto", "recording", "jsonl", "vllm-log")

LENGTH = struct.Struct(">I")
#: A single engine event is far smaller; a larger length means the file is not a recording.
MAX_RECORD_BYTES = 64 * 1024 * 1024
_SINGLE_OBJECT = b"\xc3\x01"
_REGISTRY = b"\x00"
#: A vLLM log line: ``(APIServer pid=12) INFO 12-01 04:05:08 [`` (a library may print first).
_VLLM_LINE = re.compile(
    rb"\((?:APIServer|EngineCore|Worker)[\w-]* pid=\d+\) [A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \["
)


def pack(values: Iterable[bytes]) -> bytes:
    """Values as a recording (length-prefixed concatenation)."""
    return b"".join(LENGTH.pack(len(v)) + v for v in values)


def iter_recording(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """The values of a recording as ``(record number from 1, value)``, read incrementally.

    Raises:
        BadTraceLineError: a length prefix or value is cut short, or a length is implausible
            (the rest of the file cannot be framed, so reading stops there).
    """
    n = 0
    while True:
        head = stream.read(LENGTH.size)
        if not head:
            return
        n += 1
        if len(head) < LENGTH.size:
            raise BadTraceLineError(n, f"truncated length prefix ({len(head)} of 4 bytes)")
        (size,) = LENGTH.unpack(head)
        if size > MAX_RECORD_BYTES:
            raise BadTraceLineError(n, f"record length {size} exceeds {MAX_RECORD_BYTES}: not a recording")
        value = stream.read(size)
        if len(value) < size:
            raise BadTraceLineError(n, f"truncated record ({len(value)} of {size} bytes)")
        yield n, value


def recording_events(
    stream: BinaryIO, decoder: Decoder
) -> Iterator[tuple[int, bytes | None, dict[str, Any] | BadTraceLineError]]:
    """Each record of a recording as ``(record number, its bytes, the EngineEvent it holds)``, or
    with the :class:`BadTraceLineError` that says why it holds none (raw bytes attached): not
    decodable, another record type, or an event the worker would reject. A framing error (a cut
    or implausible length) ends the stream with its error and ``None`` bytes."""
    records = iter_recording(stream)
    while True:
        try:
            item = next(records, None)
        except BadTraceLineError as exc:
            yield exc.line, None, exc
            return
        if item is None:
            return
        n, value = item
        try:
            name, record = decoder.decode(value)
            if name != ev.ENGINE_EVENT:
                raise BadTraceLineError(n, f"{name.rsplit('.', 1)[-1]} is not an engine event")
            ev.validate_engine_event(record, value)  # what the worker checks before folding
        except DecodeError as exc:
            yield n, value, BadTraceLineError(n, f"{type(exc).__name__}: {exc}", raw=value)
            continue
        except BadTraceLineError as exc:
            exc.raw = value
            yield n, value, exc
            continue
        yield n, value, record


def detect_format(head: bytes) -> Format:
    """Tell a recording from a JSONL log by the first bytes of the file.

    Raises:
        TraceError: neither (or an empty file).
    """
    if not head:
        raise TraceError("the trace file is empty")
    if len(head) > LENGTH.size and head[LENGTH.size :].startswith((_SINGLE_OBJECT, _REGISTRY)):
        return "recording"
    if head.lstrip().startswith(b"{"):
        return "jsonl"
    if _VLLM_LINE.search(head):
        return "vllm-log"
    raise TraceError(
        "unknown trace format: expected a SparSEEty recording (length-prefixed Avro engine events), "
        "JSONL (one JSON object per line) or a vLLM server log; pass the format explicitly if "
        "detection is wrong"
    )
