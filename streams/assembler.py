"""The assembler: fold one engine's events into per-request token accounting.

``Assembler.apply(event)`` is the pure core of the stream processor: it reads and writes keyed
state through a :class:`~streams.state.StateStore` and returns the outputs the event caused
(RequestAccounting records for the timelines topic, UsageWindow records for the usage topic,
dead letters). The Faust agent is a thin shell around it; replay and benchmarks run it directly.

Ordering and idempotency: events carry a gap-free ``seq`` per (engine epoch, stream). Per stream
the epoch keeps the next expected seq: older events are duplicates and dropped, newer ones wait
in a reorder buffer until the gap fills or is declared lost (then affected requests are flagged
``seq_gap``). Effects on the epoch (windows, frontiers) happen once per seq; effects on a request
are guarded by the last seq that request absorbed. A state persisted only partly before a crash
therefore converges when the events are replayed.

Per position, two independent axes (docs/streams.md has the table and the identity):
how it was obtained (``status``) and what became of its KV (``kv_fate``). Prompt positions
come from the admission plan (cached with their source, computed, or recomputed_after_eviction
when the block had a cache lifetime on this engine that ended before admission); output
positions are appended as tokens arrive (draft-accepted ones flagged); re-prefill after a
preemption overwrites with recomputed_after_preemption; positions an aborted request never
computed become not_computed. At the end, positions the request's attention groups released
(sliding windows, chunks; weighted by layers) get kv_fate window_released, those still held but
never attended again skipped; the status is left as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.streams import attention, kv_memory, windows
from sparseety.streams import prefix_index as pidx
from sparseety.streams import segments as sg
from sparseety.streams.flops import ModelShape
from sparseety.streams.state import (
    EpochState,
    HeadState,
    RequestState,
    StateStore,
    block_key,
    epoch_key,
    head_key,
    request_key,
)

TIMELINES, USAGE, DLQ = "timelines", "usage", "dlq"


@dataclass(frozen=True, slots=True)
class Output:
    """Something to send: ``topic`` is a role (timelines, usage, dlq), mapped to a name by config."""

    topic: str
    key: str
    record_name: str
    record: dict[str, Any]


@dataclass(slots=True)
class Stats:
    """Counters the worker exports as metrics."""

    events: int = 0
    duplicates: int = 0
    reordered: int = 0
    gaps: int = 0
    late_events: int = 0
    requests_closed: int = 0
    incomplete: int = 0
    corrections: int = 0
    reopened: int = 0  # requests closed by the idle timeout that got events again


class Assembler:
    """Folds engine events into request accounting and usage windows (one per partition or process).

    Args:
        cfg: Worker settings (window, lateness, timeouts, bounds).
        store: Where state lives (a dict in tests and replay, a Faust table in the worker).
        clock: Wall clock for processing-time closing of engines that went silent.
    """

    def __init__(self, cfg: WorkerConfig, store: StateStore, clock: Callable[[], int] = time.time_ns) -> None:
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.stats = Stats()
        self.window_ns = int(cfg.window_s * 1e9)
        self.lateness_ns = int(cfg.allowed_lateness_s * 1e9)
        self.idle_ns = int(cfg.idle_timeout_s * 1e9)
        self.routing_wait_ns = int(cfg.routing_wait_s * 1e9)
        self.retention_ns = int(cfg.closed_retention_s * 1e9)
        self._shapes: dict[str, ModelShape] = {}
        self._kv_shapes: dict[str, kv_memory.KvShape] = {}
        self._last_seen: dict[str, int] = {}  # engine_id -> wall clock of its last event here
        # Request states by key, the same objects the store holds: the per-step loop reads them
        # with a plain dict lookup instead of a store call (dropped with them in _drop_request).
        self._requests: dict[str, RequestState] = {}

    # --- entry points ---------------------------------------------------------------------

    def apply(self, event: dict[str, Any]) -> list[Output]:
        """Fold one decoded EngineEvent; return the outputs it caused (possibly none)."""
        self.stats.events += 1
        out: list[Output] = []
        eid = event["engine_id"]
        self._last_seen[eid] = self.clock()
        epoch = self._epoch(eid, event["engine_name"])
        stream = event["stream"]
        seq = event["seq"]
        nxt = epoch.next_seq.setdefault(stream, 0)
        if seq < nxt:
            epoch.duplicates += 1
            self.stats.duplicates += 1
            return out
        if seq > nxt:
            pending = epoch.pending.setdefault(stream, {})
            if str(seq) in pending:
                epoch.duplicates += 1
                self.stats.duplicates += 1
                return out
            self.stats.reordered += 1
            pending[str(seq)] = event
            self._maybe_declare_gap(epoch, stream, out)
            self._put_epoch(epoch)
            return out
        self._process(epoch, event, out)
        epoch.next_seq[stream] = seq + 1
        self._drain(epoch, stream, out)
        self._after_event(epoch, out)
        self._put_epoch(epoch)
        return out

    def tick(self) -> list[Output]:
        """Processing-time housekeeping: close engines that went silent past the idle timeout.

        Event time cannot advance for an engine that crashed, so its open requests and windows
        are closed when no event of it arrived here for ``idle_timeout_s`` of wall time (counted
        from this process's start for engines it has not heard from yet).
        """
        out: list[Output] = []
        now = self.clock()
        for key in list(self.store.keys("e|")):
            epoch = self.store.get(key)
            if epoch is None or epoch.stopped or epoch.superseded:
                continue
            seen = self._last_seen.setdefault(epoch.engine_id, now)
            if now - seen > self.idle_ns:
                self._close_epoch(epoch, "idle_timeout", out)
                self._put_epoch(epoch)
        return out

    # --- ordering ------------------------------------------------------------------------

    def _epoch(self, eid: str, name: str) -> EpochState:
        epoch = self.store.get(epoch_key(eid))
        if epoch is None:
            epoch = EpochState(engine_name=name, engine_id=eid)
            self.store.put(epoch_key(eid), epoch)
        return epoch  # type: ignore[no-any-return]

    def _put_epoch(self, epoch: EpochState) -> None:
        self.store.put(epoch_key(epoch.engine_id), epoch)

    def _drain(self, epoch: EpochState, stream: str, out: list[Output]) -> None:
        pending = epoch.pending.get(stream)
        while pending:
            nxt = epoch.next_seq[stream]
            event = pending.pop(str(nxt), None)
            if event is None:
                break
            self._process(epoch, event, out)
            epoch.next_seq[stream] = nxt + 1
        if pending is not None and not pending:
            del epoch.pending[stream]

    def _maybe_declare_gap(self, epoch: EpochState, stream: str, out: list[Output]) -> None:
        """Give up on missing seqs once the buffer is full or far ahead in event time."""
        pending = epoch.pending[stream]
        seqs = sorted(int(s) for s in pending)
        newest = max(pending[str(s)]["ts_ns"] for s in seqs[-8:])
        oldest = pending[str(seqs[0])]["ts_ns"]
        if len(pending) < self.cfg.reorder_max_events and newest - oldest < self.lateness_ns:
            return
        missing = seqs[0] - epoch.next_seq[stream]
        epoch.gaps += missing
        self.stats.gaps += missing
        for rid in epoch.open_requests:
            r = self._request(epoch, rid, create=False)
            if r is not None and not r.seq_gap:
                r.seq_gap = True
                self._put_request(r)
        epoch.next_seq[stream] = seqs[0]
        self._drain(epoch, stream, out)
        self._after_event(epoch, out)

    # --- dispatch ------------------------------------------------------------------------

    def _process(self, epoch: EpochState, event: dict[str, Any], out: list[Output]) -> None:
        kind, body = event["payload"]
        ts = event["ts_ns"]
        if ts > epoch.watermark:
            epoch.watermark = ts
        seq = event["seq"]
        if kind == ev.STEP_BATCH:
            self._on_step(epoch, seq, ts, body)
            epoch.step_seq = seq
        elif kind == ev.KV_STORED:
            self._on_kv(epoch, seq, body, stored=True)
        elif kind == ev.KV_REMOVED:
            self._on_kv(epoch, seq, body, stored=False)
        elif kind == ev.REQUEST_STARTED:
            self._on_started(epoch, seq, ts, body)
        elif kind == ev.REQUEST_FINISHED:
            self._on_finished(epoch, event["stream"], seq, ts, body, out)
        elif kind == ev.MOE_ROUTING:
            self._on_routing(epoch, seq, body, out)
        elif kind == ev.KV_CLEARED:
            if not epoch.cleared or epoch.cleared[-1] < seq:
                epoch.cleared.append(seq)
        elif kind == ev.HEARTBEAT:
            epoch.producer_stats = {k: int(v) for k, v in body.items()}
            self._sweep(epoch, out)
        elif kind == ev.ENGINE_STARTED:
            self._on_engine_started(epoch, body, out)
        elif kind == ev.ENGINE_STOPPED:
            self._close_epoch(epoch, "engine_stopped", out)

    def _after_event(self, epoch: EpochState, out: list[Output]) -> None:
        if epoch.pending_close:
            self._close_waiting(epoch, out)
        if epoch.windows and not epoch.stopped:
            for rec in windows.close_due(epoch, self.window_ns, self.lateness_ns):
                out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))

    # --- engine lifecycle ------------------------------------------------------------------

    def _on_engine_started(self, epoch: EpochState, body: dict[str, Any], out: list[Output]) -> None:
        epoch.config = body
        self._shapes.pop(epoch.engine_id, None)
        self._kv_shapes.pop(epoch.engine_id, None)
        head = self.store.get(head_key(epoch.engine_name)) or HeadState(epoch.engine_name)
        if head.current and head.current != epoch.engine_id:
            previous = self.store.get(epoch_key(head.current))
            if previous is not None and not previous.superseded:
                self._close_epoch(previous, "new_epoch", out)
                previous.superseded = True
                self._put_epoch(previous)
        head.current = epoch.engine_id
        self.store.put(head_key(epoch.engine_name), head)

    def _close_epoch(self, epoch: EpochState, reason: str, out: list[Output]) -> None:
        """Close every open request as incomplete and flush every window."""
        for rid in list(epoch.open_requests):
            r = self._request(epoch, rid, create=False)
            if r is not None:
                self._close(epoch, r, None, r.last_ts or epoch.watermark, reason, out)
        epoch.pending_close.clear()
        for rec in windows.close_due(epoch, self.window_ns, self.lateness_ns, flush=True):
            out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))
        epoch.stopped = True

    def _shape(self, epoch: EpochState) -> ModelShape:
        shape = self._shapes.get(epoch.engine_id)
        if shape is None:
            shape = ModelShape.from_engine_started(epoch.config or {})
            self._shapes[epoch.engine_id] = shape
        return shape

    # --- requests --------------------------------------------------------------------------

    def _request(self, epoch: EpochState, rid: str, *, create: bool = True) -> RequestState | None:
        key = request_key(epoch.engine_id, rid)
        r = self.store.get(key)
        if r is None and create:
            r = RequestState(engine_name=epoch.engine_name, engine_id=epoch.engine_id, request_id=rid)
            self.store.put(key, r)
            epoch.open_requests.append(rid)
        return r  # type: ignore[no-any-return]

    def _put_request(self, r: RequestState) -> None:
        self.store.put(request_key(r.engine_id, r.request_id), r)

    def _on_started(self, epoch: EpochState, seq: int, ts: int, body: dict[str, Any]) -> None:
        r = self._request(epoch, body["request_id"])
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
        r.model = body["model"] or (epoch.config or {}).get("served_model_name", "")
        r.lora_name = body["lora_name"]
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
        local = cached - external
        r.external_kv = external
        r.cache_read += local
        r.kv_end = max(r.kv_end, cached)
        self._plan_prompt(epoch, r, seq, body["block_hashes"], prompt, local, cached)
        self._put_request(r)

    def _plan_prompt(
        self,
        epoch: EpochState,
        r: RequestState,
        seq: int,
        hashes: list[bytes],
        prompt: int,
        cached: int,
        loaded: int | None = None,
    ) -> None:
        """Lay out the prompt's statuses at admission: cached blocks with their source, positions
        a KV connector loaded (``[cached, loaded)``), computed blocks (recomputed when the engine
        had cached and evicted them before), and claims."""
        bs = (epoch.config or {}).get("block_size") or 0
        segs = r.segments
        loaded = cached if loaded is None else max(cached, loaded)
        if not bs or not hashes:
            sg.append(segs, cached, sg.PROMPT, sg.CACHED)
            sg.append(segs, loaded - cached, sg.PROMPT, sg.EXTERNAL_KV)
            sg.append(segs, prompt - loaded, sg.PROMPT, sg.COMPUTED)
            return
        cleared = epoch.cleared
        pos = 0
        for i, h in enumerate(hashes):
            hexh = h.hex()
            key = block_key(epoch.engine_id, hexh)
            block = self.store.get(key)
            start, end = i * bs, (i + 1) * bs
            if start < cached:
                # Served from the prefix cache (a fully cached prompt still recomputes its last
                # token, so the last block may be cached only in part).
                live = pidx.live_as_of(block, seq, cleared) if block is not None else None
                owner = live[pidx.COMPUTED_BY] if live else None
                source = f"{epoch.engine_id}/{owner}" if owner else None
                head = min(bs, cached - start)
                sg.append(segs, head, sg.PROMPT, sg.CACHED, source=source)
                sg.append(segs, bs - head, sg.PROMPT, sg.COMPUTED)
                r.blocks.append([hexh, "cached", int(live[pidx.STORED]) if live else -1])
            elif start < loaded:
                # Loaded by a KV connector: no BlockUse (not computed or read here); a block it
                # fills only in part is finished here, so this request begins its lifetime.
                head = min(bs, loaded - start)
                sg.append(segs, head, sg.PROMPT, sg.EXTERNAL_KV)
                sg.append(segs, bs - head, sg.PROMPT, sg.COMPUTED)
                if block is None:
                    block = pidx.new_block()
                    epoch.block_count += 1
                pidx.claim(block, r.request_id, seq, cleared)
                self.store.put(key, block)
            else:
                if block is None:
                    block = pidx.new_block()
                    epoch.block_count += 1
                # Recomputed after eviction: a lifetime of the hash ended before admission and no
                # copy was live when vLLM looked the request up. Copies stored in this step (after
                # the previous StepBatch) by an earlier admission of the step were live then: a
                # hybrid model's request misses them when its sliding-window groups lack them.
                recompute = pidx.evicted_before(block, seq, cleared) and not pidx.live_at_lookup(
                    block, r.request_id, seq, epoch.step_seq, cleared
                )
                sg.append(segs, bs, sg.PROMPT, sg.RECOMPUTED_EVICTION if recompute else sg.COMPUTED)
                if recompute:
                    _add_span(r.eviction_spans, start, end)
                    r.evicted_blocks_recomputed += 1
                r.blocks.append([hexh, "recomputed" if recompute else "computed", -1])
                pidx.claim(block, r.request_id, seq, cleared)
                self.store.put(key, block)
            pos = end
        tail = prompt - pos
        head = max(0, min(cached - pos, tail))
        sg.append(segs, head, sg.PROMPT, sg.CACHED)
        ext = max(0, min(loaded - pos - head, tail - head))
        sg.append(segs, ext, sg.PROMPT, sg.EXTERNAL_KV)
        sg.append(segs, tail - head - ext, sg.PROMPT, sg.COMPUTED)
        self._bound_index(epoch)

    def _on_step(self, epoch: EpochState, seq: int, ts: int, body: dict[str, Any]) -> None:
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
        shape = self._shape(epoch)
        step = body["step"]
        # Async scheduling: steps from updates_before up to this one were in flight when it was
        # scheduled (-1 from producers that do not say).
        in_flight_from = body.get("updates_before", -1)
        preempted = set(body["preempted_req_ids"])
        if preempted:
            for rid in preempted.difference(rids):
                req = self._request(epoch, rid, create=False)
                if req is None:
                    epoch.unknown_requests += 1
                elif req.seq < seq and not req.closed:
                    req.seq = seq
                    req.preemptions += 1
                    req.preempted = True
                    self._kv_drop(epoch, req, body["step"], max(epoch.kv_clock, ts - body["duration_ns"]))
                    self._put_request(req)
        step_ns = body["duration_ns"]
        start_ts = ts - step_ns
        limited = bool(shape.limited)
        per_token = shape.linear_flops_per_token
        per_pair = shape.flops_per_pair
        store = self.store
        known = self._requests
        touched: list[str] = []
        prefix = f"r|{epoch.engine_id}|"
        shares: list[tuple[RequestState, float]] = []
        kv_shape = self._kv_shape(epoch)
        kv_on = kv_shape.observed
        epoch.kv_last_step = step
        kv_ts = epoch.kv_clock = max(epoch.kv_clock, start_ts)
        hits: list[tuple[RequestState, int, bool]] = []
        total = 0.0
        for i, rid in enumerate(rids):
            ids_from = ids_at
            ids_at += n_new[i]
            key = prefix + rid
            req = known.get(key)
            if req is None:
                req = self._request(epoch, rid, create=False)
                if req is None:
                    # Never started here (its RequestStarted was lost, or it was forgotten after
                    # closing): counted, no state invented for it.
                    epoch.unknown_requests += 1
                    continue
                known[key] = req
            if req.seq >= seq:
                continue
            if req.closed and not self._reopen(epoch, req):
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
            req.seq = seq
            # vLLM frees sliding-window blocks on the tokens processed at schedule time: with
            # the request's previous step still in flight, that is where the previous step began.
            if 0 <= in_flight_from <= req.last_step and req.steps:
                req.release_basis = req.last_computed_before
            else:
                req.release_basis = -1
            # Under async scheduling vLLM allocated this step on num_computed_tokens that counted
            # the in-flight step's drafts as accepted (the producer's num_computed_before does not).
            optimistic = (
                computed_before + req.kv_last_dropped
                if 0 <= in_flight_from <= req.last_step and req.steps
                else computed_before
            )
            if kv_on and (not req.steps or req.preempted):
                hits.append((req, computed_before, not req.steps))
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
                    self._kv_drop(epoch, req, step, kv_ts)
                    hits.append((req, computed_before, False))
            if kv_on:
                basis = req.release_basis if req.release_basis >= 0 else computed_before
                kv_memory.on_step(kv_shape, req, step, kv_ts, optimistic, n, basis)
                if req.kv_shared:
                    kv_memory.release_window(req, kv_shape, store, step, kv_ts, self._kv_holder(epoch))
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
            n_proposed = proposed[i] if proposed else 0
            n_cut = 0
            if n_proposed:
                n_accepted, n_cut = _split_drafts(n_proposed, n_accepted, new)
            rejected = n_proposed - n_accepted - n_cut
            req.kv_last_dropped = rejected + n_cut
            valid_end = computed_before + n - rejected - n_cut
            if n_proposed:
                req.draft_accepted += n_accepted
                req.draft_rejected += rejected
                req.draft_cut += n_cut
            kv_end = req.kv_end
            if computed_before < kv_end:
                self._recompute_after_preemption(req, computed_before, min(valid_end, kv_end))
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
                    and last[sg.KIND] == sg.OUTPUT
                    and last[sg.STATUS] == sg.COMPUTED
                    and not last[sg.DRAFT]
                    and last[sg.FATE] == sg.KEPT
                ):
                    last[sg.END] += new  # the common decode step: extend the output run
                else:
                    drafts = min(n_accepted, new)
                    sg.append(segs, drafts, sg.OUTPUT, sg.COMPUTED, draft=True)
                    sg.append(segs, new - drafts, sg.OUTPUT, sg.COMPUTED)
            touched.append(key)
        store.touch_many(touched)
        if hits:
            self._kv_join(epoch, kv_shape, seq, step, kv_ts, hits)
        if total > 0:
            scale = step_ns / total
            for req, f in shares:
                req.gpu_ns += f * scale

    # --- KV memory-time (streams/kv_memory.py) ----------------------------------------------

    def _kv_shape(self, epoch: EpochState) -> kv_memory.KvShape:
        shape = self._kv_shapes.get(epoch.engine_id)
        if shape is None:
            shape = self._kv_shapes[epoch.engine_id] = kv_memory.KvShape(epoch.config)
        return shape

    def _kv_holder(self, epoch: EpochState) -> Callable[[str], RequestState | None]:
        def holder(rid: str) -> RequestState | None:
            r = self._request(epoch, rid, create=False)
            if r is not None:
                self._put_request(r)
            return r

        return holder

    def _kv_drop(self, epoch: EpochState, req: RequestState, step: int, ts: int) -> None:
        """The request's blocks are freed at (step, ts): it was preempted or it ended."""
        if not req.kv_since or req.kv_since[0] < 0:
            return
        if req.kv_shared:
            kv_memory.leave(req, self.store, step, ts, self._kv_holder(epoch))
        kv_memory.drop(req, step, ts)

    def _kv_join(
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
        holder = self._kv_holder(epoch)
        for req, hit, first in hits:
            if req.request_id in seen or hit <= 0:
                continue
            seen.add(req.request_id)
            blocks = kv_memory.hit_blocks(req, shape, self.store, epoch.engine_id, seq, hit, first, epoch.cleared)
            if blocks:
                kv_memory.join(req, shape, self.store, epoch.engine_id, blocks, step, ts, holder)
                self._put_request(req)

    def _recompute_after_preemption(self, req: RequestState, start: int, end: int) -> None:
        """Re-prefill of [start, end), positions this request had computed or read before."""
        if end <= start:
            return
        req.recomputed_preemption += end - start
        sg.assign(req.segments, start, end, sg.RECOMPUTED_PREEMPTION)

    def _reopen(self, epoch: EpochState, req: RequestState) -> bool:
        """A closed request got a step: reopen it when the close was an idle timeout (its record
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

    def _on_routing(self, epoch: EpochState, seq: int, body: dict[str, Any], out: list[Output]) -> None:
        layers, experts = body["num_layers"], body["num_experts"]
        width = layers * experts
        counts = body["expert_counts"]
        for i, rid in enumerate(body["req_ids"]):
            # Routing comes on the worker stream, which is not ordered with the core stream: it
            # may precede the request's RequestStarted, so it may create the request's state.
            r = self._request(epoch, rid)
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
            self._put_request(r)
        if body["step"] > epoch.worker_step:
            epoch.worker_step = body["step"]

    def _on_finished(
        self, epoch: EpochState, stream: str, seq: int, ts: int, body: dict[str, Any], out: list[Output]
    ) -> None:
        rid = body["request_id"]
        r = self._request(epoch, rid)
        assert r is not None
        timed_out = r.output is not None and r.output["incomplete_reason"] == "idle_timeout"
        if r.closed and r.seq < seq and timed_out:
            self._reopen(epoch, r)  # the finish supersedes the record the idle timeout wrote
        if r.closed:
            # Replayed after a partial checkpoint: the request closed but the epoch effects may not
            # have been persisted; emit them again (downstream is idempotent by key).
            if rid in epoch.open_requests and r.output is not None:
                self._emit_closed(epoch, r, out)
            return
        if r.seq < seq:
            r.seq = seq
            r.finish = body
            r.last_ts = ts
            self._put_request(r)
        waits_for_routing = (
            bool((epoch.config or {}).get("routing_capture")) and epoch.worker_step < r.last_step
        )
        if waits_for_routing:
            epoch.pending_close[rid] = [r.last_step, ts]
            return
        self._close(epoch, r, body, ts, None, out)

    def _close_waiting(self, epoch: EpochState, out: list[Output]) -> None:
        for rid, (last_step, ts) in list(epoch.pending_close.items()):
            if epoch.worker_step >= last_step or epoch.watermark - ts >= self.routing_wait_ns:
                del epoch.pending_close[rid]
                r = self._request(epoch, rid, create=False)
                if r is not None:
                    self._close(epoch, r, r.finish, ts, None, out)

    def _sweep(self, epoch: EpochState, out: list[Output]) -> None:
        """Close requests idle past the timeout (event time) and forget closed ones."""
        self._forget_retired(epoch)
        wm = epoch.watermark
        for rid in list(epoch.open_requests):
            r = self._request(epoch, rid, create=False)
            if r is None:
                epoch.open_requests.remove(rid)
                continue
            if (
                not r.closed
                and rid not in epoch.pending_close
                and r.last_ts
                and wm - r.last_ts > self.idle_ns
            ):
                self._close(epoch, r, None, r.last_ts, "idle_timeout", out)

    # --- closing ---------------------------------------------------------------------------

    def _close(
        self,
        epoch: EpochState,
        r: RequestState,
        finish: dict[str, Any] | None,
        ts: int,
        incomplete: str | None,
        out: list[Output],
    ) -> None:
        if not r.closed:
            r.output = self._accounting(epoch, r, finish, ts, incomplete)
            r.closed = True
            r.close_ts = ts
            r.finish = None
            self._put_request(r)
        self._emit_closed(epoch, r, out)

    def _emit_closed(self, epoch: EpochState, r: RequestState, out: list[Output]) -> None:
        """Epoch-level effects of a closed request: its window, its output, its retirement."""
        acc = r.output
        assert acc is not None
        if r.reopened is not None:
            # This record supersedes one an idle timeout emitted: take that one out of its window.
            for rec in windows.add(epoch, r.reopened, self.window_ns, retract=True):
                self.stats.corrections += 1
                out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))
            r.reopened = None
        for rec in windows.add(epoch, acc, self.window_ns):
            self.stats.corrections += 1
            out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))
        out.append(Output(TIMELINES, acc["request_uid"], ev.REQUEST_ACCOUNTING, acc))
        self.stats.requests_closed += 1
        if not acc["complete"]:
            self.stats.incomplete += 1
        if r.request_id in epoch.open_requests:
            epoch.open_requests.remove(r.request_id)
        # The closed state stays behind briefly (its output answers replays of its events);
        # it is dropped by the next sweeps once older than the retention.
        self._retire(epoch, r)

    def _drop_request(self, key: str) -> None:
        self._requests.pop(key, None)
        self.store.delete(key)

    def _retire(self, epoch: EpochState, r: RequestState) -> None:
        if self.retention_ns == 0:
            self._drop_request(request_key(r.engine_id, r.request_id))
        else:
            epoch.retiring.append([r.request_id, r.close_ts])

    def _forget_retired(self, epoch: EpochState) -> None:
        horizon = epoch.watermark - self.retention_ns
        keep = 0
        for rid, ts in epoch.retiring:
            if ts > horizon:
                break
            self._drop_request(request_key(epoch.engine_id, rid))
            keep += 1
        if keep:
            del epoch.retiring[:keep]

    def _accounting(
        self,
        epoch: EpochState,
        r: RequestState,
        finish: dict[str, Any] | None,
        ts: int,
        incomplete: str | None,
    ) -> dict[str, Any]:
        cfg = epoch.config or {}
        fin = finish or {}
        # The request's KV blocks are freed with its end: the hold covers its last step.
        freed = fin.get("kv_freed_before_step", -1)
        freed_ts = fin.get("kv_freed_ts_ns", 0)
        self._kv_drop(
            epoch,
            r,
            freed if freed > r.last_step else max(epoch.kv_last_step, r.last_step) + 1,
            min(ts, freed_ts) if freed_ts > 0 else ts,
        )
        kv_shape = self._kv_shape(epoch)
        if r.steps == 0 and finish is not None and fin.get("finish_reason") != "abort":
            self._synthesise_request_level(r, finish)
        segs = sg.upgrade(r.segments)
        prompt = r.prompt_len if r.started else fin.get("num_prompt_tokens", r.prompt_len)
        if not r.started:
            r.prompt_len = prompt
        covered_prompt = sum(s[sg.END] - s[sg.START] for s in segs if s[sg.KIND] == sg.PROMPT)
        if covered_prompt < prompt and not any(s[sg.KIND] == sg.OUTPUT for s in segs):
            sg.append(segs, prompt - covered_prompt, sg.PROMPT, sg.COMPUTED)
        # Prompt positions never computed (aborted before or during prefill) were never obtained:
        # not_computed, not charged (they count in skipped_tokens: attention never saw them).
        if (r.steps or fin.get("finish_reason") == "abort") and r.kv_end < prompt:
            sg.assign(segs, r.kv_end, prompt, sg.NOT_COMPUTED)
        groups = attention.groups_of(cfg)
        basis = r.release_basis if r.release_basis >= 0 else r.last_computed_before
        # Under async scheduling a step already in flight when the request stopped computes past
        # its last position; the timeline ends at prompt + output.
        kv_end = min(r.kv_end, prompt + r.out)
        released_end, unattended_end = attention.fates(groups, kv_end, basis)
        if unattended_end:
            sg.assign(segs, 0, released_end, sg.WINDOW_RELEASED, field=sg.FATE)
            sg.assign(segs, released_end, unattended_end, sg.FATE_SKIPPED, field=sg.FATE)
        window = _attention_window(groups)
        by_status = sg.count_by_status(segs)
        by_fate = sg.count_by_fate(segs)
        gpu_ns = round(r.gpu_ns)
        engine_prompt = fin.get("num_prompt_tokens", -1)
        engine_output = fin.get("num_output_tokens", -1)
        engine_cached = fin.get("num_cached_tokens", -1)
        drafts = r.draft_accepted + r.draft_rejected + r.draft_cut
        identity = r.scheduled == r.uncached + r.recomputed_preemption + r.recomputed_eviction + drafts
        consistent = (
            finish is not None
            and incomplete is None
            and not r.seq_gap
            and engine_prompt == prompt
            and engine_output == r.out
            and engine_cached == r.cached_at_admission
            and identity
            and sg.total(segs) == prompt + r.out
        )
        uid = r.uid
        block_uses = self._block_uses(epoch, r, fin)
        skipped = by_fate.get(sg.FATE_SKIPPED, 0) + by_status.get(sg.NOT_COMPUTED, 0)
        return {
            "request_uid": uid,
            "engine_name": r.engine_name,
            "engine_id": r.engine_id,
            "request_id": r.request_id,
            "tenant": r.tenant,
            "model": r.model or cfg.get("served_model_name", ""),
            "lora_name": r.lora_name,
            "engine_kind": cfg.get("engine_kind", "vllm"),
            "arrival_ts_ns": r.arrival_ts,
            "first_scheduled_ts_ns": r.first_sched_ts,
            "first_token_ts_ns": r.first_token_ts or fin.get("first_token_ts_ns", 0),
            "finished_ts_ns": ts,
            "finish_reason": fin.get("finish_reason", "incomplete"),
            "complete": incomplete is None,
            "incomplete_reason": incomplete,
            "seq_gap": r.seq_gap,
            "prompt_tokens": prompt,
            "output_tokens": r.out,
            "cache_read_tokens": r.cache_read,
            "uncached_computed_tokens": r.uncached,
            "recomputed_tokens": r.recomputed_preemption + r.recomputed_eviction,
            "draft_accepted_tokens": r.draft_accepted,
            "draft_rejected_tokens": r.draft_rejected,
            "skipped_tokens": skipped,
            "evicted_tokens": 0,
            "scheduled_tokens": r.scheduled,
            "preemptions": r.preemptions,
            "steps": r.steps,
            "attention_pairs": round(r.pairs),
            "attention_pairs_skipped": (r.pairs_full - round(r.pairs)) if window else 0,
            "gpu_time_ns": gpu_ns,
            "est_flops": float(r.flops),
            "engine_prompt_tokens": engine_prompt,
            "engine_output_tokens": engine_output,
            "engine_cached_tokens": engine_cached,
            "consistent": bool(consistent),
            "expert_num_layers": r.expert_layers,
            "expert_num_experts": r.expert_experts,
            "expert_counts": list(r.experts),
            "block_uses": block_uses,
            "timeline": {"segments": sg.to_records(segs), "attention_window": window},
            "recomputed_preemption_tokens": r.recomputed_preemption,
            "recomputed_eviction_tokens": r.recomputed_eviction,
            "draft_cut_tokens": r.draft_cut,
            "window_released_tokens": by_fate.get(sg.WINDOW_RELEASED, 0),
            "evicted_blocks_recomputed": r.evicted_blocks_recomputed,
            "waste_tokens": r.recomputed_preemption + r.draft_rejected + r.draft_cut,
            "session_id": r.session_id,
            "external_request_id": r.external_request_id,
            "parent_request_id": r.parent_request_id,
            "choice_index": r.choice_index,
            "external_kv_tokens": r.external_kv,
            **_token_fields(cfg.get("privacy_mode", ""), r),
            "kv_groups": kv_memory.record(kv_shape, r) if r.steps else [],
            "kv_peak_bytes": r.kv_peak_bytes if r.steps and r.kv else -1,
        }

    def _synthesise_request_level(self, r: RequestState, finish: dict[str, Any]) -> None:
        """Request-level producers (proxy, traces) report totals only: derive the timeline from them."""
        prompt = finish["num_prompt_tokens"]
        cached = min(finish["num_cached_tokens"], prompt)
        output = finish["num_output_tokens"]
        r.segments = []
        sg.append(r.segments, cached, sg.PROMPT, sg.CACHED)
        sg.append(r.segments, prompt - cached, sg.PROMPT, sg.COMPUTED)
        sg.append(r.segments, output, sg.OUTPUT, sg.COMPUTED)
        r.prompt_len = prompt
        r.cached_at_admission = r.cache_read = cached
        r.out = output
        r.uncached = prompt - cached + max(output - 1, 0)
        r.scheduled = r.uncached
        r.kv_end = prompt + max(output - 1, 0)

    def _block_uses(self, epoch: EpochState, r: RequestState, finish: dict[str, Any]) -> list[dict[str, Any]]:
        bs = (epoch.config or {}).get("block_size") or 0
        uses = []
        cleared = epoch.cleared
        for hexh, role, lifetime in r.blocks:
            if lifetime < 0:
                block = self.store.get(block_key(epoch.engine_id, hexh))
                lifetime = pidx.lifetime_of(block, r.request_id, r.admission_seq, cleared)
            uses.append(
                {"block_hash": bytes.fromhex(hexh), "lifetime_seq": lifetime, "role": role, "tokens": bs}
            )
        for h in finish.get("output_block_hashes", []):
            hexh = h.hex()
            key = block_key(epoch.engine_id, hexh)
            block = self.store.get(key)
            # Credit only a block already stored: every block the request computed was stored
            # before its RequestFinished (vLLM publishes a step's KV events first). A block not
            # stored ends with the last output token, whose KV nobody computed; a pending claim
            # on it would credit this request with the next turn's computation of that block.
            if block is not None and pidx.live_as_of(block, r.seq, cleared) is not None:
                pidx.claim(block, r.request_id, r.seq, cleared)
                self.store.put(key, block)
            lifetime = pidx.lifetime_of(block, r.request_id, r.seq, cleared)
            uses.append({"block_hash": h, "lifetime_seq": lifetime, "role": "computed", "tokens": bs})
        return uses

    # --- KV events -------------------------------------------------------------------------

    def _on_kv(self, epoch: EpochState, seq: int, body: dict[str, Any], *, stored: bool) -> None:
        primary = _primary_group_kind(epoch.config)
        if primary is not None and body.get("group_kind", primary) != primary:
            return  # other KV cache groups mirror the same hashes; index one group only
        for h in body["block_hashes"]:
            key = block_key(epoch.engine_id, h.hex())
            block = self.store.get(key)
            if block is None:
                if not stored:
                    continue  # removal of a block we never saw stored: nothing to end
                block = pidx.new_block()
                epoch.block_count += 1
            changed = pidx.on_stored(block, seq) if stored else pidx.on_removed(block, seq)
            if changed:
                self.store.put(key, block)
        if stored:
            self._bound_index(epoch)

    def _bound_index(self, epoch: EpochState) -> None:
        cap = self.cfg.prefix_index_max_blocks
        if epoch.block_count <= cap:
            return
        prefix = f"b|{epoch.engine_id}|"
        history = []
        count = 0
        for key in self.store.keys(prefix):
            count += 1
            block = self.store.get(key)
            end = pidx.last_end(block) if block is not None else -1
            if end is not None:
                history.append((end, key))
        history.sort()
        drop = max(0, count - cap * 3 // 4)
        for _, key in history[:drop]:
            self.store.delete(key)
        epoch.block_count = count - min(drop, len(history))


#: KV-cache group kinds that cache every full block of a request (vLLM's KVCacheSpecKind values;
#: older producers sent the spec class name).
_FULL_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "FullAttentionSpec", "MLAAttentionSpec"}
)


def _token_fields(privacy: str, r: RequestState) -> dict[str, Any]:
    """RequestAccounting's token-record fields: what the privacy mode allows, nothing more."""
    raw = privacy == "raw"
    return {
        "token_privacy": privacy,
        "prompt_token_ids": list(r.prompt_ids) if raw else [],
        "prompt_token_hashes": list(r.prompt_hashes) if privacy == "hashed" else [],
        "output_token_ids": list(r.output_ids) if raw else [],
    }


def _primary_group_kind(config: dict[str, Any] | None) -> str | None:
    """The KV-cache group whose block lifetimes the prefix index follows: the first full-attention
    group. Sliding-window groups of a hybrid model cache only the blocks a later hit can reach
    (vLLM's sparse retention, ``reachable_block_mask``), so their lifetimes are not the prefix
    cache's; the first group stands in only for a model without a full-attention group."""
    groups = (config or {}).get("kv_cache_groups") or []
    for g in groups:
        if g["kind"] in _FULL_KINDS:
            return str(g["kind"])
    return groups[0]["kind"] if groups else None


def _attention_window(groups: tuple[attention.Group, ...]) -> int | None:
    """The timeline's ``attention_window``: the smallest window or chunk of a limited group."""
    reach = [g.window or g.chunk for g in groups if g.limited]
    return int(min(r for r in reach if r)) if reach else None


def _split_drafts(proposed: int, accepted: int, new: int) -> tuple[int, int]:
    """``(accepted, cut)`` drafts of one step; the rest of ``proposed`` were rejected.

    A verified step yields the accepted drafts plus one sampled token. Fewer new tokens mean the
    stop condition cut the tail: drafts past the stop were computed, then thrown away (cut, not
    accepted). No new token and nothing accepted means the request finished between schedule
    and update: its drafts were never verified (cut, not rejected).
    """
    if new == 0 and accepted == 0:
        return 0, proposed
    cut = max(0, accepted - new)
    return accepted - cut, cut


def _add_span(spans: list[list[int]], start: int, end: int) -> None:
    """Add [start, end) to sorted disjoint spans (admission plans add them in order)."""
    if spans and spans[-1][1] >= start:
        spans[-1][1] = max(spans[-1][1], end)
    else:
        spans.append([start, end])


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
