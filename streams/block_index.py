"""The prefix index in the state store: one epoch's blocks, fed by KV events, bounded in size.

:mod:`streams.prefix_index` is the pure logic of one block's lifetimes; this module keeps those
blocks under :func:`~streams.state.block_key` in the :class:`~streams.state.StateStore`:

- :func:`on_kv_event` applies a BlockStored / BlockRemoved event (one KV-cache group is indexed,
  the others mirror the same hashes);
- :func:`bound` drops the oldest history when an epoch holds more blocks than allowed;
- :func:`block_uses` lists the blocks a closing request read and computed, with the lifetime each
  use belongs to (the record's ``block_uses``, which the sink's prefix dedup reads);
- :func:`cache_write_tokens` counts the prompt positions whose blocks the request wrote to the
  prefix cache (RequestAccounting.cache_write_tokens).
"""

from __future__ import annotations

from typing import Any

from . import prefix_index as pidx
from .state import EpochState, RequestState, StateStore, block_key, block_prefix

#: KV-cache group kinds that cache every full block of a request (vLLM's KVCacheSpecKind values;
#: older producers sent the spec class name).
_FULL_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "FullAttentionSpec", "MLAAttentionSpec"}
)


def primary_group_kind(config: dict[str, Any] | None) -> str | None:
    """The KV-cache group whose block lifetimes the prefix index follows: the first full-attention
    group. Sliding-window groups of a hybrid model cache only the blocks a later hit can reach
    (vLLM's sparse retention, ``reachable_block_mask``), so their lifetimes are not the prefix
    cache's; the first group stands in only for a model without a full-attention group."""
    groups = (config or {}).get("kv_cache_groups") or []
    for g in groups:
        if g["kind"] in _FULL_KINDS:
            return str(g["kind"])
    return groups[0]["kind"] if groups else None


def caches_every_block(config: dict[str, Any] | None) -> bool:
    """Whether the indexed group caches every full block of a request (a full-attention group).
    Where it does not (a model with sliding-window groups only), a prefix-cache hit also counts
    the blocks outside the window that vLLM never cached (see :mod:`streams.prefix_index`)."""
    return primary_group_kind(config) in _FULL_KINDS or not (config or {}).get("kv_cache_groups")


#: KV-event media of the engine's own prefix cache in accelerator memory (vLLM's block pool says
#: "GPU", on this CPU build too). None: a producer that does not say (every event before issue 36
#: was the device tier's).
DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "cuda", "xpu", "device"})


def device_medium(body: dict[str, Any]) -> bool:
    """Whether a KV event is about the device tier the prefix index follows. A KV offload tier's
    events (vLLM's OffloadingConnector: medium "CPU") are another cache: a block stored there is
    no new lifetime in the device cache, and one removed there ends none (issue 36)."""
    return body.get("medium") in DEVICE_MEDIA


def on_kv_event(
    store: StateStore, epoch: EpochState, seq: int, body: dict[str, Any], *, stored: bool, max_blocks: int
) -> None:
    """Apply one KvBlocksStored (``stored``) or KvBlocksRemoved event to the epoch's index (a
    device-tier event; :func:`device_medium`)."""
    if not device_medium(body):
        epoch.offload_events += 1
        return
    primary = primary_group_kind(epoch.config)
    if primary is not None and body.get("group_kind", primary) != primary:
        return  # other KV cache groups mirror the same hashes; index one group only
    prefix = block_key(epoch.engine_id, "")
    put = store.put
    for h in body["block_hashes"]:
        key = prefix + h.hex()
        block = store.get(key)
        if block is None:
            if not stored:
                continue  # removal of a block we never saw stored: nothing to end
            # a hash never seen: new_block + its first lifetime (pidx.on_stored), at once
            epoch.block_count += 1
            put(key, {"l": [[seq, None, None, [[], []]]], "c": None})
        elif stored and not block["l"]:
            # the common case, the first store of a block an admission claimed (pidx.on_stored)
            block["l"].append([seq, None, block["c"], [[], []]])
            block["c"] = None
            block.pop("s", None)
            put(key, block)
        elif pidx.on_stored(block, seq) if stored else pidx.on_removed(block, seq):
            put(key, block)
    if stored:
        bound(store, epoch, max_blocks)


