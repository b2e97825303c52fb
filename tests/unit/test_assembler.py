"""The assembler's pure fold: crafted scenarios with hand-computed answers, then properties over
simulated engine runs (sums, disjointness, engine totals, order and duplicate independence)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.streams import segments as sg
from sparseety.streams.assembler import TIMELINES, USAGE, Assembler, Output
from sparseety.streams.state import MemoryStore, RequestState, decode_state, encode_state, epoch_key
from tests import factories as f
from tests.sim import SimEngine, workload

CFG = WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0)


def run(events: list[dict[str, Any]], cfg: WorkerConfig = CFG) -> tuple[list[Output], Assembler]:
    asm = Assembler(cfg, MemoryStore())
    out: list[Output] = []
    for e in events:
        out.extend(asm.apply(e))
    return out, asm


def accounts(out: list[Output]) -> dict[str, dict[str, Any]]:
    return {o.key: o.record for o in out if o.topic == TIMELINES}


def segs(acc: dict[str, Any]) -> list[tuple[int, int, str, str, bool]]:
    """The timeline's axis 1 (how positions were obtained), neighbours with equal values merged."""
    out: list[tuple[int, int, str, str, bool]] = []
    for s in acc["timeline"]["segments"]:
        row = (s["start"], s["end"], s["kind"], s["status"], s["draft_accepted"])
        if out and out[-1][1] == row[0] and out[-1][2:] == row[2:]:
            out[-1] = (out[-1][0], row[1], *row[2:])
        else:
            out.append(row)
    return out


def fates(acc: dict[str, Any]) -> list[tuple[int, int, str]]:
    """The timeline's axis 2 (KV fate), neighbours with equal values merged."""
    out: list[tuple[int, int, str]] = []
    for s in acc["timeline"]["segments"]:
        if out and out[-1][2] == s["kv_fate"]:
            out[-1] = (out[-1][0], s["end"], s["kv_fate"])
        else:
            out.append((s["start"], s["end"], s["kv_fate"]))
    return out


# --- crafted scenarios -----------------------------------------------------------------------


def test_single_request_plain_prefill_and_decode() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(10)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 10, 0, [7])])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 10, [8])])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(2, [("r1", 1, 11, [9])])),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=10, output=3)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert acc["consistent"] and acc["complete"]
    assert (acc["prompt_tokens"], acc["output_tokens"], acc["cache_read_tokens"]) == (10, 3, 0)
    # 10 prompt positions + 2 decode inputs computed; the last output token is never an input.
    assert (acc["uncached_computed_tokens"], acc["scheduled_tokens"], acc["steps"]) == (12, 12, 3)
    assert segs(acc) == [(0, 10, "prompt", "computed", False), (10, 13, "output", "computed", False)]
    assert acc["attention_pairs"] == 55 + 11 + 12 and acc["attention_pairs_skipped"] == 0
    # alone in every step: the whole step time; the epoch's first step is flagged as warm-up
    assert (acc["gpu_time_ns"], acc["warmup_gpu_time_ns"]) == (3_000_000, 1_000_000)
    assert acc["source_history_lost_ts_ns"] == 0


def test_prefix_hit_names_its_source_and_amortization_inputs() -> None:
    prompt = list(range(12))
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.KV_STORED, f.kv_stored([b"a", b"b", b"c"])),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("r1", prompt, hashes=[b"a", b"b", b"c"])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(0, [("r1", 12, 0, [1])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=12, output=1)),
        f.wrap(
            5,
            ev.REQUEST_STARTED,
            f.request_started("r2", [*prompt, 99, 98], cached=8, hashes=[b"a", b"b", b"c"]),
        ),
        f.wrap(6, ev.STEP_BATCH, f.step_batch(1, [("r2", 6, 8, [5])])),
        f.wrap(7, ev.REQUEST_FINISHED, f.request_finished("r2", prompt=14, output=1, cached=8)),
    ]
    out, _ = run(events)
    r2 = accounts(out)[f"{f.EID}/r2"]
    assert r2["consistent"]
    assert (r2["cache_read_tokens"], r2["uncached_computed_tokens"]) == (8, 6)
    cached = [s for s in r2["timeline"]["segments"] if s["status"] == "cached"]
    assert cached == [
        {
            "start": 0,
            "end": 8,
            "kind": "prompt",
            "status": "cached",
            "draft_accepted": False,
            "source_request_uid": f"{f.EID}/r1",
            "kv_fate": "kept",
        }
    ]
    uses = {(u["block_hash"], u["role"], u["lifetime_seq"]) for u in r2["block_uses"]}
    assert uses == {(b"a", "cached", 1), (b"b", "cached", 1), (b"c", "computed", 1)}
    r1 = accounts(out)[f"{f.EID}/r1"]
    assert {(u["block_hash"], u["role"], u["lifetime_seq"]) for u in r1["block_uses"]} == {
        (b"a", "computed", 1),
        (b"b", "computed", 1),
        (b"c", "computed", 1),
    }
    # cache writes (issue 36): r1 began the lifetimes of a, b, c; r2 computed c's positions while
    # r1's entry held it, so it added no entry
    assert (r1["cache_write_tokens"], r2["cache_write_tokens"]) == (12, 0)


def test_cache_writes_count_new_entries_once_and_not_a_second_copy() -> None:
    """Two requests compute the same new block in one step (the engine stores two copies of the
    hash): one cache lifetime begins, credited to one of them; the second copy adds no entry. A
    block computed but never stored (no KV event) is no write."""
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(9)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("r2", list(range(9)), hashes=[b"a", b"b"])),
        f.wrap(3, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(4, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(0, [("r1", 9, 0, [1]), ("r2", 9, 0, [1])])),
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=9, output=1)),
        f.wrap(
            7, ev.REQUEST_FINISHED, f.request_finished("r2", prompt=9, output=1, num_cache_creation_tokens=8)
        ),
    ]
    accs = accounts(run(events)[0])
    r1, r2 = accs[f"{f.EID}/r1"], accs[f"{f.EID}/r2"]
    # one entry, credited once: to the request the prefix index names as the block's source (the
    # last claim of the step), whom later readers' cached segments name too; b was never stored
    assert (r1["cache_write_tokens"], r2["cache_write_tokens"]) == (0, 4)
    assert (r1["engine_cache_write_tokens"], r2["engine_cache_write_tokens"]) == (-1, 8)


def test_block_evicted_then_computed_again_is_recomputed() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(2, ev.KV_REMOVED, f.kv_removed([b"a"])),
        f.wrap(3, ev.REQUEST_STARTED, f.request_started("r1", list(range(6)), hashes=[b"a"])),
        f.wrap(4, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(0, [("r1", 6, 0, [1])])),
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=6, output=1)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["recomputed_eviction_tokens"], acc["uncached_computed_tokens"]) == (4, 2)
    assert (acc["recomputed_tokens"], acc["recomputed_preemption_tokens"], acc["waste_tokens"]) == (4, 0, 0)
    assert acc["evicted_blocks_recomputed"] == 1
    assert segs(acc)[:2] == [
        (0, 4, "prompt", "recomputed_after_eviction", False),
        (4, 6, "prompt", "computed", False),
    ]
    assert acc["block_uses"][0]["role"] == "recomputed" and acc["block_uses"][0]["lifetime_seq"] == 4
    assert acc["consistent"]
    assert acc["cache_write_tokens"] == 4  # the recomputed block began a new cache entry


