"""What the API and dashboard ask beyond the cost library: request listings, store health, and
timeline counts.

:class:`ApiQueries` extends :class:`~sparseety.sinks.clickhouse.queries.Queries` (same store,
same scoping rules); :class:`~sparseety.api.client.RemoteQueries` offers the same methods over
HTTP, so the dashboard and the CLI work with either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sparseety.sinks.clickhouse.queries import Queries, QueryError, Scope

ORDERS = ("recent", "varied")
#: The default scope: every finish time, every tenant.
EVERYTHING = Scope()
#: Axis 1, how positions were obtained (docs/streams.md); the last three only in schema-v1 rows.
STATUSES = (
    "computed",
    "cached",
    "recomputed_after_preemption",
    "recomputed_after_eviction",
    "not_computed",
    "recomputed",
    "skipped",
    "evicted",
)
#: Axis 2, what became of the KV: counted beside (``skipped`` adds to the old status of that name).
FATES = ("window_released", "skipped")

#: How many kinds of token fate a request shows: "varied" lists the most telling timelines first.
_VARIETY = (
    "(cache_read_tokens > 0) + (recomputed_tokens > 0) + (skipped_tokens > 0) "
    "+ (window_released_tokens + evicted_tokens > 0) + (draft_cut_tokens > 0) "
    "+ (draft_accepted_tokens > 0) + (draft_rejected_tokens > 0) + (uncached_computed_tokens > 0)"
)


def requests_sql(db: str, *, scope: Scope, limit: int, order: str) -> tuple[str, dict[str, Any]]:
    """Requests in scope, newest first (``recent``) or most varied timelines first (``varied``)."""
    if order not in ORDERS:
        raise QueryError(f"unknown order {order!r}: choose from {', '.join(ORDERS)}")
    if not 1 <= limit <= 10_000:
        raise QueryError("limit must be between 1 and 10000")
    where, params = scope.where()
    params["limit"] = limit
    by = "finished_ts_ns DESC, request_uid" if order == "recent" else f"{_VARIETY} DESC, finished_ts_ns DESC"
    sql = (
        "SELECT request_uid, tenant, model, engine_name, engine_kind, finished_at, finish_reason, complete, "
        "consistent, prompt_tokens, output_tokens, cache_read_tokens, uncached_computed_tokens, "
        "recomputed_tokens, recomputed_preemption_tokens, recomputed_eviction_tokens, draft_accepted_tokens, "
        "draft_rejected_tokens, draft_cut_tokens, skipped_tokens, evicted_tokens, window_released_tokens, "
        f"gpu_time_ns FROM {db}.requests_v WHERE {where} ORDER BY {by} LIMIT {{limit:UInt32}}"
    )
    return sql, params


def health_sql(db: str, *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Stored requests, how many are incomplete or inconsistent, and the newest finish time."""
    where, params = scope.where()
    sql = (
        "SELECT count() AS requests, countIf(NOT complete) AS incomplete_requests, "
        "countIf(NOT consistent) AS inconsistent_requests, countIf(seq_gap) AS seq_gap_requests, "
        "if(count() = 0, 0, max(finished_ts_ns)) AS latest_finished_ts_ns "
        f"FROM {db}.requests_v WHERE {where}"
    )
    return sql, params


def dead_letters_sql(db: str) -> tuple[str, dict[str, Any]]:
    """Dead letters stored (the whole pipeline's; not tenant-scoped)."""
    return f"SELECT count() AS dead_letters FROM {db}.dead_letters FINAL", {}


def timeline_counts(segments: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Positions per status (axis 1: these partition the positions), per KV fate
    (``window_released``; fate ``skipped`` adds to ``skipped``), per kind (prompt / output) and
    from accepted drafts."""
    counts = dict.fromkeys(
        (*STATUSES, "window_released", "prompt", "output", "draft_accepted", "positions"), 0
    )
    for s in segments:
        n = int(s["end"]) - int(s["start"])
        counts[str(s["status"])] = counts.get(str(s["status"]), 0) + n
        fate = str(s.get("kv_fate") or "kept")
        if fate != "kept":
            counts[fate] = counts.get(fate, 0) + n
        counts[str(s["kind"])] = counts.get(str(s["kind"]), 0) + n
        counts["positions"] += n
        if s.get("draft_accepted"):
            counts["draft_accepted"] += n
    return counts


class ApiQueries(Queries):
    """The query library plus the listings and health figures the API serves."""

    def requests(
        self, *, scope: Scope = EVERYTHING, limit: int = 50, order: str = "recent"
    ) -> list[dict[str, Any]]:
        """Requests in ``scope`` with their token counts (``order``: recent or varied)."""
        return self._run(requests_sql(self.db, scope=scope, limit=limit, order=order))

    def health(self, *, scope: Scope = EVERYTHING, now_ns: int) -> dict[str, Any]:
        """Store-side pipeline health within ``scope``.

        Keys: ``requests``, ``incomplete_requests``, ``inconsistent_requests``, ``seq_gap_requests``,
        ``latest_finished_ts_ns`` (0 when empty), ``freshness_s`` (now - newest finish; None when
        empty) and, for an unscoped caller, ``dead_letters``.
        """
        (row,) = self._run(health_sql(self.db, scope=scope))
        out: dict[str, Any] = {k: int(v) for k, v in row.items()}
        latest = out["latest_finished_ts_ns"]
        out["freshness_s"] = (now_ns - latest) / 1e9 if latest else None
        if scope.tenants is None:
            (dead,) = self._run(dead_letters_sql(self.db))
            out["dead_letters"] = int(dead["dead_letters"])
        return out
