"""EngineStarted: the engine configuration as far as it shapes token accounting.

Read once per engine start from the scheduler's ``vllm_config`` and ``kv_cache_config``. Every
read is defensive: a field vLLM renamed reads as its default (0, "", null) rather than stopping
the engine; the seams the hooks depend on are checked separately (see ``plugin.py``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from sparseety import __version__ as sparseety_version


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def _call(obj: Any, name: str, *args: Any, default: Any = 0) -> Any:
    fn = getattr(obj, name, None)
    if fn is None:
        return default
    try:
        return fn(*args)
    except Exception:
        return default


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def kv_cache_groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    """One KvCacheGroup record per vLLM KV cache group (kind as vLLM names it in KV events).

    ``num_layers`` weights the group in the fold's window arithmetic; a chunked local attention
    group carries ``attention_chunk_size`` and no ``sliding_window``.
    """
    spec_kind: Any
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind as spec_kind
    except ImportError:  # older vLLM: name the spec class instead
        spec_kind = None
    out = []
    for group in _get(kv_cache_config, "kv_cache_groups", default=[]):
        spec = group.kv_cache_spec
        if spec_kind is not None:
            kind = str(getattr(spec_kind(spec), "value", spec_kind(spec)))
        else:
            kind = type(spec).__name__
        # Chunked local attention is not a sliding window: each query attends its own chunk.
        chunk = getattr(spec, "attention_chunk_size", None)
        window = None if chunk else getattr(spec, "sliding_window", None)
        out.append(
            {
                "kind": kind,
                "sliding_window": int(window) if window else None,
                "block_size": int(getattr(spec, "block_size", 0) or 0),
                "num_layers": len(getattr(group, "layer_names", []) or []),
                "attention_chunk_size": int(chunk) if chunk else None,
                # vLLM's own bytes per block and layer (fp8, MLA, padding included): what KV
                # memory-time multiplies block-time by; 0 when the spec has none.
                "page_size_bytes": int(_page_size(spec)),
            }
        )
    return out


def _page_size(spec: Any) -> int:
    try:
        return int(getattr(spec, "page_size_bytes", 0) or 0)
    except Exception:  # a spec whose page size needs a config it does not carry
        return 0


def _lookahead(vllm_config: Any) -> int:
    try:
        return int(getattr(vllm_config, "num_lookahead_tokens", 0) or 0)
    except Exception:  # an older vLLM without the property, or a config it cannot read
        return 0


def kv_role(vllm_config: Any) -> str | None:
    """The engine's KV connector role (``kv_producer``, ``kv_consumer``, ``kv_both``), None
    without a connector."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(ktc, "kv_role", None) if ktc is not None else None
    return str(role) if role else None


def dp_rank(vllm_config: Any) -> int:
    """The engine's data-parallel index (0 without data parallelism)."""
    pc = vllm_config.parallel_config
    return int(_get(pc, "data_parallel_index", "data_parallel_rank", default=0) or 0)


def engine_started(
    vllm_config: Any,
    kv_cache_config: Any,
    *,
    block_size: int,
    privacy_mode: str,
    routing_capture: bool,
    engine_version: str,
) -> dict[str, Any]:
    """The EngineStarted payload for one engine start."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    sc = vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    hf = _get(mc, "hf_text_config", "hf_config")
    groups = kv_cache_groups(kv_cache_config)
    cache_dtype = str(_get(cc, "cache_dtype", default="auto"))
    if cache_dtype == "auto":
        # Resolve "auto" to what the cache holds, so FP8 and BF16 engines are told apart.
        kv_groups = _get(kv_cache_config, "kv_cache_groups", default=[])
        if kv_groups:
            cache_dtype = _dtype_name(getattr(kv_groups[0].kv_cache_spec, "dtype", None)) or cache_dtype
    served = _get(mc, "served_model_name", default="")
    if isinstance(served, list):
        served = served[0] if served else ""
    is_moe = bool(_get(mc, "is_moe", default=False)) or _call(mc, "get_num_experts") > 0
    return {
        "model": str(_get(mc, "model", default="")),
        "served_model_name": str(served or _get(mc, "model", default="")),
        "engine_kind": "vllm",
        "engine_version": engine_version,
        "sparseety_version": sparseety_version,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "block_size": int(block_size or (groups[0]["block_size"] if groups else 0)),
        "enable_prefix_caching": bool(_get(cc, "enable_prefix_caching", default=False)),
        "prefix_hash_algo": str(_get(cc, "prefix_caching_hash_algo", default="")),
        "kv_cache_groups": groups,
        "kv_cache_dtype": cache_dtype,
        "dtype": _dtype_name(_get(mc, "dtype")),
        "spec_method": str(spec.method) if spec is not None and getattr(spec, "method", None) else None,
        "spec_num_tokens": int(_get(spec, "num_speculative_tokens", default=0) or 0) if spec else 0,
        "moe_num_experts": int(_call(mc, "get_num_experts")) if is_moe else 0,
        "moe_top_k": int(_call(mc, "get_num_experts_per_tok")) if is_moe else 0,
        "num_layers": int(_call(mc, "get_total_num_hidden_layers")),
        "hidden_size": int(_call(mc, "get_hidden_size")),
        "intermediate_size": int(
            _get(hf, "moe_intermediate_size", "intermediate_size", "ffn_dim", default=0) or 0
        ),
        "num_attention_heads": int(_get(hf, "num_attention_heads", default=0) or 0),
        "num_kv_heads": int(_call(mc, "get_total_num_kv_heads")),
        "head_dim": int(_call(mc, "get_head_size")),
        "vocab_size": int(_call(mc, "get_vocab_size")),
        "max_num_seqs": int(_get(sc, "max_num_seqs", default=0) or 0),
        "max_num_batched_tokens": int(_get(sc, "max_num_batched_tokens", default=0) or 0),
        "max_model_len": int(_get(mc, "max_model_len", default=0) or 0),
        "num_gpu_blocks": int(
            _get(cc, "num_gpu_blocks", default=0) or _get(kv_cache_config, "num_blocks", default=0) or 0
        ),
        "privacy_mode": privacy_mode,
        "routing_capture": routing_capture,
        # KV slots reserved past the scheduled tokens for a drafter with KV (EAGLE, MTP): every
        # allocation adds them (vLLM's one property for it; 0 without speculation or for ngram).
        "num_lookahead_tokens": _lookahead(vllm_config),
    }