def test_speculative_drafts_accepted_and_rejected() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(spec_method="ngram", spec_num_tokens=3)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])], spec=[(0, 0)])),
        # 1 input + 3 drafts; 2 drafts accepted -> 3 new tokens, 1 rejected.
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 4, 8, [2, 3, 4])], spec=[(3, 2)])),
        # 1 input + 3 drafts; none accepted -> 1 new token, 3 rejected.
        f.wrap(4, ev.STEP_BATCH, f.step_batch(2, [("r1", 4, 11, [5])], spec=[(3, 0)])),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=5)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert acc["consistent"]
    assert (acc["draft_accepted_tokens"], acc["draft_rejected_tokens"]) == (2, 4)
    assert acc["uncached_computed_tokens"] == 8 + 2  # prompt + one non-draft input per decode step
    assert acc["scheduled_tokens"] == 16
    assert segs(acc) == [
        (0, 8, "prompt", "computed", False),
        (8, 9, "output", "computed", False),
        (9, 11, "output", "computed", True),
        (11, 13, "output", "computed", False),
    ]


def test_preemption_recomputes_and_rereads_cache() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 8, [2])])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(2, [], preempted=["r1"])),
        # Resumed: the first block is found in the prefix cache, positions 4..9 are recomputed.
        f.wrap(5, ev.STEP_BATCH, f.step_batch(3, [("r1", 6, 4, [3])], resumed=["r1"])),
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=3, num_preemptions=1)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert acc["preemptions"] == 1 and acc["consistent"]
    assert (
        acc["cache_read_tokens"],
        acc["recomputed_preemption_tokens"],
        acc["uncached_computed_tokens"],
    ) == (
        4,
        5,
        10,
    )
    assert (acc["recomputed_eviction_tokens"], acc["waste_tokens"]) == (0, 5)
    assert acc["scheduled_tokens"] == 15
    assert segs(acc) == [
        (0, 4, "prompt", "computed", False),
        (4, 8, "prompt", "recomputed_after_preemption", False),
        (8, 9, "output", "recomputed_after_preemption", False),
        (9, 11, "output", "computed", False),
    ]


def test_sliding_window_evicts_whole_blocks_and_skips_the_rest() -> None:
    groups = [{"kind": "sliding_window", "sliding_window": 8, "block_size": 4, "num_layers": 2}]
    rows = [(f.wrap(2 + i, ev.STEP_BATCH, f.step_batch(1 + i, [("r1", 1, 20 + i, [i])]))) for i in range(3)]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(kv_cache_groups=groups)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(20)), hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 20, 0, [1])])),
        *[f.wrap(3 + i, ev.STEP_BATCH, f.step_batch(1 + i, [("r1", 1, 20 + i, [i])])) for i in range(3)],
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=20, output=4)),
    ]
    del rows
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    # 23 KV positions computed; the last query attends 8 of them: 15 outside the window.
    # Before the last step 22 were computed: (22 - 8 + 1) // 4 = 3 blocks = 12 positions freed.
    assert (acc["window_released_tokens"], acc["skipped_tokens"]) == (12, 3)
    assert "evicted_tokens" not in acc  # deprecated since the two-axis model; readers default it to 0
    assert acc["timeline"]["attention_window"] == 8
    # The KV fate is a second axis: how the positions were obtained (computed) stays.
    assert segs(acc)[:1] == [(0, 20, "prompt", "computed", False)]
    assert fates(acc) == [(0, 12, "window_released"), (12, 15, "skipped"), (15, 24, "kept")]
    assert acc["attention_pairs_skipped"] > 0 and acc["consistent"]


def test_gpu_time_is_split_by_flops() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("big", list(range(64)), hashes=[])),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("small", list(range(4)), hashes=[])),
        f.wrap(
            3,
            ev.STEP_BATCH,
            f.step_batch(1, [("big", 64, 0, [1]), ("small", 4, 0, [1])], duration_ns=10_000_000),
        ),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("big", prompt=64, output=1)),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("small", prompt=4, output=1)),
    ]
    accs = accounts(run(events)[0])
    big, small = accs[f"{f.EID}/big"], accs[f"{f.EID}/small"]
    assert big["gpu_time_ns"] + small["gpu_time_ns"] == 10_000_000
    assert big["gpu_time_ns"] > 15 * small["gpu_time_ns"]  # more tokens and quadratic attention
    assert big["warmup_gpu_time_ns"] == small["warmup_gpu_time_ns"] == 0  # not the first step


def test_the_first_steps_cold_start_is_warm_up_reported_apart() -> None:
    # the first request of a server: a 2.6 s cold first step, then 10 ms steps (issue 21)
    cold = f.step_batch(0, [("first", 8, 0, [1]), ("second", 24, 0, [1])], duration_ns=2_600_000_000)
    warm = f.step_batch(1, [("first", 1, 8, [2]), ("second", 1, 24, [2])], duration_ns=10_000_000)
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("first", list(range(8)), hashes=[])),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("second", list(range(24)), hashes=[])),
        f.wrap(3, ev.STEP_BATCH, cold),
        f.wrap(4, ev.STEP_BATCH, warm),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("first", prompt=8, output=2)),
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("second", prompt=24, output=2)),
    ]
    accs = accounts(run(events)[0])
    first, second = accs[f"{f.EID}/first"], accs[f"{f.EID}/second"]
    # the cold step is split by the same FLOPs weights, in gpu_time_ns and flagged apart
    assert first["warmup_gpu_time_ns"] + second["warmup_gpu_time_ns"] == 2_600_000_000
    assert second["warmup_gpu_time_ns"] > 2 * first["warmup_gpu_time_ns"] > 0
    assert first["gpu_time_ns"] + second["gpu_time_ns"] == 2_610_000_000
    assert first["consistent"] and second["consistent"]


def test_a_cached_block_whose_source_was_lost_with_the_history_says_when() -> None:
    # r1 computes blocks a, b; the KV events that stored them are lost (a core-stream gap, as
    # when the broker lost its log); r2 reads both from the cache afterwards
    events = f.history_loss()
    cfg = WorkerConfig(reorder_max_events=1, closed_retention_s=0)
    lost = accounts(run([e for e in events if e["seq"] != 3], cfg)[0])
    r2 = lost[f"{f.EID}/r2"]
    assert r2["cache_read_tokens"] == 8
    cached = [s["source_request_uid"] for s in r2["timeline"]["segments"] if s["status"] == "cached"]
    assert cached == [None]
    assert r2["source_history_lost_ts_ns"] == events[4]["ts_ns"]  # the first event after the gap
    assert lost[f"{f.EID}/r1"]["source_history_lost_ts_ns"] == 0  # it read nothing from the cache
    # with the history whole, the source is named and nothing is flagged
    whole = accounts(run(events, cfg)[0])[f"{f.EID}/r2"]
    cached = [s["source_request_uid"] for s in whole["timeline"]["segments"] if s["status"] == "cached"]
    assert cached == [f"{f.EID}/r1"]
    assert whole["source_history_lost_ts_ns"] == 0


