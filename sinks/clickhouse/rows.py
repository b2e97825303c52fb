"""Records -> table rows, column-oriented (pure: no I/O).

One RequestAccounting becomes one ``requests`` row, one ``token_segments`` row per timeline
segment, one ``kv_blocks`` row per block use, (when routing was captured) one ``expert_load``
row and (records of schema v3 on) one ``request_tokens`` row. Child rows carry the request's
``_version`` so that readers can ignore rows of an older version of the same request (a newer
version may have fewer segments or blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

from sparseety import events as ev

from .tables import (
    BLOCK_FIELDS,
    DEAD_LETTERS,
    EXPERT_LOAD,
    KV_BLOCKS,
    KV_COLUMNS,
    REQUEST_FIELDS,
    REQUEST_TOKENS,
    REQUESTS,
    SEGMENT_FIELDS,
    SINK_TABLES,
    TOKEN_SEGMENTS,
    USAGE,
    Table,
)

_TS_MASK = (1 << 63) - 1
_segment_values = itemgetter(*SEGMENT_FIELDS)
_block_values = itemgetter(*BLOCK_FIELDS)
_DLQ_FIELDS = DEAD_LETTERS.columns[3:]

#: Records this module turns into rows.
RECORDS = frozenset({ev.REQUEST_ACCOUNTING, ev.USAGE_WINDOW, ev.DEAD_LETTER})


def request_version(record: Mapping[str, Any]) -> int:
    """The ``_version`` of a request row: ``(complete << 63) | finished_ts_ns``.

    Derived from content, not from when it was written: the same record always gets the same
    version (a rewrite leaves FINAL unchanged), a complete record beats an incomplete one
    (closed by idle timeout) whatever order they arrive in, and among records of the same
    completeness the one that saw the later finish wins. A replay of an older range therefore
    never regresses a newer record.
    """
    return (1 << 63 if record["complete"] else 0) | (max(0, int(record["finished_ts_ns"])) & _TS_MASK)


def kv_totals(rec: Mapping[str, Any]) -> tuple[int | None, ...]:
    """The ``requests`` KV memory-time columns (tables.KV_COLUMNS) from ``kv_groups``: sums over
    the groups, bytes from each group's bytes per block, block-ns to byte-ms floored once per
    request. All NULL when the record has no groups (not observed); the byte columns NULL when a
    group's bytes per block are unknown."""
    groups = rec.get("kv_groups") or []
    if not groups:
        return (None,) * len(KV_COLUMNS)
    known = all(g["bytes_per_block"] > 0 for g in groups)

    def byte_ms(key: str) -> int | None:
        return sum(g[key] * g["bytes_per_block"] for g in groups) // 1_000_000 if known else None

    peak = rec.get("kv_peak_bytes", -1)
    return (
        sum(g["block_steps"] for g in groups),
        sum(g["block_ns"] for g in groups),
        byte_ms("block_ns"),
        byte_ms("block_ns_amortized"),
        byte_ms("block_ns_actual"),
        peak if known and peak >= 0 else None,
        sum(g["slot_steps_used"] for g in groups),
        sum(g["slot_steps_allocated"] for g in groups),
        sum(g["never_held_blocks"] for g in groups),
    )


_Append = Callable[[Any], None]


def _appenders(
    columns: dict[str, list[Any]], fields: tuple[str, ...]
) -> tuple[list[tuple[_Append, str]], list[tuple[_Append, str, str]]]:
    """The appenders of a record's ``fields`` into ``columns``: (append, field) for a field
    copied as it is, (append, field, moved field) for one that also counts a moved field
    (:data:`~sparseety.events.MOVED_FIELDS`)."""
    into = {new: old for old, new in ev.MOVED_FIELDS.items()}
    plain = [(columns[f].append, f) for f in fields if f not in into]
    moved = [(columns[f].append, f, into[f]) for f in fields if f in into]
    return plain, moved


