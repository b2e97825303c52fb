"""State of the assembler, kept per key so a changelog can persist it piecewise.

Keys (all carry the engine, so keys of different partitions never collide):

* ``e|<engine_id>``                epoch state: stream frontiers, reorder buffers, windows.
* ``n|<engine_name>``              which epoch of that engine is current.
* ``r|<engine_id>|<request_id>``   one request: counts and its RLE timeline (O(segments)).
* ``b|<engine_id>|<block hash>``   one prefix-cache block: its cache lifetimes.
* ``k|<engine_id>|<group>|<hash>|<lifetime>``  a KV block shared by running requests: its holders.

Each key guards itself against re-application (a request remembers the last seq it absorbed;
a block's lifetimes are keyed by the seq that began them), so a state that was persisted only
partly before a crash converges when the events are replayed. Epoch keys are written last.

Faust stores states as changelog values: :func:`encode_state` writes a format byte (0x01) and
MessagePack (msgspec; encoding was a visible share of the worker's CPU as JSON, and MessagePack is
several times cheaper and smaller: docs/benchmarks.md). :func:`decode_state` still reads the JSON
values written before (bytes tagged ``{"$b": hex}``): JSON text never starts with 0x01, and a value
holding an int beyond 64 bits is still written as JSON. Both formats decode to the same Python
structures: lists (never tuples or arrays), bytes, and dicts keyed by str. JSON made every dict key
a str, MessagePack keeps an int key an int, so states key their dicts by str (``pending`` by
``str(seq)``; ``tests/unit/test_state_codec.py`` checks that over simulated runs).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, ClassVar, Protocol

import msgspec

from sparseety.events import USAGE_COUNTERS

#: Prefix of every epoch's key (``StateStore.keys(EPOCHS)`` lists the epochs).
EPOCHS = "e|"


def epoch_key(engine_id: str) -> str:
    return f"{EPOCHS}{engine_id}"


def head_key(engine_name: str) -> str:
    return f"n|{engine_name}"


def request_prefix(engine_id: str) -> str:
    """Prefix of the keys of one epoch's requests: ``request_prefix(e) + request_id`` is a key."""
    return f"r|{engine_id}|"


def request_key(engine_id: str, request_id: str) -> str:
    return f"r|{engine_id}|{request_id}"


def block_prefix(engine_id: str) -> str:
    """Prefix of the keys of one epoch's prefix-index blocks."""
    return f"b|{engine_id}|"


def block_key(engine_id: str, block_hash: str) -> str:
    return f"b|{engine_id}|{block_hash}"


def kv_share_key(engine_id: str, group: int, block_hash: str, lifetime: int) -> str:
    """A physical KV block shared through the prefix cache: its holders (streams/kv_memory.py)."""
    return f"k|{engine_id}|{group}|{block_hash}|{lifetime}"


#: Window counter layout: UsageWindow's counters, in schema order. Counters are only appended to
#: the schema (schema v2 appended the position classes), so windows persisted before are a prefix.
WINDOW_COUNTERS = USAGE_COUNTERS


_FIELD_GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


class _Record:
    """Dataclass <-> JSON list, in field order (compact, and fast to build)."""

    TAG: ClassVar[str]

    def to_json(self) -> list[Any]:
        # One C-level attrgetter per class: dataclasses.fields() per call was a visible share of
        # the worker's changelog writes (benchmarks/bench_worker.py --profile).
        get = _FIELD_GETTERS.get(type(self))
        if get is None:
            names = [f.name for f in fields(self)]  # type: ignore[arg-type]
            one = attrgetter(names[0])
            get = attrgetter(*names) if len(names) > 1 else (lambda obj: (one(obj),))
            _FIELD_GETTERS[type(self)] = get
        return [self.TAG, *get(self)]

    @classmethod
    def from_json(cls, data: list[Any]) -> Any:
        return cls(*data[1:])


