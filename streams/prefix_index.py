"""The per-engine prefix index: which request computed each cached block, and when it lived.

A block's state is ``{"l": [[stored_seq, removed_seq, computed_by, copies], ...], "c": claim,
"s": claim_seq}``: the cache *lifetimes* of that block hash on one engine epoch (oldest first, at
most ``MAX_LIFETIMES``), and a pending claim by the request that scheduled its computation before
the engine's BlockStored arrived (with the seq it was made at).

A claim no BlockStored ever follows is how a model without a full-attention group looks: vLLM
caches only the blocks of a sliding-window group a later hit can reach, and counts the others
(outside the window, never cached: null blocks) in the hit all the same. Such a block's source is
its pending claim, and its claim seq stands in for the lifetime it never had
(:func:`unstored_claim`), so amortized cost shares it like any other.

vLLM can hold several physical blocks with the same hash (two requests computed it before
either was cached). Each BlockStored of a hash already live adds a copy to that lifetime; each
BlockRemoved takes one away; the lifetime ends (``removed_seq``) only when its last copy goes.
``copies`` is ``[seqs of extra stores, seqs of removals]``, so re-applied events count once.

Queries are *as of* an event's seq, so the answer does not
depend on whether later events were already applied (replays after a crash stay exact).

KvCleared is kept as a list of seqs on the epoch rather than a write to every block.

Eviction policy (bounded memory): every block still cached is kept (the engine's KV cache
bounds their number); blocks whose last lifetime ended are history, kept only to recognise a
later recomputation. When the epoch holds more than ``prefix_index_max_blocks`` blocks, the
history blocks removed longest ago are dropped until 3/4 of the cap remains. Forgetting history
only weakens recompute detection: a recomputed block that was forgotten reads as computed.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

MAX_LIFETIMES = 4
STORED, REMOVED, COMPUTED_BY, COPIES = 0, 1, 2, 3

BlockState = dict[str, Any]


def new_block() -> BlockState:
    return {"l": [], "c": None}


def claimed_block(uid: str, seq: int) -> BlockState:
    """A block never seen before, claimed by request ``uid`` at ``seq``: what :func:`new_block`
    then :func:`claim` give (a block without lifetimes has none live), in one step."""
    return {"l": [], "c": uid, "s": seq}


def _cleared_between(cleared: list[int], lo: int, hi: int) -> int | None:
    """First KvCleared seq in (lo, hi], if any."""
    i = bisect_right(cleared, lo)
    if i < len(cleared) and cleared[i] <= hi:
        return cleared[i]
    return None


def _end(lifetime: list[Any], cleared: list[int], horizon: int) -> int | None:
    """Seq at which a lifetime ended, as of ``horizon`` (None: still alive then)."""
    end = lifetime[REMOVED]
    clear = _cleared_between(cleared, lifetime[STORED], horizon)
    if clear is not None and (end is None or clear < end):
        end = clear
    if end is not None and end > horizon:
        return None
    return end  # type: ignore[no-any-return]


def live_as_of(block: BlockState, seq: int, cleared: list[int]) -> list[Any] | None:
    """The lifetime alive at ``seq`` (stored at or before it, not yet removed or cleared)."""
    for lt in reversed(block["l"]):
        if lt[STORED] <= seq:
            return lt if _end(lt, cleared, seq) is None else None
    return None


def evicted_before(block: BlockState, seq: int, cleared: list[int]) -> bool:
    """Whether this hash was cached and then dropped before ``seq`` (so computing it is a recompute)."""
    return any(lt[STORED] < seq and _end(lt, cleared, seq) is not None for lt in block["l"])


def live_at_lookup(block: BlockState, uid: str, seq: int, step_seq: int, cleared: list[int]) -> bool:
    """Whether a copy of the hash was cached when vLLM looked request ``uid`` up (admitted at
    ``seq``, in the step after the StepBatch at ``step_seq``).

    A step's KV events precede its admissions, so a lifetime alive at ``seq`` that began after
    ``step_seq`` was begun by an allocation of this step: the request's own (nobody else claims
    it) or an earlier admission's of the same step, which vLLM had cached before this lookup.
    """
    live = live_as_of(block, seq, cleared)
    if live is None:
        return False
    if live[STORED] <= step_seq:
        return True
    return live[COMPUTED_BY] not in (None, uid)


def _copies(lifetime: list[Any]) -> list[list[int]]:
    if len(lifetime) <= COPIES:  # persisted before copies were counted
        lifetime.append([[], []])
    return lifetime[COPIES]  # type: ignore[no-any-return]


def live_copies(lifetime: list[Any]) -> int:
    """Physical copies of the hash alive in this lifetime (0 once it ended)."""
    if lifetime[REMOVED] is not None:
        return 0
    stores, removals = _copies(lifetime)
    return 1 + len(stores) - len(removals)


def on_stored(block: BlockState, seq: int) -> bool:
    """A BlockStored at ``seq``: begin a lifetime, or add a copy to the live one (idempotent).
    Returns whether anything changed."""
    lifetimes = block["l"]
    if not lifetimes:  # the common case, a first store: begin the first lifetime
        lifetimes.append([seq, None, block["c"], [[], []]])
        block["c"] = None
        block.pop("s", None)
        return True
    if any(lt[STORED] == seq or seq in _copies(lt)[0] for lt in lifetimes):
        return False
    for lt in reversed(lifetimes):
        if lt[STORED] < seq:
            if lt[REMOVED] is None:
                _copies(lt)[0].append(seq)  # another physical copy of a hash still cached
                return True
            break
    computed_by = block["c"]
    block["c"] = None
    block.pop("s", None)
    lifetimes.append([seq, None, computed_by, [[], []]])
    lifetimes.sort(key=lambda lt: lt[STORED])
    del lifetimes[:-MAX_LIFETIMES]
    return True


def on_removed(block: BlockState, seq: int) -> bool:
    """A BlockRemoved at ``seq``: drop one copy of the lifetime alive then; the lifetime ends
    with its last copy (idempotent)."""
    for lt in reversed(block["l"]):
        if lt[STORED] <= seq:
            if lt[REMOVED] is not None:
                return False
            stores, removals = _copies(lt)
            if seq in removals:
                return False
            if len(removals) < len(stores):
                removals.append(seq)
            else:
                lt[REMOVED] = seq
            return True
    return False


def claim(block: BlockState, uid: str, seq: int, cleared: list[int]) -> None:
    """Request ``uid`` computes this block (decided at ``seq``): credit it with the lifetime.

    If the engine already reported the block stored (same step, published first) and nobody
    owns that lifetime, the request owns it; otherwise the claim waits for the next BlockStored.
    """
    live = live_as_of(block, seq, cleared)
    if live is None:
        block["c"] = uid
        block["s"] = seq
    elif live[COMPUTED_BY] is None and live[STORED] >= seq - _SAME_STEP_WINDOW:
        live[COMPUTED_BY] = uid


#: How many seqs before a request's admission a BlockStored may come and still belong to it:
#: vLLM publishes a step's KV events before that step's output, i.e. before our admission event.
_SAME_STEP_WINDOW = 4096


def lifetime_of(block: BlockState | None, uid: str, seq: int, cleared: list[int]) -> int:
    """The lifetime seq this request computed or read, for amortized attribution (-1 if unknown)."""
    if block is None:
        return -1
    for lt in block["l"]:
        if lt[COMPUTED_BY] == uid:
            return int(lt[STORED])
    if block.get("c") == uid and "s" in block:
        return int(block["s"])  # computed, never cached (a null block of a sliding window)
    live = live_as_of(block, seq, cleared)
    return int(live[STORED]) if live is not None else -1


def unstored_claim(block: BlockState) -> tuple[str | None, int]:
    """The request that last claimed a block no BlockStored followed, and the claim's seq
    (``(None, -1)`` if none): the source of a sliding-window block vLLM counted in a hit without
    caching it."""
    if block.get("c") is None or "s" not in block:
        return None, -1
    return block["c"], int(block["s"])


def last_end(block: BlockState) -> int | None:
    """Seq at which the block's last lifetime was removed; None while it is cached. A block never
    stored is history from its claim on (the oldest claims are forgotten first)."""
    if not block["l"]:
        return int(block.get("s", -1))
    return block["l"][-1][REMOVED]  # type: ignore[no-any-return]