def bound(store: StateStore, epoch: EpochState, cap: int) -> None:
    """Keep the epoch's index under ``cap`` blocks: past it, drop the history blocks whose last
    lifetime ended longest ago until 3/4 of the cap remains (blocks still cached stay)."""
    if epoch.block_count <= cap:
        return
    history = []
    count = 0
    for key in store.keys(block_prefix(epoch.engine_id)):
        count += 1
        block = store.get(key)
        end = pidx.last_end(block) if block is not None else -1
        if end is not None:
            history.append((end, key))
    history.sort()
    drop = max(0, count - cap * 3 // 4)
    for _, key in history[:drop]:
        store.delete(key)
    epoch.block_count = count - min(drop, len(history))


def block_uses(
    store: StateStore, epoch: EpochState, r: RequestState, finish: dict[str, Any]
) -> list[dict[str, Any]]:
    """The closing request's block uses: its prompt blocks as planned at admission (cached or
    computed, with the lifetime they belong to), then the output blocks its finish names.

    Output blocks already stored are claimed for the request here, at its close: that is when
    the engine says which blocks its output filled.
    """
    bs = (epoch.config or {}).get("block_size") or 0
    uses = []
    cleared = epoch.cleared
    prefix = block_key(epoch.engine_id, "")
    uid, admitted = r.request_id, r.admission_seq
    # the blocks whose lifetime the plan left open (computed ones), looked up at once
    found = iter(store.get_many([prefix + hexh for hexh, _, lifetime in r.blocks if lifetime < 0]))
    lifetime_of = pidx.lifetime_of
    computed_by, stored_at = pidx.COMPUTED_BY, pidx.STORED
    for hexh, role, lifetime in r.blocks:
        if lifetime < 0:
            block = next(found)
            # pidx.lifetime_of, its common case inlined: a lifetime this request computed
            for lt in block["l"] if block is not None else ():
                if lt[computed_by] == uid:
                    lifetime = int(lt[stored_at])
                    break
            else:
                lifetime = lifetime_of(block, uid, admitted, cleared)
        uses.append({"block_hash": bytes.fromhex(hexh), "lifetime_seq": lifetime, "role": role, "tokens": bs})
    for h in finish.get("output_block_hashes", []):
        hexh = h.hex()
        key = block_key(epoch.engine_id, hexh)
        block = store.get(key)
        # Credit only a block already stored: every block the request computed was stored
        # before its RequestFinished (vLLM publishes a step's KV events first). A block not
        # stored ends with the last output token, whose KV nobody computed; a pending claim
        # on it would credit this request with the next turn's computation of that block.
        if block is not None and pidx.live_as_of(block, r.seq, cleared) is not None:
            pidx.claim(block, r.request_id, r.seq, cleared)
            store.put(key, block)
        lifetime = pidx.lifetime_of(block, r.request_id, r.seq, cleared)
        uses.append({"block_hash": h, "lifetime_seq": lifetime, "role": "computed", "tokens": bs})
    return uses


def cache_write_tokens(store: StateStore, epoch: EpochState, r: RequestState) -> int:
    """Prompt positions of the closing request's cache writes: its prompt blocks it computed (or
    recomputed after an eviction) whose storing began a cache lifetime credited to it, a new
    entry of the prefix cache. Each block counts once, however often the request computed it.

    A block it computed while a copy of the same hash was already cached (two requests computed
    it in flight together) added no entry: the other request's lifetime holds it. vLLM's
    ``created_cache_tokens`` counts such a copy for both requests (docs/streams.md). A block
    never stored (a sliding-window block no later hit can reach) is no write.
    """
    bs = (epoch.config or {}).get("block_size") or 0
    written = 0
    prefix = block_key(epoch.engine_id, "")
    uid = r.request_id
    computed_by = pidx.COMPUTED_BY
    for block in store.get_many([prefix + hexh for hexh, role, _ in r.blocks if role != "cached"]):
        if block is not None:
            for lt in block["l"]:
                if lt[computed_by] == uid:
                    written += bs
                    break
    return written
