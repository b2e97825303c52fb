"""What a request was served by: its base model and adapter, and its output's think section.

Pure helpers of the fold (``streams/assembler.py``).
"""

from __future__ import annotations

from typing import Any


def base_model(started: dict[str, Any], config: dict[str, Any] | None) -> str:
    """The base model of a RequestStarted, its adapter aside (``lora_name``).

    Producers before issue 23 wrote the LoRA adapter's name into ``model``; the engine's
    served model name (EngineStarted) is then the base, so old topics replay into the same two
    columns as new ones.
    """
    served = str((config or {}).get("served_model_name", "") or "")
    model = str(started.get("model") or "")
    lora = started.get("lora_name")
    if not model or (lora and model == lora and served):
        return served or model
    return model


def reasoning(finish: dict[str, Any], output_tokens: int) -> tuple[int | None, list[int]]:
    """``(reasoning_output_tokens, reasoning_spans)`` from RequestFinished.reasoning_spans, the
    spans cut at the output's end: ``(None, [])`` when the engine ran no reasoning parser or the
    request has no finish (not observed)."""
    spans = finish.get("reasoning_spans")
    if spans is None:
        return None, []
    kept: list[int] = []
    for a, b in zip(spans[::2], spans[1::2], strict=False):
        a, b = max(0, int(a)), min(int(b), output_tokens)
        if b > a:
            kept += [a, b]
    return sum(b - a for a, b in zip(kept[::2], kept[1::2], strict=True)), kept