@dataclass(slots=True)
class RequestState(_Record):
    """One request while it runs (and briefly after it closed)."""

    TAG: ClassVar[str] = "R"

    engine_name: str
    engine_id: str
    request_id: str
    seq: int = -1  # last core-stream seq absorbed
    worker_seq: int = -1  # last worker-stream seq absorbed
    started: bool = False
    tenant: str = ""
    model: str = ""
    lora_name: str | None = None
    arrival_ts: int = 0
    first_sched_ts: int = 0
    first_token_ts: int = 0
    last_ts: int = 0
    prompt_len: int = 0
    cached_at_admission: int = 0
    kv_end: int = 0  # positions whose KV was computed or read from cache so far (a high-water mark)
    out: int = 0  # output tokens so far
    cache_read: int = 0
    uncached: int = 0
    recomputed_preemption: int = 0  # re-prefill of positions this request had already computed
    draft_accepted: int = 0
    draft_rejected: int = 0
    scheduled: int = 0
    preemptions: int = 0
    preempted: bool = False
    steps: int = 0
    last_step: int = -1
    last_computed_before: int = 0
    pairs: float = 0  # attended query-key pairs, mean over layers (rounded when reported)
    pairs_full: int = 0
    gpu_ns: float = 0.0
    flops: float = 0.0
    segments: list[list[Any]] = field(default_factory=list)
    # Prompt full blocks: [hash hex, role, lifetime seq] from the admission plan.
    blocks: list[list[Any]] = field(default_factory=list)
    # Prompt position intervals [start, end) whose block had a cache lifetime on this engine that
    # ended before admission: computing them is recompute after eviction (sorted, disjoint).
    eviction_spans: list[list[int]] = field(default_factory=list)
    expert_layers: int = 0
    expert_experts: int = 0
    experts: list[int] = field(default_factory=list)
    seq_gap: bool = False
    admission_seq: int = -1
    closed: bool = False
    close_ts: int = 0
    output: dict[str, Any] | None = None  # the RequestAccounting record once closed
    finish: dict[str, Any] | None = None  # RequestFinished payload while waiting for routing
    # Fields added with the two-axis position model (appended: older persisted states still load).
    recomputed_eviction: int = 0  # first computation for this request of blocks evicted before
    evicted_blocks_recomputed: int = 0
    draft_cut: int = 0  # drafts computed, then thrown away because the request stopped
    reopened: dict[str, Any] | None = None  # the record emitted by an idle-timeout close, if reopened
    # Added with sessions (appended: older persisted states still load).
    session_id: str = ""  # the session the client named (RequestStarted.session_id)
    # Token records (schema v3): what the engine's privacy mode let out, kept until the record.
    prompt_ids: list[int] = field(default_factory=list)  # raw mode
    prompt_hashes: list[int] = field(default_factory=list)  # hashed mode
    output_ids: list[int] = field(default_factory=list)  # raw mode
    # Added with look-up by the client's id (appended: older persisted states still load).
    external_request_id: str = ""  # the front end's id of the API request (RequestStarted)
    parent_request_id: str = ""  # the API request whose n choices this is one of; "" when n = 1
    choice_index: int = 0
    # Added with async scheduling (appended: older persisted states still load). Tokens vLLM had
    # processed when it scheduled the last step, what it frees sliding-window blocks on (-1: the
    # last step's num_computed_before; no earlier step of the request was in flight then).
    release_basis: int = -1
    # Added with KV connectors (appended): prompt positions loaded from outside this engine.
    external_kv: int = 0
    # Added with the fold's caveats (appended; streams/caveats.py): the share of the epoch's cold
    # first step, and when the prefix history some cached block's source was lost with.
    warmup_gpu_ns: float = 0.0
    source_lost_ns: int = 0
    # Added with KV memory-time (appended; streams/kv_memory.py has the per-group layout):
    # per KV-cache group the block table, null blocks, peak and the integrals; the (step, ts) of
    # the last change of the holding ([-1, 0]: holds nothing); the shared-block entries it is in
    # ([group, key, block index, then the entry's S and D when it joined]); the peak bytes held
    # over all groups (-1: not observed).
    kv: list[list[int]] = field(default_factory=list)
    kv_since: list[int] = field(default_factory=list)
    kv_shared: list[list[Any]] = field(default_factory=list)
    kv_peak_bytes: int = -1
    # Drafts of the request's last step that were not kept (rejected or cut): under async
    # scheduling vLLM allocated the next step as if they had been accepted.
    kv_last_dropped: int = 0
    # Of draft_cut, the drafts of a step in which the request ended before they were verified
    # (vLLM counts them nowhere; appended: older persisted states still load).
    draft_unverified: int = 0
    # Issue 36 (schema v7; appended: older persisted states still load). RequestStarted's
    # billing facts, carried to the record (sparseety/billing.py names them).
    priority: int = 0
    service_tier: str = ""
    cache_ttl: str = ""
    pd_join_id: str = ""
    pd_role: str = "none"
    # Prompt positions served at admission from the engine's other cache tiers (issue 36).
    cpu_offload_read: int = 0
    host_read: int = 0
    storage_read: int = 0
    # Issue 36 multimodal (appended): streams/multimodal.admitted of RequestStarted.mm_inputs
    # (per modality: placeholder positions, then those of them below the admission hit).
    mm: list[int] = field(default_factory=list)

    @property
    def uid(self) -> str:
        return f"{self.engine_id}/{self.request_id}"

    @classmethod
    def from_json(cls, data: list[Any]) -> Any:
        """Also loads a state persisted before the two-axis model (fields appended since)."""
        r = cls(*data[1:])
        if isinstance(r.eviction_spans, int):  # was recompute_until, a high-water mark
            r.eviction_spans = [[0, r.eviction_spans]] if r.eviction_spans else []
        for seg in r.segments:
            if len(seg) == 6:  # before kv_fate
                seg.append("kept")
        return r


