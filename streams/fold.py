"""The position fold: admissions, steps and routing, folded into each request's state.

Per position, two independent axes (docs/streams.md has the table and the identity): how it was
obtained (``status``) and what became of its KV (``kv_fate``). Prompt positions come from the
admission plan (cached with their source, computed, or recomputed_after_eviction when the block
had a cache lifetime on this engine that ended before admission); output positions are appended
as tokens arrive (draft-accepted ones flagged); re-prefill after a preemption overwrites with
recomputed_after_preemption, while hit positions a request's first step computes (the engine gave
them back: the last token of a prompt a KV connector loaded whole) become computed. Fates and the
not_computed tail are settled when the request closes (:mod:`streams.accounting`).

Each ``on_*`` method is a step ``(state, event) -> state``: it reads and writes the request (and
prefix-index block) states in the store and emits nothing; outputs come only from closing a
request (:class:`streams.assembler.Assembler`). A request absorbs an event once: it keeps the
last core seq (and worker seq) it absorbed, so a replayed event changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sparseety import billing

from . import admission, kv_memory, multimodal
from . import segments as sg
from .caveats import is_warmup_step
from .columnar import SteadyColumns, fast_kv, steady
from .flops import ModelShape
from .outputs import Stats
from .served import base_model
from .state import (
    EpochState,
    RequestState,
    StateStore,
    request_key,
    request_prefix,
)

#: Fewest rows of a step folded in columns: a columnar step costs a fixed ~0.1 ms of numpy calls
#: plus well under a microsecond a row, the general path ~2.5 us a row (docs/benchmarks.md), so
#: smaller steps take the general path (and their requests leave their slots).
COLUMNAR_MIN_ROWS = 32
#: No request preempted in a step (most steps): no set built.
_NONE: frozenset[str] = frozenset()


class PositionFold:
    """Request state in the store, and the steps that fold engine events into it.

    Args:
        store: Where state lives (a dict in tests and replay, a Faust table in the worker).
        stats: Counters to update (late events, reopened requests).
        max_blocks: Bound of one epoch's prefix index (``prefix_index_max_blocks``).
        columnar: Fold steady decode rows in columns (:mod:`streams.columnar`) where the store
            supports leases; False folds every row on the general path (the reference the
            columnar path is tested against).
    """

    def __init__(self, store: StateStore, stats: Stats, max_blocks: int, *, columnar: bool = True) -> None:
        self.store = store
        self.stats = stats
        self.max_blocks = max_blocks
        # Request states by key, the same objects the store holds: the per-step loop reads them
        # with a plain dict lookup instead of a store call (dropped with them in ``drop``).
        self._requests: dict[str, RequestState] = {}
        #: KV-cache shapes per engine epoch (KV memory-time; dropped when an epoch restarts).
        self.kv_shapes: dict[str, kv_memory.KvShape] = {}
        #: Steady decode rows in columns, per engine epoch (streams/columnar.py).
        self.columnar = columnar and hasattr(store, "lease")
        self.columns: dict[str, SteadyColumns] = {}

    # --- request state ---------------------------------------------------------------------

    def request(self, epoch: EpochState, rid: str, *, create: bool = True) -> RequestState | None:
        """The request's state; created (and opened on the epoch) when missing and ``create``."""
        key = request_key(epoch.engine_id, rid)
        r = self.store.get(key)
        if r is None and create:
            r = RequestState(engine_name=epoch.engine_name, engine_id=epoch.engine_id, request_id=rid)
            self.store.put(key, r)
            epoch.open_requests.append(rid)
        return r  # type: ignore[no-any-return]

    def forget_columns(self, engine_id: str) -> None:
        """Release and drop the epoch's steady columns (its configuration, hence its shapes,
        changed; or it ended)."""
        cols = self.columns.pop(engine_id, None)
        if cols is not None:
            cols.release_all()
            self.store.drop_lessee(cols)

    def _steady_columns(
        self, epoch: EpochState, kv_shape: kv_memory.KvShape, shape: ModelShape, step: int, n_rows: int
    ) -> SteadyColumns | None:
        """The epoch's steady columns, when this step (of ``n_rows`` rows) may fold rows in them."""
        if not self.columnar:
            return None
        cols = self.columns.get(epoch.engine_id)
        if cols is not None and cols.kv_shape is not kv_shape:
            self.forget_columns(epoch.engine_id)
            cols = None
        if n_rows < COLUMNAR_MIN_ROWS or shape.limited or not fast_kv(kv_shape) or is_warmup_step(step):
            if cols is not None:
                cols.release_all()
            return None
        if cols is None:
            cols = self.columns[epoch.engine_id] = SteadyColumns(
                self.store, request_prefix(epoch.engine_id), kv_shape
            )
        return cols

    def put(self, r: RequestState) -> None:
        self.store.put(request_key(r.engine_id, r.request_id), r)

    def drop(self, engine_id: str, rid: str) -> None:
        """Forget a request's state."""
        key = request_key(engine_id, rid)
        self._requests.pop(key, None)
        self.store.delete(key)  # also ends the key's lease, if the columns held it

    def reopen(self, epoch: EpochState, req: RequestState) -> bool:
        """A closed request got an event: reopen it when the close was an idle timeout (its record
        is superseded by a new version when it closes again), else count a late event."""
        acc = req.output
        if acc is None or acc.get("incomplete_reason") != "idle_timeout":
            self.stats.late_events += 1
            return False
        req.reopened = req.reopened or acc
        req.output = None
        req.closed = False
        if req.request_id not in epoch.open_requests:
            epoch.open_requests.append(req.request_id)
        epoch.retiring = [x for x in epoch.retiring if x[0] != req.request_id]
        self.stats.reopened += 1
        return True

    # --- admission -------------------------------------------------------------------------

    def on_started(self, epoch: EpochState, seq: int, ts: int, body: dict[str, Any]) -> None:
        r = self.request(epoch, body["request_id"])
        assert r is not None
        if r.seq >= seq or r.closed:
            return
        r.seq = seq
        r.started = True
        r.admission_seq = seq
        r.tenant = body["tenant"]
        r.session_id = body.get("session_id", "")
        r.external_request_id = body.get("external_request_id", "")
        r.parent_request_id = body.get("parent_request_id", "")
        r.choice_index = body.get("choice_index", 0)
        r.priority = body.get("priority", 0)
        r.service_tier = body.get("service_tier", "")
        r.cache_ttl = body.get("cache_ttl", "")
        r.pd_join_id = body.get("pd_join_id", "")
        r.pd_role = body.get("pd_role", "none")
        r.model = base_model(body, epoch.config)
        r.lora_name = body["lora_name"]
        if epoch.config is None:
            # The epoch's EngineStarted never reached this fold (a fresh worker met the engine
            # mid-stream, or the broker lost it): what needs the engine's configuration (windows,
            # KV bytes, FLOPs) is unknown for this request, so it says so. The producer announces
            # the configuration again (periodically, and after Kafka recovers); requests admitted
            # after that are whole again.
            r.seq_gap = True
        r.arrival_ts = body["arrival_ts_ns"]
        r.last_ts = ts
        prompt = r.prompt_len = body["prompt_len"]
        # Token records: kept as the engine's privacy mode sent them (ids, hashes or neither).
        r.prompt_ids = list(body.get("prompt_token_ids") or ())
        r.prompt_hashes = list(body.get("prompt_token_hashes") or ())
        cached = r.cached_at_admission = body["num_cached_tokens"]
        # A KV connector's tokens (P/D decode side) follow the local hit: loaded, not read from
        # this engine's prefix cache, not computed here.
        external = min(cached, max(0, body.get("num_external_cached_tokens", 0)))
        # Issue 36: which cache tier served each part of the hit, as the engine split it (the
        # device hit first); without a split, the local hit is tier gpu and the rest external.
        runs = billing.split_cached(
            (epoch.config or {}).get("engine_kind", "vllm"),
            body.get("cached_tokens_by_source") or {},
            cached,
            external,
        )
        if runs is None:
            runs = [(billing.GPU, cached - external), (billing.EXTERNAL, external)]
        local = runs[0][1] if runs and runs[0][0] == billing.GPU else 0
        by_tier = {tier: 0 for tier in billing.CACHE_TIERS}
        for tier, n in runs:
            by_tier[tier] += n
        r.external_kv = by_tier[billing.EXTERNAL]
        r.cpu_offload_read = by_tier[billing.CPU_OFFLOAD]
        r.host_read = by_tier[billing.HOST]
        r.storage_read = by_tier[billing.STORAGE]
        r.cache_read += local
        items = body.get("mm_inputs")
        if items:
            r.mm = multimodal.admitted(items, cached)
        r.kv_end = max(r.kv_end, cached)
        admission.plan_prompt(
            self.store, epoch, r, seq, body["block_hashes"], prompt, local, cached, max_blocks=self.max_blocks
        )
        # the positions after the device hit: each tier's status, in the engine's order
        pos = local
        for tier, n in runs[1 if local else 0 :]:
            if tier != billing.EXTERNAL:  # external_kv is what the plan laid out already
                sg.assign(r.segments, pos, pos + n, billing.TIER_STATUS[tier])
            pos += n
        self.put(r)

    # --- steps -----------------------------------------------------------------------------

    def on_step(self, epoch: EpochState, seq: int, ts: int, body: dict[str, Any], shape: ModelShape) -> None:
        # The hottest code of the worker (once per request per engine step): locals and inlined
        # arithmetic on purpose; the rare paths (recompute, drafts, reopening) call out.
        rids = body["req_ids"]
        n_sched = body["num_scheduled_tokens"]
        before = body["num_computed_before"]
        n_new = body["num_new_tokens"]
        # Output ids are kept only when the engine's privacy mode is raw (StepBatch carries them in
        # every mode: the fold is where hashed and none drop them).
        new_ids = body["new_token_ids"] if (epoch.config or {}).get("privacy_mode") == "raw" else None
        ids_at = 0
        proposed = body["spec_proposed"]
        accepted = body["spec_accepted"]
        step = body["step"]
        # Async scheduling: steps from updates_before up to this one were in flight when it was
        # scheduled (-1 from producers that do not say).
        in_flight_from = body.get("updates_before", -1)
        listed = body["preempted_req_ids"]
        preempted: set[str] | frozenset[str] = set(listed) if listed else _NONE
        if preempted:
            for rid in preempted.difference(rids):
                req = self.request(epoch, rid, create=False)
                if req is None:
                    epoch.unknown_requests += 1
                elif req.seq < seq and not req.closed:
                    req.seq = seq
                    req.preemptions += 1
                    req.preempted = True
                    self.kv_drop(epoch, req, step, max(epoch.kv_clock, ts - body["duration_ns"]))
                    self.put(req)
        step_ns = body["duration_ns"]
        start_ts = ts - step_ns
        limited = bool(shape.limited)
        per_token = shape.linear_flops_per_token
        per_pair = shape.flops_per_pair
        known = self._requests
        touched: list[str] = []
        prefix = request_prefix(epoch.engine_id)
        shares: list[tuple[RequestState, float]] = []
        kv_shape = self.kv_shapes.get(epoch.engine_id) or self.kv_shape(epoch)
        kv_on = kv_shape.observed
        epoch.kv_last_step = step
        kv_ts = epoch.kv_clock = max(epoch.kv_clock, start_ts)
        hits: list[tuple[RequestState, int, bool]] = []
        held: list[tuple[RequestState, int, int, int]] = []  # KV holdings, folded after the loop
        total = 0.0
        # Steady rows (one token, nothing else happening) fold in the epoch's columns; the rest
        # take the loop below (streams/columnar.py). A small step of an epoch without columns
        # would get none: not asked.
        if len(rids) < COLUMNAR_MIN_ROWS and epoch.engine_id not in self.columns:
            cols = None
        else:
            cols = self._steady_columns(epoch, kv_shape, shape, step, len(rids))
        # the segment fields the common decode row compares, as locals
        KIND, STATUS, DRAFT, FATE, END = sg.KIND, sg.STATUS, sg.DRAFT, sg.FATE, sg.END
        OUTPUT, COMPUTED, KEPT = sg.OUTPUT, sg.COMPUTED, sg.KEPT
        plan = None
        if cols is not None and cols.slot_of:
            general_mask = None
            if preempted or any(proposed) or any(accepted):
                general_mask = np.fromiter((rid in preempted for rid in rids), dtype=bool, count=len(rids))
                if proposed:
                    general_mask |= np.asarray(proposed) != 0
                if accepted:
                    general_mask |= np.asarray(accepted) != 0
            plan = cols.plan(rids, n_sched, n_new, before, seq, general_mask)
        rows: Any = range(len(rids))
        ends: Any = None  # with a plan in raw mode: where each row's new token ids end
        row_f: list[int] = []  # with a plan: the general rows with a share, in order
        if plan is not None:
            rows = plan.general
            if new_ids is not None:
                ends = np.cumsum(plan.new, dtype=np.int64)
        for i in rows:
            rid = rids[i]
            if ends is None:
                ids_from = ids_at
                ids_at += n_new[i]
            else:
                ids_at = int(ends[i])
                ids_from = ids_at - n_new[i]
            key = prefix + rid
            req = known.get(key)
            if req is None:
                req = self.request(epoch, rid, create=False)
                if req is None:
                    # Never started here (its RequestStarted was lost, or it was forgotten after
                    # closing): counted, no state invented for it.
                    epoch.unknown_requests += 1
                    continue
                known[key] = req
            if req.seq >= seq:
                continue
            if req.closed and not self.reopen(epoch, req):
                continue
            computed_before = before[i]
            n = n_sched[i]
            causal = n * computed_before + n * (n + 1) // 2
            attended: float = causal  # limits (windows, chunks) are rare
            if limited:
                req.pairs_full += causal
                attended = shape.pairs(computed_before, n)[0]
            req.pairs += attended
            f = n * per_token + attended * per_pair
            req.flops += f
            total += f
            shares.append((req, f))
            if plan is not None:
                row_f.append(i)
            req.seq = seq
            # vLLM frees sliding-window blocks on the tokens processed at schedule time: with
            # the request's previous step still in flight, that is where the previous step began.
            # Under async scheduling vLLM allocated this step on num_computed_tokens that counted
            # the in-flight step's drafts as accepted (the producer's num_computed_before does not).
            if 0 <= in_flight_from <= req.last_step and req.steps:
                req.release_basis = req.last_computed_before
                optimistic = computed_before + req.kv_last_dropped
            else:
                req.release_basis = -1
                optimistic = computed_before
            first_step = not req.steps
            if kv_on and (first_step or req.preempted):
                hits.append((req, computed_before, first_step))
            req.steps += 1
            req.last_step = step
            req.last_ts = ts
            if not req.first_sched_ts:
                req.first_sched_ts = start_ts
            req.last_computed_before = computed_before
            req.scheduled += n
            if preempted and rid in preempted:
                req.preemptions += 1
                req.preempted = True
                if kv_on:
                    self.kv_drop(epoch, req, step, kv_ts)
                    hits.append((req, computed_before, False))
            if kv_on:
                basis = req.release_basis if req.release_basis >= 0 else computed_before
                held.append((req, optimistic, n, basis))
            if req.preempted:
                # Resumed: what it finds in the prefix cache again is read, not computed.
                req.preempted = False
                req.cache_read += computed_before
                if computed_before > req.kv_end:
                    # Read beyond what it had obtained (another request computed it meanwhile).
                    sg.assign(req.segments, req.kv_end, computed_before, sg.CACHED)
                    req.kv_end = computed_before
            new = n_new[i]
            n_accepted = accepted[i] if accepted else 0
            if proposed and proposed[i]:
                n_proposed = proposed[i]
                n_accepted, n_cut, n_unverified = split_drafts(n_proposed, n_accepted, new)
                rejected = n_proposed - n_accepted - n_cut - n_unverified
                req.kv_last_dropped = rejected + n_cut + n_unverified
                req.draft_accepted += n_accepted
                req.draft_rejected += rejected
                req.draft_cut += n_cut + n_unverified
                req.draft_unverified += n_unverified
            else:  # no drafts (the common row): nothing rejected, cut or unverified
                req.kv_last_dropped = -n_accepted
            valid_end = computed_before + n - req.kv_last_dropped
            kv_end = req.kv_end
            if computed_before < kv_end:
                if first_step and not req.preemptions:
                    # Never preempted: the engine computes part of the hit it reported at
                    # admission (a whole prompt a KV connector loaded: vLLM computes its last
                    # token again to sample the next one).
                    _hit_given_back(req, computed_before, kv_end)
                else:
                    _recompute_after_preemption(req, computed_before, min(valid_end, kv_end))
                    computed_before = kv_end
            if valid_end > computed_before:
                # First computation of [computed_before, valid_end) for this request: accepted
                # drafts are their own class; blocks the engine had evicted are recomputes.
                first_end = valid_end - n_accepted
                if req.eviction_spans and first_end > computed_before:
                    again = _overlap(req.eviction_spans, computed_before, first_end)
                    req.recomputed_eviction += again
                    req.uncached += first_end - computed_before - again
                else:
                    req.uncached += max(0, first_end - computed_before)
                req.kv_end = valid_end
            if new:
                if not req.first_token_ts:
                    req.first_token_ts = ts
                req.out += new
                if new_ids is not None:
                    req.output_ids.extend(new_ids[ids_from:ids_at])
                segs = req.segments
                last = segs[-1] if segs else None
                if (
                    not n_accepted
                    and last is not None
                    and last[KIND] == OUTPUT
                    and last[STATUS] == COMPUTED
                    and not last[DRAFT]
                    and last[FATE] == KEPT
                ):
                    last[END] += new  # the common decode step: extend the output run
                else:
                    drafts = min(n_accepted, new)
                    sg.append(segs, drafts, sg.OUTPUT, sg.COMPUTED, draft=True)
                    sg.append(segs, new - drafts, sg.OUTPUT, sg.COMPUTED)
            touched.append(key)
        self.store.touch_many(touched)
        if plan is not None:
            assert cols is not None
            steady_rows, slots, cb = plan.rows, plan.slots, plan.cb
            f_steady = cols.fold(
                slots,
                cb,
                seq,
                step,
                ts,
                start_ts,
                kv_ts,
                in_flight_from,
                shape.linear_flops_per_token,
                shape.flops_per_pair,
            )
            if new_ids is not None:
                cols.append_ids(slots, np.asarray(new_ids)[ends[steady_rows] - 1].tolist())
            # The step's total in row order, as the general loop sums it.
            by_row = np.zeros(len(rids))
            by_row[steady_rows] = f_steady
            if row_f:
                by_row[row_f] = [f for _, f in shares]
            total = float(np.add.accumulate(by_row)[-1])
            if total > 0:
                cols.add_time(slots, f_steady, step_ns / total)
        if held:
            kv_memory.on_steps(kv_shape, self.store, step, kv_ts, held)
        if hits:
            self.kv_join(epoch, kv_shape, seq, step, kv_ts, hits)
        if total > 0:
            scale = step_ns / total
            for req, f in shares:
                req.gpu_ns += f * scale
            if is_warmup_step(step):  # the cold start: flagged, its share reported apart
                for req, f in shares:
                    req.warmup_gpu_ns += f * scale
        if cols is not None:
            kv_on_cols = cols.kv_on
            for req, _ in shares:
                if steady(req, kv_on_cols):
                    cols.admit(req)

    # --- KV memory-time (streams/kv_memory.py) ----------------------------------------------

    def kv_shape(self, epoch: EpochState) -> kv_memory.KvShape:
        shape = self.kv_shapes.get(epoch.engine_id)
        if shape is None:
            shape = self.kv_shapes[epoch.engine_id] = kv_memory.KvShape(epoch.config)
        return shape

    def kv_holder(self, epoch: EpochState) -> Callable[[str], RequestState | None]:
        """Look-up of a holder's state for a shared-block entry (marked written)."""

        def holder(rid: str) -> RequestState | None:
            r = self.request(epoch, rid, create=False)
            if r is not None:
                self.put(r)
            return r

        return holder

    def kv_drop(self, epoch: EpochState, req: RequestState, step: int, ts: int) -> None:
        """The request's blocks are freed at (step, ts): it was preempted or it ended."""
        if not req.kv_since or req.kv_since[0] < 0:
            return
        if req.kv_shared:
            kv_memory.leave(req, self.store, step, ts)
        kv_memory.drop(req, step, ts)

    def kv_close(self, epoch: EpochState, r: RequestState, finish: dict[str, Any] | None, ts: int) -> None:
        """The request ended: its hold ends where the engine freed its blocks (RequestFinished
        says when; else after the last step seen, at the close time)."""
        fin = finish or {}
        freed = fin.get("kv_freed_before_step", -1)
        freed_ts = fin.get("kv_freed_ts_ns", 0)
        self.kv_drop(
            epoch,
            r,
            freed if freed > r.last_step else max(epoch.kv_last_step, r.last_step) + 1,
            min(ts, freed_ts) if freed_ts > 0 else ts,
        )

    def kv_join(
        self,
        epoch: EpochState,
        shape: kv_memory.KvShape,
        seq: int,
        step: int,
        ts: int,
        hits: list[tuple[RequestState, int, bool]],
    ) -> None:
        """Requests admitted or resumed in this step hold their prefix-cache hit's blocks, shared
        with whoever else holds them (after the step's loop: every holder's table is current)."""
        seen: set[str] = set()
        holder = self.kv_holder(epoch)
        for req, hit, first in hits:
            if req.request_id in seen or hit <= 0:
                continue
            seen.add(req.request_id)
            blocks = kv_memory.hit_blocks(
                req, shape, self.store, epoch.engine_id, seq, hit, first, epoch.cleared
            )
            if blocks:
                kv_memory.join(req, shape, self.store, epoch.engine_id, blocks, step, ts, holder)
                self.put(req)

    # --- MoE routing -----------------------------------------------------------------------

    def on_routing(self, epoch: EpochState, seq: int, body: dict[str, Any]) -> None:
        layers, experts = body["num_layers"], body["num_experts"]
        width = layers * experts
        counts = body["expert_counts"]
        for i, rid in enumerate(body["req_ids"]):
            # Routing comes on the worker stream, which is not ordered with the core stream: it
            # may precede the request's RequestStarted, so it may create the request's state.
            r = self.request(epoch, rid)
            if r is None or r.worker_seq >= seq:
                continue
            if r.closed:
                self.stats.late_events += 1
                continue
            r.worker_seq = seq
            row = counts[i * width : (i + 1) * width]
            if not r.experts:
                r.expert_layers, r.expert_experts = layers, experts
                r.experts = list(row)
            else:
                r.experts = [x + y for x, y in zip(r.experts, row, strict=False)]
            self.put(r)
        if body["step"] > epoch.worker_step:
            epoch.worker_step = body["step"]


