"""Engine ground truth: what vLLM's scheduler and KV-cache manager did, recorded in the engine.

:class:`EngineTruth` attaches to the ``Scheduler`` of an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) by wrapping methods of that one scheduler, its KV-cache
manager and its block pool (instance attributes: the plugin's class-level hooks stay underneath).
It is independent of the SparSEEty fold: it reads vLLM's own state at the moment vLLM decides,
not the events the plugin publishes, so the e2e tests can hold the fold's classes against it.

Per request it records:

* admissions and resumes: the prefix-cache hit vLLM's ``get_computed_blocks`` returned (the last
  lookup before the request was scheduled), and, for every full block past the hit, whether its
  hash had a cache lifetime on this engine that had ended (no copy left in the block pool);
* per step: the tokens scheduled, split into re-prefill of positions the request had computed
  before a preemption, recompute of blocks whose cache lifetime had ended (eviction), drafts, and
  first-time compute;
* drafts: accepted as vLLM counts them (``len(sampled) - 1``, before the stop check), kept as
  output, cut by the stop condition, and never verified because the request finished between
  schedule and update (vLLM skips those in its counters);
* window release: the blocks vLLM replaced with the null block in each KV-cache group, read when
  the request's blocks are freed at its end;
* sources: for every block of the first admission's prefix-cache hit, the request whose
  allocation began the cache lifetime of the copy that was live at the lookup (vLLM caches a
  block's hash in ``cache_full_blocks`` when it allocates it for a request); in a model without a
  full-attention group, a hit block with no copy in the pool (outside the window: vLLM never
  cached it) names the last request whose step computed the block's last position;
* attention pairs: per step, the query-key pairs each layer attends, from the model's KV-cache
  groups (full: ``q + 1`` keys for query ``q``; sliding window ``W``: ``min(q + 1, W)``; chunked
  local attention ``C``: ``q % C + 1``), summed over the layers of each group;
* KV memory: after every ``schedule()`` (vLLM has allocated for the step), the blocks each
  request holds in each group (``req_to_blocks``, null blocks excluded) with the block pool's
  reference counts: per request and group its block-steps, peak, token slots used, and the
  block-steps it is charged when each physical block is split among its holders (amortized) or
  charged to the holder that has held it longest (actual), step by step for the time integrals.

Hashes evicted from the prefix cache (all copies of a hash gone) are kept per KV-cache group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTruth:
    """What the engine did for one request (engine request id)."""

    prompt_len: int = 0
    admission_hit: int = 0  # tokens vLLM served from the prefix cache at the first admission
    cache_read: int = 0  # admission + every resume after a preemption
    scheduled: int = 0
    uncached_computed: int = 0
    recomputed_preemption: int = 0
    recomputed_eviction: int = 0
    evicted_blocks_recomputed: int = 0
    drafts_scheduled: int = 0
    drafts_accepted_vllm: int = 0  # vLLM's count: before the stop check
    drafts_kept: int = 0  # accepted drafts that became output tokens
    drafts_cut_by_stop: int = 0
    drafts_unverified: int = 0  # the request finished between schedule and update
    drafts_rejected: int = 0
    preemptions: int = 0
    resumes: int = 0
    output_tokens: int = 0
    released_blocks: list[int] = field(default_factory=list)  # per KV-cache group, at the end
    finished: bool = False
    # working state
    high: int = 0  # positions whose KV this request has computed at some point
    evicted_idx: set[int] = field(default_factory=set)  # block indices of the last lookup
    recomputed_idx: set[int] = field(default_factory=set)
    lookup: tuple[int, set[int], list[str | None]] | None = None
    sources: list[str | None] = field(default_factory=list)  # per hit block at first admission
    layer_pairs: int = 0  # query-key pairs attended, summed over every layer
    full_pairs: int = 0  # pairs full causal attention would attend (per layer)
    #: KV memory per group: step -> [blocks held, amortized share (Fraction), actual blocks,
    #: token slots used] after the step's schedule().
    kv_steps: dict[int, dict[int, list[Any]]] = field(default_factory=dict)

    @property
    def drafts_cut(self) -> int:
        """Drafts cut by a stop plus drafts never verified (the fold's ``draft_cut_tokens``)."""
        return self.drafts_cut_by_stop + self.drafts_unverified


class EngineTruth:
    """Recorder attached to one in-process vLLM scheduler (see the module docstring)."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self._get_block_hash = get_block_hash
        self._get_group_id = get_group_id
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.block_size = int(scheduler.block_size)
        self.async_scheduling = bool(getattr(scheduler.scheduler_config, "async_scheduling", False))
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.groups = [
            {
                "kind": type(g.kv_cache_spec).__name__,
                "layers": len(g.layer_names),
                "block_size": int(g.kv_cache_spec.block_size),
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "attention_chunk_size": getattr(g.kv_cache_spec, "attention_chunk_size", None),
            }
            for g in groups
        ]
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        #: The group whose cache lifetimes decide eviction recompute (full attention keeps every
        #: block of a request; sliding groups release and re-cache blocks on their own).
        self.lifetime_group = full[0] if full else 0
        self.caches_every_block = bool(full)
        #: The last request whose step computed each block's last position (by hash).
        self.computed_by: dict[bytes, str] = {}
        self.requests: dict[str, RequestTruth] = defaultdict(RequestTruth)
        self.ever_cached: dict[int, set[bytes]] = defaultdict(set)
        self.evicted: dict[int, set[bytes]] = defaultdict(set)  # hashes whose every copy was removed
        #: The request whose allocation began each live lifetime of the lifetime group's hashes.
        self.owner: dict[bytes, str | None] = {}
        self._caching: str | None = None  # request of the cache_full_blocks call in progress
        self.steps = 0
        #: Per (group, block id): holder -> (step first held, position in that step's order).
        self._holders: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
        self.ref_mismatches = 0  # blocks whose pool ref_cnt differed from their holders
        self._wrap()

    # --- wrapping ------------------------------------------------------------------------------

    def _wrap(self) -> None:
        sched, kv, pool = self.scheduler, self.kv, self.pool
        schedule, update = sched.schedule, sched.update_from_output
        lookup, free = kv.get_computed_blocks, kv.free
        insert, remove = pool._insert_block_hash, pool._remove_cached_block_hashes
        cache_full = pool.cache_full_blocks

        def cache_full_blocks(request: Any, *a: Any, **k: Any) -> Any:
            self._caching = request.request_id
            try:
                return cache_full(request, *a, **k)
            finally:
                self._caching = None

        def get_computed_blocks(request: Any) -> Any:
            out = lookup(request)
            self._on_lookup(request, int(out[1]))
            return out

        def insert_block_hash(key: Any, block: Any, *a: Any, **k: Any) -> Any:
            group, h = self._get_group_id(key), bytes(self._get_block_hash(key))
            self.ever_cached[group].add(h)
            if group == self.lifetime_group and pool.cached_block_hash_to_block.get_one_block(key) is None:
                self.owner[h] = self._caching  # a new lifetime begins with this copy
            return insert(key, block, *a, **k)

        def remove_cached_block_hashes(block: Any) -> Any:
            removed = remove(block)
            for key in removed:
                if pool.cached_block_hash_to_block.get_one_block(key) is None:  # last copy gone
                    self.evicted[self._get_group_id(key)].add(bytes(self._get_block_hash(key)))
            return removed

        def free_(request: Any) -> Any:
            self._on_free(request)
            return free(request)

        def schedule_(*a: Any, **k: Any) -> Any:
            so = schedule(*a, **k)
            self._on_schedule(so)
            if so.total_num_scheduled_tokens:
                self._record_kv(so)
            return so

        def update_(so: Any, mro: Any, *a: Any, **k: Any) -> Any:
            before = self._before_update(so, mro)
            out = update(so, mro, *a, **k)
            self._after_update(so, before)
            return out

        kv.get_computed_blocks = get_computed_blocks
        kv.free = free_
        pool._insert_block_hash = insert_block_hash
        pool.cache_full_blocks = cache_full_blocks
        pool._remove_cached_block_hashes = remove_cached_block_hashes
        sched.schedule = schedule_
        sched.update_from_output = update_

    # --- hooks ---------------------------------------------------------------------------------

    def _live(self, group: int, h: bytes) -> bool:
        from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

        key = make_block_hash_with_group_id(BlockHash(h), group)
        return self.pool.cached_block_hash_to_block.get_one_block(key) is not None

    def _on_lookup(self, request: Any, hit: int) -> None:
        """The hit, and the blocks past it whose cache lifetime had ended, at this lookup."""
        g = self.lifetime_group
        bs = self.block_size
        evicted: set[int] = set()
        sources: list[str | None] = []
        for i, h in enumerate(request.block_hashes or ()):
            hb = bytes(h)
            if (i + 1) * bs <= hit:
                if not self.caches_every_block and not self._live(g, hb):
                    sources.append(self.computed_by.get(hb))  # counted in the hit, never cached
                else:
                    sources.append(self.owner.get(hb))
                continue
            if hb in self.evicted[g] and not self._live(g, hb):
                evicted.add(i)
        self.requests[request.request_id].lookup = (hit, evicted, sources)

    def _on_schedule(self, so: Any) -> None:
        if not so.total_num_scheduled_tokens:
            return
        self.steps += 1
        reqs = self.scheduler.requests
        before: dict[str, int] = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for nr in so.scheduled_new_reqs:
            self._admit(nr.req_id, reqs.get(nr.req_id), first=True)
        for rid in resumed:
            self._admit(rid, reqs.get(rid), first=False)
        for rid in so.preempted_req_ids or ():
            self.requests[rid].preemptions += 1
        spec = so.scheduled_spec_decode_tokens or {}
        for rid, n in so.num_scheduled_tokens.items():
            k = len(spec.get(rid, ()))
            self._count_step(self.requests[rid], before.get(rid, 0), n, k, self.groups)
            hashes = getattr(reqs.get(rid), "block_hashes", None) or ()
            c, bs = before.get(rid, 0), self.block_size
            for i in range(c // bs, min(len(hashes), (c + n - k) // bs)):
                self.computed_by[bytes(hashes[i])] = rid

    def _count_step(self, rt: RequestTruth, c: int, n: int, k: int, groups: list[dict[str, Any]]) -> None:
        """One step's ``n`` tokens from position ``c`` (the last ``k`` are drafts) into the
        request's classes and attention pairs (per layer, from ``groups``' reach)."""
        bs = self.block_size
        end = c + n - k  # drafts are the last k positions
        rt.scheduled += n
        rt.drafts_scheduled += k
        for q in range(c, c + n):
            rt.full_pairs += q + 1
            for grp in groups:
                if grp["attention_chunk_size"]:
                    keys = q % grp["attention_chunk_size"] + 1
                elif grp["sliding_window"]:
                    keys = min(q + 1, grp["sliding_window"])
                else:
                    keys = q + 1
                rt.layer_pairs += grp["layers"] * keys
        pre = max(0, min(end, rt.high) - c)
        evict = 0
        for p in range(max(c, rt.high), end):
            i = p // bs
            if i in rt.evicted_idx:
                evict += 1
                rt.recomputed_idx.add(i)
        rt.recomputed_preemption += pre
        rt.recomputed_eviction += evict
        rt.uncached_computed += end - c - pre - evict
        rt.evicted_blocks_recomputed = len(rt.recomputed_idx)

    def _admit(self, rid: str, request: Any, *, first: bool) -> None:
        rt = self.requests[rid]
        hit, evicted, sources = rt.lookup or (0, set(), [])
        rt.lookup = None
        rt.cache_read += hit
        rt.evicted_idx = evicted
        if first:
            rt.admission_hit = hit
            rt.sources = sources
            rt.prompt_len = int(getattr(request, "num_prompt_tokens", 0) or 0)
        else:
            rt.resumes += 1

    def _record_kv(self, so: Any) -> None:
        """The blocks every request holds after this step's allocation, per group."""
        from fractions import Fraction

        step = self.steps - 1
        order = {rid: i for i, rid in enumerate(so.num_scheduled_tokens)}
        reqs = self.scheduler.requests
        null = self.pool.null_block
        for gi, m in enumerate(self.kv.coordinator.single_type_managers):
            held: dict[str, list[Any]] = {}
            by_block: dict[int, list[str]] = {}
            for rid, blocks in m.req_to_blocks.items():
                real = [b for b in blocks if b is not null]
                if not real:
                    continue
                held[rid] = real
                for b in real:
                    by_block.setdefault(b.block_id, []).append(rid)
            for bid, rids in by_block.items():
                key = (gi, bid)
                known = self._holders.setdefault(key, {})
                for gone in set(known) - set(rids):
                    del known[gone]
                for rid in rids:
                    known.setdefault(rid, (step, order.get(rid, len(order))))
            for key in [k for k in self._holders if k[0] == gi and k[1] not in by_block]:
                del self._holders[key]
            bs = m.block_size
            for rid, real in held.items():
                share = Fraction(0)
                actual = 0
                for b in real:
                    holders = self._holders[(gi, b.block_id)]
                    if b.ref_cnt != len(holders):
                        self.ref_mismatches += 1
                    share += Fraction(1, len(holders))
                    actual += min(holders, key=holders.__getitem__) == rid
                req = reqs.get(rid)
                computed = int(getattr(req, "num_computed_tokens", 0) or 0) if req is not None else 0
                nulls = len(m.req_to_blocks[rid]) - len(real)
                used = max(0, min(computed, len(m.req_to_blocks[rid]) * bs) - nulls * bs)
                self.requests[rid].kv_steps.setdefault(step, {})[gi] = [len(real), share, actual, used]

    def kv_summary(self, rid: str) -> list[dict[str, Any]]:
        """Per group: block-steps, peak, amortized and actual block-steps, slot-steps used."""
        rt = self.requests[rid]
        out = []
        for gi in range(len(self.groups)):
            rows = [v[gi] for v in rt.kv_steps.values() if gi in v]
            amortized = sum((r[1] for r in rows), start=0)
            out.append(
                {
                    "block_steps": sum(r[0] for r in rows),
                    "peak_blocks": max((r[0] for r in rows), default=0),
                    "block_steps_amortized": [amortized.numerator, amortized.denominator] if rows else [0, 1],
                    "block_steps_actual": sum(r[2] for r in rows),
                    "slot_steps_used": sum(r[3] for r in rows),
                    "steps": {
                        str(k): [v[gi][0], float(v[gi][1]), v[gi][2]]
                        for k, v in rt.kv_steps.items()
                        if gi in v
                    },
                }
            )
        return out

    def _before_update(self, so: Any, mro: Any) -> dict[str, Any]:
        spec = so.scheduled_spec_decode_tokens or {}
        reqs = self.scheduler.requests
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        out: dict[str, Any] = {}
        for rid in so.num_scheduled_tokens:
            req = reqs.get(rid)
            drafts = len(spec.get(rid, ()))
            if req is None or req.is_finished():
                out[rid] = ("finished", drafts, 0, 0, None)
                continue
            i = index.get(rid)
            n = len(sampled[i]) if sampled and i is not None else 0
            accepted = max(n - 1, 0) if drafts and n else 0
            # The object itself: a request that finishes in this update leaves the scheduler.
            out[rid] = ("live", drafts, accepted, req.num_output_tokens, req)
        return out

    def _after_update(self, so: Any, before: dict[str, Any]) -> None:
        for rid, (state, drafts, accepted, outputs_before, req) in before.items():
            rt = self.requests[rid]
            if state == "finished":
                rt.drafts_unverified += drafts
                continue
            new = req.num_output_tokens - outputs_before
            rt.output_tokens += new
            if drafts:
                kept = min(accepted, new)
                rt.drafts_accepted_vllm += accepted
                rt.drafts_kept += kept
                rt.drafts_cut_by_stop += accepted - kept
                rt.drafts_rejected += drafts - accepted
            self._computed_up_to(rt, req)

    def _computed_up_to(self, rt: RequestTruth, req: Any) -> None:
        """After an update: the positions the request has computed (the plain scheduler's
        ``num_computed_tokens`` is exact then; the harness takes them from its executor)."""
        rt.high = max(rt.high, int(req.num_computed_tokens))

    def _on_free(self, request: Any) -> None:
        """Blocks replaced by the null block, per group, when the request's blocks are freed."""
        rid = request.request_id
        rt = self.requests[rid]
        managers = self.kv.coordinator.single_type_managers
        null = self.pool.null_block
        rt.released_blocks = [sum(1 for b in m.req_to_blocks.get(rid, ()) if b is null) for m in managers]
        if request.is_finished():
            rt.finished = True

    # --- derived -------------------------------------------------------------------------------

    def window_released(self, rid: str) -> int:
        """Positions released by the groups holding more than half of the layers (the fold's rule
        in ``streams/attention.py``): the largest released prefix such a majority shares."""
        rt = self.requests[rid]
        if not rt.released_blocks:
            return 0
        total = sum(g["layers"] for g in self.groups)
        ends = [n * g["block_size"] for n, g in zip(rt.released_blocks, self.groups, strict=True)]
        acc = 0
        for end, layers in sorted(zip(ends, (g["layers"] for g in self.groups), strict=True), reverse=True):
            acc += layers
            if 2 * acc > total:
                return end
        return 0

    def summary(self, rid: str) -> dict[str, int]:
        """The request's truth under the fold's RequestAccounting names."""
        rt = self.requests[rid]
        return {
            "cache_read_tokens": rt.cache_read,
            "uncached_computed_tokens": rt.uncached_computed,
            "recomputed_preemption_tokens": rt.recomputed_preemption,
            "recomputed_eviction_tokens": rt.recomputed_eviction,
            "evicted_blocks_recomputed": rt.evicted_blocks_recomputed,
            "draft_accepted_tokens": rt.drafts_kept,
            "draft_rejected_tokens": rt.drafts_rejected,
            "draft_cut_tokens": rt.drafts_cut,
            "draft_unverified_tokens": rt.drafts_unverified,
            "window_released_tokens": self.window_released(rid),
            "scheduled_tokens": rt.scheduled,
            "preemptions": rt.preemptions,
        }


