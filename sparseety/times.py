"""Reading times and durations people type: ISO-8601, ``now``, or a duration ago (``15m``, ``2h``).

One parser for the API's ``since``/``until``, the query CLI's ``--since``/``--until`` and replay
bounds, so all three accept the same text.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from sparseety.errors import QueryError

_DURATION = re.compile(r"^(\d+)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``1h``, ``2d``, ``1w`` -> timedelta.

    Raises:
        QueryError: anything else.
    """
    m = _DURATION.match(text.strip())
    if m is None:
        raise QueryError(f"bad duration {text!r}: use a number and s, m, h, d or w (e.g. 15m, 1h)")
    return timedelta(seconds=int(m.group(1)) * _UNIT_S[m.group(2)])


def parse_time(text: str, *, now_ns: int, name: str) -> int:
    """An ISO-8601 time (naive = UTC), ``now``, or a duration ago (``15m``, ``2h``) -> wall ns.

    Raises:
        QueryError: none of those (``name`` says which parameter).
    """
    t = text.strip()
    if t.lower() == "now":
        return now_ns
    try:
        return now_ns - int(parse_duration(t).total_seconds() * 1e9)
    except QueryError:
        pass
    try:
        return to_ns(datetime.fromisoformat(t.replace("Z", "+00:00")))
    except ValueError:
        raise QueryError(
            f"bad {name} {text!r}: use an ISO-8601 time (2024-05-01T12:00:00Z), now, or a duration "
            f"ago such as 15m, 2h or 1d"
        ) from None


def to_ns(t: datetime | int) -> int:
    """Wall-clock ns of a datetime (naive means UTC) or an int already in ns."""
    if isinstance(t, int):
        return t
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return (t - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) * 1000
