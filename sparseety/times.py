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
_DIGITS = 15  # more digits than any bounded duration needs; stops int() on a megabyte of digits

#: Times are stored as Int64 ns since the epoch, so a time outside [1970, 2262) cannot be compared
#: with them: ClickHouse wraps it around Int64 (``since=9999-12-31`` would select every row).
MIN_NS = 0
MAX_NS = 2**63 - 1
#: The longest duration ``since``/``until`` may go back (about 200 years: before 1970 anyway).
MAX_DURATION = timedelta(days=200 * 366)
#: A time bucket between one second and a (leap) year.
MIN_BUCKET = timedelta(seconds=1)
MAX_BUCKET = timedelta(days=366)


def parse_duration(text: str, *, name: str = "duration", longest: timedelta = MAX_DURATION) -> timedelta:
    """``90s``, ``15m``, ``1h``, ``2d``, ``1w`` -> a positive timedelta of at most ``longest``.

    Raises:
        QueryError: anything else, zero, or longer than ``longest`` (``name`` says which parameter).
    """
    m = _DURATION.match(text.strip())
    if m is None:
        raise QueryError(
            f"bad {name} {text!r}: not a duration; use a number and s, m, h, d or w (e.g. 15m, 1h)"
        )
    digits = m.group(1).lstrip("0")
    seconds = int(digits[:_DIGITS] or "0") * _UNIT_S[m.group(2)]
    if seconds <= 0:
        raise QueryError(f"bad {name} {text!r}: must be positive")
    if len(digits) > _DIGITS or seconds > longest.total_seconds():
        raise QueryError(f"bad {name} {text!r}: at most {_human(longest)}")
    return timedelta(seconds=seconds)


def parse_bucket(text: str, *, name: str = "bucket") -> timedelta:
    """A time bucket (``1h``) between :data:`MIN_BUCKET` and :data:`MAX_BUCKET`.

    Raises:
        QueryError: not a duration, or out of that range.
    """
    d = parse_duration(text, name=name, longest=MAX_BUCKET)
    if d < MIN_BUCKET:  # pragma: no cover - the smallest unit is a second, kept for a finer one
        raise QueryError(f"bad {name} {text!r}: at least {_human(MIN_BUCKET)}")
    return d


def check_ns(ns: int, *, name: str, given: str | None = None) -> int:
    """``ns`` when it is a time the store can compare (1970 to 2262), else a QueryError.

    ``given`` is what the caller typed, when it was not ``ns`` itself.
    """
    if not MIN_NS <= ns <= MAX_NS:
        raise QueryError(
            f"bad {name} {given if given is not None else ns}: times must lie between 1970-01-01 "
            f"and 2262-04-11 "
            f"({MIN_NS} to {MAX_NS} ns since the epoch)"
        )
    return ns


def _human(d: timedelta) -> str:
    return f"{d.days} days" if d.days else f"{int(d.total_seconds())} seconds"


def parse_time(text: str, *, now_ns: int, name: str) -> int:
    """An ISO-8601 time (naive = UTC), ``now``, or a duration ago (``15m``, ``2h``) -> wall ns.

    Raises:
        QueryError: none of those, or a time outside 1970 to 2262 (``name`` says which parameter).
    """
    t = text.strip()
    if t.lower() == "now":
        return now_ns
    if _DURATION.match(t):
        ago = parse_duration(t, name=name)
        return check_ns(now_ns - ago // timedelta(microseconds=1) * 1000, name=name, given=repr(text))
    try:
        return check_ns(to_ns(datetime.fromisoformat(t.replace("Z", "+00:00"))), name=name, given=repr(text))
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
