"""Every class the fold produces equals the engine's ground truth, on workloads the project never
saw (prefix sharing, a 24-block cache that evicts, preemption, ngram drafts) with a full-attention
model, a hybrid full + sliding-window model and a chunked-local-attention model.

Each engine kind runs once per session, in a child process with the engine core in-process, so
``tests/e2e/ground_truth.py`` can wrap vLLM's scheduler, KV-cache manager and block pool there.
The ground truth itself is anchored to vLLM's own counters (``prompt_tokens_by_source``, spec
decode, preemptions, ``num_cached_tokens``) before the fold is held against it. Beyond the token
classes, the ``source_request_uid`` of every admission-cached block and the attention pairs
(per layer, from each KV-cache group's window or chunk) are held against it too.
"""

from __future__ import annotations

import json
import uuid
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config, WorkerConfig
from sparseety.stack.engine_checks import check_engine_counters
from tests.e2e.conftest import MODEL_CACHE, engine_config, run_driver, tiny_model
from tests.e2e.engine_events import engine_events
from tests.e2e.ground_truth import CLASSES, kv_mismatches, majority_end, unattended_end
from tests.e2e.truth_workloads import ENGINES, phases

ROOT = Path(__file__).resolve().parents[2]
DRIVER = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.e2e.ground_truth import main
if __name__ == "__main__":
    main()
"""


class Run:
    """One engine kind's run: vLLM's answers and truth, the published events, the fold's output."""

    def __init__(self, result: dict[str, Any], events: list[dict[str, Any]]) -> None:
        from sparseety.streams.assembler import TIMELINES, Assembler
        from sparseety.streams.state import MemoryStore

        self.result = result
        self.events = events
        asm = Assembler(WorkerConfig(window_s=60, allowed_lateness_s=5, closed_retention_s=0), MemoryStore())
        out = [o for e in sorted(events, key=lambda e: (e["stream"], e["seq"])) for o in asm.apply(e)]
        self.accounts = {o.record["request_id"]: o.record for o in out if o.topic == TIMELINES}
        self.requests = result["requests"]
        self.started = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)

    def total(self, key: str) -> int:
        return sum(int(r["truth"][key]) for r in self.requests)


_RUNS: dict[str, Run] = {}


def engine_run(kind: str, broker: Config, workdir: Path) -> Run:
    """Run ``kind``'s workload once per session (engines are shared by the tests)."""
    if kind not in _RUNS:
        spec = ENGINES[kind]
        tiny_model(spec["model"])
        cfg = engine_config(broker, workdir / kind, f"truth-{kind}")
        spec_path = workdir / f"{kind}-{uuid.uuid4().hex[:6]}.json"
        out_path = spec_path.with_suffix(".out.json")
        spec_path.write_text(
            json.dumps(
                {
                    "model": str(MODEL_CACHE / spec["model"]),
                    "engine": spec["engine"],
                    "phases": phases(second_turns=spec.get("second_turns", False)),
                }
            )
        )
        run_driver(DRIVER, cfg, [str(spec_path), str(out_path)], workdir)
        result = json.loads(out_path.read_text())
        n = len(result["requests"])

        def done(events: list[dict[str, Any]]) -> bool:
            return sum(ev.payload_type(e) == ev.REQUEST_FINISHED for e in events) >= n

        _RUNS[kind] = Run(result, engine_events(cfg, done))
    return _RUNS[kind]


@pytest.fixture(scope="module")
def workdir(e2e_dir: Path) -> Path:
    d = e2e_dir / "truth"
    d.mkdir(exist_ok=True)
    return d


KINDS = list(ENGINES)


@pytest.mark.parametrize("kind", KINDS)
def test_ground_truth_equals_vllm_counters(kind: str, broker: Config, workdir: Path) -> None:
    """The recorder agrees with what vLLM itself counts, so it can judge the fold."""
    run = engine_run(kind, broker, workdir)
    res, m = run.result, run.result["metrics"]
    assert not res["async_scheduling"]
    reqs = run.requests
    for r in reqs:
        assert r["truth"]["admission_hit"] == r["num_cached_tokens"], r["request_id"]
        assert r["truth"]["output_tokens"] == len(r["output_token_ids"]), r["request_id"]
    by_source = res["prompt_tokens_by_source"]
    assert by_source.get("local_cache_hit", 0) == sum(r["truth"]["admission_hit"] for r in reqs)
    assert by_source.get("local_compute", 0) == sum(
        len(r["prompt_token_ids"]) - r["truth"]["admission_hit"] for r in reqs
    )
    assert run.total("preemptions") == m.get("vllm:num_preemptions", 0)
    if kind == "llama":
        assert run.total("drafts_accepted_vllm") == m["vllm:spec_decode_num_accepted_tokens"]
        verified = sum(r["truth"]["drafts_scheduled"] - r["truth"]["drafts_unverified"] for r in reqs)
        assert verified == m["vllm:spec_decode_num_draft_tokens"]
    # The workload makes what it is for happen.
    assert res["evicted_hashes"] > 0
    assert run.total("cache_read_tokens") > 0
    if ENGINES[kind].get("preempts", True):
        assert run.total("preemptions") > 0
        assert run.total("recomputed_preemption_tokens") > 0
    if kind == "llama":
        assert run.total("recomputed_eviction_tokens") > 0
        assert run.total("draft_accepted_tokens") > 0 and run.total("draft_rejected_tokens") > 0
    else:
        assert run.total("window_released_tokens") > 0