def unattended_end(group: dict[str, Any], kv_end: int) -> int:
    """Positions ``[0, result)`` the last query no longer attends in one group."""
    if kv_end <= 0:
        return 0
    if group.get("attention_chunk_size"):
        return (kv_end - 1) // group["attention_chunk_size"] * group["attention_chunk_size"]
    if group.get("sliding_window"):
        return max(0, kv_end - group["sliding_window"])
    return 0


def majority_end(groups: list[dict[str, Any]], ends: list[int]) -> int:
    """The largest prefix end shared by groups holding more than half of the layers."""
    total = sum(g["layers"] for g in groups)
    acc = 0
    for end, layers in sorted(zip(ends, (g["layers"] for g in groups), strict=True), reverse=True):
        acc += layers
        if 2 * acc > total:
            return end
    return 0


#: Every KV memory-time count :func:`kv_mismatches` can hold against the truth.
KV_CHECKS = frozenset(
    {"block_steps", "peak_blocks", "block_steps_actual", "slot_steps_used", "amortized", "block_ns"}
)


def kv_mismatches(
    accounts: dict[str, dict[str, Any]],
    truths: dict[str, list[dict[str, Any]]],
    events: list[dict[str, Any]],
    checks: frozenset[str] = KV_CHECKS,
) -> tuple[list[str], dict[str, int]]:
    """The fold's KV memory-time (``kv_groups``) against :meth:`EngineTruth.kv_summary`, per
    request (engine id) and group: block-steps, peak, token slots used and the actual mode
    exactly, the amortized mode within rounding (a holder's share of one interval is floored or
    ceiled), block-ns on the steps' own clock (StepBatch start, RequestFinished time). Returns
    the mismatches and the totals (``physical`` block-steps of the pool, both modes folded)."""
    from fractions import Fraction

    from sparseety import events as ev

    starts: dict[int, int] = {}
    finished: dict[str, int] = {}
    for e in events:
        kind = ev.payload_type(e)
        if kind == ev.STEP_BATCH:
            body = ev.payload(e)
            starts[body["step"]] = e["ts_ns"] - body["duration_ns"]
        elif kind == ev.REQUEST_FINISHED:
            body = ev.payload(e)
            freed = body.get("kv_freed_ts_ns", 0)
            finished[body["request_id"]] = min(e["ts_ns"], freed) if freed > 0 else e["ts_ns"]
    clock = 0
    for step in sorted(starts):  # the fold's KV clock: the running maximum of step starts
        clock = starts[step] = max(clock, starts[step])
    out: list[str] = []
    totals = {"physical": 0, "amortized": 0, "actual": 0, "shared": 0, "requests": 0}
    for rid, truth in truths.items():
        acc = accounts.get(rid)
        if acc is None:
            out.append(f"{rid}: no accounting")
            continue
        groups = acc["kv_groups"]
        if len(groups) != len(truth):
            out.append(f"{rid}: {len(groups)} kv groups != {len(truth)}")
            continue
        totals["requests"] += 1
        for gi, (g, t) in enumerate(zip(groups, truth, strict=True)):
            for k in ("block_steps", "peak_blocks", "block_steps_actual", "slot_steps_used"):
                if k in checks and g[k] != t[k]:
                    out.append(f"{rid} group {gi} {k}: fold {g[k]} != engine {t[k]}")
            amortized = Fraction(*t["block_steps_amortized"])
            if "amortized" in checks and abs(g["block_steps_amortized"] - amortized) > max(
                1, g["peak_blocks"]
            ):
                out.append(f"{rid} group {gi} amortized: fold {g['block_steps_amortized']} != {amortized}")
            if g["slot_steps_allocated"] != g["block_steps"] * g["block_size"]:
                out.append(f"{rid} group {gi}: allocated slots != block-steps x block size")
            if g["slot_steps_used"] > g["slot_steps_allocated"]:
                out.append(f"{rid} group {gi}: more slots used than allocated")
            ns = 0
            for k, (held, _share, _actual) in t["steps"].items():
                step = int(k)
                end = min(starts.get(step + 1, finished[rid]), finished[rid])
                ns += held * max(0, end - starts[step])
            if "block_ns" in checks and g["block_ns"] != ns:
                out.append(f"{rid} group {gi} block_ns: fold {g['block_ns']} != engine {ns}")
            totals["physical"] += t["block_steps_actual"]
            totals["amortized"] += g["block_steps_amortized"]
            totals["actual"] += g["block_steps_actual"]
            totals["shared"] += g["block_steps"] - g["block_steps_actual"]
    return out, totals