@dataclass(slots=True)
class EpochState(_Record):
    """One engine epoch: what makes its event streams totally ordered and windowed."""

    TAG: ClassVar[str] = "E"

    engine_name: str
    engine_id: str
    config: dict[str, Any] | None = None  # EngineStarted payload
    next_seq: dict[str, int] = field(default_factory=dict)  # per stream
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)  # stream -> {seq: event}
    gaps: int = 0  # events declared lost
    duplicates: int = 0
    watermark: int = 0  # max event time seen (wall ns)
    open_requests: list[str] = field(default_factory=list)
    pending_close: dict[str, list[Any]] = field(default_factory=dict)  # rid -> [last_step, ts, reason]
    worker_step: int = -1  # highest step the worker stream reported routing for
    windows: dict[str, list[Any]] = field(default_factory=dict)  # "start|model|tenant" -> counters
    closed_through: int = 0  # windows starting before this are closed (wall ns)
    cleared: list[int] = field(default_factory=list)  # seqs of KvCleared
    block_count: int = 0
    retiring: list[list[Any]] = field(default_factory=list)  # [request_id, close_ts] of closed requests
    stopped: bool = False
    superseded: bool = False  # a newer epoch of the same engine started
    producer_stats: dict[str, int] = field(default_factory=dict)
    unknown_requests: int = 0  # step entries for request ids never started here (no state made)
    step_seq: int = -1  # core-stream seq of the last StepBatch (a step's KV events come after it)
    history_lost_ts_ns: int = 0  # event time after the last core-stream gap (streams/caveats.py)
    kv_last_step: int = -1  # step number of the last StepBatch (a request's KV hold ends after it)
    #: The KV clock: the latest step start seen (StepBatch ts - duration). Under async scheduling
    #: a step's duration includes waiting for the one before, so starts are not monotone; KV
    #: memory-time integrates over this running maximum.
    kv_clock: int = 0
    #: KV events of an offload tier (medium other than the device's; issue 36): counted, not
    #: indexed (appended: older persisted states still load).
    offload_events: int = 0


@dataclass(slots=True)
class HeadState(_Record):
    """Which epoch of an engine name is current."""

    TAG: ClassVar[str] = "N"

    engine_name: str
    current: str = ""


# --- serialisation ----------------------------------------------------------------------------

_TAGS: dict[str, type[_Record]] = {c.TAG: c for c in (RequestState, EpochState, HeadState)}


def _default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return {"$b": obj.hex()}
    if isinstance(obj, (tuple, array)):
        # array('i'): a packed StepBatch column as decoded (sparseety.packed), e.g. an event held
        # in the reorder buffer; it reads back as a list of the same ints, as older events decode
        return list(obj)
    if isinstance(obj, _Record):
        return obj.to_json()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and "$b" in obj:
        return bytes.fromhex(obj["$b"])
    return obj


# One encoder for every value: json.dumps with options builds a new JSONEncoder per call, a third
# of the cost of a small value (a prompt block's lifetimes), and the worker encodes every dirty key
# at each flush. Same options as before, so the bytes are identical. Now only the fallback for
# values MessagePack cannot hold (ints beyond 64 bits).
_ENCODER = json.JSONEncoder(default=_default, separators=(",", ":"))


def _enc_hook(obj: Any) -> Any:
    # msgspec writes tuples as arrays and bytes/bytearray as bin itself; it calls this for the rest.
    # (It also writes a dataclass as a map without asking: records are top-level values only, which
    # encode_state turns into their lists.)
    if isinstance(obj, array):
        # a packed StepBatch column held in the reorder buffer: reads back as a list, as in JSON
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


