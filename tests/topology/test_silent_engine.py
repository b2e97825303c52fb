"""Issue 21: an engine pointed at a wrong Kafka bootstrap keeps serving and spills to its journal;
with its spill dir under the stack's data dir, ``sparseety status`` lists it as a silent engine
that does not deliver, and its log names the bootstrap to check. A real producer (the emitter
the plugin uses) against an address where no broker listens; the status command as a process."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from sparseety.config import load_config, to_env
from sparseety.producers.delivery import STATE_FILE
from sparseety.producers.emitter import Emitter
from sparseety.stack.engines import engine_rows, journals
from tests.helpers import VENV_BIN, free_port, wait_for
from tests.topology.test_producer_outage import _finished


def test_wrong_bootstrap_is_a_silent_engine_in_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    data = tmp_path / "stack-data"
    # the engine's environment names the stack's data dir, nothing else about the spill dir
    cfg = load_config(
        env={"SPARSEETY_DATA_DIR": str(data), "SPARSEETY_KAFKA_BOOTSTRAP": wrong},
        producer={"memory_limit_bytes": 1024 * 1024, "heartbeat_interval_s": 3600, "flush_timeout_s": 1},
        topics={"engine_events": "silent.engine-events", "partitions": 1},
    )
    assert cfg.spill_path == data / "spill"
    caplog.set_level(logging.INFO, logger="sparseety")
    em = Emitter(cfg, engine_name="wrong-bootstrap", epoch="1", stall_s=2.0)
    try:
        for i in range(4000):  # ~1.4 MB: past the 1 MiB bound, so it spills while Kafka is away
            em.emit(_finished, i)
        journal = cfg.spill_path / "wrong-bootstrap" / "core"
        wait_for(lambda: any(journal.glob("*.seg")), 30, 0.2, "a spilled journal segment")
        # the engine said where it spills, and which setting to check (the relay's lines go to
        # the engine's stderr)
        text = caplog.text + capfd.readouterr().err
        assert f"spill journal {journal}" in text
        assert f"Kafka at {wrong} does not take events" in text and "SPARSEETY_KAFKA_BOOTSTRAP" in text

        (j,) = journals(cfg.spill_path)
        assert (j.engine, j.stream, j.process_alive) == ("wrong-bootstrap", "core", True)
        assert j.pending_bytes > 0

        # the stack's view: `sparseety status` on the same data dir (no stack running)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update(to_env(load_config(data_dir=str(data), kafka={"bootstrap": f"127.0.0.1:{free_port()}"})))
        out = subprocess.run(
            [str(VENV_BIN / "sparseety"), "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert "wrong-bootstrap" in out.stdout, out.stdout + out.stderr
        line = next(x for x in out.stdout.splitlines() if "wrong-bootstrap" in x)
        assert "silent: not delivering" in line and "its process runs" in line
    finally:
        em.close(timeout=1)
    # once the engine process is gone, the journal waits for its next start
    (j,) = journals(cfg.spill_path)
    assert not j.process_alive
    row = engine_rows([j], [], bootstrap=wrong, now_ns=time.time_ns())[0]
    assert "drains at its next start" in row["detail"]


def test_a_wrong_bootstrap_is_said_within_seconds_before_anything_spills(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 31: with light traffic nothing spills (the events wait in memory), yet the engine's
    log says within seconds that Kafka takes none, and ``sparseety status`` lists it as not
    delivering and exits 1 (it said "reporting" with exit 0 for minutes)."""
    wrong = f"127.0.0.1:{free_port()}"
    data = tmp_path / "stack-data"
    cfg = load_config(
        env={"SPARSEETY_DATA_DIR": str(data), "SPARSEETY_KAFKA_BOOTSTRAP": wrong},
        producer={"heartbeat_interval_s": 3600, "flush_timeout_s": 1},
        topics={"engine_events": "silent.engine-events", "partitions": 1},
    )
    caplog.set_level(logging.WARNING, logger="sparseety")
    em = Emitter(cfg, engine_name="light-traffic", epoch="1", stall_s=2.0)
    started = time.monotonic()
    try:
        for i in range(10):
            em.emit(_finished, i)
        state = cfg.spill_path / "light-traffic" / "core" / STATE_FILE
        while not (state.exists() and '"delivering": false' in state.read_text()):
            assert time.monotonic() - started < 15, "no delivery state within 15 s"
            time.sleep(0.2)
        assert time.monotonic() - started < 12
        assert f"Kafka at {wrong} takes no events" in capfd.readouterr().err  # the relay's stderr
        assert not any((cfg.spill_path / "light-traffic" / "core").glob("*.seg"))  # nothing spilled
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update(to_env(load_config(data_dir=str(data), kafka={"bootstrap": f"127.0.0.1:{free_port()}"})))
        out = subprocess.run(
            [str(VENV_BIN / "sparseety"), "status"], env=env, capture_output=True, text=True, timeout=60
        )
        line = next(x for x in out.stdout.splitlines() if "light-traffic" in x)
        assert "silent: not delivering" in line and "events waiting" in line, out.stdout
        assert out.returncode == 1
    finally:
        em.close(timeout=1)
    assert not state.exists()  # a stopped stream leaves its journal, not a stale state


def test_store_side_engines_are_flagged_when_their_newest_request_is_old() -> None:
    now = 10_000 * 10**9
    stored = [
        {"engine": "busy", "epochs": 1, "requests": 5, "last_finished_ts_ns": now - 10 * 10**9},
        {"engine": "quiet", "epochs": 2, "requests": 9, "last_finished_ts_ns": now - 3600 * 10**9},
    ]
    rows = {r["engine"]: r for r in engine_rows([], stored, bootstrap="b:1", now_ns=now)}
    assert rows["busy"]["state"] == "reporting" and "10 s ago" in rows["busy"]["last seen"]
    assert rows["quiet"]["state"] == "silent" and "60 min ago" in rows["quiet"]["last seen"]
