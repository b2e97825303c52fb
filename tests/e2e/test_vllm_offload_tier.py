"""Cached tokens by tier on the real CPU engine (issue 36): vLLM's own ``OffloadingConnector`` with
a CPU tier (its scheduler side as shipped; the test-only worker of ``tests/e2e/cpu_offload_spec``
copies the blocks), the plugin inside, and the fold's per-request tiers checked against what the
engine itself reported: ``RequestOutput.num_cached_tokens`` and the
``vllm:prompt_tokens_cached_by_source{source=device|host}`` counters, read around each request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import Config
from tests.e2e.conftest import EnginePool, OfflineEngine, engine_config, environ, start_offline, tiny_model
from tests.e2e.cpu_offload_spec import kv_transfer_config
from tests.e2e.engine_events import engine_events, engine_rid, finished_ids

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32


@pytest.fixture(scope="module")
def offload(engine_pool: EnginePool, broker: Config, e2e_dir: Path) -> OfflineEngine:
    def start() -> OfflineEngine:
        cfg = engine_config(broker, e2e_dir / "offload", "offload")
        with environ({"PYTHONPATH": str(REPO)}):  # the engine and worker import the spec
            llm = start_offline(
                cfg,
                tiny_model("llama"),
                enable_prefix_caching=True,
                block_size=BLOCK,
                max_model_len=512,
                max_num_seqs=4,
                enforce_eager=True,
                kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
                kv_transfer_config=kv_transfer_config(),
            )
        return OfflineEngine(cfg, llm)

    return engine_pool.get("offload", start)  # type: ignore[no-any-return]


def _by_source(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source" and isinstance(
            getattr(m, "value", None), (int, float)
        ):
            out[m.labels["source"]] = out.get(m.labels["source"], 0) + m.value
    return out


def test_cached_tokens_by_tier_equal_the_engines_own(offload: OfflineEngine) -> None:
    """A prompt is computed (its blocks go to the GPU prefix cache and the CPU tier); the GPU
    cache is reset (the CPU tier kept); its first half comes back from the CPU tier alone; the
    whole prompt then reads the first half from the GPU cache and the rest from the CPU tier.
    Per request the fold's tiers (``cache_read_tokens`` = gpu, ``cache_read_cpu_offload_tokens``)
    and the timeline statuses equal the engine's own split; nothing is external.

    Then two block-aligned prompts are loaded whole (the GPU cache reset again): one all from the
    CPU tier, one GPU first and its last block from the CPU tier. vLLM counts the whole prompt
    cached (its ``num_cached_tokens``, its counters by source) and, after the load, computes the
    last token again (``Scheduler._update_waiting_for_remote_kv``). The fold counts that position
    once, computed: the CPU tier's read is the engine's host count less one, nothing is
    recomputed after a preemption (none happened), and the engine scheduled exactly that one
    prompt token."""
    from vllm import SamplingParams

    from sparseety.config import WorkerConfig
    from sparseety.streams.assembler import TIMELINES, Assembler
    from sparseety.streams.state import MemoryStore

    llm = offload.llm
    text = "The fleet offloads its KV cache to host memory and loads it back when asked. " * 12
    params = SamplingParams(max_tokens=4, temperature=0)
    tok = llm.get_tokenizer()
    ids = tok.encode(text)[: 7 * BLOCK + 5]
    half = ids[: 3 * BLOCK + 5]
    assert len(ids) == 7 * BLOCK + 5
    aligned, aligned_more = ids[: 4 * BLOCK], ids[: 5 * BLOCK]  # every block loaded
    runs: list[tuple[str, Any, dict[str, float]]] = []

    def run(name: str, prompt: list[int]) -> None:
        before = _by_source(llm)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        after = _by_source(llm)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        runs.append((name, out, {k: v for k, v in delta.items() if v}))

    run("cold", ids)
    assert llm.reset_prefix_cache(reset_connector=False)  # the GPU cache only
    run("half", half)
    run("whole", ids)
    assert llm.reset_prefix_cache(reset_connector=False)
    run("aligned", aligned)  # all four blocks from the CPU tier
    run("aligned_more", aligned_more)  # four from the GPU cache, the fifth from the CPU tier
    names = {out.request_id: name for name, out, _ in runs}

    def complete(events: list[dict[str, Any]]) -> bool:
        return set(names) <= {r.rsplit("-", 1)[0] for r in finished_ids(events)}

    events = engine_events(offload.cfg, complete, timeout=90)
    asm = Assembler(WorkerConfig(closed_retention_s=0), MemoryStore())
    records = {o.record["request_id"]: o.record for e in events for o in asm.apply(e) if o.topic == TIMELINES}
    started = {
        ev.payload(e)["request_id"]: ev.payload(e) for e in events if ev.payload_type(e) == ev.REQUEST_STARTED
    }
    media = {ev.payload(e).get("medium") for e in events if ev.payload_type(e) == ev.KV_STORED}

    seen = {}
    for name, out, delta in runs:
        rid = engine_rid(events, out.request_id)
        rec = records[rid]
        device, host = int(delta.get("device", 0)), int(delta.get("host", 0))
        seen[name] = (device, host)
        # the engine's own counts: its total hit, and its counters by source
        assert device + host == out.num_cached_tokens == rec["engine_cached_tokens"], (name, delta)
        assert set(delta) <= {"device", "host"}, (name, delta)
        assert started[rid]["cached_tokens_by_source"] == {
            k: v for k, v in (("device", device), ("host", host)) if v
        }, name
        # A whole prompt loaded: vLLM counts its last token in the hit, then computes it; the
        # fold counts it computed only (docs/streams.md, "Hits the engine gives back").
        whole_load = out.num_cached_tokens == len(out.prompt_token_ids)
        back = 1 if whole_load else 0
        assert (rec["cache_read_tokens"], rec["cache_read_cpu_offload_tokens"]) == (device, host - back), name
        assert rec["preemptions"] == rec["recomputed_preemption_tokens"] == rec["waste_tokens"] == 0, name
        # what the engine scheduled: the prompt positions it computed, then one per output token
        # but the last (each is computed first here)
        output = len(out.outputs[0].token_ids)
        computed_prompt = len(out.prompt_token_ids) - out.num_cached_tokens + back
        scheduled = computed_prompt + output - 1
        assert rec["scheduled_tokens"] == rec["uncached_computed_tokens"] == scheduled, name
        assert rec["external_kv_tokens"] == 0 and rec["consistent"], name
        # a block loaded from the CPU tier is no cache write (vLLM: its created_cache_tokens
        # leaves the hit out, the connector's part included), a block computed here is
        assert (
            rec["cache_write_tokens"] == rec["engine_cache_write_tokens"] == out.num_cache_creation_tokens
        ), name
        statuses = [
            (s["start"], s["end"], s["status"]) for s in rec["timeline"]["segments"] if s["kind"] == "prompt"
        ]
        want = [(0, device, "cached")] if device else []
        want += [(device, device + host - back, "cached_cpu_offload")] if host else []
        want += [(device + host - back, len(out.prompt_token_ids), "computed")]
        assert [s for s in statuses if s[0] < s[1]] == want, (name, statuses)
    assert (
        seen["cold"] == (0, 0)
        and records[engine_rid(events, runs[0][1].request_id)]["cache_write_tokens"] == 7 * BLOCK
    )
    assert seen["half"] == (0, 3 * BLOCK)  # the GPU cache was reset: all from the CPU tier
    assert seen["whole"][0] == 3 * BLOCK and seen["whole"][1] > 0  # GPU first, the rest from CPU
    assert seen["aligned"] == (0, 4 * BLOCK)  # the whole prompt from the CPU tier, as vLLM counts
    assert seen["aligned_more"] == (4 * BLOCK, BLOCK)
    # the CPU tier's own KV events reached the stream with their medium (the device pool says GPU)
    assert "CPU" in media and "GPU" in media, media
