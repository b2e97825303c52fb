"""`sparseety up / status / down` as a user runs them: separate CLI invocations that agree through
the data dir; the status table and exit codes say what runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from sparseety.config import load_config
from tests.helpers import VENV_BIN, finished_uids, free_port, produce_events, stack_env, stored_uids, wait_for
from tests.sim import SimEngine, workload


def cli(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "sparseety"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_up_status_down(tmp_path: Path) -> None:
    api_port = free_port()
    env = stack_env(tmp_path / "data", free_port(), api_port=str(api_port))
    try:
        stopped = cli(env, "status")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout

        up = cli(env, "up", "--workers", "2")
        assert up.returncode == 0, up.stderr
        assert "worker-1: starting the assembler" in up.stderr
        table = {
            line.split()[0]: line.split()[1] for line in up.stdout.splitlines()[1:] if line[:1].isalpha()
        }
        assert table["broker"] == "ready" and table["store"] == "ready"
        assert table["worker-0"] == table["worker-1"] == "ready"  # started and consuming
        assert httpx.get(f"http://127.0.0.1:{api_port}/healthz", timeout=5).json()["status"] == "ok"

        status = cli(env, "status")
        assert status.returncode == 0 and status.stdout.count("ready") == 4  # broker, store, 2 workers
        assert "engines (spill journals under" in status.stdout and "none seen" in status.stdout

        again = cli(env, "up")  # idempotent: nothing new starts
        assert again.returncode == 0 and "starting" not in again.stderr
        assert "broker: already running on" in again.stderr
        assert (tmp_path / "data" / "logs" / "worker-0.log").stat().st_size > 0
    finally:
        down = cli(env, "down")
    assert down.returncode == 0, down.stderr
    assert "stopped: worker-0, worker-1, store, broker" in down.stdout
    after = cli(env, "status")
    parts = after.stdout.split("\nlogs:")[0].splitlines()[1:]  # the parts table; engines follow
    states = [line.split()[1] for line in parts]
    assert after.returncode == 0 and states and set(states) == {"stopped"}


def test_broker_start_alone_puts_the_stack_on_the_new_log(tmp_path: Path) -> None:
    """``broker stop`` + ``broker start`` in a stack's data dir (issue 31): the in-memory broker
    comes back empty, so ``broker start`` restarts the worker and the store on the new log, as
    ``up`` does; a request sent afterwards is stored without another ``up``."""
    data = tmp_path / "data"
    port = free_port()
    env = stack_env(data, port)
    cfg = load_config(data_dir=str(data), kafka={"bootstrap": f"127.0.0.1:{port}"})
    try:
        assert cli(env, "up").returncode == 0
        before = SimEngine(engine="before", epoch="e1", seed=2).run(workload(5, seed=2))
        produce_events(cfg, before)
        wait_for(lambda: set(stored_uids(cfg)) >= finished_uids(before), 120, 1.0, "the first requests")
        worker_pid = (data / "run" / "worker-0.pid").read_text()

        assert cli(env, "broker", "stop").returncode == 0
        start = cli(env, "broker", "start")
        assert start.returncode == 0, start.stderr
        assert "restarting worker-0, store so they start on the new broker's log" in start.stderr
        assert {"broker: ready", "worker-0: ready", "store: ready"} <= set(start.stdout.splitlines())
        assert (data / "run" / "worker-0.pid").read_text() != worker_pid
        status = cli(env, "status")
        assert status.returncode == 0, status.stdout

        after = SimEngine(engine="after", epoch="e1", seed=3).run(workload(5, seed=3))
        produce_events(cfg, after)
        wait_for(lambda: set(stored_uids(cfg)) >= finished_uids(after), 120, 1.0, "the requests after")
    finally:
        down = cli(env, "down")
    assert down.returncode == 0, down.stderr