def test_windows_final_then_correction_for_late_requests() -> None:
    minute = 60_000_000_000
    t0 = 1_700_000_000 * 1_000_000_000 // minute * minute
    events = [f.wrap(0, ev.ENGINE_STARTED, f.engine_started(), ts_ns=t0)]
    seq = 1
    for i, t in enumerate([t0 + 1, t0 + 2, t0 + minute + 10_000_000_000]):
        rid = f"r{i}"
        events += [
            f.wrap(seq, ev.REQUEST_STARTED, f.request_started(rid, [1, 2, 3], hashes=[]), ts_ns=t),
            f.wrap(seq + 1, ev.STEP_BATCH, f.step_batch(i, [(rid, 3, 0, [4])]), ts_ns=t),
            f.wrap(seq + 2, ev.REQUEST_FINISHED, f.request_finished(rid, prompt=3, output=1), ts_ns=t),
        ]
        seq += 3
    # The first window closed when the watermark passed its end + 5 s lateness; r3 comes late.
    events += [
        f.wrap(seq, ev.REQUEST_STARTED, f.request_started("r3", [1, 2], hashes=[]), ts_ns=t0 + 3),
        f.wrap(seq + 1, ev.STEP_BATCH, f.step_batch(9, [("r3", 2, 0, [4])]), ts_ns=t0 + 3),
        f.wrap(seq + 2, ev.REQUEST_FINISHED, f.request_finished("r3", prompt=2, output=1), ts_ns=t0 + 3),
        f.wrap(seq + 3, ev.ENGINE_STOPPED, {"reason": "shutdown"}, ts_ns=t0 + minute + 11_000_000_000),
    ]
    out, asm = run(events)
    usage = [o.record for o in out if o.topic == USAGE]
    finals = [u for u in usage if u["kind"] == "final"]
    corrections = [u for u in usage if u["kind"] == "correction"]
    assert [(u["window_start_ns"], u["requests"], u["prompt_tokens"]) for u in finals] == [
        (t0, 2, 6),
        (t0 + minute, 1, 3),
    ]
    assert [(u["window_start_ns"], u["requests"], u["prompt_tokens"]) for u in corrections] == [(t0, 1, 2)]
    assert corrections[0]["usage_id"].endswith(f"/correction/{f.EID}/r3")
    assert asm.stats.corrections == 1


def test_new_epoch_closes_open_requests_as_incomplete() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])])),
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(), epoch="e2"),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert not acc["complete"] and acc["incomplete_reason"] == "new_epoch" and not acc["consistent"]
    assert acc["finish_reason"] == "incomplete" and acc["output_tokens"] == 1


def test_idle_requests_close_on_heartbeat_and_silent_engines_on_tick() -> None:
    cfg = WorkerConfig(idle_timeout_s=10, closed_retention_s=0)
    t = 1_700_000_000_000_000_000
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(), ts_ns=t),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", [1, 2], hashes=[]), ts_ns=t),
        f.wrap(
            2,
            ev.HEARTBEAT,
            {"queued": 0, "produced": 2, "dropped": 0, "spilled": 0, "drained": 0},
            ts_ns=t + 11_000_000_000,
        ),
    ]
    acc = accounts(run(events, cfg)[0])[f"{f.EID}/r1"]
    assert acc["incomplete_reason"] == "idle_timeout"

    now = [0]
    asm = Assembler(cfg, MemoryStore(), clock=lambda: now[0])
    for e in events[:2]:
        asm.apply(e)
    assert asm.tick() == []
    now[0] = 11_000_000_000
    closed = accounts(asm.tick())
    assert closed[f"{f.EID}/r1"]["incomplete_reason"] == "idle_timeout"


def test_proxy_requests_are_accounted_from_totals() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(engine_kind="proxy", block_size=0, kv_cache_groups=[])),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("p1", [], hashes=[], prompt_len=0)),
        f.wrap(2, ev.REQUEST_FINISHED, f.request_finished("p1", prompt=20, output=5, cached=16)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/p1"]
    assert acc["engine_kind"] == "proxy"
    assert (acc["prompt_tokens"], acc["cache_read_tokens"], acc["uncached_computed_tokens"]) == (20, 16, 8)
    assert segs(acc) == [
        (0, 16, "prompt", "cached", False),
        (16, 20, "prompt", "computed", False),
        (20, 25, "output", "computed", False),
    ]


def test_routing_is_joined_and_waits_for_the_last_step() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(routing_capture=True, moe_num_experts=2, moe_top_k=1)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", [1, 2, 3], hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 3, 0, [4])])),
        f.wrap(
            0,
            ev.MOE_ROUTING,
            {"step": 0, "req_ids": ["r1"], "num_layers": 1, "num_experts": 2, "expert_counts": [2, 1]},
            stream="worker-0",
        ),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 3, [5])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=3, output=2)),
    ]
    out, _ = run(events)
    assert not accounts(out)  # waits for step 1's routing
    late, _ = run(
        [
            *events,
            f.wrap(
                1,
                ev.MOE_ROUTING,
                {"step": 1, "req_ids": ["r1"], "num_layers": 1, "num_experts": 2, "expert_counts": [0, 1]},
                stream="worker-0",
            ),
        ]
    )
    acc = accounts(late)[f"{f.EID}/r1"]
    assert acc["expert_counts"] == [2, 2] and (acc["expert_num_layers"], acc["expert_num_experts"]) == (1, 2)


def test_gaps_are_flagged_and_reordering_is_undone() -> None:
    base = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", [1, 2, 3, 4], hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 4, 0, [5])])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 4, [6])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=4, output=2)),
    ]
    swapped = [base[0], base[2], base[1], base[4], base[3]]
    assert accounts(run(swapped)[0]) == accounts(run(base)[0])
    cfg = WorkerConfig(reorder_max_events=2, closed_retention_s=0)
    gap_out, asm = run([base[0], base[1], base[3], base[4]], cfg)
    acc = accounts(gap_out)[f"{f.EID}/r1"]
    assert acc["seq_gap"] and not acc["consistent"] and asm.stats.gaps == 1


def test_state_round_trips_through_json() -> None:
    events = SimEngine(spec_k=2, preempt_prob=0.2, cache_blocks=12, seed=3).run(workload(12, seed=3))
    store = MemoryStore()
    asm = Assembler(CFG, store)
    for e in events[: len(events) // 2]:
        asm.apply(e)
    copy = MemoryStore()
    store.sync()  # the steady columns' changes into the objects, as before a changelog write
    for k, v in store.data.items():
        copy.data[k] = decode_state(encode_state(v))
    rest = events[len(events) // 2 :]
    a = [o for e in rest for o in asm.apply(e)]
    asm2 = Assembler(CFG, copy)
    b = [o for e in rest for o in asm2.apply(e)]
    assert a == b


# --- properties over simulated runs ----------------------------------------------------------


def _check_invariants(acc: dict[str, Any]) -> None:
    segments = acc["timeline"]["segments"]
    assert segments[0]["start"] == 0
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(segments))
    assert segments[-1]["end"] == acc["prompt_tokens"] + acc["output_tokens"]
    assert acc["scheduled_tokens"] == (
        acc["uncached_computed_tokens"]
        + acc["recomputed_tokens"]
        + acc["draft_accepted_tokens"]
        + acc["draft_rejected_tokens"]
    )
    by_status: dict[str, int] = {}
    for s in segments:
        by_status[s["status"]] = by_status.get(s["status"], 0) + s["end"] - s["start"]
    assert by_status.get("skipped", 0) == acc["skipped_tokens"]
    assert "evicted" not in by_status  # not a status since the two-axis model (a fate)


sim_params = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 10_000),
        "spec_k": st.sampled_from([0, 2]),
        "preempt_prob": st.sampled_from([0.0, 0.15]),
        "cache_blocks": st.sampled_from([8, 32, 256]),
        "n": st.integers(1, 14),
    }
)


