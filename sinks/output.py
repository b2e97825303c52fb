"""Result rows -> text: an aligned table, JSON or CSV (pure). Money (Decimal) is exact in every
format: a table pads a column's amounts to the most decimals among them, never rounds."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

FORMATS = ("table", "json", "csv")


def jsonable(value: Any) -> Any:
    """A JSON-ready copy of a query result, as the CLI (json, csv) and the HTTP API send it:
    Decimals as decimal text, times as ISO-8601 UTC, bytes as hex, NaN as null."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _cell(value: Any) -> str:
    """A compact cell for the table view (a Decimal exactly: money is never rounded)."""
    if value is None:
        return "-"
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(_cell(v) for v in value)
    return str(jsonable(value))


def render_object(obj: dict[str, Any]) -> str:
    """One object (a request, token statistics) as JSON."""
    return json.dumps(jsonable(obj), indent=2)


def render(rows: Sequence[dict[str, Any]], fmt: str = "table") -> str:
    """Rows as text in ``fmt`` (``table``, ``json`` or ``csv``).

    Raises:
        ValueError: unknown format.
    """
    if fmt == "json":
        return json.dumps([jsonable(r) for r in rows], indent=2)
    columns: list[str] = []
    for r in rows:
        columns.extend(k for k in r if k not in columns)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        for r in rows:
            writer.writerow(
                [
                    jsonable(r.get(c, ""))
                    if not isinstance(r.get(c), list)
                    else json.dumps(jsonable(r.get(c)))
                    for c in columns
                ]
            )
        return buf.getvalue().rstrip("\n")
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}: choose from {', '.join(FORMATS)}")
    if not rows:
        return "(no rows)"
    places = {c: _decimal_places([r.get(c) for r in rows]) for c in columns}
    cells = [[_money(r.get(c), places[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(_is_number(r.get(c)) for r in rows) for c in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(columns), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _decimal_places(values: Sequence[Any]) -> int | None:
    """For a column of Decimals (money): the most decimals any of them has, so that every cell
    is exact and the points line up; None for any other column."""
    given = [v for v in values if v is not None]
    if not given or not all(isinstance(v, Decimal) for v in given):
        return None
    return max(max(-int(v.normalize().as_tuple().exponent), 0) for v in given)


def _money(value: Any, places: int | None) -> str:
    """A cell; in a money column (``places`` not None) a Decimal exactly, with ``places``
    decimals (never rounded: ``places`` is the column's most)."""
    if places is None or value is None:
        return _cell(value)
    return f"{value:.{places}f}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)
