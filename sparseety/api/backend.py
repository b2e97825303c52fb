"""What the HTTP handlers share: the store, queries, tokens, jobs, metrics and the sink (if any).

Reads go through :meth:`Backend.read`: on a :class:`~sparseety.sinks.clickhouse.client.ReaderPool`
(read-only clients, threads of their own), under the caller's limits (``api.limits.tenant`` or
``.admin``: time, memory, bytes read, requests at once per token), and stopped (``KILL QUERY``)
when the client goes away. The store's own thread keeps the sink's writes, the price writes
(:meth:`Backend.write`) and ``/healthz`` (:meth:`Backend.ping`), so one slow query delays only its
caller. The event loop — shared with the sink loop in ``sparseety store`` — never waits on
ClickHouse; every call is timed for ``sparseety:store_query_duration_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sparseety.api.auth import ADMIN_PRINCIPAL, Principal, TokenTable
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
from sparseety.config import Config, QueryLimits
from sparseety.errors import QueryError, QueryLimitError, StoreError, TooManyQueriesError
from sparseety.queries.registry import Scope
from sparseety.queries.sql import clickhouse_message
from sparseety.sinks.clickhouse.client import Store

log = logging.getLogger("sparseety.api")
T = TypeVar("T")
JOB_KINDS = ("replay", "ingest", "vllm_log", "analyze")
#: ClickHouse's codes for a statement stopped at a limit: time, rows, memory, bytes, rows or bytes.
LIMIT_CODES = frozenset({159, 158, 241, 307, 396})
#: How often a waiting read checks whether its client went away.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The caller disconnected while its query ran; the query was stopped (nobody is answered)."""


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

    Attributes:
        readers: The read-only clients the API's reads run on (closed by :meth:`close`).
        queries: The query library on the readers, under the admin limits (the API's own
            health and regression figures).
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
        self.limits = cfg.api.limits
        self.readers = store.readers(self.limits.readers)
        self.queries = self._queries(self.limits.admin.settings())
        self._running: dict[str, int] = {}  # principal name -> its reads at the store now
        self._kills: set[asyncio.Future[None]] = set()
        self.tokens = tokens
        self.sink_feeder = sink_feeder
        self.clock = clock
        self.metrics = ApiMetrics()
        if sink_feeder is not None:
            self.metrics.watch_sink(sink_feeder)
        self.jobs = JobManager(max_workers=max_jobs, on_finish=self._job_finished)

    def _job_finished(self, job: Job) -> None:
        self.metrics.job_finished(job.kind, job.state)

    def _queries(self, settings: dict[str, Any]) -> ApiQueries:
        return ApiQueries(self.readers.store(settings), tokenizers=self.cfg.api.tokenizers)

    def limits_for(self, who: Principal) -> QueryLimits:
        """The caller's limits: an all-tenant token's, or a tenant's."""
        return self.limits.admin if who.admin else self.limits.tenant

    async def read(
        self,
        who: Principal,
        name: str,
        fn: Callable[[ApiQueries], T],
        *,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> T:
        """``fn(queries)`` on a reader thread, its statements under ``who``'s limits; timed as ``name``.

        Args:
            who: The caller (its limits, and its cap of reads at once).
            name: The metric label.
            fn: Called with the query library over a pooled read-only store.
            disconnected: Whether the caller went away (``Request.is_disconnected``): then the
                query is killed and :class:`ClientGone` raised.

        Raises:
            TooManyQueriesError: ``who`` has its ``max_concurrent`` reads running already.
            QueryLimitError: a statement reached a limit.
            ClientGone: the caller went away.
        """
        limits = self.limits_for(who)
        held = self._running.get(who.name, 0)
        if held >= limits.max_concurrent:
            self.metrics.query_errors.labels(name).inc()
            raise TooManyQueriesError(
                f"this token has {held} queries running already (at most {limits.max_concurrent} "
                f"at once: api.limits.{'admin' if who.admin else 'tenant'}.max_concurrent); retry",
                limit=limits.max_concurrent,
            )
        self._running[who.name] = held + 1
        tag = f"sparseety-{secrets.token_hex(8)}"  # the statements' log_comment, to KILL them by
        queries = self._queries({**limits.settings(), "log_comment": tag})
        started = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(self.readers.executor, fn, queries)
        try:
            return await self._wait(future, tag, disconnected)
        except (StoreError, QueryError) as exc:
            self.metrics.query_errors.labels(name).inc()
            code = exc.fields.get("code")
            if code in LIMIT_CODES:
                message = f"the query reached a limit: {_limit_message(exc)}"
                raise QueryLimitError(message, code=code) from None
            raise
        except BaseException:
            self.metrics.query_errors.labels(name).inc()
            raise
        finally:
            left = self._running[who.name] - 1
            if left:
                self._running[who.name] = left
            else:
                del self._running[who.name]
            self.metrics.query_seconds.labels(name).observe(time.perf_counter() - started)

    async def _wait(
        self, future: asyncio.Future[T], tag: str, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> T:
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if disconnected is not None and await disconnected():
                    self._kill(tag)
                    raise ClientGone(tag)
        except asyncio.CancelledError:
            self._kill(tag)
            raise

    def _kill(self, tag: str) -> None:
        """Stop the statements tagged ``tag`` (on the store's own thread; not awaited)."""
        sql = f"KILL QUERY WHERE Settings['log_comment'] = '{tag}' ASYNC"  # tag: hex we made

        async def kill() -> None:
            with contextlib.suppress(Exception):
                await self.store.arun(lambda c: c.command(sql))

        task = asyncio.ensure_future(kill())
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def write(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` (store writes inside, on :attr:`store`) on the store's thread."""
        started = time.perf_counter()
        try:
            return await self.store.arun(lambda _client: fn(*args, **kwargs))
        except Exception:
            self.metrics.query_errors.labels(name).inc()
            raise
        finally:
            self.metrics.query_seconds.labels(name).observe(time.perf_counter() - started)

    async def ping(self) -> None:
        """Whether the store answers, on its own thread (never behind a slow read).

        Raises:
            StoreError: it does not.
        """
        await self.write("ping", self.store.query, "SELECT 1 AS ok")

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

    async def health(self, who: Principal, scope: Scope) -> dict[str, Any]:
        """Store health within ``scope`` (refreshes the store gauges for an unscoped caller)."""
        now = self.clock()
        try:
            health = await self.read(who, "health", lambda q: q.health(scope=scope, now_ns=now))
        except Exception:
            if scope.tenants is None:
                self.metrics.set_health(None)
            raise
        if scope.tenants is None:
            self.metrics.set_health(health)
        return health

    async def bill_2026_totals(self) -> None:
        """Refresh the token-class gauges of issue 36 (all tenants)."""
        totals = await self.read(ADMIN_PRINCIPAL, "bill_2026_totals", lambda q: q.bill_2026_totals())
        self.metrics.set_bill_2026(totals)

    async def regressions(self) -> None:
        """Refresh the sparsity-regression gauges (every signal, default windows, all tenants), at
        most once per ``regressions_every_s``; the gauges keep their values in between."""
        if time.monotonic() < self._regressions_due:
            return
        until = self.clock()
        rows = await self.read(
            ADMIN_PRINCIPAL,
            "regressions",
            lambda q: q.regressions(all_signals=1, scope=Scope(until_ns=until)),
        )
        self.metrics.set_regressions(rows)
        self._regressions_due = time.monotonic() + self.regressions_every_s

    def close(self) -> None:
        """Stop the jobs (running ones at their next progress report), close the readers."""
        self.jobs.shutdown(wait=True)
        self.readers.close()


def _limit_message(exc: BaseException) -> str:
    return clickhouse_message(exc).removeprefix("the store refused the SQL: ")[:300]
