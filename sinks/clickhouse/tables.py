"""The tables the sink writes: insert columns and the key that identifies a row.

The DDL lives in ``migrations/``; this module names the columns the writer fills, in insert
order (materialized columns excluded). A unit test checks both agree with ``system.columns``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparseety.events import POSITION_COUNTS, TOKEN_COUNTS

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


REQUESTS = Table(
    "requests",
    (
        "request_uid",
        "engine_name",
        "engine_id",
        "request_id",
        "tenant",
        "model",
        "lora_name",
        "engine_kind",
        "arrival_ts_ns",
        "first_scheduled_ts_ns",
        "first_token_ts_ns",
        "finished_ts_ns",
        "finish_reason",
        "complete",
        "incomplete_reason",
        "seq_gap",
        "prompt_tokens",
        "output_tokens",
        *TOKEN_COUNTS,
        "scheduled_tokens",
        "preemptions",
        "steps",
        "attention_pairs",
        "attention_pairs_skipped",
        "gpu_time_ns",
        "est_flops",
        "engine_prompt_tokens",
        "engine_output_tokens",
        "engine_cached_tokens",
        "consistent",
        "expert_num_layers",
        "expert_num_experts",
        # Added by migration 003 (issue 11: the two-axis position model).
        *POSITION_COUNTS,
        "session_id",  # added by migration 005 (issue 14: sessions)
        # Added by migration 009 (issue 21: look-up by the client's id, n > 1 billed once).
        "external_request_id",
        "parent_request_id",
        "choice_index",
        "external_kv_tokens",  # added by migration 010 (issue 20: KV connectors, P/D)
        # Added by migration 011 (issue 21: the fold's caveats, streams/caveats.py).
        "warmup_gpu_time_ns",
        "source_history_lost_ts_ns",
        # Added by migration 013 (issue 23: reasoning tokens).
        "reasoning_output_tokens",
        "reasoning_spans",
        "draft_unverified_tokens",  # added by migration 015 (issue 31: drafts reconcile with vLLM)
        # Added by migration 012 (issue 23: KV memory-time; NULL = not observed).
        *KV_COLUMNS,
        "attention_window",
        "segment_count",
        "block_use_count",
        "_version",
    ),
    ("tenant", "model", "request_uid"),
)

#: RequestAccounting fields copied verbatim into ``requests`` (the rest are derived).
REQUEST_FIELDS = REQUESTS.columns[: REQUESTS.columns.index(KV_COLUMNS[0])]

TOKEN_SEGMENTS = Table(
    "token_segments",
    (
        "request_uid",
        "idx",
        "_version",
        "start",
        "end",
        "kind",
        "status",
        "draft_accepted",
        "source_request_uid",
        "kv_fate",
    ),
    ("request_uid", "idx"),
)

KV_BLOCKS = Table(
    "kv_blocks",
    ("request_uid", "idx", "_version", "block_hash", "lifetime_seq", "role", "tokens"),
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

USAGE = Table(
    "usage_1m",
    (
        "tenant",
        "model",
        "window_start_ns",
        "engine_name",
        "usage_id",
        "kind",
        "window_ns",
        "requests",
        "incomplete_requests",
        "prompt_tokens",
        "output_tokens",
        *TOKEN_COUNTS,
        "gpu_time_ns",
        "est_flops",
        *POSITION_COUNTS,  # added by migration 003
        "lora_name",  # added by migration 013 (issue 23: windows per adapter)
    ),
    ("tenant", "model", "window_start_ns", "engine_name", "usage_id"),
)

DEAD_LETTERS = Table(
    "dead_letters",
    (
        "dlq_topic",
        "dlq_partition",
        "dlq_offset",
        "error_type",
        "reason",
        "component",
        "topic",
        "partition",
        "offset",
        "key",
        "value",
        "ts_ns",
    ),
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
