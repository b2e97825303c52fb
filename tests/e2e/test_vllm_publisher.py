"""The KV publisher registered as ``sparseety`` in vLLM's EventPublisherFactory, selected through a
``KVEventsConfig`` object (the only way vLLM accepts a custom name), and privacy mode ``hashed``:
an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in a child process."""

from __future__ import annotations

import json
from pathlib import Path

from sparseety import events as ev
from sparseety.config import Config
from sparseety.producers.privacy import token_hasher
from tests.e2e.conftest import engine_config, run_driver, tiny_model
from tests.e2e.engine_events import engine_events

DRIVER = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVEventsConfig

if __name__ == "__main__":
    kv = KVEventsConfig(enable_kv_cache_events=True)
    kv.publisher = "sparseety"  # set after validation: vLLM's config only names null and zmq
    llm = LLM(model=sys.argv[1], enable_prefix_caching=True, block_size=32, max_model_len=512,
              enforce_eager=True, kv_events_config=kv, seed=0)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 8 + str(i) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps([list(o.prompt_token_ids) for o in outs]), flush=True)
"""

KEY = "a-secret-key-of-some-length"


def test_registered_publisher_and_hashed_prompts(broker: Config, e2e_dir: Path) -> None:
    cfg = engine_config(broker, e2e_dir / "publisher", "publisher")
    cfg = cfg.replace(privacy={"mode": "hashed", "key": KEY})
    (e2e_dir / "publisher").mkdir(parents=True, exist_ok=True)
    log = run_driver(DRIVER, cfg, [str(tiny_model("llama"))], e2e_dir / "publisher", timeout=300)
    assert "KV events via sparseety publisher" in log
    prompts = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    events = engine_events(cfg, lambda evs: any(ev.payload_type(e) == ev.ENGINE_STOPPED for e in evs))
    started = [ev.payload(e) for e in events if ev.payload_type(e) == ev.REQUEST_STARTED]
    assert len(started) == 3
    hashed = token_hasher(KEY)
    assert sorted(s["prompt_token_hashes"] for s in started) == sorted(hashed(p) for p in prompts)
    assert all(s["prompt_token_ids"] == [] for s in started)
    assert KEY not in log  # the key is never logged
    engine = next(ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED)
    assert engine["privacy_mode"] == "hashed"
    stored = [ev.payload(e) for e in events if ev.payload_type(e) == ev.KV_STORED]
    assert stored
    # The prompts' shared blocks are in the KV events with the same bytes as in RequestStarted.
    assert set(started[0]["block_hashes"]) <= {h for s in stored for h in s["block_hashes"]}
