"""Prompt tokens per modality from an OpenAI-style ``usage.prompt_tokens_details`` (issue 36).

Request-level producers (the OpenAI proxy, request-level JSONL logs) read what the server returned:

* vLLM's chat API: ``multimodal_tokens``, ``{modality: placeholder tokens}`` (with
  ``--enable-prompt-tokens-details``; ``entrypoints/openai/chat_completion/serving.py``);
* per-modality fields ``image_tokens``, ``audio_tokens``, ``video_tokens`` (OpenAI's
  ``audio_tokens`` and ``image_tokens``; vLLM #45458, SGLang #27122), read where
  ``multimodal_tokens`` is absent.

The result is RequestFinished's ``prompt_tokens_by_modality``: only the modalities of
``sparseety.billing.MODALITIES`` with a count above 0 (text is not listed). A count that is not
an integer in 0..MAX_TOKENS, or counts summing past the prompt, make the usage unaccountable:
:func:`modality_tokens` returns the problem, the producer raises its own typed error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparseety.billing import MODALITIES
from sparseety.validate import MAX_TOKENS


def modality_tokens(details: Mapping[str, Any], prompt_tokens: int) -> tuple[dict[str, int], str | None]:
    """``(prompt_tokens_by_modality, problem)``: ``problem`` names what is wrong (then the counts
    are ``{}``), None when the details hold no modality counts or valid ones."""
    source = details.get("multimodal_tokens")
    if source is not None:
        if not isinstance(source, Mapping):
            return {}, "usage.prompt_tokens_details.multimodal_tokens is not an object"
        where = "multimodal_tokens."
        counts = {m: source.get(m) for m in MODALITIES}
    else:
        where = ""
        counts = {m: details.get(f"{m}_tokens") for m in MODALITIES}
    out: dict[str, int] = {}
    for modality, value in counts.items():
        if value is None:
            continue
        name = f"usage.prompt_tokens_details.{where}{modality if where else modality + '_tokens'}"
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
            return {}, f"{name} must be an integer in 0..{MAX_TOKENS}"
        if value:
            out[modality] = value
    if sum(out.values()) > prompt_tokens:
        return {}, f"multimodal prompt tokens {sum(out.values())} exceed prompt_tokens {prompt_tokens}"
    return out, None
