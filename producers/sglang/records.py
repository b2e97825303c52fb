"""Background-thread builders: SGLang scheduler facts -> the same payloads the vLLM producer sends.

Block identity. SGLang's radix cache holds token runs, not hashed blocks; the contract (and the
fold's prefix index) speaks of blocks of ``block_size`` tokens named by a hash that chains every
token before them. This module names them so: block ``k`` of a token sequence is
``blake2b-64(name of block k-1 || its tokens)``, seeded with the radix key's namespace
(``extra_key``, ``cache_salt``), written as 8 bytes. A block is cached exactly while the radix
tree holds the node that contains its last token (a radix node's ancestors are always held), so
a node the tree inserts stores the blocks whose last token lies in it, and a node it evicts
removes the same blocks. A request's ``block_hashes`` are the same names over its prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

from sparseety import events as ev
from sparseety.tenants import engine_tenant

from ..privacy import PromptPolicy
from ..vllm.request_ids import request_identity

HASH_ALGO = "sparseety-chain-blake2b64"


def _seed(extra_key: Any, cache_salt: Any) -> bytes:
    if extra_key is None and cache_salt is None:
        return b""
    return hashlib.blake2b(repr((extra_key, cache_salt)).encode(), digest_size=8).digest()


def chain_hashes(tokens: Any, block_size: int, seed: bytes, first: int = 0) -> list[bytes]:
    """Names of the full blocks ``first ..`` of ``tokens`` (each chains all tokens before it)."""
    n = len(tokens) // block_size
    out: list[bytes] = []
    prev = seed
    for k in range(n):
        chunk = array("q", tokens[k * block_size : (k + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        if k >= first:
            out.append(prev)
    return out


#: SGLang's cache tiers, in ``cached_tokens_details`` order (sparseety.billing.SOURCE_TIERS).
SGLANG_SOURCES = ("device", "host", "storage")


def cached_by_source(tiers: tuple[Any, Any, Any] | None) -> dict[str, int]:
    """RequestStarted.cached_tokens_by_source from SGLang's (device, host, storage) split: the
    non-zero entries under SGLang's own names; empty when not reported."""
    if tiers is None:
        return {}
    return {name: int(n) for name, n in zip(SGLANG_SOURCES, tiers, strict=True) if n}


def _finish_reason(reason: Any) -> str:
    """SGLang's finish classes (FINISH_LENGTH, FINISH_MATCHED_TOKEN, FINISH_ABORT, ...)."""
    name = type(reason).__name__ if reason is not None else "FINISH_ABORT"
    if name in ("FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX"):
        return "stop"
    return name.removeprefix("FINISH_").lower()


@dataclass(slots=True, frozen=True)
class Admission:
    """A request's first batch, as the scheduler thread saw it at ``run_batch``; the emitter
    thread builds its RequestStarted from it."""

    rid: str
    prompt: Any  #: ``req.origin_input_ids``
    cached: int  #: the admission's cache hit (its ``prefix_len``)
    arrival_s: float
    max_tokens: int | None
    custom: Any  #: ``sampling_params.custom_params`` (tenant, session)
    namespace: tuple[Any, Any]  #: the radix key's ``extra_key`` and ``cache_salt``
    #: SGLang's split of the hit (device, host, storage); None when the request has none
    tiers: tuple[Any, Any, Any] | None = None


@dataclass(frozen=True, slots=True)
class RustRun:
    """The tokens one KV event of SGLang's Rust TreeCore stored: ``tokens`` from depth ``start``
    of their radix path, ``page`` tokens per SGLang block hash, under ``parent`` (the run that
    holds the token before ``start``; None at the root). Immutable: the hot path makes it, the
    emitter thread reads it."""

    parent: RustRun | None
    start: int
    tokens: Any
    page: int
    namespace: tuple[Any, Any]  #: (extra_key, cache_salt), as a node's


def rust_path(run: RustRun | None, end: int) -> list[int]:
    """The token path from the root to depth ``end`` (inside ``run``).

    Under EAGLE speculation SGLang keys its radix tree by bigrams (``RadixKey.is_bigram``; the
    Rust core's ``RustBigramUnifiedTreeCoreBinding``) and its KV events carry one pair
    ``(t[i], t[i + 1])`` per position ``i``: the token at ``i`` is the pair's first."""
    parts = []
    while run is not None:
        parts.append(run.tokens[: end - run.start])
        end, run = run.start, run.parent
    out: list[int] = []
    for part in reversed(parts):
        if len(part) and isinstance(part[0], tuple | list):
            out.extend(pair[0] for pair in part)
        else:
            out.extend(part)
    return out