@settings(max_examples=60, deadline=None)
@given(sim_params)
def test_simulated_runs_are_consistent_with_engine_totals(p: dict[str, Any]) -> None:
    sim = SimEngine(
        seed=p["seed"], spec_k=p["spec_k"], preempt_prob=p["preempt_prob"], cache_blocks=p["cache_blocks"]
    )
    reqs = workload(p["n"], seed=p["seed"])
    out, _ = run(sim.run(reqs))
    accs = accounts(out)
    assert len(accs) == len(reqs)
    for r in reqs:
        acc = accs[f"{f.EID}/{r.rid}"]
        _check_invariants(acc)
        assert acc["consistent"], acc
        assert acc["output_tokens"] == len(r.output)
        assert acc["cache_read_tokens"] >= r.cached_at_admission
    usage = [o.record for o in out if o.topic == USAGE]
    assert sum(u["requests"] for u in usage) == len(reqs)
    assert sum(u["prompt_tokens"] for u in usage) == sum(len(r.prompt) for r in reqs)


@settings(max_examples=40, deadline=None)
@given(sim_params, st.randoms(use_true_random=False), st.integers(1, 6))
def test_shuffling_nearby_events_and_duplicating_them_changes_nothing(
    p: dict[str, Any], rnd: random.Random, span: int
) -> None:
    events = SimEngine(
        seed=p["seed"], spec_k=p["spec_k"], preempt_prob=p["preempt_prob"], cache_blocks=p["cache_blocks"]
    ).run(workload(p["n"], seed=p["seed"]))
    expected, _ = run(events)
    messy: list[dict[str, Any]] = []
    i = 0
    while i < len(events):
        chunk = events[i : i + span]
        rnd.shuffle(chunk)
        for e in chunk:
            messy.append(e)
            if rnd.random() < 0.2:
                messy.append(e)  # re-sent
        i += span
    got, asm = run(messy)
    assert accounts(got) == accounts(expected)
    assert sorted((o.key, str(o.record)) for o in got if o.topic == USAGE) == sorted(
        (o.key, str(o.record)) for o in expected if o.topic == USAGE
    )
    assert asm.stats.duplicates == len(messy) - len(events)


def test_state_per_request_is_segments_not_tokens() -> None:
    # A 128k-token prompt, half from the prefix cache, decoded 64 tokens in chunked prefill of 8k.
    prompt = 131_072
    events = f.long_request(63, prompt=prompt)
    seq = events[-1]["seq"] + 1
    store = MemoryStore()
    asm = Assembler(CFG, store)
    for e in events:
        asm.apply(e)
    size = store.size_bytes(f"r|{f.EID}|long")
    assert size <= 1024 * 1024, size  # the block list dominates (8192 hashes); segments are few
    req = store.get(f"r|{f.EID}|long")
    assert len(req.segments) <= 3
    out = asm.apply(
        f.wrap(
            seq, ev.REQUEST_FINISHED, f.request_finished("long", prompt=prompt, output=64, cached=prompt // 2)
        )
    )
    assert accounts(out)[f"{f.EID}/long"]["consistent"]


def test_segments_assign_keeps_coverage_and_merges() -> None:
    s: list[list[Any]] = []
    sg.append(s, 10, sg.PROMPT, sg.CACHED, source="x")
    sg.append(s, 5, sg.PROMPT, sg.COMPUTED)
    before = sg.assign(s, 3, 12, sg.RECOMPUTED)
    assert before == [(3, 10, "cached"), (10, 12, "computed")]
    assert [(x[0], x[1], x[3]) for x in s] == [(0, 3, "cached"), (3, 12, "recomputed"), (12, 15, "computed")]
    sg.assign(s, 0, 15, sg.COMPUTED)
    assert [(x[0], x[1], x[3]) for x in s] == [(0, 15, "computed")]


# --- the two-axis position model (issue 11) ---------------------------------------------------

KV = f.kv_stored([b"x"])  # one 4-token block; callers replace the hashes (num_tokens stays 4)


def stored(seq: int, *hashes: bytes) -> dict[str, Any]:
    return f.wrap(seq, ev.KV_STORED, f.kv_stored(list(hashes)))


def removed(seq: int, *hashes: bytes) -> dict[str, Any]:
    return f.wrap(seq, ev.KV_REMOVED, f.kv_removed(list(hashes)))


def test_recompute_after_eviction_counts_only_evicted_blocks() -> None:
    # The repro: h0-h2 stored, h0 and h2 removed; a 12-token prompt recomputes 8, not 12.
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        stored(1, b"h0", b"h1", b"h2"),
        removed(2, b"h0", b"h2"),
        f.wrap(3, ev.REQUEST_STARTED, f.request_started("r1", list(range(12)), hashes=[b"h0", b"h1", b"h2"])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(0, [("r1", 12, 0, [1])])),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=12, output=1)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["recomputed_eviction_tokens"], acc["uncached_computed_tokens"]) == (8, 4)
    assert acc["evicted_blocks_recomputed"] == 2 and acc["waste_tokens"] == 0
    assert segs(acc) == [
        (0, 4, "prompt", "recomputed_after_eviction", False),
        (4, 8, "prompt", "computed", False),
        (8, 12, "prompt", "recomputed_after_eviction", False),
        (12, 13, "output", "computed", False),
    ]
    assert acc["consistent"]


def test_a_hash_with_two_copies_lives_until_its_last_copy_goes() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(5)), hashes=[b"a"])),
        stored(2, b"a"),
        stored(3, b"a"),  # a second physical copy of the same hash
        f.wrap(4, ev.STEP_BATCH, f.step_batch(0, [("r1", 5, 0, [1])])),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=5, output=1)),
        removed(6, b"a"),  # one copy goes: the hash is still cached
        f.wrap(7, ev.REQUEST_STARTED, f.request_started("r2", list(range(6)), cached=4, hashes=[b"a"])),
        f.wrap(8, ev.STEP_BATCH, f.step_batch(1, [("r2", 2, 4, [1])])),
        f.wrap(9, ev.REQUEST_FINISHED, f.request_finished("r2", prompt=6, output=1, cached=4)),
        removed(10, b"a"),  # the last copy goes: computing it again is a recompute
        f.wrap(11, ev.REQUEST_STARTED, f.request_started("r3", list(range(5)), hashes=[b"a"])),
        f.wrap(12, ev.STEP_BATCH, f.step_batch(2, [("r3", 5, 0, [1])])),
        f.wrap(13, ev.REQUEST_FINISHED, f.request_finished("r3", prompt=5, output=1)),
    ]
    accs = accounts(run(events)[0])
    r2 = accs[f"{f.EID}/r2"]
    assert r2["timeline"]["segments"][0]["source_request_uid"] == f"{f.EID}/r1"
    r3 = accs[f"{f.EID}/r3"]
    assert (r3["recomputed_eviction_tokens"], r3["uncached_computed_tokens"]) == (4, 1)


