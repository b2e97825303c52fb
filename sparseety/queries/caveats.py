"""What a request's answer says about the fold's caveats (streams/caveats.py), pure.

A stored request whose ``source_history_lost_ts_ns`` is set read cached prompt blocks whose source
the fold could not know: the engine's KV history was lost with a seq gap (the broker lost its
log, or a fresh worker met the engine mid-stream). Its answer (``query request``,
``/api/v1/requests/{id}``, the dashboard's timelines) shows those segments' source as
``source unknown (history lost at <time>)`` instead of nothing, and its cost says that amortized
fell back: with no cache lifetime to share, those positions are charged as read, as in actual.
A segment whose source is unknown on a request without the flag stays null (not observed).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

#: How a cached segment's source reads when it was lost with the history (``{at}``: ISO time).
SOURCE_LOST = "source unknown (history lost at {at})"


def iso_ns(ns: int) -> str:
    """Wall-clock ns as ISO-8601 UTC to the millisecond."""
    at = datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec="milliseconds")
    return at.replace("+00:00", "Z")


def note_lost_sources(request: dict[str, Any]) -> dict[str, Any]:
    """Mark ``request``'s cached segments of unknown source when its history was lost (in place).

    Sets their ``source_request_uid`` to :data:`SOURCE_LOST` (as a tenant-scoped reader's hidden
    source reads ``another tenant``) and adds ``amortized_note``: how many cached tokens
    amortized charged as read, as actual does, for want of a source. A request without the
    flag is returned unchanged.
    """
    lost = int(request.get("source_history_lost_ts_ns") or 0)
    if not lost:
        return request
    note = SOURCE_LOST.format(at=iso_ns(lost))
    unknown = 0
    for seg in request.get("segments", ()):
        if seg.get("status") == "cached" and seg.get("source_request_uid") is None:
            seg["source_request_uid"] = note
            unknown += int(seg["end"]) - int(seg["start"])
    request["amortized_note"] = (
        f"fell back to actual for {unknown} cached tokens: {note}" if unknown else "no fallback"
    )
    return request
