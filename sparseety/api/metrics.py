"""Prometheus metrics of the API process, named ``sparseety:<noun>_<unit>``.

Each API instance has its own registry (so tests can run several). Store-side figures (freshness,
stored requests, dead letters) are refreshed by the ``/metrics`` handler just before rendering;
the sink feeder's counters (when the sink runs in this process) are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparseety.billing import CACHE_TIERS, MODALITIES

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SinkCollector(Collector):
    """The in-process sink feeder's counters (``sparseety.sinks.consumer.SinkFeeder``)."""

    def __init__(self, feeder: Any) -> None:
        self.feeder = feeder

    def collect(self) -> Iterator[Metric]:
        w = self.feeder
        yield CounterMetricFamily("sparseety:sink_records", "Records the sink stored.", value=w.records)
        yield CounterMetricFamily(
            "sparseety:sink_dead_letters", "Records the sink dead-lettered.", value=w.dead_letters
        )
        yield CounterMetricFamily("sparseety:sink_writes", "Batches the sink wrote.", value=w.writes)
        yield CounterMetricFamily(
            "sparseety:sink_rows_rejected",
            "Records the store refused on their data (written to dead_letters; the partition went on).",
            value=w.totals.rejected,
        )
        rows = CounterMetricFamily("sparseety:sink_rows", "Rows the sink wrote, per table.", labels=["table"])
        for table, n in sorted(w.totals.rows.items()):
            rows.add_metric([table], n)
        yield rows
        yield GaugeMetricFamily(
            "sparseety:sink_stopped_partitions",
            "Partitions held back because their writes keep failing.",
            value=len(w.held),
        )


class ApiMetrics:
    """The API's metrics and their registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "sparseety:api_requests", "HTTP requests served.", ["route", "method", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "sparseety:api_request_duration_seconds",
            "HTTP request latency.",
            ["route"],
            buckets=_LATENCY,
            registry=r,
        )
        self.query_seconds = Histogram(
            "sparseety:store_query_duration_seconds",
            "Store query latency, per query.",
            ["query"],
            buckets=_LATENCY,
            registry=r,
        )
        self.query_errors = Counter(
            "sparseety:store_query_errors", "Store queries that failed.", ["query"], registry=r
        )
        self.jobs = Counter(
            "sparseety:jobs", "Collect jobs finished, per kind and state.", ["kind", "state"], registry=r
        )
        self.jobs_active = Gauge(
            "sparseety:jobs_active", "Collect jobs queued or running.", ["kind"], registry=r
        )
        self.store_up = Gauge(
            "sparseety:store_up", "1 when the store answered the last health query.", registry=r
        )
        self.freshness = Gauge(
            "sparseety:freshness_seconds",
            "Now minus the newest finish time in the store (NaN when it is empty).",
            registry=r,
        )
        self.latest_finished = Gauge(
            "sparseety:store_latest_finished_timestamp_seconds",
            "Newest finish time in the store.",
            registry=r,
        )
        self.stored = Gauge(
            "sparseety:store_requests",
            "Requests stored: all, incomplete (closed without finishing), inconsistent, seq_gap.",
            ["state"],
            registry=r,
        )
        self.dead_letters = Gauge("sparseety:store_dead_letters", "Dead letters stored.", registry=r)
        self.regression_findings = Gauge(
            "sparseety:sparsity_regression_findings",
            "1 when a sparsity signal of an engine and model is a regression finding now, else 0 "
            "(/api/v1/regressions; docs/operations.md, Sparsity regressions).",
            ["engine", "model", "signal"],
            registry=r,
        )
        self.signal_ratio = Gauge(
            "sparseety:sparsity_signal_ratio",
            "A sparsity signal's rate over the current window and the engine's baseline window.",
            ["engine", "model", "signal", "window"],
            registry=r,
        )

        # issue 36 (docs/operations.md): stored totals of the new token classes; the OTel GenAI
        # names are on each request's span (sinks/otel/spans.py)
        self.cache_write_tokens = Gauge(
            "sparseety:store_cache_write_tokens",
            "Prompt positions written to the prefix cache (cache_write_tokens), all stored requests; "
            "OTel gen_ai.usage.cache_creation.input_tokens per request.",
            registry=r,
        )
        self.cache_read_tokens = Gauge(
            "sparseety:store_cache_read_tokens",
            "Prompt positions served from a cache tier (gpu, cpu_offload, host, storage) or loaded from "
            "outside (external), all stored requests.",
            ["tier"],
            registry=r,
        )
        self.modality_tokens = Gauge(
            "sparseety:store_prompt_modality_tokens",
            "Prompt positions of a modality (image, audio, video), all stored requests; the label is "
            "OTel's gen_ai.token.modality.",
            ["modality"],
            registry=r,
        )
        self.encoder_tokens = Gauge(
            "sparseety:store_encoder_tokens",
            "Multimodal encoder tokens computed (compute) or read from the encoder cache (cache_hit).",
            ["kind"],
            registry=r,
        )

    def set_bill_2026(self, totals: dict[str, int]) -> None:
        """The token-class gauges from :meth:`ApiQueries.bill_2026_totals`."""
        self.cache_write_tokens.set(totals["cache_write"])
        for tier in CACHE_TIERS:
            self.cache_read_tokens.labels(tier).set(totals[f"read_{tier}"])
        for m in MODALITIES:
            self.modality_tokens.labels(m).set(totals[f"modality_{m}"])
        self.encoder_tokens.labels("compute").set(totals["encoder_compute"])
        self.encoder_tokens.labels("cache_hit").set(totals["encoder_cache_hit"])

    def watch_sink(self, feeder: Any) -> None:
        """Export an in-process sink feeder's counters."""
        self.registry.register(SinkCollector(feeder))

    def job_finished(self, kind: str, state: str) -> None:
        self.jobs.labels(kind, state).inc()

    def set_jobs_active(self, active: dict[str, int], kinds: tuple[str, ...]) -> None:
        for kind in kinds:
            self.jobs_active.labels(kind).set(active.get(kind, 0))

    def set_health(self, health: dict[str, Any] | None) -> None:
        """Store-side gauges from :meth:`ApiQueries.health` (None: the store did not answer)."""
        if health is None:
            self.store_up.set(0)
            return
        self.store_up.set(1)
        fresh = health.get("freshness_s")
        self.freshness.set(float("nan") if fresh is None else fresh)
        self.latest_finished.set(health["latest_finished_ts_ns"] / 1e9)
        self.stored.labels("all").set(health["requests"])
        self.stored.labels("incomplete").set(health["incomplete_requests"])
        self.stored.labels("inconsistent").set(health["inconsistent_requests"])
        self.stored.labels("seq_gap").set(health["seq_gap_requests"])
        if "dead_letters" in health:
            self.dead_letters.set(health["dead_letters"])

    def set_regressions(self, rows: list[dict[str, Any]]) -> None:
        """Every evaluated sparsity signal (``regressions`` with ``all_signals``); stale ones go."""
        self.regression_findings.clear()
        self.signal_ratio.clear()
        for r in rows:
            key = (r["engine"], r["model"], r["signal"])
            self.regression_findings.labels(*key).set(1 if r["firing"] else 0)
            self.signal_ratio.labels(*key, "baseline").set(r["baseline"])
            self.signal_ratio.labels(*key, "current").set(r["current"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
