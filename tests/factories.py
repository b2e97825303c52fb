"""Valid example events of every payload type, for tests of the contract and the pipeline."""

from __future__ import annotations

from typing import Any

from sparseety import events as ev

ENGINE = "engine-a"
EPOCH = "e1"
EID = ev.engine_id(ENGINE, EPOCH)


def wrap(
    seq: int,
    payload_type: str,
    payload: dict[str, Any],
    *,
    ts_ns: int | None = None,
    stream: str = ev.CORE_STREAM,
    engine: str = ENGINE,
    epoch: str = EPOCH,
) -> dict[str, Any]:
    """An envelope around ``payload``."""
    return ev.envelope(
        engine_name=engine,
        engine_id_=ev.engine_id(engine, epoch),
        stream=stream,
        seq=seq,
        ts_ns=ts_ns if ts_ns is not None else 1_700_000_000_000_000_000 + seq * 1_000_000,
        mono_ns=seq * 1_000_000,
        payload_type=payload_type,
        payload=payload,
    )


def engine_started(**over: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "served_model_name": "tiny",
        "engine_kind": "vllm",
        "engine_version": "0.32.0",
        "sparseety_version": "0.1.0",
        "host": "h",
        "pid": 1,
        "block_size": 4,
        "enable_prefix_caching": True,
        "prefix_hash_algo": "sha256",
        "kv_cache_groups": [
            {
                "kind": "full_attention",
                "sliding_window": None,
                "block_size": 4,
                "num_layers": 2,
                "attention_chunk_size": None,
                "page_size_bytes": 0,
            }
        ],
        "kv_cache_dtype": "auto",
        "dtype": "bfloat16",
        "spec_method": None,
        "spec_num_tokens": 0,
        "moe_num_experts": 0,
        "moe_top_k": 0,
        "num_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "num_gpu_blocks": 100,
        "privacy_mode": "raw",
        "routing_capture": False,
        "reasoning_parser": None,
        "num_lookahead_tokens": 0,
        "kv_events_observed": True,
        **over,
    }