def test_folded_counts_pass_the_demos_engine_check(broker: Config, workdir: Path) -> None:
    """The fold's records through the demo's own check (``sparseety/stack/engine_checks.py``):
    per tenant prompt, output and cached tokens = vLLM's RequestOutputs summed; accepted drafts
    (+ cut), preemptions and cached prompt tokens = vLLM's counters. The spec-decoding engine
    only: the hybrid one runs no drafts, so vLLM has no draft counter to compare."""
    run = engine_run("llama", broker, workdir)
    answers = [
        {
            "tenant": r["tenant"],
            "prompt_tokens": len(r["prompt_token_ids"]),
            "output_tokens": len(r["output_token_ids"]),
            "num_cached_tokens": r["num_cached_tokens"],
            "reasoning_tokens": None,  # no reasoning parser in this engine
        }
        for r in run.requests
    ]
    stored = [run.accounts[r["engine_request_id"]] for r in run.requests]
    engine = {"requests": answers, "metrics": run.result["metrics"]}
    assert check_engine_counters(stored, engine) == []


@pytest.mark.parametrize("kind", KINDS)
def test_every_fold_class_equals_engine_truth(kind: str, broker: Config, workdir: Path) -> None:
    run = engine_run(kind, broker, workdir)
    mismatches = []
    for r in run.requests:
        acc = run.accounts.get(r["engine_request_id"])
        assert acc is not None, f"no accounting for {r['engine_request_id']}"
        assert acc["prompt_tokens"] == len(r["prompt_token_ids"])
        assert acc["output_tokens"] == len(r["output_token_ids"])
        assert acc["consistent"], r["engine_request_id"]
        for k in CLASSES:
            if int(acc[k]) != int(r["truth"][k]):
                mismatches.append(f"{r['engine_request_id']} {k}: fold {acc[k]} != engine {r['truth'][k]}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_recompute_is_separate_from_eviction_recompute(
    kind: str, broker: Config, workdir: Path
) -> None:
    run = engine_run(kind, broker, workdir)
    for r in run.requests:
        acc = run.accounts[r["engine_request_id"]]
        assert (
            acc["recomputed_tokens"]
            == acc["recomputed_preemption_tokens"] + acc["recomputed_eviction_tokens"]
        )
        assert acc["waste_tokens"] == (
            acc["recomputed_preemption_tokens"] + acc["draft_rejected_tokens"] + acc["draft_cut_tokens"]
        )
        if r["truth"]["preemptions"] == 0:
            assert acc["recomputed_preemption_tokens"] == 0
    # Requests that were never preempted recompute only evicted blocks; both senses occur.
    assert any(
        r["truth"]["preemptions"] == 0 and r["truth"]["recomputed_eviction_tokens"] for r in run.requests
    ) or (kind != "llama")


@pytest.mark.parametrize("kind", KINDS)
def test_skipped_tokens_follow_the_groups_window_and_chunk_arithmetic(
    kind: str, broker: Config, workdir: Path
) -> None:
    run = engine_run(kind, broker, workdir)
    groups = run.result["kv_cache_groups"]
    # EngineStarted carries the same groups: kind, window, chunk and layers.
    published = run.started["kv_cache_groups"]
    assert [(g["sliding_window"], g["attention_chunk_size"], g["num_layers"]) for g in published] == [
        (g["sliding_window"], g["attention_chunk_size"], g["layers"]) for g in groups
    ]
    if kind == "hybrid":
        assert {g["kind"] for g in published} == {"full_attention", "sliding_window"}
    if kind == "chunked":
        assert {g["kind"] for g in published} == {"full_attention", "chunked_local_attention"}
    for r in run.requests:
        acc = run.accounts[r["engine_request_id"]]
        t = r["truth"]
        unattended = majority_end(groups, [unattended_end(g, t["kv_end"]) for g in groups])
        released = t["window_released_tokens"]
        assert acc["skipped_tokens"] == max(0, unattended - released), r["engine_request_id"]


