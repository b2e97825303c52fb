"""Record real-engine event fixtures into ``tests/data/<scenario>/``.

For each scenario a child process runs vLLM (CPU, tiny local model, in-process engine) with the
SparSEEty plugin publishing to an embedded broker; the parent then writes

* ``events.bin``: the topic's message values exactly as produced (length-prefixed Avro
  single-object records, topic order; see ``tests/recorded.py``), and
* ``truth.json``: vLLM's own view of the same run (RequestOutput token ids, num_cached_tokens,
  finish reasons, metric counters such as accepted drafts and preemptions, engine arguments).

Usage::

    .venv/bin/python scripts/record_fixtures.py                  # every scenario
    .venv/bin/python scripts/record_fixtures.py spec_ngram moe_routing

Nothing is downloaded: the tiny models are built locally (``sparseety/stack/tiny_models.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data"
MODEL_CACHE = Path(os.environ.get("TINY_MODEL_CACHE", "~/.cache/sparseety-tiny-models")).expanduser()
MAX_BYTES = 1_000_000

FOX = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "
SYSTEMS = [
    "You are the billing assistant of the serving fleet. Answer in one short paragraph. " * 3,
    "Explain the scheduler: every step it decides which requests run and which blocks are freed. " * 3,
    "Numbers such as 0, 1, 2, 3, 42, 100, 256 and 1024 appear in logs, tables and invoices. " * 3,
]

Workload = list[tuple[str, dict[str, Any]]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _engine(max_model_len: int, **over: Any) -> dict[str, Any]:
    """A scenario's engine arguments: prefix caching on 32-token blocks, eager, then ``over``."""
    return {
        "enable_prefix_caching": True,
        "block_size": 32,
        "max_model_len": max_model_len,
        "enforce_eager": True,
        **over,
    }


def _phase(prompts: list[str], **params: Any) -> Workload:
    return [(p, dict(params)) for p in prompts]


SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix_reuse": {
        "model": "llama",
        "doc": "Shared system prompts across tenants, then second and third turns of the same chats.",
        "engine": _engine(1024),
    },
    "spec_ngram": {
        "model": "llama",
        "doc": "ngram speculative decoding (k=3): drafts proposed, accepted and rejected per step.",
        "engine": _engine(512, speculative_config=NGRAM),
    },
    "moe_routing": {
        "model": "mixtral",
        "doc": "Tiny Mixtral (4 experts, top-2) with routing capture: MoeRouting per step on worker-0.",
        "engine": _engine(512),
        "producer": {"routing_capture": True},
    },
    "sliding_window": {
        "model": "mistral-sw",
        "doc": "Sliding window 64: long prompts with a shared prefix, decodes past the window.",
        "engine": _engine(512),
    },
    "preemption_eviction": {
        "model": "llama",
        "doc": "A 20-block KV cache: distinct prompts evict blocks, then long decodes preempt requests.",
        "engine": _engine(320, num_gpu_blocks_override=20, max_num_seqs=8),
    },
    "sessions": {
        "model": "llama",
        "doc": (
            "Issue 14 sessions: three-turn conversations sent as token ids (turn N = turn N-1's prompt"
            " and answer + a new message) under one system prompt, with session ids (tenant"
            " sessions-a) and without (sessions-b); truth.json names each request's conversation."
        ),
        "engine": _engine(1024),
        "multi_turn": True,
    },
    # Issue 15: counterfactual and regression checks. Each reruns an earlier scenario's workload
    # ("workload") on the same engine name ("engine_name"), later, with one setting changed, so the
    # no-cache what-if can be compared with a real no-cache run and a regression against the
    # engine's own earlier baseline.
    "prefix_reuse_nocache": {
        "model": "llama",
        "doc": "prefix_reuse's workload again with prefix caching disabled (the no-cache what-if's truth).",
        "workload": "prefix_reuse",
        "engine_name": "fixture-prefix_reuse",
        "engine": _engine(1024, enable_prefix_caching=False),
    },
    "prefix_reuse_again": {
        "model": "llama",
        "doc": "prefix_reuse unchanged, a second run on the same engine name (no regression expected).",
        "workload": "prefix_reuse",
        "engine_name": "fixture-prefix_reuse",
        "engine": _engine(1024),
    },
    "spec_ngram_again": {
        "model": "llama",
        "doc": "spec_ngram unchanged, a second run on the same engine name (no regression expected).",
        "workload": "spec_ngram",
        "engine_name": "fixture-spec_ngram",
        "engine": _engine(512, speculative_config=NGRAM),
    },
    "spec_ngram_off": {
        "model": "llama",
        "doc": "spec_ngram's workload with speculative decoding off, same engine name (drafts stop).",
        "workload": "spec_ngram",
        "engine_name": "fixture-spec_ngram",
        "engine": _engine(512),
    },
    "sparsity_truth": {
        "model": "gemma3-hybrid",
        "doc": (
            "Issue 11's engine truth: a hybrid model (2 sliding-window layers, 1 full), prefix sharing,"
            " a tiny KV cache that evicts, preemption; truth.json adds per request what vLLM's"
            " scheduler, KV-cache manager and block pool did (tests/e2e/ground_truth.py)."
        ),
        "engine": {},  # tests/e2e/truth_workloads.py ENGINES["hybrid"]
        "truth_workload": "hybrid",
    },
}


