"""Multimodal counts of a request (issue 36, schema v7): placeholder positions per modality, the
part of them not computed at admission, and the encoder's own work.

Pure functions over the raw facts: RequestStarted's ``mm_inputs`` (each item's modality and
placeholder range) and ``num_cached_tokens`` (the admission hit, a KV connector's tokens included),
RequestFinished's ``prompt_tokens_by_modality`` (the engine's, or a response usage's, own counts:
what a request-level producer has without items) and its encoder counts. ``sparseety/billing.py``
names the modalities and their columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparseety.billing import MODALITIES, MODALITY_CACHED_COLUMN, MODALITY_COLUMN


def admitted(items: list[Mapping[str, Any]], cached: int) -> list[int]:
    """Per modality (``MODALITIES`` order) the placeholder positions, then those of them below the
    admission hit ``cached`` (served by a cache tier or loaded, not computed here). Items of a
    modality not in ``MODALITIES`` count in none."""
    tokens = [0] * len(MODALITIES)
    below = [0] * len(MODALITIES)
    for item in items:
        modality = item.get("modality", "")
        if modality not in MODALITIES:
            continue
        k = MODALITIES.index(modality)
        start, length = int(item["offset"]), int(item["length"])
        tokens[k] += length
        below[k] += max(0, min(start + length, cached) - start)
    return tokens + below


def record_fields(mm: list[int], finish: Mapping[str, Any]) -> dict[str, int]:
    """RequestAccounting's modality and encoder fields. ``mm`` is :func:`admitted`'s list (empty
    when the request had no items, or its producer reports totals only: then the modality counts
    are the RequestFinished's ``prompt_tokens_by_modality``, none of them known to be cached)."""
    n = len(MODALITIES)
    if not mm:
        by = finish.get("prompt_tokens_by_modality") or {}
        if not by:  # no multimodal input (most requests): every count 0, without the loops
            out = dict(_NONE)
            out["encoder_compute_tokens"] = max(0, int(finish.get("num_encoder_compute_tokens", 0)))
            out["encoder_cache_hit_tokens"] = max(0, int(finish.get("num_encoder_cache_hit_tokens", 0)))
            return out
        mm = [max(0, int(by.get(m, 0))) for m in MODALITIES] + [0] * n
    out = {MODALITY_COLUMN[m]: mm[k] for k, m in enumerate(MODALITIES)}
    out.update({MODALITY_CACHED_COLUMN[m]: mm[n + k] for k, m in enumerate(MODALITIES)})
    out["encoder_compute_tokens"] = max(0, int(finish.get("num_encoder_compute_tokens", 0)))
    out["encoder_cache_hit_tokens"] = max(0, int(finish.get("num_encoder_cache_hit_tokens", 0)))
    return out


#: :func:`record_fields`' modality counts of a request without multimodal input (all 0).
_NONE = {**{MODALITY_COLUMN[m]: 0 for m in MODALITIES}, **{MODALITY_CACHED_COLUMN[m]: 0 for m in MODALITIES}}