@pytest.mark.parametrize("kind", KINDS)
def test_cached_blocks_name_the_request_that_computed_them(kind: str, broker: Config, workdir: Path) -> None:
    """Each block of an admission hit names, as ``source_request_uid``, the request whose
    allocation began the cache lifetime vLLM served it from."""
    run = engine_run(kind, broker, workdir)
    bs = run.result["block_size"]
    compared = expected = 0
    mismatches = []
    for r in run.requests:
        acc = run.accounts[r["engine_request_id"]]
        t = r["truth"]
        sources = t["sources"]
        assert len(sources) == t["admission_hit"] // bs, r["engine_request_id"]
        if not t["preemptions"]:
            expected += len(sources)
        segments = acc["timeline"]["segments"]
        for i, src in enumerate(sources):
            seg = next(s for s in segments if s["start"] <= i * bs < s["end"])
            if seg["status"] != "cached":
                continue  # re-prefilled after a preemption: the admission's source is gone
            compared += 1
            truth = f"{acc['engine_id']}/{src}" if src is not None else None
            if seg["source_request_uid"] != truth:
                mismatches.append(
                    f"{r['engine_request_id']} block {i}: {seg['source_request_uid']} != {truth}"
                )
    assert expected > 0 and compared >= expected
    assert not mismatches, "\n".join(mismatches)
    assert all(src is not None for r in run.requests for src in r["truth"]["sources"])


@pytest.mark.parametrize("kind", KINDS)
def test_attention_pairs_follow_each_layers_window_and_chunk(
    kind: str, broker: Config, workdir: Path
) -> None:
    """``attention_pairs`` is the mean over layers of the query-key pairs vLLM's attention
    attends (the truth counts them per layer from the groups' window and chunk), and
    ``attention_pairs_skipped`` what full attention would have attended beyond that."""
    run = engine_run(kind, broker, workdir)
    layers = sum(g["layers"] for g in run.result["kv_cache_groups"])
    limited = any(g["sliding_window"] or g["attention_chunk_size"] for g in run.result["kv_cache_groups"])
    for r in run.requests:
        acc = run.accounts[r["engine_request_id"]]
        t = r["truth"]
        pairs = round(Fraction(t["layer_pairs"], layers))
        assert acc["attention_pairs"] == pairs, r["engine_request_id"]
        assert acc["attention_pairs_skipped"] == (t["full_pairs"] - pairs if limited else 0)
    if limited:
        assert sum(run.accounts[r["engine_request_id"]]["attention_pairs_skipped"] for r in run.requests) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_kv_memory_time_equals_the_kv_managers_blocks(kind: str, broker: Config, workdir: Path) -> None:
    """Per request and KV-cache group, the fold's memory-time equals the blocks vLLM's KV-cache
    manager held for it after every schedule() (``req_to_blocks``, null blocks excluded): block-steps,
    peak, token slots used, the actual mode (a shared block charged to its longest holder) exactly,
    the amortized mode within rounding (Σ exact), and block-nanoseconds on the steps' own clock."""
    run = engine_run(kind, broker, workdir)
    assert run.result["kv_ref_mismatches"] == 0  # the truth's holders are the pool's ref counts
    truths = {r["engine_request_id"]: r["truth"]["kv"] for r in run.requests}
    bad, totals = kv_mismatches(run.accounts, truths, run.events)
    assert not bad, "\n".join(bad[:40])
    assert totals["requests"] == len(run.requests)
    # A physical block is held once: both modes add up to the pool's block-steps exactly.
    assert totals["amortized"] == totals["actual"] == totals["physical"]
    assert totals["shared"] > 0  # the workload shares prefix blocks between running requests
    for r in run.requests:
        acc = run.accounts[r["engine_request_id"]]
        assert all(g["bytes_per_block"] > 0 for g in acc["kv_groups"])
        assert acc["kv_peak_bytes"] >= max(g["peak_blocks"] * g["bytes_per_block"] for g in acc["kv_groups"])


@pytest.mark.parametrize("kind", KINDS)
def test_kv_bytes_per_block_are_vllms_page_size(kind: str, broker: Config, workdir: Path) -> None:
    """Bytes per block = the group's page size x its layers; the page size vLLM reports equals
    2 x KV heads x head size x block size x dtype bytes of EngineStarted's KV spec."""
    from sparseety.streams.kv_memory import bytes_per_block

    run = engine_run(kind, broker, workdir)
    started = run.started
    for g in started["kv_cache_groups"]:
        assert g["page_size_bytes"] > 0
        fallback = bytes_per_block(started, {**g, "page_size_bytes": 0})
        assert fallback == g["page_size_bytes"] * g["num_layers"], g
