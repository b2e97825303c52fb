"""``compat.fill_holes``: what the worker folds of a delivered batch (re-deliveries dropped, skipped
offsets re-read), including the fast path for a batch of exactly the expected offsets."""

from __future__ import annotations

import asyncio
from typing import Any

from sparseety.kafka import Record
from sparseety.streams.compat import fill_holes


class FakeRefetcher:
    """Serves offsets from a log and a committed offset; records what was asked."""

    def __init__(self, committed: int | None) -> None:
        self._committed = committed
        self.fetched: list[tuple[int, int, int]] = []

    async def committed(self, partition: int) -> int | None:
        return self._committed

    async def fetch(self, partition: int, start: int, end: int) -> list[Record]:
        self.fetched.append((partition, start, end))
        return [rec(o) for o in range(start, end)]


def rec(offset: int) -> Record:
    return Record("ee", 0, offset, b"k", f"v{offset}".encode())


def run(expected: int | None, offsets: list[int], committed: int | None = None) -> tuple[list[int], Any]:
    refetcher = FakeRefetcher(committed)
    counted: list[int] = []
    batch = [rec(o) for o in offsets]
    out = asyncio.run(fill_holes(refetcher, 0, expected, batch, counted.append))  # type: ignore[arg-type]
    return [m.offset for m in out], (refetcher.fetched, counted, out is batch)


def test_the_expected_offsets_pass_as_they_are() -> None:
    assert run(5, [5, 6, 7]) == ([5, 6, 7], ([], [], True))
    assert run(None, [3, 4], committed=3) == ([3, 4], ([], [], True))
    assert run(5, []) == ([], ([], [], True))


def test_redeliveries_are_dropped_and_holes_reread() -> None:
    assert run(5, [3, 4, 5, 6])[0] == [5, 6]
    offsets, (fetched, counted, same) = run(5, [5, 8, 9])
    assert offsets == [5, 6, 7, 8, 9] and fetched == [(0, 6, 8)] and counted == [2] and not same
    offsets, (fetched, counted, _) = run(5, [7, 8])
    assert offsets == [5, 6, 7, 8] and fetched == [(0, 5, 7)] and counted == [2]
    # a duplicate next to a hole: the span alone would look whole
    offsets, (fetched, _, same) = run(5, [5, 6, 6, 8])
    assert offsets == [5, 6, 7, 8] and fetched == [(0, 7, 8)] and not same


def test_nothing_committed_starts_at_the_first_record() -> None:
    assert run(None, [4, 5], committed=None) == ([4, 5], ([], [], False))
    assert run(None, [0, 2], committed=None)[0] == [0, 1, 2]
