"""The columnar steady path (streams/columnar.py) gives exactly the general path's outputs and state.

Each stream is folded twice, with the steady columns and without (``Assembler(columnar=False)``:
every row on the general path), and compared output for output; the states are compared after
``MemoryStore.sync`` at several points (the objects the changelog would get), so a field the
columns forget to write back fails here even when no output shows it yet. The harness matrix
(tests/harness/test_matrix.py) does the same over vLLM's real scheduler in every mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.streams import fold as fold_module
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore, decode_state, encode_state
from tests import factories as f
from tests.sim import SimEngine, workload


@pytest.fixture(autouse=True)
def columns_from_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated engines run small batches: fold every step's steady rows in columns."""
    monkeypatch.setattr(fold_module, "COLUMNAR_MIN_ROWS", 1)


CFG = WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0)

SIMS = {
    "plain": {},
    "long-decode": {"max_batch": 16},
    "spec": {"spec_k": 2},
    "preempt": {"preempt_prob": 0.2, "cache_blocks": 12},
    "spec-preempt": {"spec_k": 3, "preempt_prob": 0.15, "cache_blocks": 16},
    "sliding": {"sliding_window": 8},
}


def _states(store: MemoryStore) -> dict[str, bytes]:
    store.sync()
    return {k: encode_state(v) for k, v in sorted(store.data.items())}


def fold_both(events: list[dict[str, Any]], cfg: WorkerConfig = CFG, every: int = 7) -> tuple[Assembler, int]:
    """Fold ``events`` both ways, checking outputs per event and states every ``every`` events;
    returns the columnar assembler and how many steady rows it folded in columns."""
    ref_store, col_store = MemoryStore(), MemoryStore()
    ref = Assembler(cfg, ref_store, clock=lambda: 0, columnar=False)
    col = Assembler(cfg, col_store, clock=lambda: 0)
    steady_rows = 0
    for i, e in enumerate(events):
        a, b = ref.apply(e), col.apply(e)
        assert b == a, f"event {i} ({ev.payload_type(e)})"
        steady_rows += sum(len(c) for c in col.fold.columns.values())
        if i % every == 0:
            assert _states(col_store) == _states(ref_store), f"state after event {i}"
    assert _states(col_store) == _states(ref_store)
    return col, steady_rows


@pytest.mark.parametrize("name", list(SIMS))
@pytest.mark.parametrize("seed", [1, 2])
def test_columnar_equals_general_on_simulated_engines(name: str, seed: int) -> None:
    events = SimEngine(seed=seed, **SIMS[name]).run(workload(24, seed=seed, max_tokens=40))
    _, steady_rows = fold_both(events)
    if name == "sliding":  # a limited attention shape takes the general path only
        assert steady_rows == 0
    else:
        assert steady_rows > 0  # the columns were used, not only the general path


def test_columnar_equals_general_on_the_synthetic_decode_batch() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_assembler import synthetic

    events, _ = synthetic(16, 120, prompt=64, finish_every=3)
    _, steady_rows = fold_both(events, WorkerConfig(), every=11)
    assert steady_rows > 16 * 50


def test_columnar_equals_general_with_async_steps_and_replays() -> None:
    """Async scheduling's ``updates_before``, an event delivered twice and a request reopened
    after an idle close all meet requests that are in slots."""
    rows = [("a", 8, 0, [1]), ("b", 8, 0, [2])]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("a", list(range(8)))),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("b", list(range(8)))),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(0, rows)),
    ]
    seq = 4
    for step in range(1, 30):
        body = f.step_batch(step, [("a", 1, 8 + step - 1, [3]), ("b", 1, 8 + step - 1, [4])])
        body["updates_before"] = step - 1 if step % 3 else -1
        events.append(f.wrap(seq, ev.STEP_BATCH, body, ts_ns=1_700_000_000_000_000_000 + step * 10_000_000))
        seq += 1
        if step == 10:
            events.append(events[-1])  # a re-delivery
    events.append(f.wrap(seq, ev.REQUEST_FINISHED, f.request_finished("a", prompt=8, output=30)))
    fold_both(events, every=1)


def test_small_steps_take_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold_module, "COLUMNAR_MIN_ROWS", 9)
    events = SimEngine(seed=3, max_batch=8).run(workload(24, seed=3, max_tokens=40))
    _, steady_rows = fold_both(events)
    assert steady_rows == 0


def test_a_state_restored_mid_stream_continues_identically() -> None:
    """The changelog's view (sync, encode, decode into a fresh store) continues as the live one."""
    events = SimEngine(seed=5, max_batch=12).run(workload(20, seed=5, max_tokens=40))
    store = MemoryStore()
    asm = Assembler(CFG, store, clock=lambda: 0)
    half = len(events) // 2
    for e in events[:half]:
        asm.apply(e)
    assert sum(len(c) for c in asm.fold.columns.values()) > 0
    store.sync()
    copy = MemoryStore()
    for k, v in store.data.items():
        copy.data[k] = decode_state(encode_state(v))
    a = [o for e in events[half:] for o in asm.apply(e)]
    restored = Assembler(CFG, copy, clock=lambda: 0)
    b = [o for e in events[half:] for o in restored.apply(e)]
    assert a == b


def test_an_engine_that_stops_leaves_no_columns_behind() -> None:
    engine = SimEngine(seed=4, max_batch=12)
    events = engine.run(workload(12, seed=4, max_tokens=30))
    assert ev.payload_type(events[-1]) == ev.ENGINE_STOPPED
    store = MemoryStore()
    asm = Assembler(CFG, store, clock=lambda: 0)
    used = 0
    for e in events[:-1]:
        asm.apply(e)
        used = max(used, sum(len(c) for c in asm.fold.columns.values()))
    assert used > 0
    asm.apply(events[-1])
    assert not asm.fold.columns and not store.lessees and not store.leased