def test_an_output_block_never_stored_is_credited_to_the_turn_that_computes_it() -> None:
    # r1's output fills block "c" with its last token, whose KV is never computed: vLLM never
    # stores "c" for r1. r2 (the next turn) computes it; vLLM publishes the BlockStored before
    # r2's admission (same step). r3 reads it: its source is r2, not r1.
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[b"a", b"b"])),
        stored(2, b"a", b"b"),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 8, [2])])),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(2, [("r1", 1, 9, [3])])),
        f.wrap(6, ev.STEP_BATCH, f.step_batch(3, [("r1", 1, 10, [4])])),
        f.wrap(
            7, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=4, output_block_hashes=[b"c"])
        ),
        stored(8, b"c"),
        f.wrap(
            9,
            ev.REQUEST_STARTED,
            f.request_started("r2", list(range(14)), cached=8, hashes=[b"a", b"b", b"c"]),
        ),
        f.wrap(10, ev.STEP_BATCH, f.step_batch(4, [("r2", 6, 8, [1])])),
        f.wrap(11, ev.REQUEST_FINISHED, f.request_finished("r2", prompt=14, output=1, cached=8)),
        f.wrap(
            12,
            ev.REQUEST_STARTED,
            f.request_started("r3", list(range(13)), cached=12, hashes=[b"a", b"b", b"c"]),
        ),
        f.wrap(13, ev.STEP_BATCH, f.step_batch(5, [("r3", 1, 12, [1])])),
        f.wrap(14, ev.REQUEST_FINISHED, f.request_finished("r3", prompt=13, output=1, cached=12)),
    ]
    accs = accounts(run(events)[0])
    sources = [
        (s["start"], s["end"], s["source_request_uid"]) for s in accs[f"{f.EID}/r3"]["timeline"]["segments"]
    ]
    assert sources[:2] == [(0, 8, f"{f.EID}/r1"), (8, 12, f"{f.EID}/r2")]
    r1_uses = {(u["block_hash"], u["lifetime_seq"]) for u in accs[f"{f.EID}/r1"]["block_uses"]}
    assert r1_uses == {(b"a", 2), (b"b", 2), (b"c", -1)}  # "c" stays its chain tail, shares no cost
    assert accs[f"{f.EID}/r3"]["consistent"]


def test_drafts_cut_by_stop_are_not_accepted() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(spec_method="ngram", spec_num_tokens=3)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])], spec=[(0, 0)])),
        # 1 input + 3 drafts, all 3 accepted, but the stop string ends output after 1 token.
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 4, 8, [2])], spec=[(3, 3)])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=2)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["draft_accepted_tokens"], acc["draft_cut_tokens"], acc["draft_rejected_tokens"]) == (1, 2, 0)
    assert acc["draft_unverified_tokens"] == 0  # verified: vLLM counts all 3 as drafted and accepted
    assert acc["waste_tokens"] == 2 and acc["consistent"]
    assert acc["scheduled_tokens"] == 12 == acc["uncached_computed_tokens"] + 1 + 2


def test_drafts_of_a_request_finished_before_update_are_cut_not_rejected() -> None:
    """An abort while the step runs: vLLM never verifies its 3 drafts and counts them nowhere, so
    they are cut and, of those, unverified (vLLM's num_draft_tokens = A + J + K - unverified)."""
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(spec_method="ngram", spec_num_tokens=3)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(8)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 8, 0, [1])], spec=[(0, 0)])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 4, 8, [])], spec=[(3, 0)])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=1, finish_reason="abort")),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["draft_cut_tokens"], acc["draft_rejected_tokens"], acc["draft_unverified_tokens"]) == (
        3,
        0,
        3,
    )
    a, j, k, u = (acc[f"draft_{c}_tokens"] for c in ("accepted", "rejected", "cut", "unverified"))
    assert (a + j + k - u, a + k - u) == (0, 0)  # what vLLM's two counters hold for this request


def test_idle_timeout_close_is_corrected_by_the_late_finish() -> None:
    cfg = WorkerConfig(window_s=60, allowed_lateness_s=5, idle_timeout_s=1, closed_retention_s=600)
    t = 1_700_000_000_000_000_000
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(), ts_ns=t),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(4)), hashes=[]), ts_ns=t),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 4, 0, [5])]), ts_ns=t),
        f.wrap(3, ev.HEARTBEAT, {"events_dropped": 0}, ts_ns=t + 3_000_000_000),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 4, [6])]), ts_ns=t + 3_100_000_000),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=4, output=2), ts_ns=t + 3_200_000_000),
        f.wrap(6, ev.ENGINE_STOPPED, {"reason": "shutdown"}, ts_ns=t + 3_300_000_000),
    ]
    out, asm = run(events, cfg)
    versions = [o.record for o in out if o.topic == TIMELINES]
    assert [v["complete"] for v in versions] == [False, True]
    assert versions[-1]["output_tokens"] == 2 and versions[-1]["consistent"]
    assert asm.stats.reopened == 1
    usage = [o.record for o in out if o.topic == USAGE]
    assert sum(u["requests"] for u in usage) == 1 and sum(u["incomplete_requests"] for u in usage) == 0
    assert sum(u["output_tokens"] for u in usage) == 2


def test_unknown_request_ids_make_no_state() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.STEP_BATCH, f.step_batch(0, [("ghost", 4, 0, [5])], preempted=["ghost2"])),
    ]
    out, asm = run(events)
    assert accounts(out) == {}
    assert not list(asm.store.keys("r|"))
    epoch = asm.store.get(f"e|{f.EID}")
    assert epoch.unknown_requests == 2 and epoch.open_requests == []


def test_aborted_request_is_not_charged_for_its_uncomputed_prompt() -> None:
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(12)), cached=4, hashes=[])),
        f.wrap(
            2,
            ev.REQUEST_FINISHED,
            f.request_finished("r1", prompt=12, output=0, cached=4, finish_reason="abort"),
        ),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["uncached_computed_tokens"], acc["cache_read_tokens"], acc["skipped_tokens"]) == (0, 4, 8)
    assert segs(acc) == [(0, 4, "prompt", "cached", False), (4, 12, "prompt", "not_computed", False)]


def test_hybrid_model_releases_by_the_layer_majority() -> None:
    # 3 of 4 layers slide (window 8), 1 is full attention: the sliding groups hold the majority.
    groups = [
        {"kind": "full_attention", "sliding_window": None, "block_size": 4, "num_layers": 1},
        {"kind": "sliding_window", "sliding_window": 8, "block_size": 4, "num_layers": 3},
    ]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(kv_cache_groups=groups)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(20)), hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 20, 0, [1])])),
        *[f.wrap(3 + i, ev.STEP_BATCH, f.step_batch(1 + i, [("r1", 1, 20 + i, [i])])) for i in range(3)],
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=20, output=4)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["window_released_tokens"], acc["skipped_tokens"]) == (12, 3)
    assert acc["attention_pairs_skipped"] > 0 and acc["consistent"]
    # With the full-attention group holding the majority nothing is released or skipped.
    groups[0]["num_layers"], groups[1]["num_layers"] = 3, 1
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["window_released_tokens"], acc["skipped_tokens"]) == (0, 0)
    assert acc["attention_pairs_skipped"] > 0  # the one sliding layer still skipped pairs


def test_chunked_local_attention_is_modelled_as_chunks() -> None:
    groups = [
        {
            "kind": "chunked_local_attention",
            "sliding_window": None,
            "attention_chunk_size": 8,
            "block_size": 4,
            "num_layers": 2,
        }
    ]
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(kv_cache_groups=groups)),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(20)), hashes=[])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 20, 0, [1])])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 20, [2])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=20, output=2)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    # 21 KV positions; the last query (20) attends its chunk [16, 21): 16 positions unattended.
    # Before the last step 20 were computed: chunks [0, 16) were done and released.
    assert (acc["window_released_tokens"], acc["skipped_tokens"]) == (16, 0)
    # Query q attends q % 8 + 1 keys: 36 + 36 + (1+2+3+4) + 5 = 87 pairs, of 21 * 22 / 2 = 231.
    assert acc["attention_pairs"] == 87 and acc["attention_pairs_skipped"] == 231 - 87


