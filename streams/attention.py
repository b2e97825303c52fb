"""Attention limits per KV-cache group: sliding windows and chunked local attention.

vLLM groups layers that share a KV-cache spec. Full-attention groups attend every earlier
position; a sliding-window group of window ``W`` attends the last ``W`` keys and frees whole
blocks that fell out of the window while the request runs; a chunked-local-attention group
(Llama 4's ``attention_chunk_size`` ``C``) attends only keys of the query's own chunk
``[q // C * C, q]`` and frees blocks of finished chunks.

A request has one timeline, but each group treats its positions differently. The rule that maps
the groups onto one timeline (docs/streams.md): a position counts as *window released* when the
groups that released it hold more than half of the layers, and as *skipped* (KV still held,
never attended again) when the groups that no longer attend it hold more than half of the
layers and it is not window released. Attention pairs are weighted by layers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL, SLIDING, CHUNKED = "full_attention", "sliding_window", "chunked_local_attention"


@dataclass(frozen=True, slots=True)
class Group:
    """One KV-cache group as far as attention reach goes."""

    layers: int
    block_size: int
    window: int | None = None  # sliding window (tokens)
    chunk: int | None = None  # chunked local attention (tokens)
    #: Whether vLLM's KV-cache manager frees this group's out-of-reach blocks. A full-attention
    #: group never does, even when its spec carries a window or chunk: that is what vLLM makes
    #: of a hybrid model with the hybrid KV-cache manager off (every layer promoted to full
    #: attention for allocation, each still attending its own window).
    frees: bool = True

    @property
    def limited(self) -> bool:
        return self.window is not None or self.chunk is not None

    def pairs(self, start: int, n: int) -> int:
        """Query-key pairs attended by queries [start, start + n) in this group."""
        if self.chunk:
            return chunked_pairs(start, n, self.chunk)
        if self.window:
            return windowed_pairs(start, n, self.window)
        return causal_pairs(start, n)

    def unattended_end(self, kv_end: int) -> int:
        """Positions [0, result) the last query (at ``kv_end - 1``) no longer attends."""
        if kv_end <= 0:
            return 0
        if self.chunk:
            return (kv_end - 1) // self.chunk * self.chunk
        if self.window:
            return max(0, kv_end - self.window)
        return 0

    def released_end(self, last_computed_before: int) -> int:
        """Positions [0, result) whose blocks the engine freed while the request ran.

        vLLM frees a block once no future query of the request can attend it, judged at the
        last step that scheduled the request (``num_computed_tokens`` before that step).
        """
        bs = self.block_size
        if not bs or not self.frees:
            return 0
        c = last_computed_before
        if self.chunk:
            return c // self.chunk * self.chunk // bs * bs
        if self.window:
            return max(0, c - self.window + 1) // bs * bs
        return 0


def groups_of(config: dict[str, Any] | None) -> tuple[Group, ...]:
    """The attention groups of an EngineStarted payload (layer counts default to equal shares)."""
    raw = (config or {}).get("kv_cache_groups") or []
    out = []
    for g in raw:
        kind = g.get("kind", FULL)
        chunk = g.get("attention_chunk_size") or None
        window = g.get("sliding_window") or None
        if kind == CHUNKED or "chunk" in kind.lower():
            # Older producers put the chunk size in sliding_window: a chunk, not a window.
            chunk = chunk or window
            window = None
        elif chunk:
            window = None
        out.append(
            Group(
                layers=g.get("num_layers", 0) or 0,
                block_size=g.get("block_size", 0) or 0,
                window=window,
                chunk=chunk,
                frees=kind != FULL,
            )
        )
    if out and sum(g.layers for g in out) == 0:
        out = [Group(1, g.block_size, g.window, g.chunk, g.frees) for g in out]  # layer counts unknown
    return tuple(out)


def majority_end(groups: tuple[Group, ...], ends: list[int]) -> int:
    """The largest ``p`` such that groups holding more than half the layers have ``end >= p``.

    Each group's set is a prefix ``[0, end)``; a position is in the weighted majority exactly
    when it lies below this bound.
    """
    total = sum(g.layers for g in groups)
    if not total:
        return 0
    acc = 0
    for end, layers in sorted(zip(ends, (g.layers for g in groups), strict=True), reverse=True):
        acc += layers
        if 2 * acc > total:
            return end
    return 0


def fates(groups: tuple[Group, ...], kv_end: int, last_computed_before: int) -> tuple[int, int]:
    """``(released_end, unattended_end)`` on the request's timeline by the majority rule."""
    if not any(g.limited for g in groups):
        return 0, 0
    unattended = [g.unattended_end(kv_end) for g in groups]
    released = [min(g.released_end(last_computed_before), u) for g, u in zip(groups, unattended, strict=True)]
    rel = majority_end(groups, released)
    out = majority_end(groups, unattended)
    return rel, max(rel, out)


def causal_pairs(start: int, n: int) -> int:
    """Query-key pairs of full causal attention for queries at positions [start, start + n)."""
    return n * start + n * (n + 1) // 2


def windowed_pairs(start: int, n: int, window: int) -> int:
    """Pairs when each query attends at most ``window`` keys (itself included)."""
    if n <= 0:
        return 0
    end = start + n
    full_end = min(end, window)  # queries q < window attend q + 1 keys
    pairs = 0
    if start < full_end:
        pairs = causal_pairs(start, full_end - start)
    capped = end - max(start, full_end)
    return pairs + capped * window


def chunked_pairs(start: int, n: int, chunk: int) -> int:
    """Pairs when query ``q`` attends the keys of its chunk up to itself: ``q % chunk + 1``."""
    pairs = 0
    q, end = start, start + n
    while q < end:
        chunk_end = min(end, (q // chunk + 1) * chunk)
        lo, hi = q % chunk, (chunk_end - 1) % chunk  # offsets within the chunk
        pairs += (hi - lo + 1) * (lo + hi + 2) // 2
        q = chunk_end
    return pairs
