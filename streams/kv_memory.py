"""KV memory-time per request: which KV blocks a request holds, step by step, per KV-cache group.

Computed downstream from facts the engine already emits (docs/streams.md, "KV memory-time"):
each StepBatch gives a request's ``num_computed_before`` (``c``) and scheduled tokens (``n``);
vLLM's ``allocate_slots`` then holds, in a group of block size ``bs``, a block table of
``ceil(min(c + n + lookahead, max_model_len) / bs)`` blocks (it only grows until the request is
preempted or ends), of which a sliding-window or chunked group has replaced the front with the
null block: ``released_end(basis) // bs`` blocks (``streams/attention.py``; the front of a
prefix-cache hit is null-filled the same way, and those blocks were never held). A request holds
its blocks from the step that allocated them to the step that frees them: its preemption (vLLM
frees while scheduling that step) or its end (freed in the update of its last step).

Per group the request accumulates (integers; ``KV_*`` index the per-group list):

* block-steps and block-nanoseconds of its own block table (shared prefix blocks counted whole:
  the *held* view), the peak blocks, token slots used and allocated (the gap is fragmentation);
* the deltas that turn the held view into the two attribution modes for blocks it shares through
  the prefix cache with other running requests: a physical block is held once, so its time is
  split among its holders (``amortized``: each holder ``dt / n`` of every interval it holds the
  block with ``n - 1`` others, rounded to integers as holders leave, the rounding carried to the
  next leaver so nothing is lost) or charged to its first holder (``actual``: the request that
  computed it while it holds it, else the holder that joined first). Σ amortized = Σ actual =
  physical block-time once every holder has left.

Sharing is tracked per (group, block hash, cache lifetime) in a state entry ``k|<engine>|...``:
the holders in the order they joined and running integrals (:func:`settle_entry`). A holder keeps
a snapshot of those integrals from when it joined and settles its own share when it leaves, so a
join or a leave costs the same whether 2 or 2,000 requests share the block (a fleet's system
prompt), and the per-step cost stays a few integer operations per request.
"""

from __future__ import annotations

from typing import Any

from . import attention
from . import prefix_index as pidx
from .state import block_key, kv_share_key, request_key

# Per-group list layout in RequestState.kv.
(
    KV_TABLE,  # block-table length since (re)admission, null blocks included
    KV_NULL,  # front blocks replaced by the null block (window or chunk released; hit front)
    KV_PEAK,  # peak blocks held
    KV_STEPS,  # block-steps held (own block table)
    KV_NS,  # block-nanoseconds held (own block table)
    KV_USED,  # token-slot-steps used (slots of held blocks that hold KV)
    KV_USED_NOW,  # slots used now
    KV_AM_STEPS,  # amortized delta, block-steps
    KV_AM_NS,  # amortized delta, block-ns
    KV_AC_STEPS,  # actual delta, block-steps
    KV_AC_NS,  # actual delta, block-ns
    KV_NEVER,  # null blocks at the first allocation: the front of a hit never held (-1: not yet)
) = range(12)
_WIDTH = 12

#: Page-size fallback when the producer did not report one: bytes per element of a KV dtype.
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def bytes_per_block(config: dict[str, Any], group: dict[str, Any]) -> int:
    """Bytes one block of ``group`` occupies over the group's layers (0: not known).

    vLLM's own page size when the producer reported it (``KvCacheGroup.page_size_bytes``: one
    layer's block, as allocated, fp8 and MLA included), else ``2 (K and V) · KV heads · head size
    · block size · dtype bytes`` from EngineStarted (attention layers only).
    """
    layers = int(group.get("num_layers") or 0)
    page = int(group.get("page_size_bytes") or 0)
    if not page:
        dtype = str(config.get("kv_cache_dtype") or "")
        if dtype in ("", "auto"):
            dtype = str(config.get("dtype") or "")
        width = _DTYPE_BYTES.get(dtype.removeprefix("torch."), 0)
        heads, head = int(config.get("num_kv_heads") or 0), int(config.get("head_dim") or 0)
        page = 2 * heads * head * int(group.get("block_size") or 0) * width
    return page * layers


