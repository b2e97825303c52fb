"""Exports: the rows of any registry query as a Parquet or CSV file (issue 14 part 5).

A query that is SQL (:attr:`QuerySpec.sql`) is exported by ClickHouse itself, ``FORMAT Parquet`` or
``FORMAT CSVWithNames`` (chDB included): its SQL is wrapped so that money columns (``*_pico``)
become exact ``*_usd`` decimals (Decimal(38, 12)), the same names and values the JSON answers carry.
A lookup (one object, :attr:`QuerySpec.key`) is assembled in Python (token text, several queries),
so its rows (:attr:`QuerySpec.rows`: a request's ``segments``, token ``records``; else the object as
one row) are written with pyarrow (Parquet) or the csv module. Sessions, timelines and every later
registry entry export the same way, with no code of their own.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from sparseety.errors import QueryError
from sparseety.sinks.output import render

from .base import QuerySpec, Scope

#: Export format -> ClickHouse output format.
FORMATS = {"parquet": "Parquet", "csv": "CSVWithNames"}
#: Strings and enums as Parquet strings (UTF-8), not binary, so readers get the text the JSON has.
SETTINGS = {"output_format_parquet_string_as_string": 1}
#: Export format -> HTTP media type.
MEDIA_TYPES = {"parquet": "application/vnd.apache.parquet", "csv": "text/csv; charset=utf-8"}


def check_format(fmt: str) -> str:
    """``fmt`` when it is an export format, else a QueryError (400)."""
    if fmt not in FORMATS:
        raise QueryError(f"unknown export format {fmt!r}: choose from {', '.join(FORMATS)}")
    return fmt


def _column(name: str, type_: str) -> str:
    quoted = "`" + name.replace("`", "``") + "`"
    if name.endswith("_pico"):
        usd = name[: -len("_pico")] + "_usd"
        return f"toDecimal128({quoted}, 12) / 1000000000000 AS `{usd}`"
    if "Enum" in type_:  # Parquet would carry an enum's bytes; the JSON answers carry its text
        return f"toString({quoted}) AS {quoted}"
    return quoted


def export_sql(
    store: Any,
    spec: QuerySpec,
    *,
    by: Sequence[str] | None = None,
    bucket: str | None = None,
    scope: Scope,
    **arguments: Any,
) -> tuple[str, dict[str, Any]]:
    """A registry query's SQL wrapped for export (``*_pico`` -> ``*_usd`` decimals)."""
    sql, params = spec.build(store.database, by=by, bucket=bucket, scope=scope, **arguments)
    described = store.query(f"DESCRIBE TABLE ({sql})", params)
    columns = ", ".join(_column(str(d["name"]), str(d["type"])) for d in described)
    return f"SELECT {columns} FROM ({sql})", params


def rows_of(spec: QuerySpec, found: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows a lookup's object exports: its :attr:`QuerySpec.rows` list, or itself."""
    if spec.rows:
        return list(found[spec.rows])
    return [found]


def rows_file(rows: list[dict[str, Any]], fmt: str) -> bytes:
    """Rows (the query library's Python values) as a Parquet or CSV file."""
    check_format(fmt)
    if fmt == "csv":
        return (render(rows, "csv") + "\n").encode() if rows else b""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def export(
    queries: Any,
    spec: QuerySpec,
    fmt: str,
    *,
    key: str | None = None,
    by: Sequence[str] | None = None,
    bucket: str | None = None,
    scope: Scope | None = None,
    allowed: bool = True,
    **arguments: Any,
) -> bytes | None:
    """One registry query as a file in ``fmt`` (None: a lookup found nothing)."""
    check_format(fmt)
    if scope is None:
        scope = Scope()
    if spec.key is not None:
        if key is None:
            raise QueryError(f"{spec.name} needs its {spec.key}")
        found = spec.fetch(queries, key, scope=scope, allowed=allowed, **arguments)
        return None if found is None else rows_file(rows_of(spec, found), fmt)
    sql, params = export_sql(queries.store, spec, by=by, bucket=bucket, scope=scope, **arguments)
    return bytes(queries.store.raw(sql, params, FORMATS[fmt], SETTINGS if fmt == "parquet" else None))