#: The RequestState counter of each status an admission hit lays out (one per cache tier).
_HIT_COUNTER = {
    billing.TIER_STATUS[billing.GPU]: "cache_read",
    billing.TIER_STATUS[billing.CPU_OFFLOAD]: "cpu_offload_read",
    billing.TIER_STATUS[billing.EXTERNAL]: "external_kv",
    billing.TIER_STATUS[billing.HOST]: "host_read",
    billing.TIER_STATUS[billing.STORAGE]: "storage_read",
}


def _hit_given_back(req: RequestState, start: int, end: int) -> None:
    """The request's first step computes [start, end), positions the engine counted in its
    admission hit: it loaded or found them, then discarded them and computes them here, as it
    computes the last token of its own full prefix-cache hit (vLLM caps that hit at the prompt
    less one; after a KV connector loaded a whole prompt it sets num_computed_tokens back by one
    instead, ``Scheduler._update_waiting_for_remote_kv``). Not a recompute: nothing was
    preempted and the request had not obtained them. They become ``computed`` (counted by the
    step as uncached), each leaves the tier that counted it, and the request's KV ends at
    ``start`` (docs/streams.md, "Hits the engine gives back")."""
    for lo, hi, status in sg.assign(req.segments, start, end, sg.COMPUTED):
        counter = _HIT_COUNTER.get(status)
        if counter is not None:
            setattr(req, counter, getattr(req, counter) - (hi - lo))
    req.kv_end = start