#: RequestAccounting fields held against the truth of the same name.
CLASSES = (
    "cache_read_tokens",
    "uncached_computed_tokens",
    "recomputed_preemption_tokens",
    "recomputed_eviction_tokens",
    "evicted_blocks_recomputed",
    "draft_accepted_tokens",
    "draft_rejected_tokens",
    "draft_cut_tokens",
    "draft_unverified_tokens",
    "window_released_tokens",
    "scheduled_tokens",
    "preemptions",
)


def attach(llm: Any) -> EngineTruth:
    """Attach to the scheduler of ``vllm.LLM`` running its engine core in this process."""
    core = llm.llm_engine.engine_core
    engine_core = getattr(core, "engine_core", None)
    if engine_core is None:
        raise RuntimeError("ground truth needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process engine core)")
    return EngineTruth(engine_core.scheduler)


def prompt_tokens_by_source(llm: Any) -> dict[str, int]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counter per ``source`` label (local_compute,
    local_cache_hit, external_kv_transfer): first admissions only, re-prefill not included."""
    out: dict[str, int] = defaultdict(int)
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            out[m.labels["source"]] += int(m.value)
    return dict(out)


# --- driver: a workload on an in-process engine, with its truth written out ----------------------


def run_workload(llm: Any, truth: EngineTruth, phases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``phases`` (each a list of ``{"prompt": str | token ids, "tenant", **sampling}``, one
    ``generate`` call per phase) and return what vLLM returned plus the recorded truth."""
    from vllm import SamplingParams

    requests = []
    for phase in phases:
        prompts: list[Any] = []
        params = []
        for item in phase:
            item = dict(item)
            prompt = item.pop("prompt")
            tenant = item.pop("tenant", "")
            prompts.append({"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt)
            params.append(SamplingParams(extra_args={"tenant": tenant} if tenant else None, **item))
        for o, sp in zip(llm.generate(prompts, params, use_tqdm=False), params, strict=True):
            requests.append(
                {
                    "request_id": o.request_id,
                    "tenant": (sp.extra_args or {}).get("tenant", ""),
                    "prompt_token_ids": list(o.prompt_token_ids),
                    "output_token_ids": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens or 0,
                    "finish_reason": o.outputs[0].finish_reason,
                }
            )
    by_external: dict[str, str] = {}
    for rid in truth.requests:
        by_external.setdefault(rid.rsplit("-", 1)[0], rid)
    for r in requests:
        rid = by_external.get(r["request_id"], r["request_id"])
        rt = truth.requests[rid]
        r["engine_request_id"] = rid
        r["truth"] = {
            **truth.summary(rid),
            "admission_hit": rt.admission_hit,
            "drafts_scheduled": rt.drafts_scheduled,
            "drafts_accepted_vllm": rt.drafts_accepted_vllm,
            "drafts_unverified": rt.drafts_unverified,
            "released_blocks": rt.released_blocks,
            "resumes": rt.resumes,
            "output_tokens": rt.output_tokens,
            "kv_end": rt.high,
            "sources": rt.sources,
            "layer_pairs": rt.layer_pairs,
            "full_pairs": rt.full_pairs,
            "kv": truth.kv_summary(rid),
        }
    metrics: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            labels = {k: v for k, v in m.labels.items() if k not in ("engine", "model_name")}
            key = m.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            metrics[key] = m.value
    return {
        "requests": requests,
        "metrics": metrics,
        "prompt_tokens_by_source": prompt_tokens_by_source(llm),
        "kv_cache_groups": truth.groups,
        "block_size": truth.block_size,
        "async_scheduling": truth.async_scheduling,
        "evicted_hashes": sum(len(v) for v in truth.evicted.values()),
        "kv_ref_mismatches": truth.ref_mismatches,
    }


def main(argv: list[str] | None = None) -> None:
    """``SPEC.json OUT.json``: SPEC holds ``model``, ``engine`` (LLM arguments) and ``phases``."""
    import json
    import sys
    from pathlib import Path

    spec_path, out_path = (argv or sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    kv = {"enable_kv_cache_events": True, "publisher": "null"}  # the plugin tees them
    llm = LLM(model=spec["model"], seed=0, disable_log_stats=False, kv_events_config=kv, **spec["engine"])
    truth = attach(llm)
    result = run_workload(llm, truth, spec["phases"])
    Path(out_path).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()  # the plugin sends EngineStopped and flushes


if __name__ == "__main__":  # vLLM may spawn processes: the guard is required
    main()
