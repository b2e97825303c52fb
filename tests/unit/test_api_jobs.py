"""The job manager: states, progress and throughput, failures as outcomes, cancellation at shutdown."""

from __future__ import annotations

import threading
import time
from typing import Any

from sparseety.api.jobs import CANCELLED, FAILED, SUCCEEDED, Job, JobContext, JobManager
from sparseety.errors import ReplayError


def wait_state(jobs: JobManager, job_id: str, *states: str, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = jobs.get(job_id)
        assert snap is not None
        if snap["state"] in states:
            return snap
        assert time.monotonic() < deadline, snap
        time.sleep(0.01)


def test_a_job_reports_progress_and_its_result() -> None:
    finished: list[Job] = []
    jobs = JobManager(on_finish=finished.append)

    def work(ctx: JobContext) -> dict[str, Any]:
        for i in range(1, 6):
            ctx.progress(i * 10, 50)
            time.sleep(0.01)
        return {"rows": 50}

    job = jobs.submit("replay", {"topic": "t"}, work)
    snap = wait_state(jobs, job.id, SUCCEEDED)
    assert snap["result"] == {"rows": 50} and snap["error"] is None
    assert snap["progress"] == {"done": 50, "total": 50, "unit": "records", "fraction": 1.0}
    assert snap["elapsed_s"] > 0 and snap["throughput_per_s"] > 0
    assert snap["started_ns"] >= snap["submitted_ns"] and snap["finished_ns"] >= snap["started_ns"]
    assert [j.state for j in finished] == [SUCCEEDED] and jobs.running() == {}
    jobs.shutdown()


def test_a_failure_is_the_jobs_outcome() -> None:
    jobs = JobManager()

    def fail(ctx: JobContext) -> dict[str, Any]:
        raise ReplayError("topic x does not exist")

    snap = wait_state(jobs, jobs.submit("replay", {}, fail).id, FAILED)
    assert snap["error"] == {"type": "ReplayError", "message": "topic x does not exist"}
    assert snap["result"] is None
    jobs.shutdown()


def test_shutdown_cancels_running_and_queued_jobs_at_their_next_report() -> None:
    jobs = JobManager(max_workers=1)
    started = threading.Event()

    def forever(ctx: JobContext) -> dict[str, Any]:
        started.set()
        n = 0
        while True:
            n += 1
            ctx.progress(n, 0)
            time.sleep(0.01)

    running = jobs.submit("ingest", {}, forever, unit="bytes")
    queued = jobs.submit("ingest", {}, forever, unit="bytes")
    assert started.wait(5)
    assert jobs.running() == {"ingest": 2}
    assert jobs.get(queued.id)["state"] == "queued"  # type: ignore[index]
    jobs.shutdown()
    for job in (running, queued):
        snap = jobs.get(job.id)
        assert snap is not None and snap["state"] == CANCELLED, snap
        assert "shutting down" in snap["error"]["message"]
    assert [j["id"] for j in jobs.list()] == [queued.id, running.id]


def test_finished_jobs_beyond_keep_are_forgotten() -> None:
    jobs = JobManager(keep=2)
    ids = []
    for i in range(4):
        job = jobs.submit("replay", {"i": i}, lambda ctx: {})
        wait_state(jobs, job.id, SUCCEEDED)
        ids.append(job.id)
    assert [j["id"] for j in jobs.list()] == [ids[3], ids[2]]
    assert jobs.get(ids[0]) is None
    jobs.shutdown()
