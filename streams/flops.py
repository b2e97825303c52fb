"""Compute estimates: attended query-key pairs and FLOPs per request per step.

Used to split each step's wall time across the requests in it (GPU-time attribution). The
estimate has a linear term (2 FLOPs per active parameter per token) and an attention term
(QK^T and AV: 4 FLOPs per head dimension per attended pair per layer). It is an estimate for
attribution, not a measurement: only the ratios between requests of one step matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs estimate needs from EngineStarted."""

    num_layers: int = 0
    hidden: int = 0
    intermediate: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    vocab: int = 0
    experts: int = 0
    top_k: int = 0
    window: int | None = None
    window_layer_fraction: float = 0.0
    # Derived once (the assembler reads them per request per step).
    linear_flops_per_token: float = field(init=False)
    flops_per_pair: float = field(init=False)

    def __post_init__(self) -> None:
        # 2 FLOPs per multiply-add of every active parameter (at least 1, to keep ratios sane);
        # QK^T and AV over all heads and layers per attended query-key pair.
        object.__setattr__(self, "linear_flops_per_token", float(max(2 * self.active_params, 1)))
        object.__setattr__(self, "flops_per_pair", float(4 * self.num_layers * self.heads * self.head_dim))

    @classmethod
    def from_engine_started(cls, p: dict[str, Any]) -> ModelShape:
        """Shape from an EngineStarted payload; sliding window from its KV cache groups."""
        groups = p.get("kv_cache_groups") or []
        sw = [g for g in groups if g.get("sliding_window")]
        layers = sum(g.get("num_layers", 0) for g in groups) or 1
        window = min(g["sliding_window"] for g in sw) if sw else None
        fraction = (sum(g.get("num_layers", 0) for g in sw) / layers) if sw else 0.0
        if sw and fraction == 0.0:
            fraction = 1.0  # layer counts unknown: assume every layer slides
        head_dim = p.get("head_dim") or (p.get("hidden_size", 0) // max(p.get("num_attention_heads", 1), 1))
        return cls(
            num_layers=p.get("num_layers", 0),
            hidden=p.get("hidden_size", 0),
            intermediate=p.get("intermediate_size", 0),
            heads=p.get("num_attention_heads", 0),
            kv_heads=p.get("num_kv_heads", 0) or p.get("num_attention_heads", 0),
            head_dim=head_dim,
            vocab=p.get("vocab_size", 0),
            experts=p.get("moe_num_experts", 0),
            top_k=p.get("moe_top_k", 0),
            window=window,
            window_layer_fraction=fraction,
        )

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (attention projections, active experts, LM head)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate * (self.top_k if self.experts else 1)
        return self.num_layers * (attn + mlp) + self.hidden * self.vocab

    def pairs(self, start: int, n: int) -> tuple[int, int]:
        """(attended pairs, pairs a full-attention model would attend) for queries [start, start+n).

        With sliding-window layers, attended pairs blend windowed and full attention by the
        fraction of layers that slide.
        """
        full = causal_pairs(start, n)
        if self.window is None:
            return full, full
        windowed = windowed_pairs(start, n, self.window)
        f = self.window_layer_fraction
        return round(f * windowed + (1.0 - f) * full), full

    def flops(self, tokens: int, attended_pairs: int) -> float:
        """Estimated FLOPs of ``tokens`` new positions attending ``attended_pairs`` pairs."""
        return tokens * self.linear_flops_per_token + attended_pairs * self.flops_per_pair
