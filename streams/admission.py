"""The admission plan: a request's prompt positions laid out when it is admitted.

Blocks served from the prefix cache are ``cached`` with the request that computed them (from the
epoch's prefix index); blocks a KV connector loaded are ``external_kv``; the rest are computed,
or ``recomputed_after_eviction`` when the engine had cached and evicted them before this
admission. Computed blocks are claimed in the index for this request.
"""

from __future__ import annotations

from . import block_index
from . import prefix_index as pidx
from . import segments as sg
from .caveats import kv_events_observed
from .state import EpochState, RequestState, StateStore, block_key


def plan_prompt(
    store: StateStore,
    epoch: EpochState,
    r: RequestState,
    seq: int,
    hashes: list[bytes],
    prompt: int,
    cached: int,
    loaded: int | None = None,
    *,
    max_blocks: int,
) -> None:
    """Lay out the prompt's statuses at admission: cached blocks with their source, positions
    a KV connector loaded (``[cached, loaded)``), computed blocks (recomputed when the engine
    had cached and evicted them before), and claims."""
    bs = (epoch.config or {}).get("block_size") or 0
    segs = r.segments
    loaded = cached if loaded is None else max(cached, loaded)
    if cached and not kv_events_observed(epoch.config):
        r.source_lost_ns = epoch.history_lost_ts_ns  # no source is known (streams/caveats.py)
    if not bs or not hashes or not kv_events_observed(epoch.config):
        sg.append(segs, cached, sg.PROMPT, sg.CACHED)
        sg.append(segs, loaded - cached, sg.PROMPT, sg.EXTERNAL_KV)
        sg.append(segs, prompt - loaded, sg.PROMPT, sg.COMPUTED)
        return
    cleared = epoch.cleared
    every_block_cached = block_index.caches_every_block(epoch.config)
    prefix = block_key(epoch.engine_id, "")
    uid = r.request_id
    hexes = [h.hex() for h in hashes]
    keys = [prefix + hexh for hexh in hexes]
    # The blocks looked up at once (a hash twice in one prompt sees its first claim: one by one)
    found = store.get_many(keys) if len(set(keys)) == len(keys) else None
    n = len(hashes)
    i = 0
    while i < n:
        hexh = hexes[i]
        key = keys[i]
        block = found[i] if found is not None else store.get(key)
        start, end = i * bs, (i + 1) * bs
        if start < cached:
            # Served from the prefix cache (a fully cached prompt still recomputes its last
            # token, so the last block may be cached only in part).
            live = pidx.live_as_of(block, seq, cleared) if block is not None else None
            owner = live[pidx.COMPUTED_BY] if live else None
            lifetime = int(live[pidx.STORED]) if live else -1
            if live is None and block is not None and not every_block_cached:
                # Outside a sliding window: vLLM counts the block in the hit but never cached
                # it; the request that computed it is its source (streams/prefix_index.py).
                owner, lifetime = pidx.unstored_claim(block)
            source = f"{epoch.engine_id}/{owner}" if owner else None
            if owner is None and epoch.history_lost_ts_ns:
                r.source_lost_ns = epoch.history_lost_ts_ns  # docs: streams/caveats.py
            head = min(bs, cached - start)
            sg.append(segs, head, sg.PROMPT, sg.CACHED, source=source)
            sg.append(segs, bs - head, sg.PROMPT, sg.COMPUTED)
            r.blocks.append([hexh, "cached", lifetime])
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
            store.put(key, block)
        elif block is None:
            # Hashes this epoch never saw (most computed blocks), the whole run of them at once:
            # computed, and the request's pending claim (new_block + claim, without their
            # lookups: nothing to recompute).
            j = i + 1
            if found is not None:
                while j < n and found[j] is None:
                    j += 1
            epoch.block_count += j - i
            sg.append(segs, (j - i) * bs, sg.PROMPT, sg.COMPUTED)
            r.blocks.extend([hexes[k], "computed", -1] for k in range(i, j))
            # pidx.claimed_block(uid, seq) for each, as literals
            store.put_many([(keys[k], {"l": [], "c": uid, "s": seq}) for k in range(i, j)])
            i = j
            continue
        else:
            # Recomputed after eviction: a lifetime of the hash ended before admission and no
            # copy was live when vLLM looked the request up. Copies stored in this step (after
            # the previous StepBatch) by an earlier admission of the step were live then: a
            # hybrid model's request misses them when its sliding-window groups lack them.
            recompute = pidx.evicted_before(block, seq, cleared) and not pidx.live_at_lookup(
                block, r.request_id, seq, epoch.step_seq, cleared
            )
            sg.append(segs, bs, sg.PROMPT, sg.RECOMPUTED_EVICTION if recompute else sg.COMPUTED)
            if recompute:
                add_span(r.eviction_spans, start, end)
                r.evicted_blocks_recomputed += 1
            r.blocks.append([hexh, "recomputed" if recompute else "computed", -1])
            pidx.claim(block, r.request_id, seq, cleared)
            store.put(key, block)
        i += 1
    pos = n * bs
    tail = prompt - pos
    head = max(0, min(cached - pos, tail))
    sg.append(segs, head, sg.PROMPT, sg.CACHED)
    ext = max(0, min(loaded - pos - head, tail - head))
    sg.append(segs, ext, sg.PROMPT, sg.EXTERNAL_KV)
    sg.append(segs, tail - head - ext, sg.PROMPT, sg.COMPUTED)
    block_index.bound(store, epoch, max_blocks)


def add_span(spans: list[list[int]], start: int, end: int) -> None:
    """Add [start, end) to sorted disjoint spans (admission plans add them in order)."""
    if spans and spans[-1][1] >= start:
        spans[-1][1] = max(spans[-1][1], end)
    else:
        spans.append([start, end])
