"""The tables the sink writes: insert columns and the key that identifies a row.

The DDL lives in ``migrations/``; this module names the columns the writer fills, in insert
order (materialized columns excluded). A unit test checks both agree with ``system.columns``.
Where a table copies a record's fields, its columns are derived from ``schemas/`` at import.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparseety.events import DEAD_LETTER, MOVED_FIELDS, REQUEST_ACCOUNTING, USAGE_WINDOW, field_names

#: KV memory-time columns of ``requests`` (migration 012), derived from RequestAccounting.kv_groups.
KV_COLUMNS = (
    "kv_block_steps",
    "kv_block_ns",
    "kv_byte_ms",
    "kv_byte_ms_amortized",
    "kv_byte_ms_actual",
    "kv_peak_bytes",
    "kv_slot_steps_used",
    "kv_slot_steps_allocated",
    "kv_never_held_blocks",
)


@dataclass(frozen=True)
class Table:
    """A table the sink writes.

    Attributes:
        name: Table name (without database).
        columns: Columns the writer fills, in insert order.
        key: The sorting key, which ReplacingMergeTree deduplicates on: a row's identity.
    """

    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]


#: RequestAccounting fields that are no column of ``requests``: the arrays and the timeline (their
#: own tables, or the counts and the attention window below), what the KV columns are derived from,
#: the token records' privacy mode (``request_tokens``), and the fields whose meaning moved
#: (:data:`~sparseety.events.MOVED_FIELDS`: the writer adds them to their successor's column).
NOT_COPIED = frozenset(
    {
        "expert_counts",
        "block_uses",
        "timeline",
        "token_privacy",
        "prompt_token_ids",
        "prompt_token_hashes",
        "output_token_ids",
        "kv_groups",
        "kv_peak_bytes",
        *MOVED_FIELDS,
    }
)

#: RequestAccounting fields copied verbatim into ``requests``, in schema order: every other field of
#: schemas/RequestAccounting.avsc (a field added there is a column a migration adds, appended: the
#: unit test of the DDL checks both agree); the rest of the row is derived.
REQUEST_FIELDS = tuple(f for f in field_names(REQUEST_ACCOUNTING) if f not in NOT_COPIED)

REQUESTS = Table(
    "requests",
    (
        *REQUEST_FIELDS,
        # Added by migration 012 (issue 23: KV memory-time; NULL = not observed).
        *KV_COLUMNS,
        "attention_window",
        "segment_count",
        "block_use_count",
        "_version",
    ),
    ("tenant", "model", "request_uid"),
)

#: The columns of a TokenSegment (one ``token_segments`` row) and of a BlockUse (one ``kv_blocks``
#: row), after the request's uid, the index in its list and the request's version.
SEGMENT_FIELDS = field_names("TokenSegment")
BLOCK_FIELDS = field_names("BlockUse")

TOKEN_SEGMENTS = Table(
    "token_segments",
    ("request_uid", "idx", "_version", *SEGMENT_FIELDS),
    ("request_uid", "idx"),
)

KV_BLOCKS = Table(
    "kv_blocks",
    ("request_uid", "idx", "_version", *BLOCK_FIELDS),
    ("request_uid", "idx"),
)

EXPERT_LOAD = Table(
    "expert_load",
    (
        "model",
        "request_uid",
        "_version",
        "tenant",
        "engine_name",
        "finished_ts_ns",
        "num_layers",
        "num_experts",
        "counts",
    ),
    ("model", "request_uid"),
)

_USAGE_KEY = ("tenant", "model", "window_start_ns", "engine_name", "usage_id")

#: One row per UsageWindow: its key first, then every other field of schemas/UsageWindow.avsc in
#: schema order but the moved ones (the writer adds evicted_tokens to window_released_tokens).
USAGE = Table(
    "usage_1m",
    (
        *_USAGE_KEY,
        *(f for f in field_names(USAGE_WINDOW) if f not in _USAGE_KEY and f not in MOVED_FIELDS),
    ),
    _USAGE_KEY,
)

DEAD_LETTERS = Table(
    "dead_letters",
    # the letter's own position in the dlq topic, then the DeadLetter record
    ("dlq_topic", "dlq_partition", "dlq_offset", *field_names(DEAD_LETTER)),
    # the input's identity, not the dlq message's (migration 014): a column ClickHouse derives
    # from component, topic, partition and offset, so a re-sent dead letter replaces its copy
    ("letter_key",),
)

#: Token ids (or keyed hashes) per request version, as the privacy mode allows (migration 005).
REQUEST_TOKENS = Table(
    "request_tokens",
    (
        "request_uid",
        "_version",
        "finished_ts_ns",
        "privacy",
        "prompt_token_ids",
        "prompt_token_hashes",
        "output_token_ids",
    ),
    ("request_uid",),
)

#: Every table the sink writes, in write order (parents before children).
SINK_TABLES: tuple[Table, ...] = (
    REQUESTS,
    TOKEN_SEGMENTS,
    KV_BLOCKS,
    EXPERT_LOAD,
    REQUEST_TOKENS,
    USAGE,
    DEAD_LETTERS,
)
BY_NAME = {t.name: t for t in SINK_TABLES}