class KvShape:
    """What the fold needs of an engine's KV-cache groups (one per epoch, cached by the fold)."""

    __slots__ = (
        "block_size",
        "bytes",
        "count",
        "groups",
        "hash_block",
        "kinds",
        "lookahead",
        "max_len",
        "observed",
        "raw",
        "releases",
        "releasing",
    )

    def __init__(self, config: dict[str, Any] | None) -> None:
        cfg = config or {}
        self.raw = list(cfg.get("kv_cache_groups") or [])
        self.groups = attention.groups_of(cfg)
        self.kinds = [str(g.get("kind", "")) for g in self.raw]
        self.block_size = [g.block_size for g in self.groups]
        self.bytes = [bytes_per_block(cfg, g) for g in self.raw]
        self.lookahead = int(cfg.get("num_lookahead_tokens") or 0)
        self.max_len = int(cfg.get("max_model_len") or 0) or (1 << 62)
        self.hash_block = int(cfg.get("block_size") or 0)
        #: Some group frees blocks while the request runs (sliding window, chunked attention).
        self.releasing = [g if g.frees and g.limited else None for g in self.groups]
        self.releases = any(g is not None for g in self.releasing)
        self.count = len(self.groups)
        #: KV memory-time is folded: there are groups, each with a block size (read per step).
        self.observed = bool(self.groups) and all(self.block_size)


def _ensure(r: Any, n: int) -> list[list[int]]:
    if len(r.kv) != n:
        r.kv = [[0] * (_WIDTH - 1) + [-1] for _ in range(n)]
    return r.kv  # type: ignore[no-any-return]


def settle(r: Any, step: int, ts: int) -> None:
    """Add what the request held since its last change up to (``step``, ``ts``)."""
    since = r.kv_since
    if not since or since[0] < 0:
        return
    ds, dt = max(0, step - since[0]), max(0, ts - since[1])
    for g in r.kv:
        held = g[KV_TABLE] - g[KV_NULL]
        g[KV_STEPS] += held * ds
        g[KV_NS] += held * dt
        g[KV_USED] += g[KV_USED_NOW] * ds
    since[0], since[1] = step, ts


