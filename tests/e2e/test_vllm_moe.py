"""MoE routing captured in the worker process (tiny Mixtral, multiprocess, eager) joins the
engine core's steps: one MoeRouting per step on stream worker-0, same requests, and every
request's expert counts add up to top_k choices per computed token in every layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import EnginePool, OfflineEngine, engine_config, start_offline, tiny_model
from tests.e2e.engine_events import engine_events, engine_rid, finished_ids
from tests.recorded import reconstruct, seq_gaps


@pytest.fixture(scope="module")
def mixtral(engine_pool: EnginePool, broker: Config, e2e_dir: Path) -> OfflineEngine:
    def start() -> OfflineEngine:
        cfg = engine_config(broker, e2e_dir / "mixtral", "mixtral", routing_capture=True)
        llm = start_offline(
            cfg,
            tiny_model("mixtral"),
            enable_prefix_caching=True,
            block_size=32,
            max_model_len=512,
            enforce_eager=True,
        )
        return OfflineEngine(cfg, llm)

    return engine_pool.get("mixtral", start)  # type: ignore[no-any-return]


def test_routing_is_captured_per_step_in_the_worker(mixtral: OfflineEngine) -> None:
    from vllm import SamplingParams

    shared = "Experts are chosen by a learned gate for every token. " * 6
    prompts = [shared + f"Question {i}?" for i in range(5)] + ["Short one."]
    outs = mixtral.llm.generate(
        prompts,
        [SamplingParams(max_tokens=6 + 3 * i, temperature=0) for i in range(len(prompts))],
        use_tqdm=False,
    )
    ids = {o.request_id for o in outs}

    def complete(events: list[dict[str, object]]) -> bool:
        done = ids <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}  # type: ignore[arg-type]
        if not done:
            return False
        steps = {ev.payload(e)["step"] for e in events if ev.payload_type(e) == ev.STEP_BATCH}  # type: ignore[arg-type]
        routed = {ev.payload(e)["step"] for e in events if ev.payload_type(e) == ev.MOE_ROUTING}  # type: ignore[arg-type]
        return steps <= routed

    events = engine_events(mixtral.cfg, complete)
    started = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)
    assert started["routing_capture"] is True
    assert (started["moe_num_experts"], started["moe_top_k"]) == (4, 2)
    top_k = started["moe_top_k"]

    routing = {ev.payload(e)["step"]: e for e in events if ev.payload_type(e) == ev.MOE_ROUTING}
    core_ids = {e["engine_id"] for e in events if e["stream"] == ev.CORE_STREAM}
    assert {e["engine_id"] for e in routing.values()} == core_ids
    assert {e["stream"] for e in routing.values()} == {"worker-0"}
    assert all(not gaps for gaps in seq_gaps(events).values())

    steps = [ev.payload(e) for e in events if ev.payload_type(e) == ev.STEP_BATCH]
    assert steps
    for step in steps:
        moe = ev.payload(routing[step["step"]])
        assert sorted(moe["req_ids"]) == sorted(step["req_ids"])
        layers, experts = moe["num_layers"], moe["num_experts"]
        assert (layers, experts) == (2, 4)
        width = layers * experts
        for i, rid in enumerate(moe["req_ids"]):
            row = moe["expert_counts"][i * width : (i + 1) * width]
            tokens = step["num_scheduled_tokens"][step["req_ids"].index(rid)]
            for layer in range(layers):
                assert sum(row[layer * experts : (layer + 1) * experts]) == tokens * top_k

    per_request = reconstruct(events)
    for o in outs:
        rid = engine_rid(events, o.request_id)
        assert per_request[rid]["output"] == list(o.outputs[0].token_ids)
        assert per_request[rid]["started"]["num_cached_tokens"] == o.num_cached_tokens