#: First byte of a MessagePack state value. A JSON value starts with ``[``, ``{``, ``"``, a digit,
#: ``-``, ``n``, ``t`` or ``f``, so values written before this format still decode.
MSGPACK = b"\x01"

# One encoder and one decoder, reused (each call to msgspec.msgpack.encode would build one).
_MSGPACK_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_MSGPACK_DECODER = msgspec.msgpack.Decoder()


def encode_state(value: Any) -> bytes:
    """Serialise a state value (a record or a plain structure of str-keyed dicts, lists, tuples,
    ``array``, bytes, str, numbers, bools and None): :data:`MSGPACK` + MessagePack."""
    if isinstance(value, _Record):
        value = value.to_json()
    try:
        return MSGPACK + _MSGPACK_ENCODER.encode(value)
    except OverflowError:  # an int beyond 64 bits: JSON holds any int, so such a value stays JSON
        return _ENCODER.encode(value).encode()


def decode_state(data: bytes) -> Any:
    """Inverse of :func:`encode_state`; also reads the JSON values written before MessagePack."""
    if data[:1] == MSGPACK:
        value = _MSGPACK_DECODER.decode(memoryview(data)[1:])
    else:
        value = json.loads(data, object_hook=_hook)
    if isinstance(value, list) and value and isinstance(value[0], str) and value[0] in _TAGS:
        return _TAGS[value[0]].from_json(value)
    return value


# --- stores ------------------------------------------------------------------------------------


class StateStore(Protocol):
    """Key-value state the assembler folds into. Values are live objects; ``put`` marks them dirty."""

    def get(self, key: str) -> Any | None: ...

    def put(self, key: str, value: Any) -> None: ...

    def get_many(self, keys: list[str]) -> list[Any | None]:
        """:meth:`get` for several keys, in their order (the prefix index reads a prompt's or a
        KV event's blocks at once: a method call per block was a visible share of an admission)."""
        ...

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        """:meth:`put` for several ``(key, value)`` pairs, in their order."""
        ...

    def touch(self, key: str) -> None:
        """Mark a value returned by ``get`` and changed in place as dirty."""
        ...

    def touch_many(self, keys: list[str]) -> None:
        """:meth:`touch` for several keys."""
        ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str) -> Iterator[str]: ...

    def lease(self, key: str, lessee: Lessee) -> None:
        """``lessee`` holds ``key``'s value newer than its object until the lease ends."""
        ...

    def unlease(self, key: str) -> None: ...

    def sync(self) -> None:
        """Make every object current (each lessee writes its changes back)."""
        ...

    def drop_lessee(self, lessee: Lessee) -> None:
        """Forget a lessee that holds no key any more."""
        ...


class Lessee(Protocol):
    """Holds some values newer than the store's objects (``streams.columnar.SteadyColumns``)."""

    def release(self, key: str) -> None:
        """Write ``key``'s value back into its object and stop holding it."""
        ...

    def sync(self) -> None:
        """Write every changed value back into its object (and mark it dirty in the store)."""
        ...


