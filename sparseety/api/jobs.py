"""Background jobs: offline work (replays, ingests) submitted over HTTP and polled for status.

Jobs run on a small thread pool, never on the event loop; the handlers only submit and read
snapshots. A job function gets a :class:`JobContext` whose :meth:`~JobContext.progress` records
progress and throughput and raises :class:`JobCancelled` once the manager shuts down, so long jobs
stop at their next progress report. Finished jobs are kept (the newest ``keep``) for polling.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparseety.errors import SparseetyError

log = logging.getLogger("sparseety.api.jobs")

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"


class JobCancelled(SparseetyError):
    """The job was stopped before it finished (the process is shutting down)."""


@dataclass
class Job:
    """One submitted job (mutated by its worker thread under the manager's lock)."""

    id: str
    kind: str
    params: dict[str, Any]
    unit: str
    state: str = QUEUED
    submitted_ns: int = field(default_factory=time.time_ns)
    started_ns: int | None = None
    finished_ns: int | None = None
    done: int = 0
    total: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    started_mono: float | None = None
    finished_mono: float | None = None

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view: state, progress, throughput, result or error."""
        end = self.finished_mono if self.finished_mono is not None else time.monotonic()
        elapsed = end - self.started_mono if self.started_mono is not None else 0.0
        return {
            "id": self.id,
            "kind": self.kind,
            "state": self.state,
            "params": self.params,
            "submitted_ns": self.submitted_ns,
            "started_ns": self.started_ns,
            "finished_ns": self.finished_ns,
            "progress": {
                "done": self.done,
                "total": self.total,
                "unit": self.unit,
                "fraction": round(min(self.done / self.total, 1.0), 4) if self.total else None,
            },
            "elapsed_s": round(elapsed, 3),
            "throughput_per_s": round(self.done / elapsed, 1) if elapsed > 0 else 0.0,
            "result": self.result,
            "error": self.error,
        }


class JobContext:
    """What a running job sees: progress reporting and cancellation."""

    def __init__(self, job: Job, lock: threading.Lock, cancelled: threading.Event) -> None:
        self.job = job
        self._lock = lock
        self._cancelled = cancelled

    def progress(self, done: int, total: int) -> None:
        """Record progress.

        Raises:
            JobCancelled: the manager is shutting down.
        """
        with self._lock:
            self.job.done = done
            self.job.total = max(total, done)
        if self._cancelled.is_set():
            raise JobCancelled("cancelled: the API is shutting down")


JobFn = Callable[[JobContext], dict[str, Any]]


class JobManager:
    """Runs jobs in the background and keeps their state.

    Args:
        max_workers: Jobs that run at once (the rest wait, state ``queued``).
        keep: Finished jobs remembered for polling.
        on_finish: Called with each job when it ends (metrics).
    """

    def __init__(
        self, *, max_workers: int = 1, keep: int = 200, on_finish: Callable[[Job], None] | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sparseety-job")
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keep = keep
        self._on_finish = on_finish

    def submit(self, kind: str, params: dict[str, Any], fn: JobFn, *, unit: str = "records") -> Job:
        """Queue ``fn``; returns the job (state ``queued``).

        Raises:
            JobCancelled: the manager is shut down.
        """
        if self._cancelled.is_set():
            raise JobCancelled("the API is shutting down; no new jobs")
        job = Job(uuid.uuid4().hex, kind, params, unit)
        with self._lock:
            self._jobs[job.id] = job
            self._trim()
        self._pool.submit(self._run, job, fn)
        return job

    def _run(self, job: Job, fn: JobFn) -> None:
        with self._lock:
            job.state, job.started_ns, job.started_mono = RUNNING, time.time_ns(), time.monotonic()
        try:
            if self._cancelled.is_set():
                raise JobCancelled("cancelled before it started: the API is shutting down")
            result = fn(JobContext(job, self._lock, self._cancelled))
        except JobCancelled as exc:
            self._end(job, CANCELLED, error={"type": type(exc).__name__, "message": str(exc)})
        except Exception as exc:
            # the error is the job's outcome; the message of a SparseetyError is written for users
            log.warning("job %s (%s) failed: %s: %s", job.id, job.kind, type(exc).__name__, exc)
            self._end(job, FAILED, error={"type": type(exc).__name__, "message": str(exc)})
        else:
            self._end(job, SUCCEEDED, result=result)

    def _end(
        self,
        job: Job,
        state: str,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
    ) -> None:
        with self._lock:
            job.state, job.result, job.error = state, result, error
            job.finished_ns, job.finished_mono = time.time_ns(), time.monotonic()
        if self._on_finish is not None:
            self._on_finish(job)

    def _trim(self) -> None:
        finished = [j for j in self._jobs.values() if j.state in (SUCCEEDED, FAILED, CANCELLED)]
        for j in finished[: max(0, len(self._jobs) - self._keep)]:
            del self._jobs[j.id]

    def get(self, job_id: str) -> dict[str, Any] | None:
        """A snapshot of one job, or None."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job.snapshot() if job else None

    def list(self) -> list[dict[str, Any]]:
        """Snapshots of every remembered job, newest first."""
        with self._lock:
            return [j.snapshot() for j in reversed(self._jobs.values())]

    def running(self) -> dict[str, int]:
        """Queued or running jobs per kind."""
        with self._lock:
            out: dict[str, int] = {}
            for j in self._jobs.values():
                if j.state in (QUEUED, RUNNING):
                    out[j.kind] = out.get(j.kind, 0) + 1
            return out

    def shutdown(self, *, wait: bool = True) -> None:
        """Cancel queued and running jobs (at their next progress report) and stop the pool."""
        self._cancelled.set()
        self._pool.shutdown(wait=wait, cancel_futures=False)