class RowBuffer:
    """Column-oriented rows for every sink table."""

    def __init__(self) -> None:
        self.columns: dict[str, dict[str, list[Any]]] = {
            t.name: {c: [] for c in t.columns} for t in SINK_TABLES
        }
        # A field whose meaning moved (events.MOVED_FIELDS: evicted_tokens, 0 in records written
        # since schema v2, window release in older ones) is added to its successor's column.
        self._request_fields, self._request_moved = _appenders(self.columns[REQUESTS.name], REQUEST_FIELDS)
        self._usage_fields, self._usage_moved = _appenders(self.columns[USAGE.name], USAGE.columns)
        dlq = self.columns[DEAD_LETTERS.name]
        self._dlq_fields = [(dlq[f].append, f) for f in _DLQ_FIELDS]
        self._first_columns = [(t.name, self.columns[t.name][t.columns[0]]) for t in SINK_TABLES]

    def rows(self, table: Table | str) -> int:
        """Rows buffered for ``table``."""
        name = table if isinstance(table, str) else table.name
        cols = self.columns[name]
        return len(next(iter(cols.values())))

    def total_rows(self) -> int:
        """Rows buffered over all tables."""
        return sum(self.rows(t) for t in SINK_TABLES)

    def mark(self) -> dict[str, int]:
        """Rows per table now (for :meth:`rollback`)."""
        return {name: len(first) for name, first in self._first_columns}

    def rollback(self, mark: dict[str, int]) -> None:
        """Drop everything appended since ``mark`` (a record that failed half-way)."""
        for name, cols in self.columns.items():
            n = mark[name]
            for values in cols.values():
                del values[n:]

    def add(
        self, record_name: str, record: Mapping[str, Any], *, topic: str, partition: int, offset: int
    ) -> int:
        """Append the rows of one record; return how many.

        Raises:
            KeyError: ``record_name`` is not one of :data:`RECORDS`.
        """
        if record_name == ev.REQUEST_ACCOUNTING:
            return self.add_accounting(record)
        if record_name == ev.USAGE_WINDOW:
            return self.add_usage(record)
        if record_name == ev.DEAD_LETTER:
            return self.add_dead_letter(record, dlq_topic=topic, dlq_partition=partition, dlq_offset=offset)
        raise KeyError(record_name)

    def add_accounting(self, rec: Mapping[str, Any]) -> int:
        """Rows of one RequestAccounting: request, segments, block uses, expert counts."""
        version = request_version(rec)
        uid = rec["request_uid"]
        timeline = rec["timeline"]
        segments = timeline["segments"]
        uses = rec["block_uses"]
        for append, f in self._request_fields:
            append(rec[f])
        for append, f, moved in self._request_moved:
            append(rec[f] + rec.get(moved, 0))
        req = self.columns[REQUESTS.name]
        for col, kv_value in zip(KV_COLUMNS, kv_totals(rec), strict=True):
            req[col].append(kv_value)
        req["attention_window"].append(timeline.get("attention_window"))
        req["segment_count"].append(len(segments))
        req["block_use_count"].append(len(uses))
        req["_version"].append(version)
        n = 1

        if segments:
            seg = self.columns[TOKEN_SEGMENTS.name]
            k = len(segments)
            seg["request_uid"].extend([uid] * k)
            seg["idx"].extend(range(k))
            seg["_version"].extend([version] * k)
            for f, values in zip(
                SEGMENT_FIELDS, zip(*map(_segment_values, segments), strict=True), strict=True
            ):
                seg[f].extend(values)
            n += k

        if uses:
            blk = self.columns[KV_BLOCKS.name]
            k = len(uses)
            blk["request_uid"].extend([uid] * k)
            blk["idx"].extend(range(k))
            blk["_version"].extend([version] * k)
            for f, values in zip(BLOCK_FIELDS, zip(*map(_block_values, uses), strict=True), strict=True):
                blk[f].extend(values)
            n += k

        counts = rec["expert_counts"]
        if counts and rec["expert_num_layers"] > 0:
            exp = self.columns[EXPERT_LOAD.name]
            for col, value in (
                ("model", rec["model"]),
                ("request_uid", uid),
                ("_version", version),
                ("tenant", rec["tenant"]),
                ("engine_name", rec["engine_name"]),
                ("finished_ts_ns", rec["finished_ts_ns"]),
                ("num_layers", rec["expert_num_layers"]),
                ("num_experts", rec["expert_num_experts"]),
                ("counts", list(counts)),
            ):
                exp[col].append(value)
            n += 1

        privacy = rec.get("token_privacy") or ""
        if privacy:  # schema v3: a row even in mode none, so answers can say nothing was stored
            tok = self.columns[REQUEST_TOKENS.name]
            for col, value in (
                ("request_uid", uid),
                ("_version", version),
                ("finished_ts_ns", rec["finished_ts_ns"]),
                ("privacy", privacy),
                ("prompt_token_ids", list(rec.get("prompt_token_ids") or ())),
                ("prompt_token_hashes", list(rec.get("prompt_token_hashes") or ())),
                ("output_token_ids", list(rec.get("output_token_ids") or ())),
            ):
                tok[col].append(value)
            n += 1
        return n

    def add_usage(self, rec: Mapping[str, Any]) -> int:
        """The row of one UsageWindow (final or correction)."""
        for append, f in self._usage_fields:
            append(rec[f])
        for append, f, moved in self._usage_moved:
            append(rec[f] + rec.get(moved, 0))
        return 1

    def add_dead_letter(
        self, rec: Mapping[str, Any], *, dlq_topic: str, dlq_partition: int, dlq_offset: int
    ) -> int:
        """The row of one DeadLetter, keyed by its own position in the dlq topic."""
        dlq = self.columns[DEAD_LETTERS.name]
        dlq["dlq_topic"].append(dlq_topic)
        dlq["dlq_partition"].append(dlq_partition)
        dlq["dlq_offset"].append(dlq_offset)
        for append, f in self._dlq_fields:
            append(rec[f])
        return 1
