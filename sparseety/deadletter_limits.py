"""How much of a rejected payload a dead letter keeps (one place for every component).

A dead letter carries the original bytes so the input can be inspected or replayed, but the input
may be what was wrong: a 10 MB log line dead-lettered whole exceeds the broker's message size
(``MSG_SIZE_TOO_LARGE``, the default ``message.max.bytes`` is 1 MB) and the ingest dies on the
dead letter instead of the line. So the bytes are cut to :data:`MAX_DEAD_LETTER_BYTES`, well under
that limit, and the reason then names the original length and its SHA-256, which identify the
input without carrying it.
"""

from __future__ import annotations

import hashlib

#: Bytes of the original payload a dead letter keeps (the broker's default limit is 1 MiB).
MAX_DEAD_LETTER_BYTES = 64 * 1024


def cap_raw(value: bytes | None, reason: str, limit: int = MAX_DEAD_LETTER_BYTES) -> tuple[bytes | None, str]:
    """``(value, reason)`` with ``value`` cut to ``limit`` bytes; a cut one is noted in the reason
    with the original length and SHA-256."""
    if value is None or len(value) <= limit:
        return value, reason
    digest = hashlib.sha256(value).hexdigest()
    note = f"[value truncated to {limit} of {len(value)} bytes; sha256 {digest}]"
    return bytes(value[:limit]), f"{reason} {note}"