class MemoryStore:
    """A dict; tracks dirty keys so an adapter can persist them (epoch keys last).

    Leases: a :class:`Lessee` (the fold's steady columns) may hold a key's value newer than the
    object in ``data``. Any ``get``, ``put`` or ``delete`` of a leased key first ends the lease (the
    lessee writes the value back), so readers always see the current state; :meth:`sync` writes
    back every lessee's changes without ending the leases (``data`` is then current: the worker
    does it before each changelog write, tests before reading ``data`` directly).
    """

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.dirty: set[str] = set()
        self.deleted: set[str] = set()
        self.leased: dict[str, Lessee] = {}
        self.lessees: list[Lessee] = []

    def lease(self, key: str, lessee: Lessee) -> None:
        self.leased[key] = lessee
        if lessee not in self.lessees:
            self.lessees.append(lessee)

    def unlease(self, key: str) -> None:
        """End the lease on ``key`` (if any): its value is written back."""
        lessee = self.leased.pop(key, None)
        if lessee is not None:
            lessee.release(key)

    def sync(self) -> None:
        for lessee in self.lessees:
            lessee.sync()

    def drop_lessee(self, lessee: Lessee) -> None:
        if lessee in self.lessees:
            self.lessees.remove(lessee)

    def get(self, key: str) -> Any | None:
        if self.leased and key in self.leased:
            self.unlease(key)
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        if self.leased and key in self.leased:
            self.unlease(key)
        self.data[key] = value
        self.dirty.add(key)
        if self.deleted:
            self.deleted.discard(key)

    def get_many(self, keys: list[str]) -> list[Any | None]:
        if self.leased and not self.leased.keys().isdisjoint(keys):
            return [self.get(k) for k in keys]
        get = self.data.get
        return [get(k) for k in keys]

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        if self.leased and any(k in self.leased for k, _ in items):
            for k, v in items:
                self.put(k, v)
            return
        data = self.data
        dirty = self.dirty
        for k, v in items:
            data[k] = v
        dirty.update(k for k, _ in items)
        if self.deleted:
            self.deleted.difference_update(k for k, _ in items)

    def touch(self, key: str) -> None:
        self.dirty.add(key)

    def touch_many(self, keys: list[str]) -> None:
        self.dirty.update(keys)

    def delete(self, key: str) -> None:
        if self.leased and key in self.leased:
            self.unlease(key)
        if self.data.pop(key, None) is not None:
            self.deleted.add(key)
        self.dirty.discard(key)

    def keys(self, prefix: str) -> Iterator[str]:
        return (k for k in list(self.data) if k.startswith(prefix))

    def size_bytes(self, prefix: str = "") -> int:
        """Serialised size of the values under ``prefix`` (for state-size benchmarks)."""
        self.sync()
        return sum(len(encode_state(v)) for k, v in self.data.items() if k.startswith(prefix))


class Changelog(Protocol):
    """Where a :class:`TableStore` persists one partition's state (raw keys and values)."""

    def get(self, key: bytes) -> bytes | None: ...

    def keys(self, prefix: bytes) -> list[bytes]: ...

    async def write(self, items: list[tuple[bytes, bytes]], deleted: list[bytes]) -> None:
        """Persist ``items`` in this order, then ``deleted``; return once durable."""
        ...


class TableStore(MemoryStore):
    """The plain store over a changelog: values are decoded on first read and cached; ``flush``
    writes the dirty ones (epoch and head keys last) and the deletions.

    The worker's changelog is a Faust table (:class:`sparseety.streams.compat.ChangelogTable`).
    """

    def __init__(self, changelog: Changelog) -> None:
        super().__init__()
        self.changelog = changelog

    def get(self, key: str) -> Any | None:
        if self.leased and key in self.leased:
            self.unlease(key)
        value = self.data.get(key)
        if value is None:
            if key in self.deleted:
                # Deleted since the last flush: the changelog still holds the old value until the
                # deletion is written, and reading it would bring the state back.
                return None
            raw = self.changelog.get(key.encode())
            if raw is None:
                return None
            value = self.data[key] = decode_state(raw)
        return value

    def get_many(self, keys: list[str]) -> list[Any | None]:
        # values already read are in ``data`` (leased ones written back); the rest as :meth:`get`
        # reads them: none for a key deleted since the flush, else from the changelog
        found = super().get_many(keys)
        if None not in found:
            return found
        deleted, data, read = self.deleted, self.data, self.changelog.get
        for i, value in enumerate(found):
            if value is None:
                key = keys[i]
                if key in deleted:
                    continue
                raw = read(key.encode())
                if raw is not None:
                    found[i] = data[key] = decode_state(raw)
        return found

    def delete(self, key: str) -> None:
        if self.leased and key in self.leased:
            self.unlease(key)
        self.data.pop(key, None)
        self.dirty.discard(key)
        self.deleted.add(key)

    def keys(self, prefix: str) -> Iterator[str]:
        found = {k.decode() for k in self.changelog.keys(prefix.encode())}
        found.update(k for k in self.data if k.startswith(prefix))
        return iter(sorted(found - self.deleted))

    async def flush(self) -> int:
        """Write dirty keys (epoch and head keys last) and deletions; return how many."""
        self.sync()  # the fold's steady columns: each changed request once per flush
        items = [
            (k.encode(), encode_state(self.data[k])) for k in sorted(self.dirty, key=lambda k: k[0] in "en")
        ]
        deleted = [k.encode() for k in self.deleted]
        self.dirty.clear()
        self.deleted.clear()
        await self.changelog.write(items, deleted)
        return len(items) + len(deleted)
