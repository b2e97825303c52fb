"""Query-string parameters -> query-library arguments (pure); bad values are QueryErrors (400)."""

from __future__ import annotations

from collections.abc import Sequence

from sparseety.queries.registry import DIMENSIONS, QueryError, Scope
from sparseety.times import check_ns, parse_bucket, parse_time


def time_range(
    *,
    since: str | None,
    until: str | None,
    since_ns: int | None,
    until_ns: int | None,
    now_ns: int,
) -> tuple[int | None, int | None]:
    """The finish-time range ``[since, until)`` in ns (either end may be open).

    Raises:
        QueryError: a malformed bound, one outside 1970 to 2262, both forms of one bound, or an
            empty range.
    """
    if since is not None and since_ns is not None:
        raise QueryError("give since or since_ns, not both")
    if until is not None and until_ns is not None:
        raise QueryError("give until or until_ns, not both")
    lo = parse_time(since, now_ns=now_ns, name="since") if since is not None else since_ns
    hi = parse_time(until, now_ns=now_ns, name="until") if until is not None else until_ns
    if since_ns is not None:
        check_ns(since_ns, name="since_ns")
    if until_ns is not None:
        check_ns(until_ns, name="until_ns")
    if lo is not None and hi is not None and lo >= hi:
        raise QueryError("empty time range: since must be before until")
    return lo, hi


def scope(
    visible: tuple[str, ...] | None,
    *,
    since: str | None = None,
    until: str | None = None,
    since_ns: int | None = None,
    until_ns: int | None = None,
    now_ns: int,
) -> Scope:
    """A :class:`Scope` from the time parameters and the tenants the caller may see."""
    lo, hi = time_range(since=since, until=until, since_ns=since_ns, until_ns=until_ns, now_ns=now_ns)
    return Scope(lo, hi, visible)


def group_by(values: Sequence[str], default: str) -> tuple[str, ...]:
    """``group_by`` given repeated and/or comma-separated; checked against the dimensions.

    Raises:
        QueryError: an unknown dimension.
    """
    dims = tuple(d.strip() for v in values for d in v.split(",") if d.strip()) or (default,)
    for d in dims:
        if d not in DIMENSIONS:
            raise QueryError(f"cannot group by {d!r}: choose from {', '.join(DIMENSIONS)}")
    return dims


#: The most request ids the dashboard draws timelines for (they are fetched in one query).
MAX_DASHBOARD_REQUESTS = 100


def request_ids(values: Sequence[str]) -> list[str] | None:
    """The dashboard's ``request_id`` list (None when none given), at most
    :data:`MAX_DASHBOARD_REQUESTS`, duplicates dropped.

    Raises:
        QueryError: too many.
    """
    uids = list(dict.fromkeys(values))
    if len(uids) > MAX_DASHBOARD_REQUESTS:
        raise QueryError(
            f"too many request_id values ({len(uids)}): the dashboard draws at most "
            f"{MAX_DASHBOARD_REQUESTS} timelines"
        )
    return uids or None


def bucket(value: str | None) -> str | None:
    """A time bucket such as ``1h`` (checked now, so a bad one is a 400 before any query).

    Raises:
        QueryError: not a duration, or not between 1s and 366d.
    """
    if value is not None:
        parse_bucket(value)
    return value
