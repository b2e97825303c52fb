"""What the API and dashboard ask beyond the query registry: store health and timeline counts
(request listings are the registry's ``requests``).

:class:`ApiQueries` extends :class:`~sparseety.queries.registry.Queries` (same store,
same scoping rules); :class:`~sparseety.api.client.RemoteQueries` offers the same methods over
HTTP, so the dashboard and the CLI work with either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sparseety.billing import CACHE_TIERS, MODALITIES, TIER_COLUMN
from sparseety.queries.listing import ORDERS as ORDERS  # re-exported (moved there)
from sparseety.queries.registry import Queries, Scope

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


def health_sql(db: str, *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """Stored requests, how many are incomplete or inconsistent, and the newest finish time."""
    where, params = scope.where()
    sql = (
        "SELECT count() AS requests, countIf(NOT complete) AS incomplete_requests, "
        "if(count() = 0, 0, min(finished_ts_ns)) AS earliest_finished_ts_ns, "
        "countIf(NOT consistent) AS inconsistent_requests, countIf(seq_gap) AS seq_gap_requests, "
        "if(count() = 0, 0, max(finished_ts_ns)) AS latest_finished_ts_ns "
        f"FROM {db}.requests_v WHERE {where}"
    )
    return sql, params


def bill_2026_totals_sql(db: str) -> tuple[str, dict[str, Any]]:
    """Issue 36's classes summed over every stored request (``/metrics``): cache writes, cache
    reads per tier (sparseety/billing.py), prompt positions per modality, encoder work."""
    sums = [
        "sum(cache_write_tokens) AS cache_write",
        *(f"sum({TIER_COLUMN[t]}) AS read_{t}" for t in CACHE_TIERS),
        *(f"sum({m}_tokens) AS modality_{m}" for m in MODALITIES),
        "sum(encoder_compute_tokens) AS encoder_compute",
        "sum(encoder_cache_hit_tokens) AS encoder_cache_hit",
    ]
    return f"SELECT {', '.join(sums)} FROM {db}.requests_v", {}


#: The component of dead letters that are lines an ingest refused (producers/logs/ingest.py).
INGEST_COMPONENT = "ingest"


def dead_letters_sql(db: str) -> tuple[str, dict[str, Any]]:
    """Dead letters stored (the whole pipeline's; not tenant-scoped), and how many of them are
    lines of ingested files that were refused (``ingest_rejects``) rather than records the
    pipeline could not use."""
    sql = (
        "SELECT count() AS dead_letters, countIf(component = {ingest:String}) AS ingest_rejects "
        f"FROM {db}.dead_letters FINAL"
    )
    return sql, {"ingest": INGEST_COMPONENT}


def dead_letter_rows_sql(db: str, *, limit: int, component: str | None = None) -> tuple[str, dict[str, Any]]:
    """The newest dead letters (what failed where, and why; never the payload), of one
    ``component`` when given."""
    where = "component = {component:String}" if component else "1"
    sql = (
        "SELECT fromUnixTimestamp64Nano(ts_ns, 'UTC') AS at, toString(component) AS component, "
        "toString(error_type) AS error_type, reason, topic, partition, offset, "
        "dlq_topic, dlq_partition, dlq_offset "
        f"FROM {db}.dead_letters FINAL WHERE {where} ORDER BY ts_ns DESC LIMIT {{limit:UInt32}}"
    )
    return sql, {"limit": limit, **({"component": component} if component else {})}


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
    """The query library plus the health figures the API serves."""

    def dead_letters(self, *, limit: int = 100, component: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` dead letters of the whole pipeline, or of one ``component``
        (``ingest``: refused lines of ingested files) (an admin's question)."""
        return self._run(dead_letter_rows_sql(self.db, limit=limit, component=component))

    def prices_list(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every stored price (:func:`~sparseety.sinks.clickhouse.prices.list_prices`)."""
        from sparseety.sinks.clickhouse.prices import list_prices

        return list_prices(self.store, model)  # type: ignore[arg-type]

    def bill_2026_totals(self) -> dict[str, int]:
        """:func:`bill_2026_totals_sql`'s sums, by name (an admin's question: every tenant)."""
        (row,) = self._run(bill_2026_totals_sql(self.db))
        return {k: int(v or 0) for k, v in row.items()}

    def health(self, *, scope: Scope = EVERYTHING, now_ns: int) -> dict[str, Any]:
        """Store-side pipeline health within ``scope``.

        Keys: ``requests``, ``incomplete_requests``, ``inconsistent_requests``, ``seq_gap_requests``,
        ``latest_finished_ts_ns`` (0 when empty), ``freshness_s`` (now - newest finish; None when
        empty) and, for an unscoped caller, ``dead_letters`` (all stored) and ``ingest_rejects``
        (those that are refused lines of ingested files; the rest are the pipeline's own).
        """
        (row,) = self._run(health_sql(self.db, scope=scope))
        out: dict[str, Any] = {k: int(v) for k, v in row.items()}
        latest = out["latest_finished_ts_ns"]
        out["freshness_s"] = (now_ns - latest) / 1e9 if latest else None
        if scope.tenants is None:
            (dead,) = self._run(dead_letters_sql(self.db))
            out["dead_letters"] = int(dead["dead_letters"])
            out["ingest_rejects"] = int(dead["ingest_rejects"])
        return out
