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
from typing import BinaryIO, Literal

from sparseety.producers.logs.errors import BadTraceLineError, TraceError

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