class RecordBuilder:
    """Builds the payloads of one SGLang engine epoch (emitter thread only).

    Args:
        policy: Prompt privacy policy.
        served_model_name: Model name on every request.
        block_size: Tokens per accounting block (SGLang's page size, 16 when it is 1).
    """

    def __init__(self, *, policy: PromptPolicy, served_model_name: str, block_size: int) -> None:
        self.policy = policy
        self.served = served_model_name
        self.block_size = block_size

    # --- requests ------------------------------------------------------------------------------

    def requests_started(self, items: list[Admission]) -> list[tuple[str, dict[str, Any]]]:
        return [
            self.request_started(
                a.rid, a.prompt, a.cached, a.arrival_s, a.max_tokens, a.custom, a.namespace, a.tiers
            )
            for a in items
        ]

    def request_started(
        self,
        rid: str,
        prompt: Any,
        cached: int,
        arrival_s: float,
        max_tokens: int | None,
        custom: Any,
        namespace: tuple[Any, Any],
        tiers: tuple[Any, Any, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """``tiers``: SGLang's split of the admission hit (``req.cached_tokens_device``,
        ``_host``, ``_storage``: what ``meta_info.cached_tokens_details`` reports), None when
        the request has none."""
        ids, hashes = self.policy.fields(list(prompt))
        custom = custom if isinstance(custom, dict) else {}
        tenant = engine_tenant(custom.get("tenant"))
        session = custom.get("session") or ""
        return ev.REQUEST_STARTED, {
            "request_id": rid,
            "arrival_ts_ns": int((arrival_s or 0) * 1e9),
            "prompt_len": len(prompt),
            "prompt_token_ids": ids,
            "prompt_token_hashes": hashes,
            "num_cached_tokens": int(cached),
            "num_external_cached_tokens": 0,
            "block_hashes": chain_hashes(prompt, self.block_size, _seed(*namespace)),
            "max_tokens": max_tokens,
            "tenant": str(tenant),
            "model": self.served,
            "lora_name": None,
            "priority": 0,
            "session_id": str(session),
            "cached_tokens_by_source": cached_by_source(tiers),
            **request_identity(rid),
        }

    def requests_finished(self, items: list[tuple[Any, ...]]) -> list[tuple[str, dict[str, Any]]]:
        return [self.request_finished(*item) for item in items]

    def request_finished(
        self,
        rid: str,
        reason: Any,
        num_prompt: int,
        num_output: int,
        cached: int,
        retractions: int,
    ) -> tuple[str, dict[str, Any]]:
        """SGLang's own totals for a finished request (what its ``meta_info`` reports)."""
        return ev.REQUEST_FINISHED, {
            "request_id": rid,
            "finish_reason": _finish_reason(reason),
            "stop_reason": None,
            "num_prompt_tokens": int(num_prompt),
            "num_output_tokens": int(num_output),
            "num_cached_tokens": int(cached),
            "num_preemptions": int(retractions),
            "output_block_hashes": [],
            "first_token_ts_ns": 0,
            "chunk_arrival_ns": [],
        }

    # --- steps ---------------------------------------------------------------------------------

    def step(
        self,
        step: int,
        start_mono_ns: int,
        end_mono_ns: int,
        rids: list[str],
        scheduled: list[int],
        before: list[int],
        new_tokens: list[int],
        token_ids: list[int],
        retracted: list[str],
        resumed: list[str],
        proposed: list[int] | None = None,
        accepted: list[int] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """One processed batch; ``proposed``/``accepted``: a verify's drafts per request (judged
        by the verifier, accepted by it), empty when the batch does not speculate."""
        return ev.STEP_BATCH, {
            "step": step,
            "start_mono_ns": start_mono_ns,
            "duration_ns": max(0, end_mono_ns - start_mono_ns),
            "req_ids": rids,
            "num_scheduled_tokens": scheduled,
            "num_computed_before": before,
            "num_new_tokens": new_tokens,
            "new_token_ids": token_ids if self.policy.mode == "raw" else [],
            "spec_proposed": proposed or [],
            "spec_accepted": accepted or [],
            "preempted_req_ids": sorted(retracted),
            "resumed_req_ids": sorted(resumed),
            "updates_before": -1,
        }

    # --- radix cache -----------------------------------------------------------------------------

    def node_blocks(self, keys: list[Any]) -> list[bytes]:
        """The blocks whose last token lies in the node ``keys[0]`` (path to the root after it)."""
        node = keys[0]
        tokens: list[int] = []
        for key in reversed(keys):
            tokens.extend(key.token_ids[: len(key)])
        depth = len(tokens) - len(node)
        first = depth // self.block_size
        return chain_hashes(tokens, self.block_size, _seed(node.extra_key, node.cache_salt), first)

    def kv_stored(self, keys: list[Any]) -> tuple[str, dict[str, Any]]:
        return self._stored(self.node_blocks(keys))

    def kv_removed(self, keys: list[Any]) -> tuple[str, dict[str, Any]]:
        return self._removed(self.node_blocks(keys))

    # --- the Rust TreeCore's KV events (teed) -------------------------------------------------

    def rust_stored(self, run: RustRun, end: int) -> tuple[str, dict[str, Any]]:
        """The blocks that end in ``run`` (its path from the root up to depth ``end``)."""
        tokens = rust_path(run, end)
        return self._stored(
            chain_hashes(tokens, self.block_size, _seed(*run.namespace), run.start // self.block_size)
        )

    def rust_removed(self, ends: list[tuple[RustRun, int]]) -> tuple[str, dict[str, Any]]:
        """The blocks ending at each ``(run, depth)`` of ``ends`` (pages the core evicted)."""
        bs = self.block_size
        blocks = [
            chain_hashes(rust_path(run, end), bs, _seed(*run.namespace), end // bs - 1)[-1]
            for run, end in ends
        ]
        return self._removed(blocks)

    def _stored(self, blocks: list[bytes]) -> tuple[str, dict[str, Any]]:
        return ev.KV_STORED, {
            "block_hashes": blocks,
            "parent_block_hash": None,
            "block_size": self.block_size,
            "num_tokens": len(blocks) * self.block_size,
            "lora_id": None,
            "medium": "GPU",
            "group_kind": "full_attention",
            "sliding_window": None,
        }

    def _removed(self, blocks: list[bytes]) -> tuple[str, dict[str, Any]]:
        return ev.KV_REMOVED, {
            "block_hashes": blocks,
            "medium": "GPU",
            "group_kind": "full_attention",
        }
