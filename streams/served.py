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


def reasoning_tokens(finish: dict[str, Any], output_tokens: int) -> int | None:
    """Output positions in the think section (RequestFinished.reasoning_end, at most the output);
    None when the engine ran no reasoning parser or the request has no finish (not observed)."""
    end = finish.get("reasoning_end")
    if end is None:
        return None
    return max(0, min(int(end), output_tokens))
