"""A small simulated engine that emits EngineEvents with vLLM's semantics, for pure-logic tests
and benchmarks of the assembler. It is a fake: the real engine's events (recorded under
tests/data/) are what topology and end-to-end tests use.

Modelled: block-hashed prefix cache with LRU eviction of unreferenced blocks (KvBlocksStored /
KvBlocksRemoved), contiguous prefix hits at admission (a full hit recomputes the last token),
chunked prefill under a token budget, decode with optional speculative drafts (k proposed, a
random number accepted), preemption (blocks released, recomputed on resume, cache hits again).
Each SimRequest keeps the ground truth of its position classes (``truth``) for property tests.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sparseety import events as ev
from tests import factories as f


@dataclass
class SimRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    tenant: str = "acme"
    computed: int = 0
    output: list[int] = field(default_factory=list)
    cached_at_admission: int = -1
    preemptions: int = 0
    admitted: bool = False
    hashes: list[bytes] = field(default_factory=list)
    # Ground truth kept by the simulator, in the fold's classes (docs/streams.md).
    high: int = 0  # positions obtained so far (computed or read)
    evicted_blocks: set[int] = field(default_factory=set)  # prompt blocks removed before admission
    truth: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("cache_read", "uncached", "preemption", "eviction", "accepted", "rejected"), 0
        )
    )

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def block_hashes(tokens: list[int], bs: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(parent + bytes(str(tokens[i * bs : (i + 1) * bs]), "ascii")).digest()[:16]
        out.append(parent)
    return out


class SimEngine:
    """Generates a valid event stream. ``run(requests)`` returns (events, requests)."""

    def __init__(
        self,
        *,
        engine: str = f.ENGINE,
        epoch: str = f.EPOCH,
        block_size: int = 4,
        cache_blocks: int = 64,
        token_budget: int = 64,
        max_batch: int = 8,
        spec_k: int = 0,
        preempt_prob: float = 0.0,
        sliding_window: int | None = None,
        seed: int = 0,
        t0: int = 1_700_000_000_000_000_000,
        step_ns: int = 10_000_000,
    ) -> None:
        self.engine, self.epoch = engine, epoch
        self.bs = block_size
        self.capacity = cache_blocks
        self.budget = token_budget
        self.max_batch = max_batch
        self.k = spec_k
        self.preempt_prob = preempt_prob
        self.window = sliding_window
        self.rng = random.Random(seed)
        self.t = t0
        self.step_ns = step_ns
        self.seq = 0
        self.events: list[dict[str, Any]] = []
        self.cache: OrderedDict[bytes, int] = OrderedDict()  # hash -> refcount (LRU order)
        self.removed: set[bytes] = set()  # hashes removed from the cache at least once
        self.step_no = 0

    def _emit(self, kind: str, payload: dict[str, Any]) -> None:
        self.events.append(
            f.wrap(self.seq, kind, payload, ts_ns=self.t, engine=self.engine, epoch=self.epoch)
        )
        self.seq += 1

    def _store(self, hashes: list[bytes]) -> None:
        new = [h for h in hashes if h not in self.cache]
        for h in hashes:
            self.cache[h] = self.cache.get(h, 0) + 1
            self.cache.move_to_end(h)
        if new:
            payload = f.kv_stored(
                new, block_size=self.bs, group_kind=self._group_kind(), sliding_window=self.window
            )
            self._emit(ev.KV_STORED, payload)
        self._evict()

    def _group_kind(self) -> str:
        return "sliding_window" if self.window else "full_attention"

    def _release(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if h in self.cache:
                self.cache[h] = max(0, self.cache[h] - 1)

    def _evict(self) -> None:
        removed = []
        while len(self.cache) > self.capacity:
            victim = next((h for h, refs in self.cache.items() if refs == 0), None)
            if victim is None:
                break
            del self.cache[victim]
            self.removed.add(victim)
            removed.append(victim)
        if removed:
            self._emit(
                ev.KV_REMOVED, {"block_hashes": removed, "medium": "GPU", "group_kind": self._group_kind()}
            )

    def _hits(self, r: SimRequest) -> int:
        n = 0
        for h in block_hashes(r.tokens, self.bs):
            if h not in self.cache:
                break
            n += 1
        hit = n * self.bs
        return min(hit, len(r.tokens) - 1)

    def run(self, requests: list[SimRequest], arrivals: dict[str, int] | None = None) -> list[dict[str, Any]]:
        arrivals = arrivals or {}
        groups = [
            {
                "kind": self._group_kind(),
                "sliding_window": self.window,
                "block_size": self.bs,
                "num_layers": 2,
            }
        ]
        self._emit(
            ev.ENGINE_STARTED,
            f.engine_started(
                block_size=self.bs,
                kv_cache_groups=groups,
                spec_method="ngram" if self.k else None,
                spec_num_tokens=self.k,
            ),
        )
        waiting = list(requests)
        running: list[SimRequest] = []
        held: dict[str, list[bytes]] = {}
        while waiting or running:
            self.step_no += 1
            self.t += self.step_ns
            budget = self.budget
            rows: list[tuple[str, int, int, list[int]]] = []
            spec: list[tuple[int, int]] = []
            preempted: list[str] = []
            resumed: list[str] = []
            started: list[SimRequest] = []
            # Preempt at most one running request now and then.
            if running and self.rng.random() < self.preempt_prob:
                victim = running.pop(self.rng.randrange(len(running)))
                victim.preemptions += 1
                victim.computed = 0
                self._release(held.pop(victim.rid, []))
                preempted.append(victim.rid)
                waiting.insert(0, victim)
            # Running requests first (decode or continuing prefill), then admissions.
            for r in list(running):
                if budget <= 0:
                    break
                rows_spec = self._schedule(r, budget)
                if rows_spec is None:
                    continue
                row, sp = rows_spec
                budget -= row[1]
                rows.append(row)
                spec.append(sp)
                self._allocate(r, row, held)
            for r in list(waiting):
                if len(running) >= self.max_batch or budget <= 1 or arrivals.get(r.rid, 0) > self.step_no:
                    continue
                waiting.remove(r)
                hit = self._hits(r)
                r.computed = hit
                r.truth["cache_read"] += hit
                r.high = max(r.high, hit)
                if not r.admitted:
                    r.admitted = True
                    r.cached_at_admission = hit
                    r.hashes = block_hashes(r.prompt, self.bs)
                    # Blocks past the hit whose cache lifetime had ended at this lookup: removed
                    # before, and no copy cached now (vLLM's truth, tests/e2e/ground_truth.py).
                    r.evicted_blocks = {
                        i
                        for i, h in enumerate(r.hashes)
                        if i * self.bs >= hit and h in self.removed and h not in self.cache
                    }
                    started.append(r)
                else:
                    resumed.append(r.rid)
                hashes = block_hashes(r.tokens, self.bs)
                held[r.rid] = hashes[: hit // self.bs]
                for h in held[r.rid]:
                    self.cache[h] += 1
                running.append(r)
                rows_spec = self._schedule(r, budget)
                assert rows_spec is not None
                row, sp = rows_spec
                budget -= row[1]
                rows.append(row)
                spec.append(sp)
                self._allocate(r, row, held)
            # KV events precede the step's admissions and output.
            for r in started:
                self._emit(
                    ev.REQUEST_STARTED,
                    f.request_started(
                        r.rid,
                        r.prompt,
                        cached=r.cached_at_admission,
                        hashes=r.hashes,
                        tenant=r.tenant,
                        max_tokens=r.max_tokens,
                        arrival_ts_ns=self.t - self.step_ns,
                    ),
                )
            # Apply outputs.
            final_rows = []
            for (rid, n, c, new), (k, a) in zip(rows, spec, strict=True):
                r = next(x for x in running if x.rid == rid)
                r.computed = c + n - (k - a)
                self._count_truth(r, c, r.computed, k, a)
                r.output.extend(new)
                final_rows.append((rid, n, c, new))
            self._emit(
                ev.STEP_BATCH,
                f.step_batch(
                    self.step_no,
                    final_rows,
                    spec=spec if self.k else None,
                    preempted=preempted,
                    resumed=resumed,
                ),
            )
            for r in list(running):
                if len(r.output) >= r.max_tokens:
                    running.remove(r)
                    self._release(held.pop(r.rid, []))
                    out_hashes = block_hashes(r.tokens, self.bs)[len(r.hashes) :]
                    self._emit(
                        ev.REQUEST_FINISHED,
                        f.request_finished(
                            r.rid,
                            prompt=len(r.prompt),
                            output=len(r.output),
                            cached=r.cached_at_admission,
                            num_preemptions=r.preemptions,
                            output_block_hashes=out_hashes,
                        ),
                    )
            self._evict()
        self._emit(ev.ENGINE_STOPPED, {"reason": "shutdown"})
        return self.events

    def _allocate(
        self, r: SimRequest, row: tuple[str, int, int, list[int]], held: dict[str, list[bytes]]
    ) -> None:
        """Blocks that become full with this row are cached at once, as vLLM's ``allocate_slots``
        does: a later admission of the same step hits them."""
        _rid, n, c, _new = row
        full = block_hashes(r.tokens[: c + n], self.bs)
        new_blocks = full[len(held.get(r.rid, [])) :]
        if new_blocks:
            held.setdefault(r.rid, []).extend(new_blocks)
            self._store(new_blocks)

    def _count_truth(self, r: SimRequest, start: int, valid_end: int, k: int, a: int) -> None:
        t = r.truth
        t["accepted"] += a
        t["rejected"] += k - a
        if start < r.high:
            t["preemption"] += min(valid_end, r.high) - start
            start = r.high
        for p in range(start, valid_end - a):
            if p < len(r.prompt) and p // self.bs in r.evicted_blocks:
                t["eviction"] += 1
            else:
                t["uncached"] += 1
        r.high = max(r.high, valid_end)

    def _schedule(
        self, r: SimRequest, budget: int
    ) -> tuple[tuple[str, int, int, list[int]], tuple[int, int]] | None:
        remaining_prompt = len(r.tokens) - r.computed
        if remaining_prompt > 1:
            n = min(remaining_prompt, budget)
            done = r.computed + n == len(r.tokens)
            new = [self.rng.randrange(500)] if done else []
            return (r.rid, n, r.computed, new), (0, 0)
        # Decode: the last token, plus k drafts when speculating.
        left = r.max_tokens - len(r.output)
        k = min(self.k, max(left - 1, 0), max(budget - 1, 0)) if r.output else 0
        a = self.rng.randint(0, k) if k else 0
        new = [self.rng.randrange(500) for _ in range(a + 1)]
        return (r.rid, 1 + k, r.computed, new), (k, a)


def workload(
    n: int, *, seed: int = 0, shared_prefix: int = 12, max_prompt: int = 40, max_tokens: int = 12
) -> list[SimRequest]:
    """``n`` requests of mixed lengths, most sharing a system prompt; two tenants."""
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        own = [rng.randrange(500) for _ in range(rng.randint(1, max_prompt))]
        prompt = (system + own) if i % 4 else own
        out.append(
            SimRequest(f"r{i}", prompt, rng.randint(1, max_tokens), tenant="acme" if i % 2 else "globex")
        )
    return out
