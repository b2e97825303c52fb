"""The SGLang producer on SGLang's Linux-default radix tree, the Rust TreeCore, with SGLang's own
KV events on (``--kv-events-config``, a zmq publisher on loopback) and the overlap scheduler.

The Rust core inserts and evicts inside Rust; with SGLang's KV events on it queues them, and the
producer tees that queue (``producers/sglang/hooks.py``: the adapter's ``_kv_event_from_tagged``).
The module's workload and checks are ``test_sglang_engine``'s, against SGLang's ``meta_info`` and
a truth built from SGLang's own converted KV events (``tests/e2e/sglang_launch.py``). What this
adds: every cached position the fold could place has its source (nothing "source unknown"),
recompute after eviction equals the truth, and EngineStarted says the KV events are observed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config
from sparseety.stack.server_process import _free_port
from sparseety.stack.sglang_engine import kv_events_args
from tests.e2e.engine_events import engine_events
from tests.e2e.test_sglang_engine import engine_workdir, run_workload, settled_realtime_tokens, start_server
from tests.sglang_checks import check_run, fold

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rust_run(broker: Config, e2e_dir: Path) -> Iterator[dict[str, Any]]:
    cfg, workdir = engine_workdir(broker, e2e_dir, "sglang-rust")
    server, truth_path = start_server(cfg, workdir, tree_core="rust", extra_args=kv_events_args(_free_port()))
    try:
        answers = run_workload(server)
        metrics = settled_realtime_tokens(server.url)
    finally:
        server.close()
    n = len(answers)
    events = engine_events(
        cfg, lambda es: any(ev.payload_type(e) == ev.ENGINE_STOPPED for e in es), timeout=60
    )
    assert sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in events) >= n
    lines = [json.loads(line) for line in truth_path.read_text().splitlines()]
    yield {
        "answers": answers,
        "metrics": metrics,
        "events": events,
        "truth": {t["rid"]: t for t in lines if "rid" in t},
        "loops": [t["event_loop"] for t in lines if "event_loop" in t],
    }


def test_sglang_rust_core_accounting_equals_sglang(rust_run: dict[str, Any]) -> None:
    """``tests/sglang_checks.check_run`` on the Rust core: meta_info per request, the engine
    totals, cache sources per full block, and recompute after eviction against the truth."""
    meta = {rid: a.get("meta_info", {}) for rid, a in rust_run["answers"].items()}
    tenants = {rid: a["tenant"] for rid, a in rust_run["answers"].items()}
    check_run(rust_run["events"], meta, tenants, rust_run["truth"], rust_run["metrics"])


def test_sglang_rust_core_sources_are_known(rust_run: dict[str, Any]) -> None:
    """EngineStarted says the KV events are observed; no request reads "source unknown"
    (``source_history_lost_ts_ns``), and the cached positions on full blocks name a request."""
    started = [ev.payload(e) for e in rust_run["events"] if ev.payload_type(e) == ev.ENGINE_STARTED]
    assert len(started) == 1 and started[0]["kv_events_observed"] is True
    assert rust_run["loops"] == ["event_loop_overlap"]
    assert any(ev.payload_type(e) == ev.KV_REMOVED for e in rust_run["events"])  # it did evict
    accounts = fold(rust_run["events"])
    cached = [rid for rid, a in accounts.items() if a["cache_read_tokens"] > 0]
    assert len(cached) >= 3, cached
    for rid in cached:
        acc = accounts[rid]
        assert acc["source_history_lost_ts_ns"] == 0, rid
        full = acc["cache_read_tokens"] // 16 * 16
        segs = [s for s in acc["timeline"]["segments"] if s["status"] == "cached" and s["end"] <= full]
        assert segs and all(s["source_request_uid"] for s in segs), (rid, segs)