def on_step(shape: KvShape, r: Any, step: int, ts: int, computed: int, n: int, basis: int) -> None:
    """The request's holding after vLLM allocated for this step (``computed`` = c, ``basis`` =
    the tokens vLLM had processed, what it frees window blocks on).

    Once per request per engine step (:func:`on_steps` calls it): :func:`settle` and the
    per-group update inlined, the group constants zipped from the shape.
    """
    kv = r.kv
    if len(kv) != shape.count:
        kv = _ensure(r, shape.count)
    since = r.kv_since
    ds = dt = 0
    if since and since[0] >= 0:
        ds, dt = step - since[0], ts - since[1]
        ds, dt = (ds if ds > 0 else 0), (dt if dt > 0 else 0)
        since[0], since[1] = step, ts
    else:
        r.kv_since = [step, ts]
    end = computed + n + shape.lookahead
    if end > shape.max_len:
        end = shape.max_len
    written = computed + n
    total_bytes = 0
    for g, bs, releasing, nbytes in zip(kv, shape.block_size, shape.releasing, shape.bytes, strict=True):
        table, null = g[KV_TABLE], g[KV_NULL]
        if ds or dt:  # what it held since its last change (settle, inlined)
            held = table - null
            g[KV_STEPS] += held * ds
            g[KV_NS] += held * dt
            g[KV_USED] += g[KV_USED_NOW] * ds
        grown = -(-end // bs)
        if grown > table:
            table = g[KV_TABLE] = grown
        if releasing is not None:
            freed = releasing.released_end(basis) // bs
            freed = freed if freed < table else table
            if freed > null:
                null = g[KV_NULL] = freed
        if g[KV_NEVER] < 0:
            g[KV_NEVER] = null
        held = table - null
        if held > g[KV_PEAK]:
            g[KV_PEAK] = held
        used = (written if written < table * bs else table * bs) - null * bs
        g[KV_USED_NOW] = used if used > 0 else 0
        total_bytes += held * nbytes
    if total_bytes > r.kv_peak_bytes:
        r.kv_peak_bytes = total_bytes


def on_steps(shape: KvShape, store: Any, step: int, ts: int, items: list[tuple[Any, int, int, int]]) -> None:
    """:func:`on_step` for each ``(request, computed, n, basis)`` scheduled in an engine step, then
    the window releases of its shared blocks. Called once per step: the common shape (one
    KV-cache group that frees nothing while a request runs: full attention) has its own loop with
    the group's constants in locals, which is what per-request calls cost most (the same
    arithmetic as :func:`on_step`, whose general loop the harness's hybrid modes check)."""
    if shape.count != 1 or shape.releases:
        for r, computed, n, basis in items:
            on_step(shape, r, step, ts, computed, n, basis)
            if r.kv_shared and shape.releases:
                release_window(r, shape, store, step, ts)
        return
    bs, nbytes, lookahead, max_len = shape.block_size[0], shape.bytes[0], shape.lookahead, shape.max_len
    for r, computed, n, _basis in items:
        kv = r.kv
        if len(kv) != 1:
            kv = _ensure(r, 1)
        g = kv[0]
        table, null = g[KV_TABLE], g[KV_NULL]
        since = r.kv_since
        if since and since[0] >= 0:
            ds, dt = step - since[0], ts - since[1]
            if ds > 0 or dt > 0:
                ds, dt = (ds if ds > 0 else 0), (dt if dt > 0 else 0)
                held = table - null
                g[KV_STEPS] += held * ds
                g[KV_NS] += held * dt
                g[KV_USED] += g[KV_USED_NOW] * ds
            since[0], since[1] = step, ts
        else:
            r.kv_since = [step, ts]
        written = computed + n
        end = written + lookahead
        if end > max_len:
            end = max_len
        cap = table * bs
        if end > cap:
            table = g[KV_TABLE] = -(-end // bs)
            cap = table * bs
        if g[KV_NEVER] < 0:
            g[KV_NEVER] = null
        held = table - null
        if held > g[KV_PEAK]:
            g[KV_PEAK] = held
        used = (written if written < cap else cap) - null * bs
        g[KV_USED_NOW] = used if used > 0 else 0
        if held * nbytes > r.kv_peak_bytes:
            r.kv_peak_bytes = held * nbytes


def drop(r: Any, step: int, ts: int) -> None:
    """The request's blocks are freed at (``step``, ``ts``): preemption or its end."""
    settle(r, step, ts)
    for g in r.kv:
        g[KV_TABLE] = g[KV_NULL] = g[KV_USED_NOW] = 0
    r.kv_since = [-1, 0]


def holds(r: Any, group: int, index: int) -> bool:
    """Whether the request holds block ``index`` of ``group`` now."""
    if r.closed or not r.kv_since or r.kv_since[0] < 0 or len(r.kv) <= group:
        return False
    g = r.kv[group]
    return bool(g[KV_NULL] <= index < g[KV_TABLE])


# --- shared blocks -------------------------------------------------------------------------------


#: Fixed-point scale of an entry's per-holder share (``dt / n`` kept to 2^-32 of a unit).
_SCALE = 1 << 32


def new_entry(group: int, step: int, ts: int) -> dict[str, Any]:
    """A shared-block entry: group, holders, last settled (step, ts), and per unit (block-steps,
    block-ns) the running integrals: ``S`` Σ dt/n (scaled by ``_SCALE``, what one holder held),
    ``D`` Σ dt (the physical block-time), ``c`` the rounding not yet handed out (scaled) and ``f``
    the ``D`` at which the current first holder became first."""
    return {"g": group, "h": [], "s": step, "t": ts, "S": [0, 0], "D": [0, 0], "c": [0, 0], "f": [0, 0]}


def _integrals(entry: dict[str, Any]) -> None:
    # Entries written before the integrals existed were settled eagerly up to (s, t): their
    # holders' snapshots read as zeros (items of length 3), so starting the integrals at zero
    # here continues them exactly.
    if "S" not in entry:
        entry.update(S=[0, 0], D=[0, 0], c=[0, 0], f=[0, 0])


def settle_entry(entry: dict[str, Any], step: int, ts: int) -> None:
    """Advance the entry's integrals to (``step``, ``ts``) for its current holders."""
    _integrals(entry)
    n = len(entry["h"])
    ds, dt = max(0, step - entry["s"]), max(0, ts - entry["t"])
    entry["s"], entry["t"] = step, ts
    if not n or not (ds or dt):
        return
    share, total, carry = entry["S"], entry["D"], entry["c"]
    for u, d in ((0, ds), (1, dt)):
        if d:
            scaled = d * _SCALE
            each = scaled // n
            share[u] += each
            carry[u] += scaled - each * n  # what flooring lost, handed out with the next leaver
            total[u] += d


def snapshot(entry: dict[str, Any]) -> list[int]:
    """What a holder joining now keeps: ``S`` and ``D`` per unit."""
    return [entry["S"][0], entry["S"][1], entry["D"][0], entry["D"][1]]


def settle_holder(entry: dict[str, Any], r: Any, item: list[Any]) -> None:
    """The holder leaves the (settled) entry: add its amortized and actual deltas to its row."""
    rid = r.request_id
    holders = entry["h"]
    if rid not in holders:
        return
    snap = item[3:7] if len(item) >= 7 else [0, 0, 0, 0]
    first = holders[0] == rid
    total, carry, share, since_first = entry["D"], entry["c"], entry["S"], entry["f"]
    deltas = []
    for u in (0, 1):
        held = total[u] - snap[2 + u]
        pool = carry[u] + share[u] - snap[u]
        mine = pool // _SCALE
        carry[u] = pool - mine * _SCALE
        owned = total[u] - since_first[u] if first else 0
        deltas.append((mine - held, owned - held))
    g = entry["g"]
    if len(r.kv) > g:
        row = r.kv[g]
        row[KV_AM_STEPS] += deltas[0][0]
        row[KV_AM_NS] += deltas[1][0]
        row[KV_AC_STEPS] += deltas[0][1]
        row[KV_AC_NS] += deltas[1][1]
    holders.remove(rid)
    if first:
        entry["f"] = [total[0], total[1]]


def hit_blocks(
    r: Any, shape: KvShape, store: Any, engine_id: str, seq: int, hit: int, first: bool, cleared: list[int]
) -> list[tuple[int, str, int, str | None]]:
    """``(block index, hash hex, lifetime seq, computer request id)`` of each full prompt block of
    a hit that has a cache lifetime (the index, because the blocks before a sliding window have
    none: vLLM never cached them, and the ones after keep their own positions)."""
    bs = shape.hash_block
    if not bs:
        return []
    out = []
    for i in range(min(hit // bs, len(r.blocks))):
        hexh, role, lifetime = r.blocks[i]
        block = store.get(block_key(engine_id, hexh))
        if block is None:
            continue
        if first and role == "cached" and lifetime >= 0:
            lt = None
            for x in block["l"]:
                if x[pidx.STORED] == lifetime:
                    lt = x
                    break
        else:
            lt = pidx.live_as_of(block, seq, cleared)
        if lt is None:
            continue
        out.append((i, hexh, int(lt[pidx.STORED]), lt[pidx.COMPUTED_BY]))
    return out


def leave(r: Any, store: Any, step: int, ts: int, *, group: int = -1, below: int = 0) -> None:
    """The request stops holding its shared blocks (all, or those of ``group`` below ``below``)."""
    keep = []
    for item in r.kv_shared:
        g, key, index = item[0], item[1], item[2]
        if group >= 0 and (g != group or index >= below):
            keep.append(item)
            continue
        entry = store.get(key)
        if entry is None:
            continue
        settle_entry(entry, step, ts)
        settle_holder(entry, r, item)
        if entry["h"]:
            store.put(key, entry)
        else:
            store.delete(key)
    r.kv_shared = keep


def join(
    r: Any,
    shape: KvShape,
    store: Any,
    engine_id: str,
    blocks: list[tuple[int, str, int, str | None]],
    step: int,
    ts: int,
    holder: Any,
) -> None:
    """The request holds the blocks of a prefix-cache hit from this step on."""
    for i, hexh, lifetime, computer in blocks:
        for g in range(len(shape.groups)):
            if shape.block_size[g] != shape.hash_block or not holds(r, g, i):
                continue
            key = kv_share_key(engine_id, g, hexh, lifetime)
            entry = store.get(key)
            if entry is None:
                entry = new_entry(g, step, ts)
                owner = holder(computer) if computer and computer != r.request_id else None
                if owner is not None and holds(owner, g, i):
                    entry["h"].append(owner.request_id)
                    owner.kv_shared.append([g, key, i, *snapshot(entry)])
                    store.touch(request_key(engine_id, owner.request_id))
            settle_entry(entry, step, ts)
            if r.request_id not in entry["h"]:
                entry["h"].append(r.request_id)
                r.kv_shared.append([g, key, i, *snapshot(entry)])
            store.put(key, entry)


def release_window(r: Any, shape: KvShape, store: Any, step: int, ts: int) -> None:
    """Shared blocks a sliding window or chunk released this step end their hold."""
    if not r.kv_shared or not shape.releases:
        return
    for g, grp in enumerate(shape.groups):
        null = r.kv[g][KV_NULL] if grp.frees and grp.limited and len(r.kv) > g else 0
        if null and any(item[0] == g and item[2] < null for item in r.kv_shared):
            leave(r, store, step, ts, group=g, below=null)


def record(shape: KvShape, r: Any) -> list[dict[str, Any]]:
    """RequestAccounting.kv_groups: one KvGroupUse per KV-cache group ([]: not observed)."""
    if not r.kv or len(r.kv) != len(shape.groups):
        return []
    out = []
    for gi, g in enumerate(r.kv):
        bs = shape.block_size[gi]
        out.append(
            {
                "kind": shape.kinds[gi],
                "block_size": bs,
                "bytes_per_block": shape.bytes[gi],
                "peak_blocks": g[KV_PEAK],
                "never_held_blocks": max(0, g[KV_NEVER]),
                "block_steps": g[KV_STEPS],
                "block_ns": g[KV_NS],
                "block_steps_amortized": g[KV_STEPS] + g[KV_AM_STEPS],
                "block_ns_amortized": g[KV_NS] + g[KV_AM_NS],
                "block_steps_actual": g[KV_STEPS] + g[KV_AC_STEPS],
                "block_ns_actual": g[KV_NS] + g[KV_AC_NS],
                "slot_steps_used": g[KV_USED],
                "slot_steps_allocated": g[KV_STEPS] * bs,
            }
        )
    return out
