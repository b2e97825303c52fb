"""MoE routing capture under torch.compile (vLLM's default mode): plain forward hooks would run
once at trace time; the capture's custom op runs inside the compiled graph every step."""

from __future__ import annotations

from pathlib import Path

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import engine_config, run_driver, tiny_model
from tests.e2e.engine_events import engine_events

DRIVER = """
import sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enable_prefix_caching=True, block_size=32, max_model_len=512, seed=0)
    prompts = ["Experts are chosen by a learned gate. " * 5 + str(i) for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
"""


def test_routing_captured_every_step_in_a_compiled_model(broker: Config, e2e_dir: Path) -> None:
    cfg = engine_config(broker, e2e_dir / "moe-compiled", "moe-compiled", routing_capture=True)
    (e2e_dir / "moe-compiled").mkdir(parents=True, exist_ok=True)
    log = run_driver(DRIVER, cfg, [str(tiny_model("mixtral"))], e2e_dir / "moe-compiled")
    assert "custom op in the compiled graph" in log
    events = engine_events(cfg, lambda evs: any(ev.payload_type(e) == ev.ENGINE_STOPPED for e in evs))
    steps = {ev.payload(e)["step"]: ev.payload(e) for e in events if ev.payload_type(e) == ev.STEP_BATCH}
    routing = {ev.payload(e)["step"]: ev.payload(e) for e in events if ev.payload_type(e) == ev.MOE_ROUTING}
    assert steps and set(routing) == set(steps)
    for step, moe in routing.items():
        width = moe["num_layers"] * moe["num_experts"]
        for i, rid in enumerate(moe["req_ids"]):
            tokens = steps[step]["num_scheduled_tokens"][steps[step]["req_ids"].index(rid)]
            assert sum(moe["expert_counts"][i * width : (i + 1) * width]) == tokens * 2 * moe["num_layers"]