def _check_identity(acc: dict[str, Any]) -> None:
    assert acc["scheduled_tokens"] == (
        acc["uncached_computed_tokens"]
        + acc["recomputed_preemption_tokens"]
        + acc["recomputed_eviction_tokens"]
        + acc["draft_accepted_tokens"]
        + acc["draft_rejected_tokens"]
        + acc["draft_cut_tokens"]
    )
    assert acc["waste_tokens"] == (
        acc["recomputed_preemption_tokens"] + acc["draft_rejected_tokens"] + acc["draft_cut_tokens"]
    )
    segments = acc["timeline"]["segments"]
    assert sum(s["end"] - s["start"] for s in segments) == acc["prompt_tokens"] + acc["output_tokens"]


@settings(max_examples=60, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "seed": st.integers(0, 10_000),
            "spec_k": st.sampled_from([0, 2, 3]),
            "preempt_prob": st.sampled_from([0.0, 0.2, 0.4]),
            "cache_blocks": st.sampled_from([6, 10, 24]),
            "n": st.integers(2, 16),
        }
    )
)
def test_every_class_equals_the_simulators_truth(p: dict[str, Any]) -> None:
    """Preemption (re-reads, re-prefill), eviction under a small cache, shared prefixes, drafts."""
    sim = SimEngine(
        seed=p["seed"], spec_k=p["spec_k"], preempt_prob=p["preempt_prob"], cache_blocks=p["cache_blocks"]
    )
    reqs = workload(p["n"], seed=p["seed"], shared_prefix=8)
    out, _ = run(sim.run(reqs))
    accs = accounts(out)
    for r in reqs:
        acc = accs[f"{f.EID}/{r.rid}"]
        _check_identity(acc)
        assert acc["consistent"], acc
        t = r.truth
        got = (
            acc["cache_read_tokens"],
            acc["uncached_computed_tokens"],
            acc["recomputed_preemption_tokens"],
            acc["recomputed_eviction_tokens"],
            acc["draft_accepted_tokens"],
            acc["draft_rejected_tokens"],
        )
        want = (t["cache_read"], t["uncached"], t["preemption"], t["eviction"], t["accepted"], t["rejected"])
        assert got == want, (r.rid, got, want)


def test_attention_groups_read_chunks_from_old_and_new_producers() -> None:
    from types import SimpleNamespace

    from sparseety.producers.vllm.facts import kv_cache_groups
    from sparseety.streams import attention

    old = {"kv_cache_groups": [{"kind": "chunked_local_attention", "sliding_window": 8, "block_size": 4}]}
    (g,) = attention.groups_of(old)
    assert (g.window, g.chunk, g.layers) == (None, 8, 1)
    spec = SimpleNamespace(attention_chunk_size=8, sliding_window=None, block_size=4)
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    (rec,) = kv_cache_groups(cfg)
    assert (rec["attention_chunk_size"], rec["sliding_window"], rec["num_layers"]) == (8, None, 2)
    assert attention.chunked_pairs(6, 4, 8) == 7 + 8 + 1 + 2  # queries 6, 7 | 8, 9


def test_a_request_state_persisted_before_the_two_axis_model_still_loads() -> None:
    old = RequestState("e", "e@1", "r1", segments=[[0, 8, "prompt", "computed", False, None]])
    data = old.to_json()
    i = [f.name for f in dataclasses.fields(RequestState)].index("eviction_spans") + 1
    data[i] = 4  # the old recompute_until high-water mark
    back = decode_state(encode_state(data))
    assert back.eviction_spans == [[0, 4]] and back.segments[0][sg.FATE] == sg.KEPT


def test_same_step_admissions_recompute_an_evicted_block_once_on_a_hybrid_model() -> None:
    # gemma3-style groups: sliding first, full attention last. vLLM's sliding groups cache only
    # the blocks a later hit can reach, so the index follows the full-attention group. r3 and r4
    # are admitted in one step and both miss h0/h1 (a sliding group lacks them): r3's lookup found
    # no copy (evicted: recompute), r4's found r3's copies, cached at r3's allocation (computed).
    groups = [
        {"kind": "sliding_window", "sliding_window": 8, "block_size": 4, "num_layers": 1},
        {"kind": "full_attention", "sliding_window": None, "block_size": 4, "num_layers": 1},
    ]

    def kv(seq: int, kind: str, group: str, *hashes: bytes) -> dict[str, Any]:
        if kind == "stored":
            return f.wrap(seq, ev.KV_STORED, {**KV, "group_kind": group, "block_hashes": list(hashes)})
        body = {"block_hashes": list(hashes), "medium": "GPU", "group_kind": group}
        return f.wrap(seq, ev.KV_REMOVED, body)

    prompt = list(range(9))
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(kv_cache_groups=groups)),
        kv(1, "stored", "full_attention", b"h0", b"h1"),
        kv(2, "stored", "sliding_window", b"h1"),
        f.wrap(3, ev.REQUEST_STARTED, f.request_started("r1", prompt, hashes=[b"h0", b"h1"])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(0, [("r1", 9, 0, [1])])),
        f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=9, output=1)),
        kv(6, "removed", "full_attention", b"h0", b"h1"),
        kv(7, "removed", "sliding_window", b"h1"),
        f.wrap(8, ev.STEP_BATCH, f.step_batch(1, [])),
        # One step: r3's allocation stores h0/h1, r4's stores second copies; then admissions.
        kv(9, "stored", "full_attention", b"h0", b"h1"),
        kv(10, "stored", "sliding_window", b"h1"),
        kv(11, "stored", "full_attention", b"h0", b"h1"),
        kv(12, "stored", "sliding_window", b"h1"),
        f.wrap(13, ev.REQUEST_STARTED, f.request_started("r3", prompt, hashes=[b"h0", b"h1"])),
        f.wrap(14, ev.REQUEST_STARTED, f.request_started("r4", prompt, hashes=[b"h0", b"h1"])),
        f.wrap(15, ev.STEP_BATCH, f.step_batch(2, [("r3", 9, 0, [1]), ("r4", 9, 0, [1])])),
        f.wrap(16, ev.REQUEST_FINISHED, f.request_finished("r3", prompt=9, output=1)),
        f.wrap(17, ev.REQUEST_FINISHED, f.request_finished("r4", prompt=9, output=1)),
    ]
    accs = accounts(run(events)[0])
    r3, r4 = accs[f"{f.EID}/r3"], accs[f"{f.EID}/r4"]
    assert (r3["recomputed_eviction_tokens"], r3["uncached_computed_tokens"]) == (8, 1)
    assert (r4["recomputed_eviction_tokens"], r4["uncached_computed_tokens"]) == (0, 9)
    assert r3["evicted_blocks_recomputed"] == 2 and r4["evicted_blocks_recomputed"] == 0
    assert r3["consistent"] and r4["consistent"]


def test_a_block_still_cached_past_a_miss_is_computed_not_recomputed() -> None:
    # h0 was evicted, h1 is still cached: the lookup stops at h0, so h1 is computed again although
    # a copy is live. Its lifetime did not end: computed, not recomputed after eviction.
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        stored(1, b"h0", b"h1"),
        removed(2, b"h1"),
        stored(3, b"h1"),  # a new lifetime of h1 (another request computed it again)
        removed(4, b"h0"),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(0, [])),
        f.wrap(6, ev.REQUEST_STARTED, f.request_started("r1", list(range(9)), hashes=[b"h0", b"h1"])),
        f.wrap(7, ev.STEP_BATCH, f.step_batch(1, [("r1", 9, 0, [1])])),
        f.wrap(8, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=9, output=1)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (acc["recomputed_eviction_tokens"], acc["uncached_computed_tokens"]) == (4, 5)


