"""The fold replays the recorded ``sparsity_truth`` run (hybrid full + sliding-window model,
prefix sharing, a tiny cache that evicts, preemption) and every class it produces equals the
engine ground truth recorded beside it by ``tests/e2e/ground_truth.py``."""

from __future__ import annotations

from typing import Any

from sparseety.config import WorkerConfig
from sparseety.streams.assembler import TIMELINES, Assembler
from sparseety.streams.state import MemoryStore
from tests.e2e.ground_truth import CLASSES
from tests.recorded import load_scenario

#: The classes the e2e truth checks. The recording predates ``draft_unverified_tokens`` (a part of
#: ``draft_cut_tokens``); where its truth lacks that class it is bounded by the recorded cut instead.
PER_REQUEST = CLASSES
NEWER_THAN_RECORDING = {"draft_unverified_tokens": "draft_cut_tokens"}


def _fold() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    events, truth = load_scenario("sparsity_truth")
    asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
    out = [o for e in events for o in asm.apply(e)]
    return {o.record["request_id"]: o.record for o in out if o.topic == TIMELINES}, truth


def test_every_class_equals_the_recorded_engine_truth() -> None:
    accounts, truth = _fold()
    reqs = truth["requests"]
    assert len(accounts) == len(reqs)
    for r in reqs:
        acc = accounts[r["engine_request_id"]]
        assert acc["consistent"], r["engine_request_id"]
        for k in PER_REQUEST:
            if k not in r["truth"] and k in NEWER_THAN_RECORDING:
                whole = NEWER_THAN_RECORDING[k]
                assert 0 <= acc[k] <= r["truth"][whole], (r["engine_request_id"], k, acc[k])
                continue
            assert acc[k] == r["truth"][k], (r["engine_request_id"], k, acc[k], r["truth"][k])
    # The workload made every class happen, and the truth agrees with vLLM's own counters.
    for k in (
        "cache_read_tokens",
        "recomputed_preemption_tokens",
        "recomputed_eviction_tokens",
        "window_released_tokens",
    ):
        assert sum(r["truth"][k] for r in reqs) > 0, k
    assert sum(r["truth"]["preemptions"] for r in reqs) == truth["metrics"]["vllm:num_preemptions"]
    by_source = truth["prompt_tokens_by_source"]
    assert by_source["local_compute"] == sum(
        len(r["prompt_token_ids"]) - r["num_cached_tokens"] for r in reqs
    )
