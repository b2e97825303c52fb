"""The store client (DSNs, one engine per process, a path another process holds), replay bounds
and the processor seam."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sparseety.config import load_config
from sparseety.errors import PluginLoadError, ReplayError, StoreError, StoreLockedError
from sparseety.sinks import processors
from sparseety.sinks.clickhouse.client import Store, parse_dsn
from sparseety.sinks.clickhouse.embedded import OWNER_FILE, read_owner
from sparseety.sinks.replay import Bound, parse_bound
from sparseety.streams.replay import FoldProcessor

NOW = 1_700_000_000 * 10**9

HOLDER = """
import sys, time
from sparseety.config import load_config
from sparseety.sinks.clickhouse.client import Store
s = Store.open(load_config(clickhouse={"dsn": "chdb://" + sys.argv[1]}), owner="holder-for-test")
print("open", flush=True)
time.sleep(60)
"""


def test_parse_dsn() -> None:
    assert parse_dsn("chdb:///var/lib/x").path == Path("/var/lib/x")
    assert parse_dsn("https://user:pw@ch.example:8443").kind == "http"
    with pytest.raises(StoreError, match="absolute"):
        parse_dsn("chdb://relative/path")
    with pytest.raises(StoreError, match="unsupported"):
        parse_dsn("clickhouse://x")


def test_a_path_held_by_another_process_is_a_clear_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        assert read_owner(path) is not None and read_owner(path)["pid"] == holder.pid  # type: ignore[index]
        with pytest.raises(StoreLockedError) as info:
            Store.open(load_config(clickhouse={"dsn": f"chdb://{path}"}))
        msg = str(info.value)
        assert f"process {holder.pid} (holder-for-test)" in msg and "sparseety store" in msg
        assert info.value.owner_pid == holder.pid
        assert "Cannot lock file" not in capfd.readouterr().err, "chDB was asked, and wrote its own error"
    finally:
        holder.kill()
        holder.wait()
    # the owner is gone: the path opens, and the stale owner record is replaced and cleaned up
    with Store.open(load_config(clickhouse={"dsn": f"chdb://{path}"}), owner="me") as store:
        assert store.query("SELECT 1 AS one") == [{"one": 1}]
        assert read_owner(path)["command"] == "me"  # type: ignore[index]
    assert not (path / OWNER_FILE).exists()


def test_one_engine_per_process_shared_by_stores_of_the_same_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = tmp_path_factory.getbasetemp() / "chdb-unit"
    cfg = load_config(clickhouse={"dsn": f"chdb://{path}"})
    a, b = Store.open(cfg), Store.open(cfg, database="other")
    try:
        assert a.engine is b.engine and b.database == "other"
        with pytest.raises(StoreError, match="one data path per process"):
            Store.open(load_config(clickhouse={"dsn": f"chdb://{path}-elsewhere"}))
        # every call runs on the store's one thread, whichever thread asks
        threads = set()
        workers = [
            threading.Thread(target=lambda: threads.add(a.run(lambda c: threading.current_thread().name)))
            for _ in range(4)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len(threads) == 1 and next(iter(threads)).startswith("sparseety-store")
    finally:
        a.close()
        b.close()
    with pytest.raises(StoreError, match="closed"):
        a.query("SELECT 1")


def test_store_errors_carry_the_clickhouse_code(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.getbasetemp() / "chdb-unit"
    with Store.open(load_config(clickhouse={"dsn": f"chdb://{path}"})) as store:
        with pytest.raises(StoreError) as info:
            store.query("SELECT * FROM no_such_db.no_such_table")
        assert info.value.fields["code"] in (60, 81)


@pytest.mark.parametrize(
    ("text", "bound"),
    [
        ("beginning", Bound("beginning")),
        ("end", Bound("end", NOW)),
        ("now", Bound("end", NOW)),
        ("1234", Bound("offset", 1234)),
        ("2h", Bound("time", NOW - 2 * 3600 * 10**9)),
        ("15m", Bound("time", NOW - 15 * 60 * 10**9)),
        ("2023-11-14T22:13:20Z", Bound("time", NOW)),
        ("2023-11-14T22:13:20", Bound("time", NOW)),
        ("2023-11-14T23:13:20+01:00", Bound("time", NOW)),
    ],
)
def test_replay_bounds(text: str, bound: Bound) -> None:
    assert parse_bound(text, now_ns=NOW) == bound


def test_bad_replay_bounds() -> None:
    with pytest.raises(ReplayError, match="replay bound"):
        parse_bound("yesterday-ish", now_ns=NOW)


def test_processors_for_topics() -> None:
    cfg = load_config()
    for topic in (cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq):
        assert processors.processor_for_topic(cfg, topic) is processors.identity
    assert list(processors.identity("n", {"a": 1}, "t", 0, 0)) == [("n", {"a": 1})]
    with pytest.raises(ReplayError, match="not a SparSEEty topic"):
        processors.processor_for_topic(cfg, "elsewhere")


def test_engine_events_replay_through_the_assemblers_fold() -> None:
    cfg = load_config()
    assert isinstance(processors.processor_for_topic(cfg, cfg.topics.engine_events), FoldProcessor)
    assert processors.load_processor("identity", cfg) is processors.identity
    with pytest.raises(PluginLoadError, match="no processor named"):
        processors.load_processor("nope", cfg)


@pytest.mark.parametrize("module", ["sparseety.streams.replay", "sparseety.sinks.replay"])
def test_replay_imports_no_faust(module: str) -> None:
    """Replay runs the fold in memory: importing it must not pull in Faust (or its runtime)."""
    probe = f"import {module}, sys; assert 'faust' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
