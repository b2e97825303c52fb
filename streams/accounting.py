"""Build a closing request's RequestAccounting record from its folded state.

:func:`build` settles what only the end of a request decides, on the request's own state:
positions an aborted request never computed become ``not_computed``; positions its attention
groups released (sliding windows, chunks; weighted by layers) get kv_fate ``window_released``,
those still held but never attended again ``skipped`` (the status is left as it was). It then
counts the positions by class, checks them against the engine's own totals (``consistent``) and
returns the record. Request-level producers (proxy, traces) report totals only: their timeline
is derived from the totals (:func:`synthesise_request_level`).
"""

from __future__ import annotations

from typing import Any

from . import attention, kv_memory, multimodal
from . import segments as sg
from .served import reasoning
from .state import EpochState, RequestState


def build(
    epoch: EpochState,
    r: RequestState,
    finish: dict[str, Any] | None,
    ts: int,
    incomplete: str | None,
    block_uses: list[dict[str, Any]],
    cache_write_tokens: int = 0,
    kv_shape: kv_memory.KvShape | None = None,
) -> dict[str, Any]:
    """The request's RequestAccounting record (``finish`` is None when it closes incomplete).
    ``kv_shape``: the epoch's, as the fold keeps it (else built from the epoch's configuration)."""
    cfg = epoch.config or {}
    if kv_shape is None:
        kv_shape = kv_memory.KvShape(cfg)
    fin = finish or {}
    if r.steps == 0 and finish is not None and fin.get("finish_reason") != "abort":
        synthesise_request_level(r, finish)
    segs = sg.upgrade(r.segments)
    prompt = r.prompt_len if r.started else fin.get("num_prompt_tokens", r.prompt_len)
    if not r.started:
        r.prompt_len = prompt
    covered_prompt = sum(s[sg.END] - s[sg.START] for s in segs if s[sg.KIND] == sg.PROMPT)
    if covered_prompt < prompt and not any(s[sg.KIND] == sg.OUTPUT for s in segs):
        sg.append(segs, prompt - covered_prompt, sg.PROMPT, sg.COMPUTED)
    # Prompt positions never computed (aborted before or during prefill) were never obtained:
    # not_computed, not charged (they count in skipped_tokens: attention never saw them).
    if (r.steps or fin.get("finish_reason") == "abort") and r.kv_end < prompt:
        sg.assign(segs, r.kv_end, prompt, sg.NOT_COMPUTED)
    groups = kv_shape.groups  # attention.groups_of(cfg)
    basis = r.release_basis if r.release_basis >= 0 else r.last_computed_before
    # Under async scheduling a step already in flight when the request stopped computes past
    # its last position; the timeline ends at prompt + output.
    kv_end = min(r.kv_end, prompt + r.out)
    released_end, unattended_end = attention.fates(groups, kv_end, basis)
    if unattended_end:
        sg.assign(segs, 0, released_end, sg.WINDOW_RELEASED, field=sg.FATE)
        sg.assign(segs, released_end, unattended_end, sg.FATE_SKIPPED, field=sg.FATE)
    window = attention_window(groups)
    by_status = sg.count_by_status(segs)
    by_fate = sg.count_by_fate(segs)
    gpu_ns = round(r.gpu_ns)
    engine_prompt = fin.get("num_prompt_tokens", -1)
    engine_output = fin.get("num_output_tokens", -1)
    engine_cached = fin.get("num_cached_tokens", -1)
    drafts = r.draft_accepted + r.draft_rejected + r.draft_cut
    identity = r.scheduled == r.uncached + r.recomputed_preemption + r.recomputed_eviction + drafts
    consistent = (
        finish is not None
        and incomplete is None
        and not r.seq_gap
        and engine_prompt == prompt
        and engine_output == r.out
        and engine_cached == r.cached_at_admission
        and identity
        and sg.total(segs) == prompt + r.out
    )
    skipped = by_fate.get(sg.FATE_SKIPPED, 0) + by_status.get(sg.NOT_COMPUTED, 0)
    thought, thought_spans = reasoning(fin, r.out)
    return {
        "request_uid": r.uid,
        "engine_name": r.engine_name,
        "engine_id": r.engine_id,
        "request_id": r.request_id,
        "tenant": r.tenant,
        "model": r.model or cfg.get("served_model_name", ""),
        "lora_name": r.lora_name,
        "engine_kind": cfg.get("engine_kind", "vllm"),
        "arrival_ts_ns": r.arrival_ts,
        "first_scheduled_ts_ns": r.first_sched_ts,
        "first_token_ts_ns": r.first_token_ts or fin.get("first_token_ts_ns", 0),
        "finished_ts_ns": ts,
        "finish_reason": fin.get("finish_reason", "incomplete"),
        "complete": incomplete is None,
        "incomplete_reason": incomplete,
        "seq_gap": r.seq_gap,
        "prompt_tokens": prompt,
        "output_tokens": r.out,
        "cache_read_tokens": r.cache_read,
        "uncached_computed_tokens": r.uncached,
        "recomputed_tokens": r.recomputed_preemption + r.recomputed_eviction,
        "draft_accepted_tokens": r.draft_accepted,
        "draft_rejected_tokens": r.draft_rejected,
        "skipped_tokens": skipped,
        "scheduled_tokens": r.scheduled,
        "preemptions": r.preemptions,
        "steps": r.steps,
        "attention_pairs": round(r.pairs),
        "attention_pairs_skipped": (r.pairs_full - round(r.pairs)) if window else 0,
        "gpu_time_ns": gpu_ns,
        "est_flops": float(r.flops),
        "engine_prompt_tokens": engine_prompt,
        "engine_output_tokens": engine_output,
        "engine_cached_tokens": engine_cached,
        "consistent": bool(consistent),
        "expert_num_layers": r.expert_layers,
        "expert_num_experts": r.expert_experts,
        "expert_counts": list(r.experts),
        "block_uses": block_uses,
        "timeline": {"segments": sg.to_records(segs), "attention_window": window},
        "recomputed_preemption_tokens": r.recomputed_preemption,
        "recomputed_eviction_tokens": r.recomputed_eviction,
        "draft_cut_tokens": r.draft_cut,
        "draft_unverified_tokens": r.draft_unverified,
        "window_released_tokens": by_fate.get(sg.WINDOW_RELEASED, 0),
        "evicted_blocks_recomputed": r.evicted_blocks_recomputed,
        "waste_tokens": r.recomputed_preemption + r.draft_rejected + r.draft_cut,
        "session_id": r.session_id,
        "external_request_id": r.external_request_id,
        "parent_request_id": r.parent_request_id,
        "choice_index": r.choice_index,
        "external_kv_tokens": r.external_kv,
        "warmup_gpu_time_ns": round(r.warmup_gpu_ns),
        "source_history_lost_ts_ns": r.source_lost_ns,
        "reasoning_output_tokens": thought,
        "reasoning_spans": thought_spans,
        **token_fields(cfg.get("privacy_mode", ""), r),
        "kv_groups": kv_memory.record(kv_shape, r) if r.steps else [],
        "kv_peak_bytes": r.kv_peak_bytes if r.steps and r.kv else -1,
        # request-level producers report the engine's own count only (no steps, no blocks)
        "cache_write_tokens": cache_write_tokens
        if r.steps
        else max(0, fin.get("num_cache_creation_tokens", -1)),
        "engine_cache_write_tokens": fin.get("num_cache_creation_tokens", -1),
        "priority": r.priority,
        "service_tier": r.service_tier,
        "cache_ttl": r.cache_ttl,
        "pd_join_id": r.pd_join_id,
        "pd_role": r.pd_role,
        # the tiers beside gpu and external, where the engine reports them (sparseety/billing.py)
        "cache_read_cpu_offload_tokens": r.cpu_offload_read,
        "cache_read_host_tokens": r.host_read,
        "cache_read_storage_tokens": r.storage_read,
        **multimodal.record_fields(r.mm, fin),
    }