def test_token_ids_are_kept_as_the_privacy_mode_allows() -> None:
    """Token records: raw keeps prompt and output ids, hashed the prompt's keyed hashes only, none
    nothing; ids of requests sharing a step stay with their request."""

    def fold(mode: str) -> dict[str, dict[str, Any]]:
        hashed = mode == "hashed"
        started = {
            rid: f.request_started(
                rid,
                [] if hashed else prompt,
                prompt_len=len(prompt),
                prompt_token_hashes=[p * 1000 for p in prompt] if hashed else [],
            )
            for rid, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6]))
        }
        if mode == "none":
            for s in started.values():
                s["prompt_token_ids"] = []
        events = [
            f.wrap(0, ev.ENGINE_STARTED, f.engine_started(privacy_mode=mode)),
            f.wrap(1, ev.REQUEST_STARTED, started["a"]),
            f.wrap(2, ev.REQUEST_STARTED, started["b"]),
            f.wrap(3, ev.STEP_BATCH, f.step_batch(0, [("a", 4, 0, [40]), ("b", 2, 0, [50])])),
            f.wrap(4, ev.STEP_BATCH, f.step_batch(1, [("b", 1, 2, [51]), ("a", 1, 4, [41])])),
            f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("a", prompt=4, output=2)),
            f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("b", prompt=2, output=2)),
        ]
        return accounts(run(events)[0])

    def fields(acc: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(
            acc[k] for k in ("token_privacy", "prompt_token_ids", "prompt_token_hashes", "output_token_ids")
        )

    raw, hashed, none = fold("raw"), fold("hashed"), fold("none")
    assert fields(raw[f"{f.EID}/a"]) == ("raw", [1, 2, 3, 4], [], [40, 41])
    assert fields(raw[f"{f.EID}/b"]) == ("raw", [5, 6], [], [50, 51])
    assert fields(hashed[f"{f.EID}/a"]) == ("hashed", [], [1000, 2000, 3000, 4000], [])
    assert fields(none[f"{f.EID}/b"]) == ("none", [], [], [])
    assert all(a["consistent"] for a in (*raw.values(), *hashed.values(), *none.values()))


# --- issue 31: a worker that never saw the epoch's EngineStarted --------------------------------


def test_a_request_admitted_without_the_engines_configuration_says_so_until_it_is_announced_again() -> None:
    """A fresh worker met the engine mid-stream (its EngineStarted, seq 0, is gone with the
    broker's log): the requests it admits before the configuration comes back carry ``seq_gap``
    (window, KV and FLOPs counts need it) and are not ``consistent``; the producer's
    re-announcement restores it, and the requests admitted after it are whole."""

    def one(rid: str, seq: int, step: int) -> list[dict[str, Any]]:
        return [
            f.wrap(seq, ev.REQUEST_STARTED, f.request_started(rid, list(range(10)), hashes=[b"a", b"b"])),
            f.wrap(seq + 1, ev.STEP_BATCH, f.step_batch(step, [(rid, 10, 0, [7])])),
            f.wrap(seq + 2, ev.STEP_BATCH, f.step_batch(step + 1, [(rid, 1, 10, [8])])),
            f.wrap(seq + 3, ev.REQUEST_FINISHED, f.request_finished(rid, prompt=10, output=2)),
        ]

    # what survived: seqs 10.. (the gap 0..9 is declared once the lateness bound passes)
    again = f.wrap(14, ev.ENGINE_STARTED, f.engine_started())
    events = [*one("before", 10, 5), again, *one("after", 15, 7)]
    late = WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0, reorder_max_events=1)
    acc = accounts(run(events, late)[0])
    before, after = acc[f"{f.EID}/before"], acc[f"{f.EID}/after"]
    assert before["seq_gap"] and not before["consistent"]
    assert not after["seq_gap"] and after["consistent"]
    assert (before["prompt_tokens"], before["output_tokens"]) == (10, 2) == (after["prompt_tokens"], 2)


def test_an_engine_started_announced_again_changes_nothing() -> None:
    """The producer re-sends EngineStarted (every announce_interval_s, after Kafka recovered):
    the same epoch's repeats are ignored, so every record is the same as without them."""
    plain = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.REQUEST_STARTED, f.request_started("r1", list(range(10)), hashes=[b"a", b"b"])),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 10, 0, [7])])),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 10, [8])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=10, output=2)),
    ]
    repeated = [plain[0], plain[1], plain[2]]
    at = plain[2]["ts_ns"] + 1
    repeated.append(f.wrap(3, ev.ENGINE_STARTED, f.engine_started(block_size=99), ts_ns=at))
    repeated += [{**e, "seq": e["seq"] + 1} for e in plain[3:]]
    assert accounts(run(plain)[0]) == accounts(run(repeated)[0])


def test_blocks_a_sliding_window_never_cached_name_the_request_that_computed_them() -> None:
    # A model with sliding-window groups only (the demo's mixtral-sw): vLLM caches only the
    # blocks a later hit can reach (h3, h4 for a window of 8) and counts h0..h2, never cached,
    # in the hit all the same. They name r1, which computed them, and share its claim's
    # lifetime, so amortized cost can split them (issue 31: 53 % of cached tokens had no source).
    groups = [{"kind": "sliding_window", "sliding_window": 8, "block_size": 4, "num_layers": 2}]
    hashes = [b"h0", b"h1", b"h2", b"h3", b"h4"]
    prompt = list(range(21))
    stored = {**KV, "group_kind": "sliding_window", "block_hashes": hashes[3:]}
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(kv_cache_groups=groups)),
        f.wrap(1, ev.KV_STORED, stored),
        f.wrap(2, ev.REQUEST_STARTED, f.request_started("r1", prompt, hashes=hashes)),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(0, [("r1", 21, 0, [1])])),
        f.wrap(4, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=21, output=1)),
        f.wrap(5, ev.REQUEST_STARTED, f.request_started("r2", prompt, cached=20, hashes=hashes)),
        f.wrap(6, ev.STEP_BATCH, f.step_batch(1, [("r2", 1, 20, [1])])),
        f.wrap(7, ev.REQUEST_FINISHED, f.request_finished("r2", prompt=21, output=1, cached=20)),
    ]
    accs = accounts(run(events)[0])
    r1, r2 = accs[f"{f.EID}/r1"], accs[f"{f.EID}/r2"]
    cached = [(s["start"], s["end"], s["source_request_uid"]) for s in r2["timeline"]["segments"]]
    assert [c for c in cached if c[2] is not None] and all(
        src == r1["request_uid"] for start, end, src in cached if end <= 20
    ), cached
    assert r2["cache_read_tokens"] == 20 and not r2["source_history_lost_ts_ns"]
    lifetimes = {u["block_hash"]: u["lifetime_seq"] for u in r1["block_uses"]}
    read = {u["block_hash"]: u["lifetime_seq"] for u in r2["block_uses"] if u["role"] == "cached"}
    assert read.keys() == set(hashes) and all(read[h] == lifetimes[h] >= 0 for h in hashes), (read, lifetimes)