def _recompute_after_preemption(req: RequestState, start: int, end: int) -> None:
    """Re-prefill of [start, end), positions this request had computed or read before."""
    if end <= start:
        return
    req.recomputed_preemption += end - start
    sg.assign(req.segments, start, end, sg.RECOMPUTED_PREEMPTION)


def split_drafts(proposed: int, accepted: int, new: int) -> tuple[int, int, int]:
    """``(accepted, cut by the stop, unverified)`` drafts of one step; the rest of ``proposed``
    were rejected (docs/streams.md, "Drafts").

    A verified step yields the accepted drafts plus one sampled token. Fewer new tokens mean the
    stop condition cut the tail: drafts past the stop were verified and accepted, then thrown
    away (cut; vLLM counts them as accepted). No new token and nothing accepted means the request
    ended between schedule and update (an abort during the step, or under async scheduling a
    finish in the step before): its drafts were never verified, and vLLM counts them nowhere.
    """
    if new == 0 and accepted == 0:
        return 0, 0, proposed
    cut = max(0, accepted - new)
    return accepted - cut, cut, 0


def _overlap(spans: list[list[int]], start: int, end: int) -> int:
    """Positions of [start, end) inside the spans."""
    total = 0
    for lo, hi in spans:
        if hi <= start:
            continue
        if lo >= end:
            break
        total += min(hi, end) - max(lo, start)
    return total