def workload(name: str) -> list[Workload]:
    """Phases of (prompt, sampling parameters); each phase is one ``generate`` call."""
    name = SCENARIOS.get(name, {}).get("workload", name)
    if name == "prefix_reuse":
        first = [
            (SYSTEMS[s] + f"Question {q}: what does line {q} of the invoice mean?", {"tenant": f"tenant-{s}"})
            for s in range(3)
            for q in range(3)
        ]
        return [
            [(p, {"max_tokens": 16, "tenant": t["tenant"]}) for p, t in first],
            # second turns: the first turn and its answer are the prefix ({answer} filled in by the child)
            [
                (p + "{answer} And what about the total?", {"max_tokens": 16, "tenant": t["tenant"]})
                for p, t in first[:4]
            ],
        ]
    if name == "spec_ngram":
        return [
            _phase(
                [("one two three four " * 6) + f"five {i}" for i in range(6)], max_tokens=48, ignore_eos=True
            )
        ]
    if name == "moe_routing":
        shared = "Experts are chosen by a learned gate for every token of the batch. " * 5
        return [_phase([shared + f"Question {i}?" for i in range(5)] + ["A short prompt."], max_tokens=12)]
    if name == "sliding_window":
        shared = FOX * 6
        return [
            _phase(
                [shared + f"Variant {i}: " + FOX * (i % 3) for i in range(4)], max_tokens=40, ignore_eos=True
            )
        ]
    if name == "preemption_eviction":
        return [
            _phase([f"Distinct prompt {i}. " + FOX * 8 for i in range(12)], max_tokens=8),
            _phase([f"Long answer {i}. " + FOX * 3 for i in range(8)], max_tokens=200, ignore_eos=True),
        ]
    raise KeyError(name)


# --- child: run the engine ------------------------------------------------------------------------


def _metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        labels = {k: v for k, v in m.labels.items() if k not in ("engine", "model_name")}
        key = m.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
        if hasattr(m, "value"):
            out[key] = m.value
        elif hasattr(m, "values"):
            out[key] = list(m.values)
    return out


def child(name: str, truth_path: Path) -> None:
    from vllm import LLM

    spec = SCENARIOS[name]
    model = MODEL_CACHE / spec["model"]
    if spec.get("truth_workload"):
        _child_with_truth(name, spec, model, truth_path)
        return
    kv = {"enable_kv_cache_events": True, "publisher": "null"}  # our tee publishes them
    llm = LLM(model=str(model), seed=0, disable_log_stats=False, kv_events_config=kv, **spec["engine"])
    requests = _multi_turn(llm) if spec.get("multi_turn") else _phases(llm, name)
    import vllm

    truth = {
        "scenario": name,
        "doc": spec["doc"],
        "model": spec["model"],
        "engine_args": spec["engine"],
        "vllm_version": vllm.__version__,
        "requests": requests,
        "metrics": _metrics(llm),
    }
    truth_path.write_text(json.dumps(truth))
    llm.llm_engine.engine_core.shutdown()  # EngineStopped + flush


def _phases(llm: Any, name: str) -> list[dict[str, Any]]:
    """Each phase of ``workload(name)`` as one ``generate`` call; vLLM's view of every request."""
    from vllm import SamplingParams

    requests = []
    answers: list[str] = []
    for phase in workload(name):
        prompts, params = [], []
        for i, (prompt, p) in enumerate(phase):
            p = dict(p)
            tenant = p.pop("tenant", "")
            prompts.append(prompt.replace("{answer}", answers[i]) if "{answer}" in prompt else prompt)
            params.append(
                SamplingParams(temperature=0, extra_args={"tenant": tenant} if tenant else None, **p)
            )
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers = [o.outputs[0].text for o in outs]
        requests += [_truth(o, sp) for o, sp in zip(outs, params, strict=True)]
    return requests


def _truth(o: Any, sp: Any, **more: Any) -> dict[str, Any]:
    """vLLM's view of one request: its RequestOutput ``o`` for SamplingParams ``sp``, then ``more``."""
    return {
        "request_id": o.request_id,
        "prompt_token_ids": list(o.prompt_token_ids),
        "output_token_ids": list(o.outputs[0].token_ids),
        "num_cached_tokens": o.num_cached_tokens,
        "finish_reason": o.outputs[0].finish_reason,
        "tenant": (sp.extra_args or {}).get("tenant", ""),
        "max_tokens": sp.max_tokens,
        **more,
    }


SESSION_SYSTEM = "You are the assistant of the serving fleet; answer each question from the report. " * 5
SESSION_OPENERS = {
    "sessions-a": ["Who runs it?", "What is a block?", "Name a GPU."],
    "sessions-b": ["Why cache?", "How big is it?", "Is it fast?"],
}


