"""Query results -> JSON values and back (pure).

Money is exact: ``*_usd`` Decimals travel as decimal strings ("0.0123"), times as ISO-8601 UTC
(``2024-05-01T12:00:00Z``), bytes as hex, NaN as null. :func:`decode_rows` restores the Decimals and
datetimes, so a remote caller gets what :class:`~sparseety.queries.registry.Queries` returns.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sparseety.sinks.output import jsonable

__all__ = ["decode_rows", "decode_value", "jsonable"]

_TIME_KEYS = ("bucket", "finished_at", "window_start")


def decode_value(key: str, value: Any) -> Any:
    """One field of a row back to its Python type (by the field's name)."""
    if isinstance(value, str) and key.endswith("_usd"):
        return Decimal(value)
    if isinstance(value, str) and key in _TIME_KEYS:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, dict):
        return {k: decode_value(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(key, v) for v in value]
    return value


def decode_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as the API sends them -> rows as the query library returns them."""
    return [{k: decode_value(k, v) for k, v in r.items()} for r in rows]
