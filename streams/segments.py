"""Run-length encoded token timelines.

A timeline is a list of segments ``[start, end, kind, status, draft, source, fate]`` in position
order,
covering positions without gaps. Adjacent segments with equal attributes merge, so state stays
O(segments), not O(tokens): a 128k-token prompt served half from cache is two segments.

Plain lists (not objects) because the assembler touches them on every engine step and stores
them as JSON.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

# Segment fields (list indices).
START, END, KIND, STATUS, DRAFT, SOURCE, FATE = range(7)

PROMPT, OUTPUT = "prompt", "output"

# Axis 1, how a position was obtained (TokenSegment.status; docs/streams.md has the table).
COMPUTED = "computed"
CACHED = "cached"
RECOMPUTED_PREEMPTION = "recomputed_after_preemption"
RECOMPUTED_EVICTION = "recomputed_after_eviction"
NOT_COMPUTED = "not_computed"  # the request ended (aborted) before computing it
EXTERNAL_KV = "external_kv"  # loaded by a KV connector from outside this engine (P/D decode side)
# Old symbols, kept so records written before the two-axis model still decode; never written now.
RECOMPUTED, SKIPPED, EVICTED = "recomputed", "skipped", "evicted"

# Axis 2, what became of its KV while the request ran (TokenSegment.kv_fate).
KEPT = "kept"
WINDOW_RELEASED = "window_released"
FATE_SKIPPED = "skipped"  # still held, outside the attention window at finish: never attended again

Segment = list  # [start, end, kind, status, draft, source, fate]


def _same(a: Segment, b: Segment) -> bool:
    return (
        a[KIND] == b[KIND]
        and a[STATUS] == b[STATUS]
        and a[DRAFT] == b[DRAFT]
        and a[SOURCE] == b[SOURCE]
        and a[FATE] == b[FATE]
    )


def append(
    segments: list[Segment],
    length: int,
    kind: str,
    status: str,
    draft: bool = False,
    source: str | None = None,
) -> None:
    """Append ``length`` positions after the last segment, merging with it when attributes match."""
    if length <= 0:
        return
    if segments:
        last = segments[-1]
        if (
            last[KIND] == kind
            and last[STATUS] == status
            and last[DRAFT] == draft
            and last[SOURCE] == source
            and last[FATE] == KEPT
        ):
            last[END] += length
            return
        start = last[END]
    else:
        start = 0
    segments.append([start, start + length, kind, status, draft, source, KEPT])


def total(segments: list[Segment]) -> int:
    """Positions covered."""
    return segments[-1][END] if segments else 0


def _split_at(segments: list[Segment], pos: int) -> int:
    """Ensure a segment boundary at ``pos``; return the index of the first segment starting there."""
    if not segments or pos >= segments[-1][END]:
        return len(segments)
    i = bisect_right([s[START] for s in segments], pos) - 1
    seg = segments[i]
    if seg[START] == pos:
        return i
    tail = [pos, seg[END], seg[KIND], seg[STATUS], seg[DRAFT], seg[SOURCE], seg[FATE]]
    seg[END] = pos
    segments.insert(i + 1, tail)
    return i + 1


def _merge_around(segments: list[Segment], lo: int, hi: int) -> None:
    """Merge equal neighbours in segments[lo-1 : hi+1]."""
    i = max(lo - 1, 0)
    hi = min(hi + 1, len(segments) - 1)
    while i < hi:
        if _same(segments[i], segments[i + 1]):
            segments[i][END] = segments[i + 1][END]
            del segments[i + 1]
            hi -= 1
        else:
            i += 1


def assign(
    segments: list[Segment],
    start: int,
    end: int,
    status: str,
    *,
    keep_source: bool = False,
    field: int = STATUS,
) -> list[tuple[int, int, str]]:
    """Set the status (or, with ``field=FATE``, the KV fate) of positions [start, end).

    Args:
        keep_source: keep each segment's source (otherwise cleared: a recomputed block no longer
            came from its cache source).

    Returns:
        The previous statuses of the range as ``(start, end, status)`` runs, so callers can count
        what changed.
    """
    end = min(end, total(segments))
    if start >= end:
        return []
    i = _split_at(segments, start)
    j = _split_at(segments, end)
    before = []
    for seg in segments[i:j]:
        before.append((seg[START], seg[END], seg[field]))
        seg[field] = status
        if not keep_source and field == STATUS:
            seg[SOURCE] = None
    _merge_around(segments, i, j - 1)
    return before


def count_by_status(segments: Iterable[Segment]) -> dict[str, int]:
    """Positions per status."""
    out: dict[str, int] = {}
    for seg in segments:
        out[seg[STATUS]] = out.get(seg[STATUS], 0) + seg[END] - seg[START]
    return out


def count_by_fate(segments: Iterable[Segment]) -> dict[str, int]:
    """Positions per KV fate."""
    out: dict[str, int] = {}
    for seg in segments:
        out[seg[FATE]] = out.get(seg[FATE], 0) + seg[END] - seg[START]
    return out


def upgrade(segments: list[Segment]) -> list[Segment]:
    """Segments of a state persisted before the KV-fate axis existed get fate ``kept``."""
    for seg in segments:
        if len(seg) == FATE:
            seg.append(KEPT)
    return segments


def to_records(segments: Iterable[Segment]) -> list[dict[str, object]]:
    """Segments as TokenSegment Avro records."""
    return [
        {
            "start": s[START],
            "end": s[END],
            "kind": s[KIND],
            "status": s[STATUS],
            "draft_accepted": s[DRAFT],
            "source_request_uid": s[SOURCE],
            "kv_fate": s[FATE],
        }
        for s in segments
    ]
