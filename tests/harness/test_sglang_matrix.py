"""SGLang's real scheduler in its production modes, a simulated model worker, the real broker
and the real fold: every class equals what SGLang itself reported, per request.

The matrix (docs/sglang.md, "Modes"): scheduler overlap (SGLang's GPU default) / normal x
TreeCore Rust (its Linux default, KV events teed) / Python; each with prefix sharing, chunked
prefill, retraction and radix eviction in one workload (``tests/harness/sglang_modes.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import tiny_model
from tests.harness.sglang_modes import BLOCK, SGLANG_PYTHON, Mode, ModeRun, run_modes

MODES = [Mode(overlap=o, tree_core=t) for o in (True, False) for t in ("rust", "python")]
_RUNS: dict[str, ModeRun] = {}


@pytest.fixture(scope="module")
def runs(broker: Config, session_dir: Path) -> dict[str, ModeRun]:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup_sglang.sh (scripts/setup.sh does)")
    workdir = session_dir / "harness-sglang"
    workdir.mkdir(exist_ok=True)
    return run_modes(MODES, tiny_model("llama"), broker, workdir)


def _ids(modes: list[Mode]) -> list[str]:
    return [m.name for m in modes]


@pytest.mark.parametrize("mode", MODES, ids=_ids(MODES))
def test_the_mode_ran_as_named(mode: Mode, runs: dict[str, ModeRun]) -> None:
    """SGLang ran the loop and core the mode names, and the workload reached what it is for."""
    run = runs[mode.name]
    assert run.loops == ["event_loop_overlap" if mode.overlap else "event_loop_normal"]
    started = [ev.payload(e) for e in run.events if ev.payload_type(e) == ev.ENGINE_STARTED]
    assert len(started) == 1 and started[0]["kv_events_observed"] is True
    assert sum(ev.payload_type(e) == ev.ENGINE_STOPPED for e in run.events) == 1
    meta = {rid: a["meta_info"] for rid, a in run.answers.items()}
    assert sum(m["num_retractions"] for m in meta.values()) > 0  # the pressure phase retracted
    assert meta["same-2"]["cached_tokens"] == 39 and meta["sys-b1"]["cached_tokens"] >= 48
    assert run.truth["long-1-again"]["recomputed_blocks"] > 0  # evicted, then computed again
    chunks = [
        n
        for e in run.events
        if ev.payload_type(e) == ev.STEP_BATCH
        for rid, n in zip(ev.payload(e)["req_ids"], ev.payload(e)["num_scheduled_tokens"], strict=True)
        if rid == "long-1"
    ]
    assert max(chunks) <= 64 < sum(chunks[:4])  # the 200-token prompt prefilled in chunks


@pytest.mark.parametrize("mode", MODES, ids=_ids(MODES))
def test_every_class_equals_what_sglang_reported(mode: Mode, runs: dict[str, ModeRun]) -> None:
    run = runs[mode.name]
    finished = {
        ev.payload(e)["request_id"]: ev.payload(e)
        for e in run.events
        if ev.payload_type(e) == ev.REQUEST_FINISHED
    }
    started = {
        ev.payload(e)["request_id"]: ev.payload(e)
        for e in run.events
        if ev.payload_type(e) == ev.REQUEST_STARTED
    }
    assert set(finished) == set(run.answers)
    bad = []
    for rid, answer in run.answers.items():
        info, acc, fin = answer["meta_info"], run.accounts[rid], finished[rid]
        details = info.get("cached_tokens_details") or {}
        want = {
            "prompt_tokens": info["prompt_tokens"],
            "output_tokens": info["completion_tokens"],
            # SGLang's cached_tokens is the admission hit (a retracted request is "stained" and
            # its resumes not counted); the fold's cache reads add the prefixes read on resume
            "engine_cached_tokens": info["cached_tokens"],
            "cache_read_tokens": info["cached_tokens"] + run.truth[rid]["resume_hits"],
            "preemptions": info["num_retractions"],
            "recomputed_eviction_tokens": BLOCK * run.truth[rid]["recomputed_blocks"],
            "tenant": run.tenants[rid],
        }
        got = {k: acc[k] for k in want}
        if got != want:
            bad.append((rid, got, want))
        if not acc["consistent"] or acc["source_history_lost_ts_ns"]:
            bad.append((rid, "consistent", acc["consistent"], acc["source_history_lost_ts_ns"]))
        if (
            fin["num_output_tokens"] != len(answer["output_ids"])
            or fin["num_preemptions"] != info["num_retractions"]
        ):
            bad.append((rid, "finished", fin))
        if started[rid]["num_cached_tokens"] != run.truth[rid]["hit"]:
            bad.append((rid, "hit", started[rid]["num_cached_tokens"], run.truth[rid]["hit"]))
        if details.get("device", 0) != info["cached_tokens"]:  # one tier: the device
            bad.append((rid, "details", details))
        # RequestStarted.cached_tokens_by_source (issue 36's contract): SGLang's own split
        if started[rid]["cached_tokens_by_source"] != {k: v for k, v in details.items() if v}:
            bad.append((rid, "by source", started[rid]["cached_tokens_by_source"], details))
        # every full block of the hit names the request that computed it (all were computed here)
        full = info["cached_tokens"] // BLOCK * BLOCK
        sources = {
            s["source_request_uid"]
            for s in acc["timeline"]["segments"]
            if s["status"] == "cached" and s["end"] <= full
        }
        if full and (None in sources or not sources):
            bad.append((rid, "sources", sources))
    assert bad == []
