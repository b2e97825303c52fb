"""An epoch whose producer cannot see the prefix cache's inserts and evictions (SGLang's Rust
radix-tree core, EngineStarted ``kv_events_observed`` false): cached positions read "source
unknown" from the epoch's start and recompute after eviction is not claimed (streams/caveats.py,
docs/sglang.md). The same workload with the KV events seen gives a named source and a recompute:
the difference is the events, not the workload."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.producers.sglang.session import kv_events_observed
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f

T0 = 1_700_000_000 * 1_000_000_000
CFG = WorkerConfig(reorder_max_events=1, closed_retention_s=0)
PROMPT = list(range(8))


def workload(observed: bool) -> list[dict[str, Any]]:
    """r1 computes blocks a, b; r2 reads both; the cache evicts them; r3 computes them again. The
    KV events are there only when the producer observes them."""
    kv = [(ev.KV_STORED, f.kv_stored([b"a", b"b"]))] if observed else []
    removed = [(ev.KV_REMOVED, f.kv_removed([b"a", b"b"]))] if observed else []
    bodies = [
        (ev.ENGINE_STARTED, f.engine_started(engine_kind="sglang", kv_events_observed=observed)),
        (ev.REQUEST_STARTED, f.request_started("r1", PROMPT, hashes=[b"a", b"b"])),
        (ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])])),
        *kv,
        (ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=1)),
        (ev.REQUEST_STARTED, f.request_started("r2", [*PROMPT, 9], cached=8, hashes=[b"a", b"b"])),
        (ev.STEP_BATCH, f.step_batch(1, [("r2", 1, 8, [5])])),
        (ev.REQUEST_FINISHED, f.request_finished("r2", prompt=9, output=1, cached=8)),
        *removed,
        (ev.REQUEST_STARTED, f.request_started("r3", [*PROMPT, 7], hashes=[b"a", b"b"])),
        (ev.STEP_BATCH, f.step_batch(2, [("r3", 9, 0, [3])])),
        (ev.REQUEST_FINISHED, f.request_finished("r3", prompt=9, output=1)),
    ]
    return [f.wrap(i, t, b, ts_ns=T0 + 1000 * (i + 1)) for i, (t, b) in enumerate(bodies)]


def fold(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    asm = Assembler(CFG, MemoryStore())
    recs = [o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES]
    return {r["request_id"]: r for r in recs}


def statuses(rec: dict[str, Any]) -> list[tuple[int, int, str, str | None]]:
    return [
        (s["start"], s["end"], s["status"], s["source_request_uid"])
        for s in rec["timeline"]["segments"]
        if s["kind"] == "prompt"
    ]


def test_with_kv_events_the_source_is_named_and_the_recompute_counted() -> None:
    got = fold(workload(observed=True))
    assert statuses(got["r2"])[0] == (0, 8, "cached", f"{f.EID}/r1")
    assert got["r2"]["source_history_lost_ts_ns"] == 0
    assert got["r3"]["recomputed_eviction_tokens"] == 8 and got["r3"]["evicted_blocks_recomputed"] == 2
    assert all(r["consistent"] for r in got.values())


def test_without_kv_events_sources_are_unknown_from_the_start_and_no_recompute_is_claimed() -> None:
    got = fold(workload(observed=False))
    started_ts = T0 + 1000  # the EngineStarted event time: no KV history from the epoch's start
    # r2's cache hit is still counted (SGLang's own prefix_len), but no request is named for it
    assert statuses(got["r2"])[0] == (0, 8, "cached", None)
    assert got["r2"]["cache_read_tokens"] == 8
    assert got["r2"]["source_history_lost_ts_ns"] == started_ts
    # r3's prompt is laid out without blocks: computed, never "recomputed after eviction"
    assert got["r3"]["recomputed_eviction_tokens"] == 0 and got["r3"]["evicted_blocks_recomputed"] == 0
    assert {s[2] for s in statuses(got["r3"])} == {"computed"}
    assert got["r3"]["uncached_computed_tokens"] == 9
    # r1 and r3 had no cached positions: nothing of theirs needs a source
    assert got["r1"]["source_history_lost_ts_ns"] == got["r3"]["source_history_lost_ts_ns"] == 0
    assert all(r["consistent"] for r in got.values())


class RustUnifiedTreeCore:  # the class name SGLang 0.5.23 gives its Rust core's adapter
    pass


class UnifiedTreeCore:
    pass


@pytest.mark.parametrize(
    ("tree", "observed"),
    [
        (SimpleNamespace(_tree_core_backend="rust", tree_core=RustUnifiedTreeCore()), False),
        (SimpleNamespace(_tree_core_backend="python", tree_core=UnifiedTreeCore()), True),
        (SimpleNamespace(tree_core=RustUnifiedTreeCore()), False),  # no resolved name: the class
        (SimpleNamespace(), True),  # RadixCache and the other Python trees call the recorder
        (None, True),
    ],
)
def test_the_producer_reads_the_tree_core_sglang_resolved(tree: Any, observed: bool) -> None:
    assert kv_events_observed(tree) is observed


def _rust_tree(enabled: bool) -> Any:
    core = RustUnifiedTreeCore()
    core.kv_events = SimpleNamespace(enabled=enabled)  # type: ignore[attr-defined]
    return SimpleNamespace(_tree_core_backend="rust", tree_core=core)


@pytest.mark.parametrize(
    ("enabled", "teed", "observed"),
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_the_rust_core_is_observed_when_its_kv_events_are_on_and_teed(
    enabled: bool, teed: bool, observed: bool
) -> None:
    """SGLang's --kv-events-config makes the Rust core queue its events; the hooks tee them."""
    assert kv_events_observed(_rust_tree(enabled), rust_tee=teed) is observed