def synthesise_request_level(r: RequestState, finish: dict[str, Any]) -> None:
    """Request-level producers (proxy, traces) report totals only: derive the timeline from them."""
    prompt = finish["num_prompt_tokens"]
    cached = min(finish["num_cached_tokens"], prompt)
    output = finish["num_output_tokens"]
    r.segments = []
    sg.append(r.segments, cached, sg.PROMPT, sg.CACHED)
    sg.append(r.segments, prompt - cached, sg.PROMPT, sg.COMPUTED)
    sg.append(r.segments, output, sg.OUTPUT, sg.COMPUTED)
    r.prompt_len = prompt
    r.cached_at_admission = r.cache_read = cached
    r.out = output
    r.uncached = prompt - cached + max(output - 1, 0)
    r.scheduled = r.uncached
    r.kv_end = prompt + max(output - 1, 0)


def token_fields(privacy: str, r: RequestState) -> dict[str, Any]:
    """RequestAccounting's token-record fields: what the privacy mode allows, nothing more."""
    raw = privacy == "raw"
    return {
        "token_privacy": privacy,
        "prompt_token_ids": list(r.prompt_ids) if raw else [],
        "prompt_token_hashes": list(r.prompt_hashes) if privacy == "hashed" else [],
        "output_token_ids": list(r.output_ids) if raw else [],
    }


def attention_window(groups: tuple[attention.Group, ...]) -> int | None:
    """The timeline's ``attention_window``: the smallest window or chunk of a limited group."""
    reach = [g.window or g.chunk for g in groups if g.limited]
    return int(min(r for r in reach if r)) if reach else None
