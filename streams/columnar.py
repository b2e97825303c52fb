"""The steady decode state of one engine epoch as columns: the fold's fast path.

Most of a serving engine's step is its steady state: every running request gets one token, no
admission, no KV-cache change, no drafts. :class:`SteadyColumns` keeps the running requests of
one engine epoch that are in that state in numpy columns indexed by a slot, and folds such a
step's rows (:meth:`SteadyColumns.fold`) with a handful of vector operations instead of Python
per request (:meth:`streams.fold.PositionFold.on_step` is the general path; this module does
exactly what that path does for a steady row, and ``tests/unit/test_columnar.py`` checks that
the two give the same outputs and the same state).

A request is in a slot between two general events: the general path admits it after a step
(:meth:`SteadyColumns.admit`, when :func:`steady` holds) and it leaves its slot, its state
written back to its :class:`~streams.state.RequestState`, whenever anything else reads it:
every ``StateStore.get``/``put``/``delete`` of its key releases it (the store's lease, see
:class:`~streams.state.MemoryStore`), and so does a row of a step that is not steady. While a
request is in a slot its object in the store is behind by the steps folded here;
``StateStore.sync`` writes those back (the worker does before each changelog write, so each
changed request goes to the changelog once per flush, whatever the number of steps).

Adding a per-request counter: one a steady decode step does not change (an admission-time
count) needs nothing here. One it changes gets a row in :data:`INTS` (or :data:`FLOATS`) and
its per-step increment in :data:`STEADY_INCREMENTS`; loading, writing back and the increment
follow from those tables.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from . import kv_memory as kvm
from . import segments as sg
from .state import RequestState

#: Integer columns: RequestState fields (by name) and the KV-memory values of the single
#: KV-cache group (``kv.*``: ``RequestState.kv[0]`` items, ``kv_since`` and ``kv_peak_bytes``),
#: and ``seg_end`` (the end of the open output run, ``segments[-1][END]``).
INTS = (
    "seq",
    "steps",
    "last_step",
    "last_ts",
    "last_computed_before",
    "scheduled",
    "uncached",
    "kv_end",
    "out",
    "pairs",
    "release_basis",
    "seg_end",
    "kv.since_step",
    "kv.since_ts",
    "kv.table",
    "kv.null",
    "kv.peak",
    "kv.steps",
    "kv.ns",
    "kv.used",
    "kv.used_now",
    "kv.peak_bytes",
)
#: Float columns (RequestState fields).
FLOATS = ("flops", "gpu_ns")
#: Counters a steady decode row (one token scheduled, one new token) adds to, and by how much.
STEADY_INCREMENTS = (("steps", 1), ("scheduled", 1), ("uncached", 1), ("out", 1), ("seg_end", 1))

_I = {name: i for i, name in enumerate(INTS)}
_F = {name: i for i, name in enumerate(FLOATS)}
_PLAIN_INTS = tuple(name for name in INTS if name != "seg_end" and not name.startswith("kv."))
_KV_ITEMS = (
    ("kv.table", kvm.KV_TABLE),
    ("kv.null", kvm.KV_NULL),
    ("kv.peak", kvm.KV_PEAK),
    ("kv.steps", kvm.KV_STEPS),
    ("kv.ns", kvm.KV_NS),
    ("kv.used", kvm.KV_USED),
    ("kv.used_now", kvm.KV_USED_NOW),
)
_INC_ROWS = np.array([_I[name] for name, _ in STEADY_INCREMENTS], dtype=np.intp)
_INC_BY = np.array([[by] for _, by in STEADY_INCREMENTS], dtype=np.int64)

(
    SEQ,
    STEPS,
    LAST_STEP,
    LAST_TS,
    LAST_CB,
    _SCHEDULED,
    _UNCACHED,
    KV_END,
    _OUT,
    PAIRS,
    RELEASE_BASIS,
    _SEG_END,
    SINCE_STEP,
    SINCE_TS,
    TABLE,
    NULL,
    PEAK,
    KSTEPS,
    KNS,
    USED,
    USED_NOW,
    PEAK_BYTES,
) = range(len(INTS))
FLOPS, GPU_NS = range(len(FLOATS))
_PLAIN_AT = tuple((name, _I[name]) for name in _PLAIN_INTS)
_KV_AT = tuple((_I[name], item) for name, item in _KV_ITEMS)


def fast_kv(shape: kvm.KvShape) -> bool:
    """Whether a steady row's KV memory-time has the columnar form: not observed at all, or one
    KV-cache group that frees nothing while a request runs (``kv_memory.on_steps``' own loop)."""
    return not shape.observed or (shape.count == 1 and not shape.releases)


def steady(r: RequestState, kv_on: bool) -> bool:
    """Whether a request's next step, if it is one token scheduled and one new, changes only
    what the columns hold (so the request can take a slot)."""
    if r.closed or r.preempted or not r.steps or not r.first_token_ts or not r.first_sched_ts:
        return False
    if r.kv_last_dropped:
        return False
    if type(r.pairs) is not int or type(r.flops) is not float or type(r.gpu_ns) is not float:
        return False
    segs = r.segments
    if not segs:
        return False
    last = segs[-1]
    if not (
        last[sg.KIND] == sg.OUTPUT
        and last[sg.STATUS] == sg.COMPUTED
        and not last[sg.DRAFT]
        and last[sg.FATE] == sg.KEPT
        and type(last[sg.END]) is int
    ):
        return False
    if r.eviction_spans and r.eviction_spans[-1][1] > r.kv_end:
        return False
    if kv_on:
        since = r.kv_since
        if len(r.kv) != 1 or len(since) != 2 or since[0] < 0 or r.kv[0][kvm.KV_NEVER] < 0:
            return False
    return True


class StepPlan(NamedTuple):
    """What :meth:`SteadyColumns.plan` found in a step: its steady rows (in step order), their
    slots and ``num_computed_before``; the other rows (the general path's, in step order); and
    the step's ``num_new_tokens`` as an array."""

    rows: np.ndarray
    slots: np.ndarray
    cb: np.ndarray
    general: list[int]
    new: np.ndarray


class SteadyColumns:
    """One engine epoch's steady requests in columns (see the module's docstring).

    Args:
        store: The state store whose keys this leases (``lease``/``release``/``sync``).
        prefix: The epoch's request-key prefix (``state.request_prefix``).
        kv_shape: The epoch's KV-cache shape (:func:`fast_kv` must hold).
    """

    def __init__(self, store: Any, prefix: str, kv_shape: kvm.KvShape) -> None:
        self.store = store
        self.prefix = prefix
        self.kv_shape = kv_shape
        self.kv_on = kv_shape.observed
        cap = 64
        # Slot-major (a slot's values side by side): a step gathers and scatters its rows as
        # whole rows, several times cheaper than per column (benchmarks: docs/benchmarks.md).
        self.ints = np.zeros((cap, len(INTS)), dtype=np.int64)
        self.floats = np.zeros((cap, len(FLOATS)), dtype=np.float64)
        self.stale = np.zeros(cap, dtype=bool)
        self.reqs: list[RequestState | None] = [None] * cap
        self.keys: list[str] = [""] * cap
        self.ids: list[list[int] | None] = [None] * cap  # each slot's RequestState.output_ids
        self.slot_of: dict[str, int] = {}
        self.free = list(range(cap - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot_of)

    # --- slots -----------------------------------------------------------------------------

    def _grow(self) -> None:
        cap = self.ints.shape[0]
        self.ints = np.concatenate([self.ints, np.zeros_like(self.ints)])
        self.floats = np.concatenate([self.floats, np.zeros_like(self.floats)])
        self.stale = np.concatenate([self.stale, np.zeros_like(self.stale)])
        self.reqs.extend([None] * cap)
        self.keys.extend([""] * cap)
        self.ids.extend([None] * cap)
        self.free.extend(range(2 * cap - 1, cap - 1, -1))

    def admit(self, r: RequestState) -> None:
        """Take a slot for ``r`` (:func:`steady` holds; its state is current)."""
        rid = r.request_id
        if rid in self.slot_of:
            return
        if not self.free:
            self._grow()
        s = self.free.pop()
        row = [0] * len(INTS)
        for name, i in _PLAIN_AT:
            row[i] = getattr(r, name)
        row[_SEG_END] = r.segments[-1][sg.END]
        if self.kv_on:
            g = r.kv[0]
            for i, item in _KV_AT:
                row[i] = g[item]
            row[SINCE_STEP], row[SINCE_TS] = r.kv_since
            row[PEAK_BYTES] = r.kv_peak_bytes
        self.ints[s] = row
        self.floats[s] = (r.flops, r.gpu_ns)
        self.stale[s] = False
        self.reqs[s] = r
        self.ids[s] = r.output_ids
        key = self.keys[s] = self.prefix + rid
        self.slot_of[rid] = s
        self.store.lease(key, self)

    def _write_back(self, s: int) -> None:
        r = self.reqs[s]
        assert r is not None
        ints = self.ints[s].tolist()  # Python ints and floats, one conversion each
        flops, gpu_ns = self.floats[s].tolist()
        for name, i in _PLAIN_AT:
            setattr(r, name, ints[i])
        r.segments[-1][sg.END] = ints[_SEG_END]
        if self.kv_on:
            g = r.kv[0]
            for i, item in _KV_AT:
                g[item] = ints[i]
            r.kv_since[0] = ints[SINCE_STEP]
            r.kv_since[1] = ints[SINCE_TS]
            r.kv_peak_bytes = ints[PEAK_BYTES]
        r.flops = flops
        r.gpu_ns = gpu_ns
        self.stale[s] = False

    def release(self, key: str) -> None:
        """The store's lease on ``key`` ends (someone reads it): write its state back, free the slot."""
        s = self.slot_of.pop(key[len(self.prefix) :])
        if self.stale[s]:
            self._write_back(s)
            self.store.touch(key)
        self.reqs[s] = None
        self.ids[s] = None
        self.free.append(s)

    def release_all(self) -> None:
        for rid in list(self.slot_of):
            self.store.unlease(self.prefix + rid)

    def sync(self) -> None:
        """Write every slot changed since the last sync back to its state (marked dirty)."""
        slots = np.flatnonzero(self.stale)
        if not len(slots):
            return
        ints = self.ints[slots].T.tolist()
        floats = self.floats[slots].T.tolist()
        reqs, keys = self.reqs, self.keys
        kv_on = self.kv_on
        plain = [(name, ints[_I[name]]) for name in _PLAIN_INTS]
        seg_end = ints[_I["seg_end"]]
        kv_items = [(item, ints[_I[name]]) for name, item in _KV_ITEMS]
        flops, gpu_ns = floats[FLOPS], floats[GPU_NS]
        touched = []
        for j, s in enumerate(slots.tolist()):
            r = reqs[s]
            assert r is not None
            for name, col in plain:
                setattr(r, name, col[j])
            r.segments[-1][sg.END] = seg_end[j]
            if kv_on:
                g = r.kv[0]
                for item, col in kv_items:
                    g[item] = col[j]
                since = r.kv_since
                since[0] = ints[SINCE_STEP][j]
                since[1] = ints[SINCE_TS][j]
                r.kv_peak_bytes = ints[PEAK_BYTES][j]
            r.flops = flops[j]
            r.gpu_ns = gpu_ns[j]
            touched.append(keys[s])
        self.stale[slots] = False
        self.store.touch_many(touched)

    # --- the steady step ---------------------------------------------------------------------

    def plan(
        self, rids: Any, n_sched: Any, n_new: Any, before: Any, seq: int, general_mask: Any = None
    ) -> StepPlan | None:
        """The step's steady rows (:class:`StepPlan`), or None when there is none. A row is steady
        when its request has a slot, one token was scheduled and one came out, its KV begins
        where the request's ends (no recompute), and it has not absorbed this seq.
        ``general_mask`` marks rows that must take the general path anyway (preempted, drafts).
        Rows with a slot that are not steady are released (their state written back) so the
        general path sees their current state."""
        slots = np.fromiter(map(self.slot_of.get, rids, repeat(-1)), dtype=np.intp, count=len(rids))
        held = slots >= 0
        if not held.any():
            return None
        ints = self.ints
        cb = np.asarray(before, dtype=np.int64)
        new = np.asarray(n_new)
        safe = np.where(held, slots, 0)
        ok = (
            held
            & (np.asarray(n_sched) == 1)
            & (new == 1)
            & (cb == ints[safe, KV_END])
            & (ints[safe, SEQ] < seq)
        )
        if general_mask is not None:
            ok &= ~general_mask
        rows = np.flatnonzero(ok)
        if len(rows):
            chosen = slots[rows]
            # A request twice in one step: the general path absorbs its first row only.
            mark = self.stale.astype(np.intp)  # any scratch of the right size
            mark[chosen] = np.arange(len(chosen))
            if (mark[chosen] != np.arange(len(chosen))).any():
                ok[:] = False
                rows = rows[:0]
        for i in np.flatnonzero(held & ~ok).tolist():
            self.store.unlease(self.prefix + rids[i])
        if not len(rows):
            return None
        return StepPlan(rows, slots[rows], cb[rows], np.flatnonzero(~ok).tolist(), new)

    def fold(
        self,
        slots: np.ndarray,
        cb: np.ndarray,
        seq: int,
        step: int,
        ts: int,
        start_ts: int,
        kv_ts: int,
        in_flight_from: int,
        per_token: float,
        per_pair: float,
    ) -> np.ndarray:
        """Fold one steady row per slot (``cb``: its num_computed_before); returns the rows'
        FLOPs (the general path's ``f``), whose share of the step's time the caller adds."""
        sub = self.ints[slots].T.copy()  # one contiguous row per column
        causal = cb + 1  # n * before + n (n + 1) / 2 with n = 1
        sub[PAIRS] += causal
        f = per_token + causal * per_pair
        fl = self.floats[slots].T.copy()
        fl[FLOPS] += f
        if in_flight_from >= 0:
            sub[RELEASE_BASIS] = np.where(in_flight_from <= sub[LAST_STEP], sub[LAST_CB], -1)
        else:
            sub[RELEASE_BASIS] = -1
        sub[_INC_ROWS] += _INC_BY
        sub[SEQ] = seq
        sub[LAST_STEP] = step
        sub[LAST_TS] = ts
        sub[LAST_CB] = cb
        written = causal  # cb + 1
        sub[KV_END] = written
        if self.kv_on:
            shape = self.kv_shape
            bs, nbytes = shape.block_size[0], shape.bytes[0]
            lookahead, max_len = shape.lookahead, shape.max_len
            ds = step - sub[SINCE_STEP]
            dt = kv_ts - sub[SINCE_TS]
            if (ds > 0).all() and (dt > 0).all():
                # the steady case, every row's hold moved on in steps and time: the general
                # form below with ``moved`` all true
                held = sub[TABLE] - sub[NULL]
                sub[KSTEPS] += held * ds
                sub[KNS] += held * dt
                sub[USED] += sub[USED_NOW] * ds
                sub[SINCE_STEP] = step
                sub[SINCE_TS] = kv_ts
            else:
                moved = (ds > 0) | (dt > 0)
                ds = np.where(moved & (ds > 0), ds, 0)
                dt = np.where(moved & (dt > 0), dt, 0)
                held = sub[TABLE] - sub[NULL]
                sub[KSTEPS] += held * ds
                sub[KNS] += held * dt
                sub[USED] += sub[USED_NOW] * ds
                sub[SINCE_STEP] = np.where(moved, step, sub[SINCE_STEP])
                sub[SINCE_TS] = np.where(moved, kv_ts, sub[SINCE_TS])
            end = np.minimum(written + lookahead, max_len)
            cap = sub[TABLE] * bs
            grow = end > cap
            if grow.any():
                sub[TABLE] = np.where(grow, -(-end // bs), sub[TABLE])
                cap = sub[TABLE] * bs
                held = sub[TABLE] - sub[NULL]
            np.maximum(sub[PEAK], held, out=sub[PEAK])
            used = np.minimum(written, cap) - sub[NULL] * bs
            sub[USED_NOW] = np.maximum(used, 0)
            np.maximum(sub[PEAK_BYTES], held * nbytes, out=sub[PEAK_BYTES])
        self.ints[slots] = sub.T
        self.floats[slots] = fl.T
        self.stale[slots] = True
        return f  # type: ignore[no-any-return]

    def add_time(self, slots: np.ndarray, f: np.ndarray, scale: float) -> None:
        """The rows' share of the step's time (``gpu_ns += f * scale``)."""
        self.floats[slots, GPU_NS] += f * scale

    def append_ids(self, slots: np.ndarray, ids: list[int]) -> None:
        """Raw privacy mode: each row's one new token id, appended to its output ids."""
        lists = itemgetter(*slots.tolist())(self.ids)
        if len(slots) == 1:
            lists = (lists,)
        deque(map(list.append, lists, ids), maxlen=0)  # each list.append in C
