"""The producer's disk journal: encoded events kept in order while Kafka is away.

A journal is a directory of segment files named by a zero-padded index. Each record is
``>II`` (key length, value length) + CRC-32 of key and value + key + value. New records go to
the highest segment; reading starts at the lowest, so the journal is one FIFO. Segments are
deleted once read past, and a segment may be written *before* the lowest one (``prepend``) so
older events found at shutdown still drain first.

Only one thread may use a journal; only one process may own its directory (an ``flock`` on
``.lock``). Records are handed to the OS on :meth:`flush` (no fsync: an engine-process crash
loses nothing written, a machine crash may lose the last moments). A record cut short by a
crash, or one that fails its CRC, ends its segment's readable part: the rest of that segment is
skipped and counted in :attr:`Journal.corrupt`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from sparseety.errors import SparseetyError
from sparseety.private_dir import private_mkdir

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">III")
_SUFFIX = ".seg"
_WIDTH = 12
#: Segments start in the middle of the index range so that ``prepend`` has room below.
_FIRST_INDEX = 10**_WIDTH // 2


class JournalError(SparseetyError):
    """The journal directory cannot be used (permissions, locked by another process)."""


class JournalFullError(SparseetyError):
    """Appending would exceed the journal's byte bound."""


def journal_dir(spill: Path, engine_name: str, stream: str) -> Path:
    """One stream's journal folder under the spill dir: ``<engine name>/<stream>``, each made
    safe as a file name."""
    return spill / _safe(engine_name) / _safe(stream)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def _seg_name(index: int) -> str:
    return f"{index:0{_WIDTH}d}{_SUFFIX}"


def _encode(key: bytes, value: bytes) -> bytes:
    crc = zlib.crc32(value, zlib.crc32(key))
    return _HEADER.pack(len(key), len(value), crc) + key + value


