"""Dry runs: write into scratch copies of the tables, then compare them with the real ones.

A :class:`DryRunSink` is a :class:`~sparseety.sinks.clickhouse.writer.ClickHouseSink` whose
inserts go to ``_dry_<id>_<table>`` (same columns, same engine). :meth:`DryRunSink.diff` then
compares each scratch table (FINAL) with the real one (FINAL) row by row on the table's key:

* ``new``: no row with that key is stored;
* ``changed``: a stored row differs and this one would replace it;
* ``unchanged``: the stored row is identical;
* ``superseded``: a stored row has a newer ``_version``, so this one would lose (ReplacingMergeTree).

The real tables are only read. Scratch tables are dropped on :meth:`close`.
"""

from __future__ import annotations

import uuid
from typing import Any

from .client import Store
from .tables import SINK_TABLES, Table
from .writer import ClickHouseSink

OUTCOMES = ("new", "changed", "unchanged", "superseded")


class DryRunSink(ClickHouseSink):
    """A sink that stages rows in scratch tables and reports what writing them would change."""

    def __init__(self, store: Store, **options: Any) -> None:
        super().__init__(store, **options)
        self._prefix = f"_dry_{uuid.uuid4().hex[:10]}"
        self._created: list[str] = []
        for t in SINK_TABLES:
            name = self.target(t)
            store.command(f"CREATE TABLE {name} AS {store.table(t.name)}")
            self._created.append(name)

    def target(self, table: Table) -> str:
        return self.store.table(f"{self._prefix}_{table.name}")

    def diff(self) -> dict[str, dict[str, int]]:
        """Per table: rows that would be new / changed / unchanged / superseded."""
        out = {}
        for t in SINK_TABLES:
            key = ", ".join(t.key)
            real = self.store.table(t.name)
            staged = self.target(t)
            version = "_version" in t.columns
            v = "_version" if version else "toUInt64(0)"
            # toString(tuple(*)): a hash of Nullable columns would be NULL whenever one is NULL
            row_hash = "cityHash64(toString(tuple(*)))"
            sql = (
                "SELECT "
                "countIf(found = 0) AS new, "
                f"countIf(found = 1 AND e_h != n_h AND {'n_v >= e_v' if version else '1'}) AS changed, "
                "countIf(found = 1 AND e_h = n_h) AS unchanged, "
                f"countIf(found = 1 AND e_h != n_h AND {'n_v < e_v' if version else '0'}) AS superseded "
                "FROM ("
                "  SELECT n.h AS n_h, n.v AS n_v, e.h AS e_h, e.v AS e_v, ifNull(e.found, 0) AS found FROM "
                f"  (SELECT {key}, {row_hash} AS h, {v} AS v FROM {staged} FINAL) AS n "
                f"  LEFT JOIN (SELECT {key}, {row_hash} AS h, {v} AS v, toUInt8(1) AS found "
                f"             FROM {real} FINAL "
                f"             WHERE ({key}) IN (SELECT {key} FROM {staged})) AS e USING ({key})"
                ")"
            )
            (row,) = self.store.query(sql)
            out[t.name] = {k: int(row[k]) for k in OUTCOMES}
        return out

    def close(self) -> None:
        for name in self._created:
            self.store.command(f"DROP TABLE IF EXISTS {name}")
        self._created.clear()
        super().close()
