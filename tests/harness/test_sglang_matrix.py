"""SGLang's real scheduler in its production modes, a simulated model worker, the real broker
and the real fold: every class equals what SGLang itself reported, per request. Then every
mode's events once more through a real worker process (the Faust assembler) and the ClickHouse
sink into a chDB store, which must say what the pure fold says.

The matrix (docs/sglang.md, "Modes"): scheduler overlap (SGLang's GPU default) / normal x
TreeCore Rust (its Linux default, KV events teed) / Python, and EAGLE-style speculation (a
simulated draft worker, ``tests/harness/sglang_spec.py``, on the normal loop); each with prefix
sharing, chunked prefill, retraction and radix eviction in one workload (``tests/harness/sglang_modes.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import tiny_model
from tests.harness.sglang_modes import BLOCK, SGLANG_PYTHON, SPEC_STEPS, Mode, ModeRun, run_modes

MODES = [Mode(overlap=o, tree_core=t) for o in (True, False) for t in ("rust", "python")] + [
    Mode(overlap=o, tree_core="rust", spec=True) for o in (True, False)
]
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
    # SGLang's radix cache keys EAGLE requests by bigrams (``is_bigram``): one position fewer
    assert meta["same-2"]["cached_tokens"] == 39 - mode.spec and meta["sys-b1"]["cached_tokens"] >= 47
    assert run.truth["long-1-again"]["recomputed_blocks"] > 0  # evicted, then computed again
    chunks = [
        n
        for e in run.events
        if ev.payload_type(e) == ev.STEP_BATCH
        for rid, n in zip(ev.payload(e)["req_ids"], ev.payload(e)["num_scheduled_tokens"], strict=True)
        if rid == "long-1"
    ]
    assert max(chunks) <= 64 < sum(chunks[:4])  # the 200-token prompt prefilled in chunks
    verifies = sum(m.get("spec_verify_ct", 0) for m in meta.values())
    if not mode.spec:
        assert verifies == 0 and started[0]["spec_method"] is None
        return
    assert started[0]["spec_method"] == "eagle" and started[0]["spec_num_tokens"] == SPEC_STEPS
    # every request verified drafts; the pattern accepted all, none and some of them; the stop
    # cut accepted drafts
    assert all(m["spec_verify_ct"] > 0 for m in meta.values())
    accounts = run.accounts.values()
    for k in ("draft_accepted_tokens", "draft_rejected_tokens", "draft_cut_tokens"):
        assert sum(a[k] for a in accounts) > 0, k


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
        if _drafts(run, rid, acc) != _spec_truth(info):
            bad.append((rid, "drafts", _drafts(run, rid, acc), _spec_truth(info)))
        if started[rid]["num_cached_tokens"] != run.truth[rid]["hit"]:
            bad.append((rid, "hit", started[rid]["num_cached_tokens"], run.truth[rid]["hit"]))
        if details.get("device", 0) != info["cached_tokens"]:  # one tier: the device
            bad.append((rid, "details", details))
        # RequestStarted.cached_tokens_by_source (issue 36's contract): SGLang's own split
        if started[rid]["cached_tokens_by_source"] != {k: v for k, v in details.items() if v}:
            bad.append((rid, "by source", started[rid]["cached_tokens_by_source"], details))
        # every full block of the hit names the request that computed it (all were computed here;
        # a segment may run on into the partial block: EAGLE's bigram hits end one token short)
        full = info["cached_tokens"] // BLOCK * BLOCK
        sources = {
            s["source_request_uid"]
            for s in acc["timeline"]["segments"]
            if s["status"] == "cached" and s["start"] < full
        }
        if full and (None in sources or not sources):
            bad.append((rid, "sources", sources))
    assert bad == []


def _spec_truth(info: dict[str, Any]) -> dict[str, int]:
    """SGLang's own spec counts of a request (``meta_info``; absent without speculation): its
    verifies, the drafts they judged, the drafts they accepted (``spec_num_correct_drafts``:
    those the stop then cut included) and the tokens they committed (accepted + one bonus each)."""
    verifies = info.get("spec_verify_ct", 0)
    correct = info.get("spec_num_correct_drafts", 0)
    return {
        "verifies": verifies,
        "judged": SPEC_STEPS * verifies,
        "accepted": correct,
        "committed": correct + verifies,
    }


def _drafts(run: ModeRun, rid: str, acc: dict[str, Any]) -> dict[str, int]:
    """Ours: verifies are the StepBatches whose drafts of ``rid`` were judged (not the fold's
    unverified); judged and accepted by the verifier are the fold's classes (docs/streams.md,
    "Drafts": accepted + rejected + cut - unverified, accepted + cut - unverified)."""
    verifies = 0
    for e in run.events:
        if ev.payload_type(e) != ev.STEP_BATCH:
            continue
        p = ev.payload(e)
        for i, r in enumerate(p["req_ids"]):
            if r == rid and p["spec_proposed"] and p["spec_proposed"][i]:
                verifies += bool(p["num_new_tokens"][i] or p["spec_accepted"][i])
    unverified = acc["draft_unverified_tokens"]
    accepted = acc["draft_accepted_tokens"] + acc["draft_cut_tokens"] - unverified
    return {
        "verifies": verifies,
        "judged": accepted + acc["draft_rejected_tokens"],
        "accepted": accepted,
        "committed": accepted + verifies,
    }


#: The RequestAccounting fields the store must hold as the pure fold has them.
STORED = ("prompt_tokens", "output_tokens", "cache_read_tokens", "engine_cached_tokens", "preemptions",
          "recomputed_eviction_tokens", "draft_accepted_tokens", "draft_rejected_tokens",
          "draft_cut_tokens", "draft_unverified_tokens", "tenant")  # fmt: skip


@pytest.fixture(scope="module")
def pipeline(
    runs: dict[str, ModeRun], broker: Config, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], dict[str, Any]]:
    """Every mode's raw events on one topic, a real worker, its records through the sink into a
    chDB store; the store's ``requests`` rows by (engine name, request id)."""
    from sparseety.kafka import ensure_topics
    from sparseety.sinks.clickhouse.tables import SINK_TABLES
    from tests.helpers import (
        ComponentProcess,
        chdb_config,
        latest_by_key,
        produce_raw,
        read_topic,
        throwaway_store,
        wait_folded,
        write_accounting,
    )
    from tests.topology.test_worker import worker_cfg

    tmp = tmp_path_factory.mktemp("sglang-pipeline")
    topics = {
        "engine_events": "sgh.ee",
        "timelines": "sgh.tl",
        "usage": "sgh.us",
        "dlq": "sgh.dlq",
        "partitions": 2,
    }
    cfg = worker_cfg(broker.replace(topics=topics, data_dir=str(tmp / "data")), "sglang-harness")
    ensure_topics(cfg)
    for run in runs.values():
        raw = read_topic(cfg, run.topic, decode=False, quiet_s=0.5)
        produce_raw(cfg, cfg.topics.engine_events, [(r[2], r[3]) for r in raw])
    expected = sum(len(run.answers) for run in runs.values())
    worker = ComponentProcess(cfg, ["worker"], tmp / "worker.log").start()
    try:
        wait_folded(cfg, worker, expected, 240, "every harness request")
        records = list(latest_by_key(read_topic(cfg, cfg.topics.timelines)).values())
        dead = read_topic(cfg, cfg.topics.dlq)
    finally:
        worker.stop()
    assert dead == []
    table = next(t for t in SINK_TABLES if t.name == "requests")
    with throwaway_store(chdb_config(tmp_path_factory)) as store:
        write_accounting(store, records)
        cols = ["engine_name", "request_id", *STORED]
        _, rows = store.query_rows(f"SELECT {', '.join(cols)} FROM {store.table(table.name)} FINAL")
    return {(r[0], r[1]): dict(zip(cols, r, strict=True)) for r in rows}


def test_the_worker_and_the_store_say_what_the_fold_says(
    runs: dict[str, ModeRun], pipeline: dict[tuple[str, str], dict[str, Any]]
) -> None:
    bad = []
    for run in runs.values():
        engine = next(e["engine_name"] for e in run.events)
        for rid in run.answers:
            row = pipeline.get((engine, rid))
            want = {k: run.accounts[rid][k] for k in STORED}
            if row is None or {k: row[k] for k in STORED} != want:
                bad.append((run.mode.name, rid, row, want))
    assert bad == []
    assert len(pipeline) == sum(len(run.answers) for run in runs.values())
