"""The disk journal: FIFO across segments, bounds, prepend, recovery after a crash, locking."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety.producers.journal import Journal, JournalError, JournalFullError


def drain(j: Journal, limit: int = 1 << 30) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < limit and (rec := j.peek()) is not None:
        out.append(rec[1])
        j.pop()
    return out


def test_fifo_across_segments_and_segments_deleted(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=10_000_000, segment_bytes=200)
    values = [f"v{i:04d}".encode() * 5 for i in range(100)]
    for v in values[:50]:
        j.append(b"k", v)
    assert len(list(tmp_path.glob("*.seg"))) > 3
    got = drain(j, 20)
    assert got == values[:20]
    for v in values[50:]:
        j.append(b"k", v)
    got += drain(j)
    assert got == values
    assert not j
    j.compact()
    assert len(list(tmp_path.glob("*.seg"))) <= 1


def test_bound_refuses_appends(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=1000)
    with pytest.raises(JournalFullError):
        for _ in range(100):
            j.append(b"k", b"x" * 50)
    assert 900 < j.disk_bytes <= 1000


def test_prepend_goes_first(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=10_000)
    j.append(b"k", b"new1")
    j.append(b"k", b"new2")
    assert j.prepend([(b"k", b"old1"), (b"k", b"old2")]) == 2
    assert drain(j) == [b"old1", b"old2", b"new1", b"new2"]


def test_survives_reopen_and_a_torn_tail(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=10_000)
    for i in range(5):
        j.append(b"key", f"value-{i}".encode())
    j.close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    seg.write_bytes(seg.read_bytes() + b"\x00\x00\x00\x03\x00\x00")  # a crash mid-write
    j2 = Journal(tmp_path, max_bytes=10_000)
    assert j2.peek() == (b"key", b"value-0")
    assert drain(j2) == [f"value-{i}".encode() for i in range(5)]
    assert j2.corrupt == 1
    j2.append(b"key", b"after")
    assert drain(j2) == [b"after"]


def test_corrupt_record_skips_rest_of_segment(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=10_000, segment_bytes=60)
    for i in range(6):
        j.append(b"k", f"value-{i}".encode())
    j.close()
    first = sorted(tmp_path.glob("*.seg"))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    j2 = Journal(tmp_path, max_bytes=10_000, segment_bytes=60)
    got = drain(j2)
    assert j2.corrupt == 1
    assert got and got[-1] == b"value-5"
    assert len(got) < 6


def test_one_owner_per_directory(tmp_path: Path) -> None:
    j = Journal(tmp_path, max_bytes=10_000)
    with pytest.raises(JournalError):
        Journal(tmp_path, max_bytes=10_000)
    j.close()
    Journal(tmp_path, max_bytes=10_000).close()
