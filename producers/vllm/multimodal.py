"""Multimodal facts of a vLLM request (issue 36): its items, the encoder's runs and cache hits.

vLLM 0.32 keeps a prompt's images, audio clips and videos as ``Request.mm_features``
(``MultiModalFeatureSpec``: ``modality``, ``identifier`` (the content hash, the encoder cache's
key) and ``mm_position``, a ``PlaceholderRange`` of prompt positions whose ``is_embed`` mask says
which of them the encoder's output fills). The placeholder positions are part of the prompt
(``prompt_tokens``); the chat API's ``usage.prompt_tokens_details.multimodal_tokens`` sums their
``length`` per modality (``_get_mm_token_counts`` in ``entrypoints/openai/chat_completion/
serving.py``), and so does :meth:`EncoderTally.finished`.

The encoder's work has no per-request count in vLLM. Two facts give it:

* ``SchedulerOutput.scheduled_encoder_inputs`` (request -> item indices): the items the encoder
  runs for a request in that step. Each run computes the item's ``num_embeds`` encoder tokens;
* ``EncoderCacheManager.check_and_update_cache(request, index)`` returning True: the scheduler
  needed the item's encoder output and the encoder cache held it, so the encoder did not run
  (``Scheduler._try_schedule_encoder_inputs``). The plugin wraps the manager's method on the
  scheduler's instance (:func:`watch_encoder_cache`); the wrapper only appends an
  :class:`EncoderHit` (request id, item index) to a list when the answer is True.

The scheduler asks again for an item it has already sent to the encoder for the same request
(an item that spans two prefill chunks), and again for a cached item in a step whose request it
then could not schedule: a hit counts once per (request, item), and never for an item the
request's own encoder run computed. Items whose positions the prefix cache served are never
needed, and are in neither count. Everything but the wrapper runs on the emitter thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

#: SchedulerOutput attribute holding the encoder-cache hits noted while it was scheduled.
ENCODER_HITS = "_sparseety_encoder_hits"


@dataclass(frozen=True, slots=True)
class EncoderHit:
    """One True answer of the encoder cache, handed from the engine's thread to the emitter's."""

    request_id: str
    index: int  # the item's index in the request's mm_features


@dataclass
class _Items:
    """One request's multimodal items (emitter thread)."""

    modality: list[str]
    length: list[int]
    embeds: list[int]
    computed_tokens: int = 0
    hit_tokens: int = 0
    encoded: set[int] = field(default_factory=set)
    hit: set[int] = field(default_factory=set)


def _num_embeds(position: Any) -> int:
    try:
        return int(position.get_num_embeds())
    except Exception:  # a PlaceholderRange without the method (older vLLM): every position
        return int(position.length)


def mm_inputs(req: Any) -> list[dict[str, Any]]:
    """RequestStarted's ``mm_inputs``: the prompt's items in prompt order."""
    out = []
    for f in getattr(req, "mm_features", None) or ():
        pos = f.mm_position
        out.append(
            {
                "modality": str(f.modality),
                "offset": int(pos.offset),
                "length": int(pos.length),
                "num_embeds": _num_embeds(pos),
                "identifier": str(f.identifier or ""),
            }
        )
    return out


class EncoderTally:
    """Per request: placeholder tokens by modality, encoder tokens computed and cache hits."""

    def __init__(self) -> None:
        self._items: dict[str, _Items] = {}

    def admitted(self, rid: str, items: list[dict[str, Any]]) -> None:
        if items:
            self._items[rid] = _Items(
                modality=[i["modality"] for i in items],
                length=[i["length"] for i in items],
                embeds=[i["num_embeds"] for i in items],
            )

    def step(self, scheduler_output: Any) -> None:
        """Fold one step's encoder runs, then the hits its schedule() noted."""
        if not self._items:
            return
        runs = getattr(scheduler_output, "scheduled_encoder_inputs", None) or {}
        for rid, indices in runs.items():
            items = self._items.get(rid)
            if items is None:
                continue
            for i in indices:
                if 0 <= i < len(items.embeds):
                    items.computed_tokens += items.embeds[i]
                    items.encoded.add(i)
        for hit in getattr(scheduler_output, ENCODER_HITS, None) or ():
            rid, i = hit.request_id, hit.index
            items = self._items.get(rid)
            if items is None or i in items.encoded or i in items.hit or not 0 <= i < len(items.embeds):
                continue
            items.hit.add(i)
            items.hit_tokens += items.embeds[i]

    def finished(self, rid: str) -> dict[str, Any]:
        """RequestFinished's multimodal fields (and forget the request)."""
        items = self._items.pop(rid, None)
        if items is None:
            return {
                "prompt_tokens_by_modality": {},
                "num_encoder_compute_tokens": 0,
                "num_encoder_cache_hit_tokens": 0,
            }
        by: dict[str, int] = {}
        for modality, length in zip(items.modality, items.length, strict=True):
            by[modality] = by.get(modality, 0) + length
        return {
            "prompt_tokens_by_modality": by,
            "num_encoder_compute_tokens": items.computed_tokens,
            "num_encoder_cache_hit_tokens": items.hit_tokens,
        }


def watch_encoder_cache(scheduler: Any, hits: list[EncoderHit]) -> bool:
    """Wrap the scheduler's ``encoder_cache_manager.check_and_update_cache`` (this instance only)
    so that each True answer appends ``(request id, item index)`` to ``hits``. False when the
    scheduler has no encoder cache manager (a text-only model)."""
    manager: Any = getattr(scheduler, "encoder_cache_manager", None)
    orig = getattr(manager, "check_and_update_cache", None)
    if manager is None or orig is None or getattr(orig, "_sparseety", False):
        return False

    @functools.wraps(orig)
    def check_and_update_cache(request: Any, input_id: int) -> bool:
        found = orig(request, input_id)
        if found:
            hits.append(EncoderHit(request.request_id, input_id))
        return bool(found)

    check_and_update_cache.__dict__["_sparseety"] = True
    manager.check_and_update_cache = check_and_update_cache
    return True
