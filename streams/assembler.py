"""The assembler: fold one engine's events into per-request token accounting.

``Assembler.apply(event)`` is the pure core of the stream processor: it reads and writes keyed
state through a :class:`~streams.state.StateStore` and returns the outputs the event caused
(RequestAccounting records for the timelines topic, UsageWindow records for the usage topic).
The Faust agent is a thin shell around it; replay and benchmarks run it directly.

It composes four steps, one module each:

- :mod:`streams.ordering`: ordering and dedup by each stream's gap-free ``seq``;
- :mod:`streams.fold`: the position fold of admissions, steps and routing into request state;
- :mod:`streams.block_index`: the prefix index of the epoch's KV blocks;
- :mod:`streams.accounting`: the RequestAccounting record of a closing request;

and owns what is left: the engine epoch's lifecycle, closing requests (finish, idle timeout,
engine stop) and their usage windows (:mod:`streams.windows`).

Idempotency: effects on the epoch (windows, frontiers) happen once per seq (ordering); effects
on a request are guarded by the last seq that request absorbed (fold). A state persisted only
partly before a crash therefore converges when the events are replayed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sparseety import events as ev
from sparseety.config import WorkerConfig

from . import accounting, block_index, ordering, windows
from .caveats import kv_history_lost_at
from .flops import ModelShape
from .fold import PositionFold
from .outputs import DLQ, TIMELINES, USAGE, Output, Stats
from .state import (
    EPOCHS,
    EpochState,
    HeadState,
    RequestState,
    StateStore,
    epoch_key,
    head_key,
)

__all__ = ["DLQ", "TIMELINES", "USAGE", "Assembler", "Output", "Stats"]


class Assembler:
    """Folds engine events into request accounting and usage windows (one per partition or process).

    Args:
        cfg: Worker settings (window, lateness, timeouts, bounds).
        store: Where state lives (a dict in tests and replay, a Faust table in the worker).
        clock: Wall clock for processing-time closing of engines that went silent.
        columnar: Fold steady decode rows in columns (streams/columnar.py); False: every row on
            the general path (the reference for tests).
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        store: StateStore,
        clock: Callable[[], int] = time.time_ns,
        *,
        columnar: bool = True,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.stats = Stats()
        self.fold = PositionFold(store, self.stats, cfg.prefix_index_max_blocks, columnar=columnar)
        self.window_ns = int(cfg.window_s * 1e9)
        self.lateness_ns = int(cfg.allowed_lateness_s * 1e9)
        self.idle_ns = int(cfg.idle_timeout_s * 1e9)
        self.routing_wait_ns = int(cfg.routing_wait_s * 1e9)
        self.retention_ns = int(cfg.closed_retention_s * 1e9)
        self._shapes: dict[str, ModelShape] = {}
        self._last_seen: dict[str, int] = {}  # engine_id -> wall clock of its last event here

    # --- entry points ---------------------------------------------------------------------

    def apply(self, event: dict[str, Any]) -> list[Output]:
        """Fold one decoded EngineEvent; return the outputs it caused (possibly none)."""
        self.stats.events += 1
        eid = event["engine_id"]
        self._last_seen[eid] = self.clock()
        key = epoch_key(eid)
        epoch = self.store.get(key)
        if epoch is None:
            epoch = EpochState(engine_name=event["engine_name"], engine_id=eid)
            self.store.put(key, epoch)
        if ordering.next_in_line(epoch, event):
            # In order, nothing buffered (the common case): as below without an Admission.
            outputs = self._process(epoch, event)
            after = self._after_event(epoch)
            if after:
                outputs = outputs + after
            self.store.put(key, epoch)
            return outputs
        admitted = ordering.admit(
            epoch, event, max_pending=self.cfg.reorder_max_events, lateness_ns=self.lateness_ns
        )
        if admitted.duplicate:
            self.stats.duplicates += 1
            return []
        if admitted.buffered:
            self.stats.reordered += 1
        if admitted.lost:
            self.stats.gaps += admitted.lost
            self._flag_gap(epoch)
        out: list[Output] = []
        for ready in admitted.ready:
            out += self._process(epoch, ready)
        if admitted.ready:
            out += self._after_event(epoch)
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
        for key in list(self.store.keys(EPOCHS)):
            epoch = self.store.get(key)
            if epoch is None or epoch.stopped or epoch.superseded:
                continue
            seen = self._last_seen.setdefault(epoch.engine_id, now)
            if now - seen > self.idle_ns:
                out += self._close_epoch(epoch, "idle_timeout")
                self._put_epoch(epoch)
        return out

    # --- epoch state -----------------------------------------------------------------------

    def _put_epoch(self, epoch: EpochState) -> None:
        self.store.put(epoch_key(epoch.engine_id), epoch)

    def _flag_gap(self, epoch: EpochState) -> None:
        """Seqs were declared lost: every request open now may have missed some of them."""
        for rid in epoch.open_requests:
            r = self.fold.request(epoch, rid, create=False)
            if r is not None and not r.seq_gap:
                r.seq_gap = True
                self.fold.put(r)

    def _shape(self, epoch: EpochState) -> ModelShape:
        shape = self._shapes.get(epoch.engine_id)
        if shape is None:
            shape = ModelShape.from_engine_started(epoch.config or {})
            self._shapes[epoch.engine_id] = shape
        return shape

    # --- dispatch ------------------------------------------------------------------------

    def _process(self, epoch: EpochState, event: dict[str, Any]) -> list[Output]:
        kind, body = event["payload"]
        ts = event["ts_ns"]
        if ts > epoch.watermark:
            epoch.watermark = ts
        seq = event["seq"]
        if kind == ev.STEP_BATCH:
            shape = self._shapes.get(epoch.engine_id) or self._shape(epoch)
            self.fold.on_step(epoch, seq, ts, body, shape)
            epoch.step_seq = seq
        elif kind == ev.KV_STORED or kind == ev.KV_REMOVED:
            stored = kind == ev.KV_STORED
            block_index.on_kv_event(
                self.store, epoch, seq, body, stored=stored, max_blocks=self.cfg.prefix_index_max_blocks
            )
        elif kind == ev.REQUEST_STARTED:
            self.fold.on_started(epoch, seq, ts, body)
        elif kind == ev.REQUEST_FINISHED:
            return self._on_finished(epoch, seq, ts, body)
        elif kind == ev.MOE_ROUTING:
            self.fold.on_routing(epoch, seq, body)
        elif kind == ev.KV_CLEARED:
            # the prefix index follows the device tier: clearing an offload tier clears nothing there
            if block_index.device_medium(body) and (not epoch.cleared or epoch.cleared[-1] < seq):
                epoch.cleared.append(seq)
        elif kind == ev.HEARTBEAT:
            epoch.producer_stats = {k: int(v) for k, v in body.items()}
            return self._sweep(epoch)
        elif kind == ev.ENGINE_STARTED:
            return self._on_engine_started(epoch, body, ts)
        elif kind == ev.ENGINE_STOPPED:
            return self._close_epoch(epoch, "engine_stopped")
        return []

    def _after_event(self, epoch: EpochState) -> list[Output]:
        out = self._close_waiting(epoch) if epoch.pending_close else []
        if epoch.windows and not epoch.stopped:
            for rec in windows.close_due(epoch, self.window_ns, self.lateness_ns):
                out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))
        return out

    # --- engine lifecycle ------------------------------------------------------------------

    def _on_engine_started(self, epoch: EpochState, body: dict[str, Any], ts: int) -> list[Output]:
        if epoch.config is not None:
            return []  # announced again by the producer (same epoch, same configuration)
        epoch.config = body
        # An engine whose prefix-cache inserts and evictions the producer cannot see (SGLang's
        # Rust radix-tree core): the epoch has no KV history from its start (streams/caveats.py).
        epoch.history_lost_ts_ns = kv_history_lost_at(body, ts, epoch.history_lost_ts_ns)
        self._shapes.pop(epoch.engine_id, None)
        self.fold.kv_shapes.pop(epoch.engine_id, None)
        self.fold.forget_columns(epoch.engine_id)
        out: list[Output] = []
        head = self.store.get(head_key(epoch.engine_name)) or HeadState(epoch.engine_name)
        if head.current and head.current != epoch.engine_id:
            previous = self.store.get(epoch_key(head.current))
            if previous is not None and not previous.superseded:
                out = self._close_epoch(previous, "new_epoch")
                previous.superseded = True
                self._put_epoch(previous)
        head.current = epoch.engine_id
        self.store.put(head_key(epoch.engine_name), head)
        return out

    def _close_epoch(self, epoch: EpochState, reason: str) -> list[Output]:
        """Close every open request as incomplete and flush every window."""
        out: list[Output] = []
        for rid in list(epoch.open_requests):
            r = self.fold.request(epoch, rid, create=False)
            if r is not None:
                out += self._close(epoch, r, None, r.last_ts or epoch.watermark, reason)
        epoch.pending_close.clear()
        for rec in windows.close_due(epoch, self.window_ns, self.lateness_ns, flush=True):
            out.append(Output(USAGE, rec["usage_id"], ev.USAGE_WINDOW, rec))
        epoch.stopped = True
        self.fold.forget_columns(epoch.engine_id)
        return out

    # --- finishing -------------------------------------------------------------------------

    def _on_finished(self, epoch: EpochState, seq: int, ts: int, body: dict[str, Any]) -> list[Output]:
        rid = body["request_id"]
        r = self.fold.request(epoch, rid)
        assert r is not None
        timed_out = r.output is not None and r.output["incomplete_reason"] == "idle_timeout"
        if r.closed and r.seq < seq and timed_out:
            self.fold.reopen(epoch, r)  # the finish supersedes the record the idle timeout wrote
        if r.closed:
            # Replayed after a partial checkpoint: the request closed but the epoch effects may not
            # have been persisted; emit them again (downstream is idempotent by key).
            if rid in epoch.open_requests and r.output is not None:
                return self._emit_closed(epoch, r)
            return []
        if r.seq < seq:
            r.seq = seq
            r.finish = body
            r.last_ts = ts
            self.fold.put(r)
        waits_for_routing = (
            bool((epoch.config or {}).get("routing_capture")) and epoch.worker_step < r.last_step
        )
        if waits_for_routing:
            epoch.pending_close[rid] = [r.last_step, ts]
            return []
        return self._close(epoch, r, body, ts, None)

    def _close_waiting(self, epoch: EpochState) -> list[Output]:
        """Close finished requests that waited for their routing (or waited long enough)."""
        out: list[Output] = []
        for rid, (last_step, ts) in list(epoch.pending_close.items()):
            if epoch.worker_step >= last_step or epoch.watermark - ts >= self.routing_wait_ns:
                del epoch.pending_close[rid]
                r = self.fold.request(epoch, rid, create=False)
                if r is not None:
                    out += self._close(epoch, r, r.finish, ts, None)
        return out

    def _sweep(self, epoch: EpochState) -> list[Output]:
        """Close requests idle past the timeout (event time) and forget closed ones."""
        self._forget_retired(epoch)
        out: list[Output] = []
        wm = epoch.watermark
        for rid in list(epoch.open_requests):
            r = self.fold.request(epoch, rid, create=False)
            if r is None:
                epoch.open_requests.remove(rid)
                continue
            if (
                not r.closed
                and rid not in epoch.pending_close
                and r.last_ts
                and wm - r.last_ts > self.idle_ns
            ):
                out += self._close(epoch, r, None, r.last_ts, "idle_timeout")
        return out

    # --- closing ---------------------------------------------------------------------------

    def _close(
        self,
        epoch: EpochState,
        r: RequestState,
        finish: dict[str, Any] | None,
        ts: int,
        incomplete: str | None,
    ) -> list[Output]:
        if not r.closed:
            self.fold.kv_close(epoch, r, finish, ts)
            uses = block_index.block_uses(self.store, epoch, r, finish or {})
            writes = block_index.cache_write_tokens(self.store, epoch, r)
            r.output = accounting.build(
                epoch, r, finish, ts, incomplete, uses, writes, self.fold.kv_shape(epoch)
            )
            r.closed = True
            r.close_ts = ts
            r.finish = None
            self.fold.put(r)
        return self._emit_closed(epoch, r)

    def _emit_closed(self, epoch: EpochState, r: RequestState) -> list[Output]:
        """Epoch-level effects of a closed request: its window, its output, its retirement."""
        acc = r.output
        assert acc is not None
        out: list[Output] = []
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
        if self.retention_ns == 0:
            self.fold.drop(r.engine_id, r.request_id)
        else:
            epoch.retiring.append([r.request_id, r.close_ts])
        return out

    def _forget_retired(self, epoch: EpochState) -> None:
        horizon = epoch.watermark - self.retention_ns
        keep = 0
        for rid, ts in epoch.retiring:
            if ts > horizon:
                break
            self.fold.drop(epoch.engine_id, rid)
            keep += 1
        if keep:
            del epoch.retiring[:keep]
