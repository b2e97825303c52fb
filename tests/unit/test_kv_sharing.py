"""The shared-block entries of KV memory-time (streams/kv_memory.py).

Holders join and leave one physical block at random times. The entry only adds each holder's
*deltas* from its held view (the whole block for as long as it holds it). So, per holder: held +
amortized delta must be within one unit of its exact share (Σ dt / n over the intervals it held
the block); held + actual delta must be the time it was the first holder; and over all holders
both modes must sum to the block's physical time exactly (the time it had any holder).
"""

from __future__ import annotations

import random
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest

from sparseety.streams import kv_memory as kvm
from sparseety.streams.state import MemoryStore

KEY = "k|e|0|h|1"


def store_with(entry: dict[str, Any]) -> MemoryStore:
    store = MemoryStore()
    store.put(KEY, entry)
    return store


def holder(rid: str) -> Any:
    row = [0] * (kvm._WIDTH - 1) + [-1]
    return SimpleNamespace(request_id=rid, kv=[row], kv_shared=[])


@pytest.mark.parametrize("seed", range(12))
def test_amortized_within_one_unit_and_both_modes_sum_to_physical(seed: int) -> None:
    rng = random.Random(seed)
    entry = kvm.new_entry(0, 0, 0)
    store = store_with(entry)
    step = ts = 0
    inside: list[Any] = []
    left: list[Any] = []
    held: dict[str, list[int]] = {}  # per holder: block-steps, block-ns held (the held view)
    share: dict[str, list[Fraction]] = {}  # the exact amortized share
    first: dict[str, list[int]] = {}  # time as the first holder (the actual mode's charge)
    physical = [0, 0]

    def advance() -> None:
        nonlocal step, ts
        ds, dt = rng.choice((0, 1, 1, 2, 7)), rng.randrange(0, 5_000_000)
        if inside:
            n = len(inside)
            for u, d in ((0, ds), (1, dt)):
                physical[u] += d
                first[inside[0].request_id][u] += d
                for r in inside:
                    held[r.request_id][u] += d
                    share[r.request_id][u] += Fraction(d, n)
        step, ts = step + ds, ts + dt

    for made in range(400):
        advance()
        # One cache lifetime: the block keeps a holder until the end (an empty entry is deleted).
        if len(inside) < 2 or (len(inside) < 40 and rng.random() < 0.55):
            r = holder(f"r{made}")
            kvm.settle_entry(entry, step, ts)
            entry["h"].append(r.request_id)
            r.kv_shared.append([0, KEY, 0, *kvm.snapshot(entry)])
            inside.append(r)
            held[r.request_id], first[r.request_id] = [0, 0], [0, 0]
            share[r.request_id] = [Fraction(0), Fraction(0)]
        else:
            r = inside.pop(rng.randrange(len(inside)))
            kvm.leave(r, store, step, ts)
            left.append(r)
    while inside:  # the rest leave, the first one first (the first holder changes each time)
        advance()
        r = inside.pop(0)
        kvm.leave(r, store, step, ts)
        left.append(r)
    assert store.get(KEY) is None, "the last holder to leave deletes the entry"
    assert all(not r.kv_shared for r in left)

    totals = {"amortized": [0, 0], "actual": [0, 0]}
    for r in left:
        row, rid = r.kv[0], r.request_id
        for u, (am, ac) in enumerate(((kvm.KV_AM_STEPS, kvm.KV_AC_STEPS), (kvm.KV_AM_NS, kvm.KV_AC_NS))):
            amortized, actual = held[rid][u] + row[am], held[rid][u] + row[ac]
            assert abs(amortized - share[rid][u]) < 1 + Fraction(1, 1000), (rid, u, amortized, share[rid][u])
            assert actual == first[rid][u], (rid, u)
            totals["amortized"][u] += amortized
            totals["actual"][u] += actual
    assert totals["amortized"] == totals["actual"] == physical
    assert physical[0] > 0 and len(left) > 100


def test_an_entry_written_before_the_integrals_continues_exactly() -> None:
    """State from a worker that settled every holder eagerly (entries without integrals, holder
    items of three fields) goes on from where that worker left it."""
    store = store_with({"g": 0, "h": ["a", "b"], "s": 10, "t": 1_000})
    a, b = holder("a"), holder("b")
    a.kv_shared, b.kv_shared = [[0, KEY, 0]], [[0, KEY, 0]]
    kvm.leave(a, store, 14, 1_600)  # 4 steps, 600 ns shared by two since the last settle
    kvm.leave(b, store, 20, 2_000)  # then b alone
    assert a.kv[0][kvm.KV_AM_STEPS] == 2 - 4 and a.kv[0][kvm.KV_AM_NS] == 300 - 600
    assert a.kv[0][kvm.KV_AC_STEPS] == 0 and a.kv[0][kvm.KV_AC_NS] == 0  # a was first
    assert b.kv[0][kvm.KV_AM_STEPS] == 2 - 4 and b.kv[0][kvm.KV_AM_NS] == 300 - 600
    assert b.kv[0][kvm.KV_AC_STEPS] == -4 and b.kv[0][kvm.KV_AC_NS] == -600
    assert store.get(KEY) is None


def test_a_join_or_leave_does_not_touch_the_other_holders() -> None:
    """The cost of a change is the changing holder's: a block shared by thousands of running
    requests (a fleet's system prompt) costs the same per join as one shared by two."""
    entry = kvm.new_entry(0, 0, 0)
    store = store_with(entry)
    rs = [holder(f"r{i}") for i in range(2_000)]
    for i, r in enumerate(rs):
        kvm.settle_entry(entry, i, i * 10)
        entry["h"].append(r.request_id)
        r.kv_shared.append([0, KEY, 0, *kvm.snapshot(entry)])
    before = [list(r.kv[0]) for r in rs[1:]]
    kvm.leave(rs[0], store, 2_000, 20_000)
    assert [r.kv[0] for r in rs[1:]] == before


def test_hit_blocks_keep_their_positions_past_the_blocks_a_window_never_cached() -> None:
    # A sliding-window-only model's hit: h0, h1 were never cached (outside the window, no
    # lifetime), h2 was. Its shared entry must be block 2's, not block 0's: holds() is asked by
    # position, and position 0 is the null block (the e2e sliding kind saw no sharing at all).
    from sparseety.streams import prefix_index as pidx
    from sparseety.streams.state import block_key

    store = MemoryStore()
    for h in ("00", "01"):
        block = pidx.new_block()
        pidx.claim(block, "r0", 5, [])
        store.put(block_key("e", h), block)
    cached = pidx.new_block()
    pidx.claim(cached, "r0", 5, [])
    pidx.on_stored(cached, 6)
    store.put(block_key("e", "02"), cached)
    r = SimpleNamespace(blocks=[["00", "cached", 5], ["01", "cached", 5], ["02", "cached", 6]])
    shape = SimpleNamespace(hash_block=4)
    assert kvm.hit_blocks(r, shape, store, "e", 9, 12, True, []) == [(2, "02", 6, "r0")]