def _multi_turn(llm: Any) -> list[dict[str, Any]]:
    """Three turns of each conversation, turn by turn, as a client that sends the exact transcript
    back: turn N's prompt ids are turn N-1's prompt and output ids plus a new message. Tenant
    sessions-a names its sessions (``extra_args["session"]``), sessions-b does not. An answer of 32
    tokens (the block size) puts output in every turn's last full block (docs/sessions.md)."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    requests = []
    for tenant, openers in SESSION_OPENERS.items():
        prompts = [tok.encode(SESSION_SYSTEM + o, add_special_tokens=False) for o in openers]
        for turn in range(1, 4):
            params = [
                SamplingParams(
                    max_tokens=32,
                    temperature=0,
                    ignore_eos=True,
                    extra_args={
                        "tenant": tenant,
                        **({"session": f"{tenant}-{i}"} if tenant.endswith("a") else {}),
                    },
                )
                for i in range(len(openers))
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for i, (o, sp) in enumerate(zip(outs, params, strict=True)):
                session = (sp.extra_args or {}).get("session", "")
                requests.append(_truth(o, sp, session=session, conversation=f"{tenant}-{i}", turn=turn))
            follow = tok.encode(
                f" Thanks. Now question {turn + 1}, please: why is that so?", add_special_tokens=False
            )
            prompts = [p + list(o.outputs[0].token_ids) + follow for p, o in zip(prompts, outs, strict=True)]
    return requests


def _child_with_truth(name: str, spec: dict[str, Any], model: Path, truth_path: Path) -> None:
    """The engine-truth workload with the ground-truth recorder attached to the scheduler."""
    import vllm
    from vllm import LLM

    from tests.e2e.ground_truth import attach, run_workload
    from tests.e2e.truth_workloads import ENGINES, phases

    engine = ENGINES[spec["truth_workload"]]["engine"]
    kv = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = LLM(model=str(model), seed=0, disable_log_stats=False, kv_events_config=kv, **engine)
    result = run_workload(llm, attach(llm), phases())
    truth = {
        "scenario": name,
        "doc": spec["doc"],
        "model": spec["model"],
        "engine_args": engine,
        "vllm_version": vllm.__version__,
        **result,
    }
    truth_path.write_text(json.dumps(truth))
    llm.llm_engine.engine_core.shutdown()


# --- parent: broker, children, files ----------------------------------------------------------------


def record(name: str, cfg: Any, work: Path) -> None:
    from sparseety.config import to_env
    from sparseety.kafka import ensure_topics, make_decoder
    from tests.helpers import read_topic
    from tests.recorded import pack

    spec = SCENARIOS[name]
    topic = f"fixtures-{name}-{int(time.time())}"
    ecfg = cfg.replace(
        data_dir=str(work / name),
        topics={**cfg.topics.model_dump(), "engine_events": topic, "partitions": 1},
        producer={
            "engine_name": spec.get("engine_name", f"fixture-{name}"),
            "heartbeat_interval_s": 1.0,
            **spec.get("producer", {}),
        },
    )
    ensure_topics(ecfg, [topic])
    truth_path = work / f"{name}.truth.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    env.update(to_env(ecfg))
    env.update(
        {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, __file__, "--child", name, str(truth_path)], env=env, check=True)
    values = [r[3] for r in read_topic(ecfg, topic, decode=False, quiet_s=2.0)]
    truth = json.loads(truth_path.read_text())
    dec = make_decoder(ecfg)
    started = {}
    for v in values:
        _, e = dec.decode(v)
        body = e["payload"][1]
        if e["payload"][0].endswith("RequestStarted"):
            started[body["request_id"].rsplit("-", 1)[0]] = body["request_id"]
    for r in truth["requests"]:
        r["engine_request_id"] = started.get(r["request_id"])
    data = pack(values)
    if len(data) > MAX_BYTES:
        raise SystemExit(f"{name}: {len(data)} bytes of events, over the {MAX_BYTES} byte budget")
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "events.bin").write_bytes(data)
    (out / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    print(f"{name}: {len(values)} events, {len(data)} bytes, {time.monotonic() - t0:.0f} s", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenarios", nargs="*", choices=[*SCENARIOS, []], help="default: all")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from sparseety.broker import EmbeddedBroker
    from sparseety.config import load_config
    from sparseety.stack.tiny_models import build_tiny_model
    from tests.helpers import free_port

    for kind in {SCENARIOS[s]["model"] for s in args.scenarios or SCENARIOS}:
        build_tiny_model(kind, MODEL_CACHE / kind)
    with tempfile.TemporaryDirectory(prefix="sparseety-fixtures-") as tmp:
        work = Path(tmp)
        cfg = load_config(data_dir=str(work / "broker"), broker={"port": free_port()})
        broker = EmbeddedBroker(cfg)
        broker.start(create_topics=False)
        try:
            for name in args.scenarios or SCENARIOS:
                record(name, broker.client_config(), work)
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