def request_started(
    rid: str = "r1",
    prompt: list[int] | None = None,
    cached: int = 0,
    hashes: list[bytes] | None = None,
    **over: Any,
) -> dict[str, Any]:
    prompt = prompt if prompt is not None else list(range(10))
    return {
        "request_id": rid,
        "arrival_ts_ns": 1_700_000_000_000_000_000,
        "prompt_len": len(prompt),
        "prompt_token_ids": prompt,
        "prompt_token_hashes": [],
        "num_cached_tokens": cached,
        "block_hashes": hashes if hashes is not None else [b"h%d" % i for i in range(len(prompt) // 4)],
        "max_tokens": 16,
        "tenant": "acme",
        "model": "tiny",
        "lora_name": None,
        "priority": 0,
        "session_id": "",
        "external_request_id": "",
        "parent_request_id": "",
        "choice_index": 0,
        "num_external_cached_tokens": 0,
        "cached_tokens_by_source": {},
        "service_tier": "",
        "cache_ttl": "",
        "pd_join_id": "",
        "pd_role": "none",
        "mm_inputs": [],
        **over,
    }


def step_batch(
    step: int,
    rows: list[tuple[str, int, int, list[int]]],
    *,
    spec: list[tuple[int, int]] | None = None,
    preempted: list[str] | None = None,
    resumed: list[str] | None = None,
    duration_ns: int = 1_000_000,
    updates_before: int = -1,
) -> dict[str, Any]:
    """rows: (req_id, num_scheduled, num_computed_before, new_token_ids)."""
    return {
        "step": step,
        "start_mono_ns": step * 1_000_000,
        "duration_ns": duration_ns,
        "req_ids": [r[0] for r in rows],
        "num_scheduled_tokens": [r[1] for r in rows],
        "num_computed_before": [r[2] for r in rows],
        "num_new_tokens": [len(r[3]) for r in rows],
        "new_token_ids": [t for r in rows for t in r[3]],
        "spec_proposed": [s[0] for s in spec] if spec else [],
        "spec_accepted": [s[1] for s in spec] if spec else [],
        "preempted_req_ids": preempted or [],
        "resumed_req_ids": resumed or [],
        "updates_before": updates_before,
    }


def request_finished(
    rid: str = "r1", prompt: int = 10, output: int = 3, cached: int = 0, **over: Any
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "finish_reason": "length",
        "stop_reason": None,
        "num_prompt_tokens": prompt,
        "num_output_tokens": output,
        "num_cached_tokens": cached,
        "num_preemptions": 0,
        "output_block_hashes": [],
        "first_token_ts_ns": 0,
        "chunk_arrival_ns": [],
        "reasoning_spans": None,
        "kv_freed_before_step": -1,
        "kv_freed_ts_ns": 0,
        "num_cache_creation_tokens": -1,
        "prompt_tokens_by_modality": {},
        "num_encoder_compute_tokens": -1,
        "num_encoder_cache_hit_tokens": -1,
        **over,
    }


def kv_stored(hashes: list[bytes], *, block_size: int = 4, **over: Any) -> dict[str, Any]:
    """A KvBlocksStored payload: full blocks ``hashes`` of ``block_size`` tokens, no parent, on
    the GPU, in the full-attention group."""
    return {
        "block_hashes": hashes,
        "parent_block_hash": None,
        "block_size": block_size,
        "num_tokens": len(hashes) * block_size,
        "lora_id": None,
        "medium": "GPU",
        "group_kind": "full_attention",
        "sliding_window": None,
        **over,
    }


def kv_removed(hashes: list[bytes]) -> dict[str, Any]:
    """A KvBlocksRemoved payload: ``hashes`` removed from the GPU's full-attention group."""
    return {"block_hashes": hashes, "medium": "GPU", "group_kind": "full_attention"}


def one_of_each() -> list[dict[str, Any]]:
    """One envelope per payload type, seq 0.."""
    payloads = [
        (ev.ENGINE_STARTED, engine_started()),
        (ev.REQUEST_STARTED, request_started()),
        (ev.STEP_BATCH, step_batch(0, [("r1", 10, 0, [7])], spec=[(0, 0)])),
        (ev.KV_STORED, kv_stored([b"h0", b"h1"])),
        (
            ev.MOE_ROUTING,
            {
                "step": 0,
                "req_ids": ["r1"],
                "num_layers": 2,
                "num_experts": 4,
                "expert_counts": [1, 0, 1, 0, 0, 2, 0, 0],
            },
        ),
        (ev.STEP_BATCH, step_batch(1, [("r1", 1, 10, [8])])),
        (ev.REQUEST_FINISHED, request_finished(output=2)),
        (ev.KV_REMOVED, kv_removed([b"h0"])),
        (ev.KV_CLEARED, {"medium": None}),
        (ev.HEARTBEAT, {"queued": 0, "produced": 9, "dropped": 0, "spilled": 0, "drained": 0}),
        (ev.ENGINE_STOPPED, {"reason": "shutdown"}),
    ]
    return [wrap(i, t, p) for i, (t, p) in enumerate(payloads)]


def long_request(
    decode_steps: int, *, prompt: int = 131_072, block_size: int = 16, hash_bytes: int = 16
) -> list[dict[str, Any]]:
    """Events of one long request "long": half its prompt from the prefix cache, the rest in
    chunked prefill of 8k tokens, then ``decode_steps`` decode steps (not finished; seqs from 0)."""
    hashes = [i.to_bytes(hash_bytes, "big") for i in range(prompt // block_size)]
    groups = [
        {
            "kind": "full_attention",
            "sliding_window": None,
            "block_size": block_size,
            "num_layers": 2,
            "attention_chunk_size": None,
            "page_size_bytes": 0,
        }
    ]
    stored = kv_stored(hashes[: len(hashes) // 2], block_size=block_size, num_tokens=prompt // 2)
    events = [
        wrap(0, ev.ENGINE_STARTED, engine_started(block_size=block_size, kv_cache_groups=groups)),
        wrap(1, ev.KV_STORED, stored),
        wrap(
            2,
            ev.REQUEST_STARTED,
            request_started("long", [], hashes=hashes, prompt_len=prompt, num_cached_tokens=prompt // 2),
        ),
    ]
    seq, c = 3, prompt // 2
    while c < prompt:
        n = min(8192, prompt - c)
        events.append(
            wrap(seq, ev.STEP_BATCH, step_batch(seq, [("long", n, c, [1] if c + n == prompt else [])]))
        )
        seq, c = seq + 1, c + n
    for i in range(decode_steps):
        events.append(wrap(seq, ev.STEP_BATCH, step_batch(seq, [("long", 1, prompt + i, [2])])))
        seq += 1
    return events


def history_loss(ts0: int = 0, *, cold_step_ns: int = 1_000_000) -> list[dict[str, Any]]:
    """An epoch whose prefix history is lost: r1 computes blocks a, b (the epoch's first step, of
    ``cold_step_ns``); seq 3, the KvBlocksStored of both, is the one to drop; r2 then reads both
    from the cache (streams/caveats.py). Event times are ``ts0 + 1000 * (seq + 1)``."""
    prompt = list(range(8))
    bodies = [
        (ev.ENGINE_STARTED, engine_started()),
        (ev.REQUEST_STARTED, request_started("r1", prompt, hashes=[b"a", b"b"])),
        (ev.STEP_BATCH, step_batch(0, [("r1", 8, 0, [1])], duration_ns=cold_step_ns)),
        (ev.KV_STORED, kv_stored([b"a", b"b"])),
        (ev.REQUEST_FINISHED, request_finished("r1", prompt=8, output=1)),
        (ev.REQUEST_STARTED, request_started("r2", [*prompt, 9], cached=8, hashes=[b"a", b"b"])),
        (ev.STEP_BATCH, step_batch(1, [("r2", 1, 8, [5])])),
        (ev.REQUEST_FINISHED, request_finished("r2", prompt=9, output=1, cached=8)),
    ]
    return [wrap(i, t, b, ts_ns=ts0 + 1000 * (i + 1)) for i, (t, b) in enumerate(bodies)]


def segment(start: int, end: int, kind: str, status: str, **over: Any) -> dict[str, Any]:
    """One TokenSegment of a RequestAccounting timeline (not a draft, no source, KV kept)."""
    return {
        "start": start,
        "end": end,
        "kind": kind,
        "status": status,
        "draft_accepted": False,
        "source_request_uid": None,
        "kv_fate": "kept",
        **over,
    }


def accounting(uid: str = f"{EID}/r1", **over: Any) -> dict[str, Any]:
    """A RequestAccounting record with every field set."""
    rec: dict[str, Any] = {
        "request_uid": uid,
        "engine_name": ENGINE,
        "engine_id": EID,
        "request_id": uid.rsplit("/", 1)[-1],
        "tenant": "acme",
        "model": "tiny",
        "lora_name": None,
        "engine_kind": "vllm",
        "arrival_ts_ns": 1,
        "first_scheduled_ts_ns": 2,
        "first_token_ts_ns": 3,
        "finished_ts_ns": 4,
        "finish_reason": "length",
        "complete": True,
        "incomplete_reason": None,
        "seq_gap": False,
        "prompt_tokens": 10,
        "output_tokens": 3,
        "cache_read_tokens": 4,
        "uncached_computed_tokens": 8,
        "recomputed_tokens": 0,
        "draft_accepted_tokens": 0,
        "draft_rejected_tokens": 0,
        "skipped_tokens": 0,
        "evicted_tokens": 0,
        "scheduled_tokens": 8,
        "preemptions": 0,
        "steps": 3,
        "attention_pairs": 40,
        "attention_pairs_skipped": 0,
        "gpu_time_ns": 1000,
        "est_flops": 1.5e6,
        "engine_prompt_tokens": 10,
        "engine_output_tokens": 3,
        "engine_cached_tokens": 4,
        "consistent": True,
        "expert_num_layers": 0,
        "expert_num_experts": 0,
        "expert_counts": [],
        "block_uses": [{"block_hash": b"h0", "lifetime_seq": 3, "role": "cached", "tokens": 4}],
        "timeline": {
            "segments": [
                segment(0, 4, "prompt", "cached", source_request_uid=f"{EID}/r0"),
                segment(4, 10, "prompt", "computed"),
                segment(10, 13, "output", "computed"),
            ],
            "attention_window": None,
        },
        "recomputed_preemption_tokens": 0,
        "recomputed_eviction_tokens": 0,
        "draft_cut_tokens": 0,
        "window_released_tokens": 0,
        "evicted_blocks_recomputed": 0,
        "waste_tokens": 0,
        "session_id": "",
        "token_privacy": "raw",
        "prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        "prompt_token_hashes": [],
        "output_token_ids": [21, 22, 23],
        "external_request_id": "",
        "parent_request_id": "",
        "choice_index": 0,
        "external_kv_tokens": 0,
        "warmup_gpu_time_ns": 0,
        "source_history_lost_ts_ns": 0,
        "reasoning_output_tokens": None,
        "reasoning_spans": [],
        "kv_groups": [],
        "kv_peak_bytes": -1,
        "draft_unverified_tokens": 0,
        "cache_write_tokens": 0,
        "engine_cache_write_tokens": -1,
        "cache_read_cpu_offload_tokens": 0,
        "cache_read_host_tokens": 0,
        "cache_read_storage_tokens": 0,
        "priority": 0,
        "service_tier": "",
        "cache_ttl": "",
        "pd_join_id": "",
        "pd_role": "none",
        "image_tokens": 0,
        "audio_tokens": 0,
        "video_tokens": 0,
        "image_cached_tokens": 0,
        "audio_cached_tokens": 0,
        "video_cached_tokens": 0,
        "encoder_compute_tokens": 0,
        "encoder_cache_hit_tokens": 0,
    }
    rec.update(over)
    return rec


def counted(
    uid: str,
    *,
    P: int,
    C: int,
    O: int,  # noqa: E741 - the cost model's names
    S: int,
    R: int = 0,
    E: int = 0,
    A: int = 0,
    J: int = 0,
    K: int = 0,
    **over: Any,
) -> dict[str, Any]:
    """A RequestAccounting of ``uid`` ("<engine>@<epoch>/<request id>") in the cost model's counts:
    P prompt, C cache-read and O output tokens (the engine's own counts the same), S scheduled
    positions, of them R recomputed after preemption, E after eviction (1000-token blocks), A/J/K
    drafts accepted/rejected/cut, the rest computed for the first time; ``over`` wins."""
    eid = uid.rsplit("/", 1)[0]
    counts = {
        "engine_name": eid.split("@")[0],
        "engine_id": eid,
        "prompt_tokens": P,
        "output_tokens": O,
        "cache_read_tokens": C,
        "engine_prompt_tokens": P,
        "engine_output_tokens": O,
        "engine_cached_tokens": C,
        "scheduled_tokens": S,
        "uncached_computed_tokens": S - R - E - A - J - K,
        "recomputed_tokens": R + E,
        "recomputed_preemption_tokens": R,
        "recomputed_eviction_tokens": E,
        "evicted_blocks_recomputed": E // 1000,
        "draft_accepted_tokens": A,
        "draft_rejected_tokens": J,
        "draft_cut_tokens": K,
        "waste_tokens": R + J + K,
    }
    return accounting(uid, **{**counts, **over})


def block_uses(role: str, *blocks: str, tokens: int = 1000) -> list[dict[str, Any]]:
    """RequestAccounting block uses of ``blocks`` in one role: "b1@10" is block b1 in lifetime 10."""
    return [
        {"block_hash": b.encode(), "lifetime_seq": int(lifetime), "role": role, "tokens": tokens}
        for b, lifetime in (spec.split("@") for spec in blocks)
    ]


def kv_group(**over: Any) -> dict[str, Any]:
    """A KvGroupUse (RequestAccounting.kv_groups): one full-attention group's memory-time."""
    return {
        "kind": "full_attention",
        "block_size": 16,
        "bytes_per_block": 1 << 20,
        "peak_blocks": 4,
        "never_held_blocks": 0,
        "block_steps": 30,
        "block_ns": 3_000_000_000,
        "block_steps_amortized": 20,
        "block_ns_amortized": 2_000_000_001,
        "block_steps_actual": 10,
        "block_ns_actual": 999_999,
        "slot_steps_used": 400,
        "slot_steps_allocated": 480,
        **over,
    }


def experts(counts: list[int] | None) -> dict[str, Any]:
    """RequestAccounting's MoE routing fields: ``counts`` over 2 layers x 4 experts, or none."""
    return {
        "expert_num_layers": 2 if counts else 0,
        "expert_num_experts": 4 if counts else 0,
        "expert_counts": counts or [],
    }


def usage_window(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "usage_id": f"{ENGINE}/tiny/acme/0/final",
        "kind": "final",
        "window_start_ns": 0,
        "window_ns": 60_000_000_000,
        "engine_name": ENGINE,
        "model": "tiny",
        "tenant": "acme",
        "requests": 1,
        "incomplete_requests": 0,
        "prompt_tokens": 10,
        "output_tokens": 3,
        "cache_read_tokens": 4,
        "uncached_computed_tokens": 8,
        "recomputed_tokens": 0,
        "draft_accepted_tokens": 0,
        "draft_rejected_tokens": 0,
        "skipped_tokens": 0,
        "evicted_tokens": 0,
        "gpu_time_ns": 1000,
        "est_flops": 1.5e6,
        "recomputed_preemption_tokens": 0,
        "recomputed_eviction_tokens": 0,
        "draft_cut_tokens": 0,
        "window_released_tokens": 0,
        "evicted_blocks_recomputed": 0,
        "waste_tokens": 0,
        "lora_name": "",
    }
    rec.update(over)
    return rec


def dead_letter(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "error_type": "BadMagicError",
        "reason": "unknown framing",
        "component": "assembler",
        "topic": "t",
        "partition": 0,
        "offset": 5,
        "key": b"k",
        "value": b"\x01\x02",
        "ts_ns": 1,
    }
    rec.update(over)
    return rec
