"""The demo's checks against the engine's own answers: what vLLM returned (``RequestOutput``) and
counted (its Prometheus metrics), or what SGLang returned (``meta_info``) and counted
(``/metrics``), compared with what SparSEEty stored. Pure functions over plain
rows, shared by ``sparseety demo`` (``sparseety/stack/demo.py``) and the end-to-end tests."""

from __future__ import annotations

from typing import Any


def same_text(decoded: str, streamed: str) -> bool:
    """Whether a whole decode equals vLLM's text: its incremental detokenizer withholds a trailing
    incomplete UTF-8 sequence, which a whole decode shows as U+FFFD (random weights emit byte tokens)."""
    return decoded.startswith(streamed) and set(decoded[len(streamed) :]) <= {"\ufffd"}


def reasoning_by_tenant(stored: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per tenant, the stored reasoning positions; None when no request of it was observed."""
    out: dict[str, int | None] = {}
    for r in stored:
        n = r.get("reasoning_output_tokens")
        prev = out.get(r["tenant"])
        out[r["tenant"]] = prev if n is None else (prev or 0) + int(n)
    return out


def engine_by_tenant(requests: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per tenant, what the engine answered: requests, and the sums of ``prompt_tokens``,
    ``output_tokens`` and ``num_cached_tokens`` (``cached``) over its answers."""
    out: dict[str, dict[str, int]] = {}
    for r in requests:
        t = out.setdefault(r["tenant"], {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "cached": 0})
        t["requests"] += 1
        t["prompt_tokens"] += int(r["prompt_tokens"])
        t["output_tokens"] += int(r["output_tokens"])
        t["cached"] += int(r["num_cached_tokens"])
    return out


def check_engine_counters(
    stored: list[dict[str, Any]], engine: dict[str, Any], kind: str = "vllm"
) -> list[str]:
    """Every engine counter the report prints, stored vs what vLLM itself returned or counted.

    ``stored``: accounting rows (``RequestAccounting`` fields); ``engine``: ``{"requests": [...],
    "metrics": {...}}``, per request the engine's answer (``tenant``, ``prompt_tokens``,
    ``output_tokens``, ``num_cached_tokens``, ``reasoning_tokens``) and its counters keyed
    ``name|label=value``. Returns one line per mismatch (empty: all equal).

    Per tenant: requests, prompt and output tokens, and admission cache hits (vLLM's
    ``RequestOutput.num_cached_tokens`` against the stored ``engine_cached_tokens``; the fold's
    ``cache_read_tokens`` also counts re-reads after a preemption, which vLLM does not).
    Engine-wide, because vLLM counts them per engine: accepted and verified drafts (the identities
    of docs/streams.md, "Drafts": accepted + cut - unverified, and accepted + rejected + cut -
    unverified), preemptions, and prompt tokens served from the cache
    (``vllm:prompt_tokens_by_source{source="local_cache_hit"}``).

    SGLang (``kind`` sglang): per tenant the same, against ``meta_info`` (``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens``); engine-wide the cached prompt tokens against
    ``sglang:realtime_tokens_total{mode="prefill_cache"}``. Drafts do not run on its CPU path and
    it has no reasoning parser here: those are not observed, not compared.
    """
    problems: list[str] = []
    tenants: dict[str, dict[str, int]] = {}
    for r in stored:
        t = tenants.setdefault(
            r["tenant"], {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "cached": 0}
        )
        t["requests"] += 1
        t["prompt_tokens"] += int(r["prompt_tokens"])
        t["output_tokens"] += int(r["output_tokens"])
        t["cached"] += int(r.get("engine_cached_tokens", -1))
    for name, e in sorted(engine_by_tenant(engine["requests"]).items()):
        t = tenants.get(name, {})
        for k in ("requests", "prompt_tokens", "output_tokens", "cached"):
            if t.get(k) != e[k]:
                problems.append(f"tenant {name}: {k} {t.get(k)} stored, {e[k]} from the engine")
    # reasoning: vLLM's own count per request (its parser's count_reasoning_tokens over its output)
    theirs: dict[str, int | None] = {}
    for r in engine["requests"]:
        n = r.get("reasoning_tokens")
        prev = theirs.get(r["tenant"])
        theirs[r["tenant"]] = prev if n is None else (prev or 0) + int(n)
    ours = reasoning_by_tenant(stored)
    for name in sorted(set(theirs) | set(ours)):
        if ours.get(name) != theirs.get(name):
            problems.append(
                f"tenant {name}: reasoning {ours.get(name)} stored, "
                f"{theirs.get(name)} counted by vLLM's parser"
            )
    m = engine.get("metrics", {})

    def total(*keys: str) -> int:
        return sum(int(r.get(k, 0) or 0) for r in stored for k in keys)

    if kind == "sglang":
        metric = "sglang:realtime_tokens_total|mode=prefill_cache"
        if metric not in m:
            problems.append(f"cached: the engine did not report {metric}")
        elif total("engine_cached_tokens") != int(m[metric]):
            problems.append(
                f"cached: {total('engine_cached_tokens')} stored, {int(m[metric])} counted by SGLang "
                '(sglang:realtime_tokens_total{mode="prefill_cache"})'
            )
        return problems

    # docs/streams.md, Drafts: vLLM counts the drafts a stop cut after its verifier accepted them
    # as drafted and accepted, and the unverified ones (a part of draft_cut) nowhere.
    unverified = total("draft_unverified_tokens")
    pairs = [
        (
            "accepted drafts",
            total("draft_accepted_tokens", "draft_cut_tokens") - unverified,
            "vllm:spec_decode_num_accepted_tokens",
        ),
        (
            "verified drafts",
            total("draft_accepted_tokens", "draft_rejected_tokens", "draft_cut_tokens") - unverified,
            "vllm:spec_decode_num_draft_tokens",
        ),
        ("preemptions", total("preemptions"), "vllm:num_preemptions"),
    ]
    for label, got, metric in pairs:
        if metric not in m:
            problems.append(f"{label}: the engine did not report {metric}")
        elif got != int(m[metric]):
            problems.append(f"{label}: {got} stored, {int(m[metric])} counted by vLLM ({metric})")
    problems += check_bill_2026(stored, engine)
    hit = m.get("vllm:prompt_tokens_by_source|source=local_cache_hit")
    # vLLM's local hits: its cached tokens less what a KV connector loaded (every tier beside gpu)
    local = sum(local_hit(r) for r in stored)
    if hit is not None and local != int(hit):
        problems.append(
            f"cached: {local} stored, {int(hit)} counted by vLLM "
            "(vllm:prompt_tokens_by_source{source=local_cache_hit})"
        )
    return problems


def check_bill_2026(stored: list[dict[str, Any]], engine: dict[str, Any]) -> list[str]:
    """Issue 36's classes against vLLM's own: per tenant the engine's cache-write count the
    plugin carried (``engine_cache_write_tokens``) = ``RequestOutput.num_cache_creation_tokens``,
    and SparSEEty's ``cache_write_tokens`` at most that (vLLM also counts a copy of a block that
    two requests computed in one step: docs/cost-model.md); engine-wide each cache tier's
    admission hits = ``vllm:prompt_tokens_cached_by_source{source}`` (gpu = device, cpu_offload =
    host), with the position vLLM gave back of a whole-prompt load added back to its tier
    (:func:`given_back`)."""
    problems: list[str] = []
    theirs: dict[str, int] = {}
    for r in engine["requests"]:
        n = r.get("num_cache_creation_tokens")
        if n is not None:
            theirs[r["tenant"]] = theirs.get(r["tenant"], 0) + int(n)
    ours: dict[str, list[int]] = {}
    for r in stored:
        t = ours.setdefault(r["tenant"], [0, 0])
        t[0] += int(r.get("cache_write_tokens", 0))
        t[1] += int(r.get("engine_cache_write_tokens", -1))
    for name, created in sorted(theirs.items()):
        mine, carried = ours.get(name, [0, 0])
        if carried != created:
            problems.append(f"tenant {name}: cache writes {carried} carried, {created} counted by vLLM")
        if mine > created:
            problems.append(f"tenant {name}: cache writes {mine} folded, more than vLLM's {created}")
    m = engine.get("metrics", {})
    tiers = {
        "device": sum(local_hit(r) for r in stored),
        "host": sum(int(r.get("cache_read_cpu_offload_tokens", 0)) + host_given_back(r) for r in stored),
    }
    for source, got in tiers.items():
        metric = f"vllm:prompt_tokens_cached_by_source|source={source}"
        if metric in m and got != int(m[metric]):  # vLLM < 0.32 has no such counter
            problems.append(f"cached ({source}): {got} stored, {int(m[metric])} counted by vLLM ({metric})")
    return problems


def given_back(r: dict[str, Any]) -> int:
    """Prompt positions vLLM counted in a request's admission hit (``engine_cached_tokens``) and
    then computed, which the fold counts computed and in no tier (docs/streams.md, "Hits the
    engine gives back"). vLLM's own prefix-cache hit stops short of the prompt's last token, so a
    hit of the whole prompt is a KV connector's load, whose last token vLLM computes again: 1;
    else 0."""
    prompt = int(r.get("prompt_tokens", 0) or 0)
    return 1 if 0 < prompt <= int(r.get("engine_cached_tokens", -1)) else 0


def host_given_back(r: dict[str, Any]) -> int:
    """What vLLM gave back of a hit whose connector part the CPU offload tier alone served (no
    external or storage positions): that position was in its ``host`` count."""
    other = int(r.get("external_kv_tokens", 0) or 0) + int(r.get("cache_read_storage_tokens", 0) or 0)
    return 0 if other else given_back(r)


def local_hit(r: dict[str, Any]) -> int:
    """vLLM's local (device) hit of a stored request at admission: its cached tokens less every
    other tier's and less what it gave back (from the connector's part)."""
    return int(r.get("engine_cached_tokens", 0)) - sum(int(r.get(k, 0)) for k in TIER_READS) - given_back(r)


#: The cache tiers' read columns beside gpu (sparseety/billing.py).
TIER_READS = (
    "cache_read_cpu_offload_tokens",
    "cache_read_host_tokens",
    "cache_read_storage_tokens",
    "external_kv_tokens",
)
