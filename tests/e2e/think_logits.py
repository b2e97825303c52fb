"""A vLLM logits processor that makes the tiny random model think, deterministically.

The tiny checkpoint's output is noise, so a reasoning parser would have nothing to split. A
request that asks for it (``vllm_xargs``: ``think`` = K and ``think_ids`` = the ids of
``<think>`` and ``</think>``) emits ``<think>``, K tokens of its own choice that are neither
delimiter, ``</think>``, then an answer without delimiters: its think section is exactly the
first K + 2 output positions. Loaded by the server (``--logits-processors
tests.e2e.think_logits:ThinkFirst``) in its engine process; other requests are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


def _forced(k: int, start: int, end: int) -> Any:
    def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        n = len(output_ids)
        if n == 0 or n == k + 1:  # open, then close, the think section
            want = start if n == 0 else end
            keep = logits[want].clone()
            logits.fill_(float("-inf"))
            logits[want] = keep if torch.isfinite(keep) else 0.0
        else:
            logits[start] = float("-inf")
            logits[end] = float("-inf")
        return logits

    return apply


class ThinkFirst(AdapterLogitsProcessor):
    """Per request: ``<think>``, ``think`` tokens, ``</think>``, then the answer."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        extra = getattr(params, "extra_args", None) or {}
        if "think" not in extra:
            return None
        start, end = extra["think_ids"]
        return _forced(int(extra["think"]), int(start), int(end))
