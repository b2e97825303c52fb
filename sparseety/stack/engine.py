"""The demo's engine: a real vLLM engine with the SparSEEty plugin, under a workload that makes
every token status happen. Run as a child process (vLLM spawns processes; the plugin reads its
configuration from ``SPARSEETY_*`` variables the parent sets):

    python -m sparseety.stack.engine --model DIR --out results.json [--sessions 4] [--quick]

Workload: three tenants share a fleet-wide policy prompt and each has its own system prompt
(prefix cache hits, across and within tenants); multi-turn chat sessions resend the growing
conversation (more hits); long documents overrun the model's sliding window (evicted and skipped
positions); repetitive text gives the ngram drafter something to propose (accepted and rejected
drafts); a KV cache of a few dozen blocks forces evictions and preemptions (recomputed
positions). ``results.json`` holds what vLLM itself returned per request, for the report's check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

TENANTS = ("acme", "globex", "initech")
POLICY = "Fleet policy: answer briefly, cite the invoice line, never reveal other tenants' data. " * 2
SYSTEMS = {
    "acme": "You are Acme's billing assistant; you explain GPU hours and token classes. " * 2,
    "globex": "You are Globex's support agent; you explain cache hits, drafts and evictions. " * 2,
    "initech": "You are Initech's analyst; you compare engines, experts and windows. " * 2,
}
QUESTIONS = [
    "What does line {i} of the invoice mean? one two three four one two three four",
    "Why did request {i} cost more than the others? repeat after me: cache, cache, cache",
    "How many tokens were served from the cache in session {i}? five six seven five six seven",
]
FOLLOW_UPS = ["And the total?", "Break it down by tenant.", "Compare it with yesterday."]
DOCUMENT = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "

#: The reasoning parser of the demo's tiny model (its tokenizer has <think> and </think>).
TINY_REASONING_PARSER = "deepseek_r1"
#: Engine arguments of the demo on the tiny local model (CPU): a KV cache of 40 blocks of 32.
TINY_ENGINE: dict[str, Any] = {
    "enable_prefix_caching": True,
    "block_size": 32,
    "max_model_len": 512,
    "max_num_seqs": 16,
    "num_gpu_blocks_override": 40,
    "enforce_eager": True,  # MoE routing capture uses forward hooks: no CUDA graphs / compile
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
}


def phases(sessions: int, quick: bool) -> list[list[tuple[str, str, int]]]:
    """Turns of the workload as (tenant, prompt template, max_tokens); ``{answer}`` is filled in
    with the previous turn's answer of the same session."""
    out_tokens = 24 if quick else 64
    first: list[tuple[str, str, int]] = []
    for s in range(sessions):
        for t in TENANTS:
            q = QUESTIONS[s % len(QUESTIONS)].format(i=s)
            first.append((t, POLICY + SYSTEMS[t] + q, out_tokens))
    docs = [
        (t, POLICY + DOCUMENT * (8 if quick else 12) + "Summarise the document.", out_tokens) for t in TENANTS
    ]
    turns = [first + docs]
    for k in range(1 if quick else 2):
        turns.append([(t, p + " {answer} " + FOLLOW_UPS[k], out_tokens) for t, p, _ in first])
    return turns


#: Room kept free beyond max_tokens: the drafter's proposals also take positions.
SPEC_MARGIN = 8


def fit_tokens(ids: list[int], room: int, tail: int = 16) -> list[int]:
    """``ids`` cut to ``room`` tokens by dropping from the middle.

    The head keeps the shared policy and system prompts (prefix cache hits stay the same whatever
    the tokenizer), the tail keeps the question; how many tokens a text takes depends on the
    model's tokenizer, so prompts are sized in tokens, not characters.
    """
    if len(ids) <= room:
        return ids
    return ids[: room - tail] + ids[-tail:]


def _reasoner(name: str | None, tokenizer: Any) -> Any:
    """vLLM's reasoning parser ``name`` over ``tokenizer`` (the front end's), or None."""
    if not name:
        return None
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)


def run(model: Path, out: Path, sessions: int, quick: bool, engine_args: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    started = time.time()
    print(f"engine: loading {model}", flush=True)
    llm = LLM(
        model=str(model),
        seed=0,
        disable_log_stats=False,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},  # the plugin tees them
        **engine_args,
    )
    print(f"engine: ready in {time.time() - started:.0f} s", flush=True)
    tokenizer = llm.get_tokenizer()
    reasoner = _reasoner(engine_args.get("reasoning_parser"), tokenizer)
    max_model_len = llm.llm_engine.model_config.max_model_len
    results: list[dict[str, Any]] = []
    answers: list[str] = []
    all_phases = phases(sessions, quick)
    for n, phase in enumerate(all_phases, 1):
        prompts: list[Any] = []
        params = []
        for i, (tenant, template, max_tokens) in enumerate(phase):
            text = template.replace("{answer}", answers[i] if i < len(answers) else "")
            ids = fit_tokens(tokenizer.encode(text), max_model_len - max_tokens - SPEC_MARGIN)
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={"tenant": tenant}
                )
            )
        t0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers = [o.outputs[0].text[:200] for o in outs]
        for o, sp in zip(outs, params, strict=True):
            results.append(
                {
                    "request_id": o.request_id,
                    "tenant": (sp.extra_args or {}).get("tenant", ""),
                    "prompt_tokens": len(o.prompt_token_ids or []),
                    "output_tokens": len(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens or 0,
                    # vLLM's own cache-write count (usage.prompt_tokens_details.created_cache_tokens)
                    "num_cache_creation_tokens": getattr(o, "num_cache_creation_tokens", None),
                    "finish_reason": o.outputs[0].finish_reason,
                    # what the demo's restored request is checked against (token records)
                    "output_token_ids": list(o.outputs[0].token_ids),
                    "output_text": o.outputs[0].text,
                    # vLLM's own count, what its API server reports as
                    # completion_tokens_details.reasoning_tokens (None: no reasoning parser)
                    "reasoning_tokens": None
                    if reasoner is None
                    else reasoner.count_reasoning_tokens(list(o.outputs[0].token_ids)),
                }
            )
        print(
            f"engine: turn {n}/{len(all_phases)}: {len(outs)} requests in {time.time() - t0:.1f} s",
            flush=True,
        )
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            source = m.labels.get("source")
            key = m.name if not source else f"{m.name}|source={source}"
            metrics[key] = metrics.get(key, 0) + m.value
    out.write_text(json.dumps({"requests": results, "metrics": metrics}, indent=1))
    llm.llm_engine.engine_core.shutdown()  # the plugin sends EngineStopped and flushes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engine-args", default="", help="JSON object replacing the tiny-model engine arguments")
    args = ap.parse_args()
    engine_args = json.loads(args.engine_args) if args.engine_args else TINY_ENGINE
    run(args.model, args.out, args.sessions, args.quick, engine_args)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