class Journal:
    """A bounded on-disk FIFO of ``(key, value)`` records.

    Args:
        path: Directory of the journal (created if missing).
        max_bytes: Bound on the bytes of all segments on disk.
        segment_bytes: Size at which the write segment is closed and a new one begun.

    Raises:
        JournalError: the directory cannot be created, or another process holds it.
    """

    def __init__(self, path: Path, max_bytes: int, segment_bytes: int = 16 * 1024 * 1024) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.corrupt = 0
        try:
            private_mkdir(self.path)  # inside an engine's process: its umask is not ours to set
            self._lock: BinaryIO | None = open(self.path / ".lock", "wb")  # noqa: SIM115
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise JournalError(f"journal {self.path} is in use by another process", path=str(path)) from exc
        except OSError as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc}", path=str(path)) from exc
        self._segments: list[int] = sorted(
            int(p.name[: -len(_SUFFIX)]) for p in self.path.glob(f"*{_SUFFIX}") if p.stem.isdigit()
        )
        self._sizes = {i: (self.path / _seg_name(i)).stat().st_size for i in self._segments}
        self._writer: BinaryIO | None = None
        self._writer_index: int | None = None
        self._reader: BinaryIO | None = None
        self._reader_index: int | None = None
        self._peeked: tuple[bytes, bytes, int] | None = None
        self._read_bytes = 0  # bytes of the reader segment already consumed
        # Records count is only known for what this process wrote; recovered segments count as
        # "non-empty" until read through.
        self.records_written = 0
        self.records_read = 0

    # --- state ---------------------------------------------------------------------------

    @property
    def disk_bytes(self) -> int:
        """Bytes of every segment on disk (read parts of the head segment included)."""
        return sum(self._sizes.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes not yet read."""
        return self.disk_bytes - self._read_bytes

    def __bool__(self) -> bool:
        """Whether any record is left to read."""
        return self.pending_bytes > 0

    # --- writing -------------------------------------------------------------------------

    def append(self, key: bytes, value: bytes) -> None:
        """Add a record at the tail.

        Raises:
            JournalFullError: the journal holds ``max_bytes`` already.
            OSError: the disk refused the write.
        """
        rec = _encode(key, value)
        if self.disk_bytes + len(rec) > self.max_bytes:
            raise JournalFullError(f"journal {self.path} is full ({self.max_bytes} bytes)")
        if self._writer is None or self._sizes.get(self._writer_index or -1, 0) >= self.segment_bytes:
            self._roll()
        assert self._writer is not None and self._writer_index is not None
        self._writer.write(rec)
        self._sizes[self._writer_index] += len(rec)
        self.records_written += 1

    def prepend(self, records: Iterable[tuple[bytes, bytes]]) -> int:
        """Write ``records`` (oldest first) as a new segment *before* every other one.

        For events older than what the journal holds (found in memory at shutdown).
        Returns the number written; those that do not fit under ``max_bytes`` are not written.
        """
        data = bytearray()
        n = 0
        room = self.max_bytes - self.disk_bytes
        for key, value in records:
            rec = _encode(key, value)
            if len(data) + len(rec) > room:
                break
            data += rec
            n += 1
        if not n:
            return 0
        self.flush()
        # A new head segment also has to be read before the current reader's rest: close the
        # reader; it reopens at the new head (its consumed part was deleted already or will
        # be re-read: duplicates are recognisable by event_id, losses are not).
        head = (self._segments[0] if self._segments else _FIRST_INDEX) - 1
        with open(self.path / _seg_name(head), "wb") as f:
            f.write(data)
        self._segments.insert(0, head)
        self._sizes[head] = len(data)
        if self._reader is not None:
            self._reader.close()
            self._reader = None
            self._reader_index = None
            self._read_bytes = 0
        self._peeked = None
        self.records_written += n
        return n

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.close()
        index = (self._segments[-1] + 1) if self._segments else _FIRST_INDEX
        self._writer = open(self.path / _seg_name(index), "ab")  # noqa: SIM115
        self._writer_index = index
        self._segments.append(index)
        self._sizes[index] = 0

    def flush(self) -> None:
        """Hand written records to the OS (readers in this process see them afterwards)."""
        if self._writer is not None:
            self._writer.flush()

    # --- reading -------------------------------------------------------------------------

    def peek(self) -> tuple[bytes, bytes] | None:
        """The oldest unread record, or None when the journal is empty."""
        if self._peeked is None:
            self._peeked = self._read_one()
        return None if self._peeked is None else self._peeked[:2]

    def pop(self) -> None:
        """Consume the record :meth:`peek` returned."""
        if self._peeked is None and self.peek() is None:
            return
        assert self._peeked is not None
        self._read_bytes += self._peeked[2]
        self._peeked = None
        self.records_read += 1

    def _read_one(self) -> tuple[bytes, bytes, int] | None:
        while self._segments:
            if self._reader is None:
                self._reader_index = self._segments[0]
                if self._reader_index == self._writer_index:
                    self.flush()
                self._reader = open(self.path / _seg_name(self._reader_index), "rb")  # noqa: SIM115
                self._read_bytes = 0
            assert self._reader is not None
            if self._reader_index == self._writer_index:
                self.flush()
            self._reader.seek(self._read_bytes)
            head = self._reader.read(_HEADER.size)
            if len(head) == _HEADER.size:
                klen, vlen, crc = _HEADER.unpack(head)
                body = self._reader.read(klen + vlen)
                if len(body) == klen + vlen and zlib.crc32(body[klen:], zlib.crc32(body[:klen])) == crc:
                    return body[:klen], body[klen:], _HEADER.size + klen + vlen
                if self._reader_index == self._writer_index and len(body) < klen + vlen:
                    return None  # cannot happen after flush; be safe
                self._skip_rest("corrupt record")
                continue
            if self._reader_index == self._writer_index:
                return None  # caught up with the writer
            if head:
                self._skip_rest("record cut short")
                continue
            self._drop_head()
        return None

    def _skip_rest(self, why: str) -> None:
        assert self._reader_index is not None
        self.corrupt += 1
        log.warning(
            "sparseety journal %s: %s in segment %s; skipping the rest of that segment",
            self.path,
            why,
            _seg_name(self._reader_index),
        )
        if self._reader_index == self._writer_index:
            # Never skip what this process is writing: start a fresh write segment instead.
            self._roll()
        self._drop_head()

    def _drop_head(self) -> None:
        assert self._reader is not None and self._reader_index is not None
        self._reader.close()
        index = self._reader_index
        self._reader = None
        self._reader_index = None
        self._read_bytes = 0
        if index == self._writer_index:
            return
        self._segments.remove(index)
        self._sizes.pop(index, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / _seg_name(index))

    def compact(self) -> None:
        """Delete the head segment once fully read, even if it is the write segment."""
        if self._reader_index is not None and self._reader_index == self._writer_index:
            size = self._sizes.get(self._reader_index, 0)
            if self._read_bytes >= size and self._peeked is None:
                assert self._writer is not None and self._reader is not None
                self._writer.close()
                self._reader.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / _seg_name(self._reader_index))
                self._segments.remove(self._reader_index)
                self._sizes.pop(self._reader_index, None)
                self._writer = self._reader = None
                self._writer_index = self._reader_index = None
                self._read_bytes = 0

    def close(self) -> None:
        """Flush and release the directory (records left stay for the next owner)."""
        self.flush()
        self.compact()
        for f in (self._writer, self._reader):
            if f is not None:
                f.close()
        self._writer = self._reader = None
        self.compact_empty()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def compact_empty(self) -> None:
        """Remove empty segment files (nothing to keep)."""
        for index in list(self._segments):
            if self._sizes.get(index, 0) == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / _seg_name(index))
                self._segments.remove(index)
                self._sizes.pop(index, None)
