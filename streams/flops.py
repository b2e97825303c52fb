"""Compute estimates: attended query-key pairs and FLOPs per request per step.

Used to split each step's wall time across the requests in it (GPU-time attribution). The
estimate has a linear term (2 FLOPs per active parameter per token) and an attention term
(QK^T and AV: 4 FLOPs per head dimension per attended pair per layer). It is an estimate for
attribution, not a measurement: only the ratios between requests of one step matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import attention
from .attention import causal_pairs, windowed_pairs

__all__ = ["ModelShape", "causal_pairs", "windowed_pairs"]


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
    # Attention groups that limit reach (sliding window, chunks), with their share of layers;
    # empty for full attention everywhere.
    limited: tuple[tuple[float, attention.Group], ...] = ()
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
        """Shape from an EngineStarted payload; windows and chunks from its KV cache groups."""
        groups = attention.groups_of(p)
        layers = sum(g.layers for g in groups) or 1
        limited = tuple((g.layers / layers, g) for g in groups if g.limited)
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
            limited=limited,
        )

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (attention projections, active experts, LM head)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate * (self.top_k if self.experts else 1)
        return self.num_layers * (attn + mlp) + self.hidden * self.vocab

    def pairs(self, start: int, n: int) -> tuple[float, int]:
        """(attended pairs, pairs a full-attention model would attend) for queries [start, start+n).

        With sliding-window or chunked layers, attended pairs blend each group's pairs by its
        fraction of the layers: the mean over layers, not rounded (the request's sum is rounded
        once, when it is reported).
        """
        full = causal_pairs(start, n)
        if not self.limited:
            return full, full
        rest = 1.0 - sum(f for f, _ in self.limited)
        return rest * full + sum(f * g.pairs(start, n) for f, g in self.limited), full

    def flops(self, tokens: int, attended_pairs: int) -> float:
        """Estimated FLOPs of ``tokens`` new positions attending ``attended_pairs`` pairs."""
        return tokens * self.linear_flops_per_token + attended_pairs * self.flops_per_pair
