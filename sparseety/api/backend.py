"""What the HTTP handlers share: the store, queries, tokens, jobs, metrics and the sink (if any).

Every store call goes through :meth:`Backend.query`, which runs it on the store's own thread
(:meth:`Store.arun`), so the event loop — shared with the sink loop in ``sparseety store`` — never
waits on ClickHouse; it also times each query for ``sparseety:store_query_duration_seconds``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sparseety.api.auth import TokenTable
from sparseety.api.collect import (
    AnalyzeJob,
    AnalyzeSpec,
    IngestJob,
    IngestSpec,
    ReplayJob,
    ReplaySpec,
    VllmLogJob,
    VllmLogSpec,
)
from sparseety.api.jobs import Job, JobManager
from sparseety.api.metrics import ApiMetrics
from sparseety.api.queries import ApiQueries
from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.queries import Scope

log = logging.getLogger("sparseety.api")
T = TypeVar("T")
JOB_KINDS = ("replay", "ingest", "vllm_log", "analyze")


class Backend:
    """The API's state.

    Args:
        cfg: Configuration (Kafka and topics for jobs, sink settings for replays).
        store: The open (migrated) store this process owns.
        tokens: Who may call.
        sink_feeder: The sink feeder of the store process (``sparseety store``), for its health counters.
        max_jobs: Collect jobs that run at once.
        clock: Wall clock in ns (tests).
        regressions_every_s: Least time between two evaluations of the sparsity-regression
            signals for ``/metrics``: their windows are hours long, and the query reads every
            request of the baseline window, so a scrape every few seconds must not run it each time.
    """

    def __init__(
        self,
        cfg: Config,
        store: Store,
        *,
        tokens: TokenTable,
        sink_feeder: Any = None,
        max_jobs: int = 1,
        clock: Callable[[], int] = time.time_ns,
        regressions_every_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.regressions_every_s = regressions_every_s
        self._regressions_due = float("-inf")  # monotonic time of the next evaluation
        self.store = store
        self.queries = ApiQueries(store, tokenizers=cfg.api.tokenizers)
        self.tokens = tokens
        self.sink_feeder = sink_feeder
        self.clock = clock
        self.metrics = ApiMetrics()
        if sink_feeder is not None:
            self.metrics.watch_sink(sink_feeder)
        self.jobs = JobManager(max_workers=max_jobs, on_finish=self._job_finished)

    def _job_finished(self, job: Job) -> None:
        self.metrics.job_finished(job.kind, job.state)

    async def query(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` (store calls inside) on the store thread; timed as ``name``."""
        started = time.perf_counter()
        try:
            return await self.store.arun(lambda _client: fn(*args, **kwargs))
        except Exception:
            self.metrics.query_errors.labels(name).inc()
            raise
        finally:
            self.metrics.query_seconds.labels(name).observe(time.perf_counter() - started)

    def submit(self, spec: ReplaySpec | IngestSpec | VllmLogSpec | AnalyzeSpec) -> dict[str, Any]:
        """Check a collect spec and queue its job; returns the job's snapshot.

        Raises:
            CollectSpecError, ReplayError, PluginLoadError: the spec cannot run (a 400).
        """
        job: ReplayJob | IngestJob | VllmLogJob | AnalyzeJob
        if isinstance(spec, ReplaySpec):
            job = ReplayJob(self.cfg, self.store, spec)
        elif isinstance(spec, AnalyzeSpec):
            job = AnalyzeJob(self.cfg, spec)
        elif isinstance(spec, VllmLogSpec):
            job = VllmLogJob(self.cfg, self.store, spec)
        else:
            job = IngestJob(self.cfg, spec)
        unit = {ReplaySpec: "records", AnalyzeSpec: "inputs"}.get(type(spec), "bytes")
        submitted = self.jobs.submit(spec.kind, job.params(), job, unit=unit)
        snapshot = self.jobs.get(submitted.id)
        assert snapshot is not None
        return snapshot

    def pipeline(self) -> dict[str, Any]:
        """Process-side health: the sink feeder's counters (when it runs here) and active jobs."""
        out: dict[str, Any] = {"sink_in_process": self.sink_feeder is not None}
        w = self.sink_feeder
        if w is not None:
            out.update(
                sink_records=w.records,
                sink_dead_letters=w.dead_letters,
                sink_writes=w.writes,
                sink_stopped_partitions=len(w.held),
            )
        out["jobs_active"] = sum(self.jobs.running().values())
        return out

    async def health(self, scope: Scope) -> dict[str, Any]:
        """Store health within ``scope`` (refreshes the store gauges for an unscoped caller)."""
        now = self.clock()
        try:
            health = await self.query("health", self.queries.health, scope=scope, now_ns=now)
        except Exception:
            if scope.tenants is None:
                self.metrics.set_health(None)
            raise
        if scope.tenants is None:
            self.metrics.set_health(health)
        return health

    async def regressions(self) -> None:
        """Refresh the sparsity-regression gauges (every signal, default windows, all tenants), at
        most once per ``regressions_every_s``; the gauges keep their values in between."""
        if time.monotonic() < self._regressions_due:
            return
        rows = await self.query(
            "regressions", self.queries.regressions, all_signals=1, scope=Scope(until_ns=self.clock())
        )
        self.metrics.set_regressions(rows)
        self._regressions_due = time.monotonic() + self.regressions_every_s

    def close(self) -> None:
        """Stop the jobs (running ones at their next progress report)."""
        self.jobs.shutdown(wait=True)
