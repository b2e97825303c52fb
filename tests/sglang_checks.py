"""Checks of an SGLang run's events against what SGLang itself reported (live and recorded runs).

``check_run`` folds the events with the real assembler and holds the result against SGLang's
``meta_info`` per request, its ``/metrics`` totals and the radix-cache truth recorded in the
scheduler (``tests/e2e/sglang_launch.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.stack.engine_checks import check_engine_counters
from sparseety.stack.sglang_engine import answer_row, metric_keys

#: An abort attempt's max_new_tokens (recorded runs asked for 400): its 30-token prompt and this
#: fit the e2e server's 640-token pool, and the abort stops it long before.
ABORTED_MAX_NEW = 500
#: Abort attempts (``abort-1``, ``abort-2``, ...) at most: one whose 500 tokens all came before the
#: abort landed is an ordinary request, and the next is tried (tests/e2e/test_sglang_engine.py).
#: 3 were not enough once: a clean-clone CI run saw the Rust-core server finish all three.
ABORT_TRIES = 6


def aborted_rid(rids: Iterable[str]) -> str:
    """The abort attempt that must have been aborted: the last of ``abort-1``, ``abort-2``, ..."""
    attempts = sorted((r for r in rids if r.startswith("abort-")), key=lambda r: int(r.split("-", 1)[1]))
    assert attempts and len(attempts) <= ABORT_TRIES, attempts
    return attempts[-1]


def fold(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """RequestAccounting by engine request id, from the real fold."""
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    out = [o for e in sorted(events, key=lambda e: (e["stream"], e["seq"])) for o in asm.apply(e)]
    return {o.record["request_id"]: o.record for o in out if o.topic == TIMELINES}


def by_rid(events: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {ev.payload(e)["request_id"]: ev.payload(e) for e in events if ev.payload_type(e) == kind}


def check_run(
    events: list[dict[str, Any]],
    meta: dict[str, dict[str, Any]],
    tenants: dict[str, str],
    truth: dict[str, dict[str, Any]],
    metrics: dict[str, float],
) -> None:
    accounts = fold(events)
    started = by_rid(events, ev.REQUEST_STARTED)
    finished = by_rid(events, ev.REQUEST_FINISHED)
    assert set(meta) <= set(finished), set(meta) - set(finished)

    # Per request: SGLang's own meta_info, on RequestFinished and after the fold. Abort attempts
    # before the last one ran out their budget and are ordinary requests.
    aborted = aborted_rid(meta)
    for rid, info in meta.items():
        fin, acc = finished[rid], accounts[rid]
        if rid == aborted:
            assert fin["finish_reason"] == "abort", fin
            assert acc["output_tokens"] < ABORTED_MAX_NEW  # stopped before its budget
            continue
        assert fin["num_prompt_tokens"] == info["prompt_tokens"], rid
        assert fin["num_output_tokens"] == info["completion_tokens"], rid
        assert fin["num_cached_tokens"] == info["cached_tokens"], rid
        details = info.get("cached_tokens_details") or {}  # null when nothing was cached
        assert details.get("device", 0) == info["cached_tokens"], rid  # one tier here: the device
        assert acc["prompt_tokens"] == info["prompt_tokens"], rid
        assert acc["output_tokens"] == info["completion_tokens"], rid
        assert acc["engine_cached_tokens"] == info["cached_tokens"], rid
        assert acc["cache_read_tokens"] == info["cached_tokens"], rid
        assert acc["tenant"] == tenants[rid], rid
        assert acc["consistent"], (rid, acc)
        # The radix-cache truth: SGLang's hit and the blocks it had held and evicted before.
        assert started[rid]["num_cached_tokens"] == truth[rid]["hit"], rid
        assert acc["recomputed_eviction_tokens"] == 16 * truth[rid]["recomputed_blocks"], rid

    # The workload's shape: shared system prompt hits, an identical prompt, an eviction recompute.
    assert meta["sys-a2"]["cached_tokens"] >= 48 and meta["sys-b1"]["cached_tokens"] >= 48
    assert meta["same-2"]["cached_tokens"] == 39  # all but the last token, which SGLang computes
    assert accounts["long-1-again"]["recomputed_eviction_tokens"] > 0
    assert truth["long-1-again"]["recomputed_blocks"] > 0

    # Cached positions point to the request that computed them: every full block of the hit. The
    # block the hit ends inside (SGLang matches single tokens) was never held whole: no source.
    uid = accounts["same-1"]["request_uid"]
    full = meta["same-2"]["cached_tokens"] // 16 * 16
    cached = [s for s in accounts["same-2"]["timeline"]["segments"] if s["status"] == "cached"]
    assert sum(s["end"] - s["start"] for s in cached) == meta["same-2"]["cached_tokens"]
    assert {s["source_request_uid"] for s in cached if s["end"] <= full} == {uid}
    assert {s["source_request_uid"] for s in cached if s["start"] >= full} == {None}
    for rid in ("sys-a2", "sys-b1"):  # the shared system prompt: computed by sys-a1
        head = [
            s for s in accounts[rid]["timeline"]["segments"] if s["status"] == "cached" and s["end"] <= 48
        ]
        assert {s["source_request_uid"] for s in head} == {accounts["sys-a1"]["request_uid"]}, rid

    # Per tenant and engine-wide, the demo's check (sparseety/stack/engine_checks.py) on the fold:
    # prompt, output and cached tokens per tenant = SGLang's meta_info summed, reasoning not
    # observed on either side, and the stored cached total = sglang:realtime_tokens_total{mode=
    # prefill_cache}.
    answers = [answer_row(rid, tenants[rid], info) for rid, info in meta.items()]
    stored = [accounts[rid] for rid in meta]
    engine = {"requests": answers, "metrics": metric_keys(metrics)}
    assert check_engine_counters(stored, engine, "sglang") == []

    # Engine totals: SGLang's /metrics (sglang:realtime_tokens_total by mode, scheduler counters).
    # prefill_cache: the radix hits of all admissions; decode: every output token after the first
    # (which a prefill produces). prefill_compute is not compared: on the recorded run it is one
    # token above the prompt tokens SGLang computed per its own meta_info (docs/sglang.md).
    admitted_cached = sum(p["num_cached_tokens"] for p in started.values())
    assert admitted_cached == metrics["prefill_cache"]
    # decode: every decode entry SGLang computed (it adds the batch size per decode result), which
    # under the overlap scheduler includes a request's entry in the batch launched before its
    # finish (an abort) was processed: computed, its token dropped. The entries that produced a
    # token are exactly the output tokens after each request's first (which a prefill produces).
    decode = [
        (rid, new)
        for e in events
        if ev.payload_type(e) == ev.STEP_BATCH
        for rid, n, b, new in zip(
            ev.payload(e)["req_ids"],
            ev.payload(e)["num_scheduled_tokens"],
            ev.payload(e)["num_computed_before"],
            ev.payload(e)["num_new_tokens"],
            strict=True,
        )
        if n == 1 and b >= started[rid]["prompt_len"]
    ]
    assert len(decode) == metrics["decode"], (len(decode), metrics)
    outputs = sum(f["num_output_tokens"] for f in finished.values())
    decoded = outputs - sum(1 for f in finished.values() if f["num_output_tokens"])
    assert sum(new for _, new in decode) == decoded, (decoded, metrics)
    # a dropped decode token belongs to a request that ended by abort (not by length: the overlap
    # scheduler leaves a request its next token finishes by length out of the next batch)
    dropped = {rid for rid, new in decode if new == 0}
    assert all(finished[rid]["finish_reason"] == "abort" for rid in dropped), dropped