def test_cache_tiers_at_admission_follow_the_engines_split() -> None:
    """Issue 36: RequestStarted.cached_tokens_by_source (vLLM: the device hit, then the KV
    connector's hit sources) lays the hit out tier by tier in prompt order: gpu, the CPU offload
    tier (vLLM's host), storage (disk), external (p2p); KV events of the offload tier (medium
    CPU) are another cache: neither a lifetime of the device's prefix index nor its clearing."""
    prompt = list(range(16))
    sources = {"device": 4, "host": 4, "disk": 2, "p2p": 2}
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(2, ev.KV_STORED, f.kv_stored([b"b", b"c"], medium="CPU")),
        f.wrap(3, ev.KV_CLEARED, {"medium": "CPU"}),
        f.wrap(
            4,
            ev.REQUEST_STARTED,
            f.request_started(
                "r1",
                prompt,
                cached=12,
                hashes=[b"a", b"b", b"c", b"d"],
                num_external_cached_tokens=8,
                cached_tokens_by_source=sources,
            ),
        ),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(0, [("r1", 4, 12, [1])])),
        f.wrap(6, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=16, output=1, cached=12)),
    ]
    out, asm = run(events)
    r1 = accounts(out)[f"{f.EID}/r1"]
    assert (r1["cache_read_tokens"], r1["cache_read_cpu_offload_tokens"]) == (4, 4)
    assert (r1["cache_read_storage_tokens"], r1["external_kv_tokens"], r1["cache_read_host_tokens"]) == (
        2,
        2,
        0,
    )
    assert [s[:4] for s in segs(r1)] == [
        (0, 4, "prompt", "cached"),
        (4, 8, "prompt", "cached_cpu_offload"),
        (8, 10, "prompt", "external_kv"),
        (10, 12, "prompt", "cached_storage"),
        (12, 16, "prompt", "computed"),
        (16, 17, "output", "computed"),
    ]
    assert r1["consistent"]
    # the offload tier's store and clear left the device index alone: a's source is still known
    cached = next(s for s in r1["timeline"]["segments"] if s["status"] == "cached")
    assert cached["source_request_uid"] is None  # a was stored before any request: no source
    epoch = asm.store.get(epoch_key(f.EID))
    assert epoch.offload_events == 1 and epoch.cleared == []


def test_a_whole_prompt_loaded_from_a_tier_computes_its_last_token_once() -> None:
    """Issue 36: a KV connector loads every block of a block-aligned prompt (vLLM counts the
    whole prompt cached: PrefillStats.num_cached_tokens = 8, the device hit 4 and the connector's
    host 4); after the load vLLM sets num_computed_tokens back to 7 and computes the last token
    (Scheduler._update_waiting_for_remote_kv). That position is computed here once: not a
    recompute after a preemption (nothing was preempted), not also a CPU-tier read. A real
    preemption afterwards still re-prefills as recomputed_after_preemption."""
    prompt = list(range(8))
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started()),
        f.wrap(1, ev.KV_STORED, f.kv_stored([b"a"])),
        f.wrap(
            2,
            ev.REQUEST_STARTED,
            f.request_started(
                "r1",
                prompt,
                cached=8,
                hashes=[b"a", b"b"],
                num_external_cached_tokens=4,
                cached_tokens_by_source={"device": 4, "host": 4},
            ),
        ),
        f.wrap(3, ev.STEP_BATCH, f.step_batch(0, [("r1", 1, 7, [1])])),
        f.wrap(4, ev.STEP_BATCH, f.step_batch(1, [("r1", 1, 8, [2])])),
        f.wrap(5, ev.STEP_BATCH, f.step_batch(2, [], preempted=["r1"])),
        # resumed: the first block is found in the prefix cache again, 4..10 re-prefilled
        f.wrap(6, ev.STEP_BATCH, f.step_batch(3, [("r1", 6, 4, [3])], resumed=["r1"])),
        f.wrap(7, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=8, output=3, cached=8)),
    ]
    acc = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert acc["engine_cached_tokens"] == 8 and acc["consistent"]
    # the admission hit less the given-back position: device 4 (+ 4 re-read on resume), host 3
    assert (acc["cache_read_tokens"], acc["cache_read_cpu_offload_tokens"], acc["external_kv_tokens"]) == (
        8,
        3,
        0,
    )
    # position 7 and output 8 computed first; 4..9 re-prefilled after the preemption (5)
    assert (acc["uncached_computed_tokens"], acc["recomputed_preemption_tokens"], acc["waste_tokens"]) == (
        2 + 1,
        5,
        5,
    )
    assert acc["scheduled_tokens"] == 8 and acc["cache_write_tokens"] == 0
    assert segs(acc) == [
        (0, 4, "prompt", "cached", False),
        (4, 8, "prompt", "recomputed_after_preemption", False),
        (8, 9, "output", "recomputed_after_preemption", False),
        (9, 11, "output", "computed", False),
    ]
    # without the preemption: each position in exactly one class
    alone = [*events[:5], f.wrap(5, ev.REQUEST_FINISHED, f.request_finished("r1", 8, 2, 8))]
    acc = accounts(run(alone)[0])[f"{f.EID}/r1"]
    assert segs(acc) == [
        (0, 4, "prompt", "cached", False),
        (4, 7, "prompt", "cached_cpu_offload", False),
        (7, 8, "prompt", "computed", False),
        (8, 10, "output", "computed", False),
    ]
    tiers = (acc["cache_read_tokens"], acc["cache_read_cpu_offload_tokens"])
    assert tiers == (4, 3) and acc["uncached_computed_tokens"] == 2
    assert acc["recomputed_preemption_tokens"] == acc["waste_tokens"] == 0 and acc["consistent"]
    assert acc["cache_read_tokens"] + acc["cache_read_cpu_offload_tokens"] + 1 == acc["engine_cached_tokens"]


def test_a_split_that_does_not_add_up_keeps_the_local_and_external_split() -> None:
    from sparseety.billing import split_cached

    assert split_cached("vllm", {"device": 4, "host": 3}, 8, 4) is None
    assert split_cached("vllm", {}, 8, 4) is None
    assert split_cached("sglang", {"device": 4, "host": 3, "storage": 1}, 8, 0) == [
        ("gpu", 4),
        ("host", 3),
        ("storage", 1),
    ]
    assert split_cached("vllm", {"device": 4, "p2p": 2, "external_unspecified": 2}, 8, 4) == [
        ("gpu", 4),
        ("external", 4),
    ]


def test_sglang_host_and_storage_tiers_follow_its_device_hit() -> None:
    """SGLang's cached_tokens_details (device, host, storage), as RequestStarted carries it: its
    hierarchical cache is the engine's own (no KV connector, num_external_cached_tokens 0), laid
    out device, host, storage in prompt order, each tier counted apart (issue 36)."""
    prompt = list(range(16))
    events = [
        f.wrap(0, ev.ENGINE_STARTED, f.engine_started(engine_kind="sglang")),
        f.wrap(
            1,
            ev.REQUEST_STARTED,
            f.request_started(
                "r1",
                prompt,
                cached=12,
                hashes=[],
                cached_tokens_by_source={"device": 4, "host": 6, "storage": 2},
            ),
        ),
        f.wrap(2, ev.STEP_BATCH, f.step_batch(0, [("r1", 4, 12, [1])])),
        f.wrap(3, ev.REQUEST_FINISHED, f.request_finished("r1", prompt=16, output=1, cached=12)),
    ]
    r1 = accounts(run(events)[0])[f"{f.EID}/r1"]
    assert (r1["cache_read_tokens"], r1["cache_read_host_tokens"], r1["cache_read_storage_tokens"]) == (
        4,
        6,
        2,
    )
    assert (r1["cache_read_cpu_offload_tokens"], r1["external_kv_tokens"]) == (0, 0)
    assert [s[:4] for s in segs(r1)][:4] == [
        (0, 4, "prompt", "cached"),
        (4, 10, "prompt", "cached_host"),
        (10, 12, "prompt", "cached_storage"),
        (12, 16, "prompt", "computed"),
    ]
    assert r1["consistent"]
