"""Counterfactual cost ("what would this traffic have cost if ..."): SQL builders.

Every answer here is **modelled**, not observed: it replays the stored timelines under one
changed setting, with the assumptions written down in ``docs/cost-model.md`` ("What if"). Rows
say so (``basis = 'modelled'``). One scenario per call:

* ``no-cache`` — no prefix caching: every position served from the cache is computed;
* ``kv-x<K>`` (``kv-x1.5``, ``kv-x2``, ``kv-x4``, any K > 1) and ``kv-curve`` (K = 1.5, 2, 4) —
  a K times larger KV cache: eviction recomputes whose idle gap the larger cache would have
  bridged become cache reads (observed block lifetimes, see :func:`_kv_avoided`);
* ``no-spec`` — no speculative decoding: rejected and cut drafts are not computed, every output
  token takes a decode step of its own;
* ``window=<N>`` — sliding-window models with another window N: attention pairs and unattended
  positions recomputed for N.

Every row has the same core columns, actual beside counterfactual (``cf_``) and their difference
(``delta_`` = counterfactual - actual): computed tokens, GPU time, token cost (actual mode) and
GPU cost. Shared inputs (block lifetimes, an engine's cache time) come from every stored request;
the scope only filters which requests are summed, so a tenant's answer does not depend on
which other tenants a caller may see.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparseety.errors import QueryError

from .base import REQUEST_COUNTS, Scope, group, with_group

#: The cache sizes ``kv-curve`` shows (the issue's 1.5x, 2x and 4x).
KV_CURVE = (1.5, 2.0, 4.0)
SCENARIO_HELP = "no-cache, kv-x<K> (kv-x1.5, kv-x2, kv-x4), kv-curve, no-spec or window=<N>"


@dataclass(frozen=True)
class Scenario:
    """A parsed ``--scenario``: its kind and its number (K or N)."""

    kind: str  # no-cache | kv | no-spec | window
    ks: tuple[float, ...] = ()
    window: int = 0


def parse_scenario(text: str) -> Scenario:
    """``no-cache`` | ``kv-x<K>`` | ``kv-curve`` | ``no-spec`` | ``window=<N>``; QueryError otherwise."""
    t = text.strip().lower()
    if t in ("no-cache", "no-spec"):
        return Scenario(t)
    if t == "kv-curve":
        return Scenario("kv", ks=KV_CURVE)
    if m := re.fullmatch(r"kv-x(\d+(?:\.\d+)?)", t):
        k = float(m.group(1))
        if not 1.0 < k <= 1000.0:
            raise QueryError(f"bad scenario {text!r}: the KV cache factor K must be > 1 and <= 1000")
        return Scenario("kv", ks=(k,))
    if m := re.fullmatch(r"window=(\d+)", t):
        n = int(m.group(1))
        if not 1 <= n <= 2**24:
            raise QueryError(f"bad scenario {text!r}: the window must be between 1 and {2**24} tokens")
        return Scenario("window", window=n)
    raise QueryError(f"unknown scenario {text!r}: choose from {SCENARIO_HELP}")


def _k_label(k: float) -> str:
    return f"kv-x{k:g}"


# --- attention pairs in SQL (the same formulas as streams/attention.py) ---------------------------


def _causal(start: str, n: str) -> str:
    return f"(({n}) * ({start}) + intDiv(({n}) * (({n}) + 1), 2))"


def _windowed(start: str, n: str, w: str) -> str:
    """``windowed_pairs(start, n, w)``: each query attends at most ``w`` keys, itself included."""
    end = f"(({start}) + ({n}))"
    full_end = f"least({end}, {w})"
    head = f"if(({start}) < {full_end}, {_causal(start, f'{full_end} - ({start})')}, 0)"
    capped = f"({end} - greatest({start}, {full_end}))"
    return f"if(({n}) <= 0, 0, {head} + {capped} * ({w}))"


# --- per-scenario pieces --------------------------------------------------------------------------


def _gpu_for(tokens: str) -> str:
    """GPU ns of ``tokens`` positions at the request's own average GPU time per computed position."""
    return f"if(c.scheduled_tokens > 0, intDiv(toInt128({tokens}) * c.gpu_time_ns, c.scheduled_tokens), 0)"


def _kv_avoided(db: str) -> str:
    """Per (request, K): the eviction-recomputed blocks a K times larger cache would have kept.

    A miss is a block a request computed again (role ``recomputed``) in a new cache lifetime of
    its hash on an engine epoch. Its idle gap is the request's admission (first_scheduled) minus
    the last finish among the users of the hash's previous lifetime there (when the block became
    evictable). Under LRU a block survives an idle gap shorter than the cache's characteristic
    time T (Che's approximation), and T grows in proportion to the cache size while the traffic's
    rate of new blocks stays the same. T_hat, per engine epoch, is the shortest idle gap after
    which that engine lost a block: every observed miss had a gap of at least T, so T_hat >= T
    and the avoided recompute is an upper bound. A K times larger cache avoids a miss when
    gap < K * T_hat. Misses whose previous lifetime is not stored are not modelled.
    """
    return (
        "(WITH blk AS ("
        "SELECT b.engine_id AS engine_id, b.block_hash AS block_hash, b.lifetime_seq AS lifetime_seq, "
        "b.role AS role, b.tokens AS tokens, b.request_uid AS request_uid, "
        "b.finished_ts_ns AS finished_ts_ns, q.first_scheduled_ts_ns AS admitted_ns "
        f"FROM {db}.kv_blocks_v AS b INNER JOIN "
        f"(SELECT request_uid, first_scheduled_ts_ns FROM {db}.requests_v) AS q "
        "ON b.request_uid = q.request_uid WHERE b.lifetime_seq >= 0), "
        "lifetimes AS (SELECT engine_id, block_hash, lifetime_seq, max(finished_ts_ns) AS last_end "
        "FROM blk GROUP BY engine_id, block_hash, lifetime_seq), "
        "chained AS (SELECT engine_id, block_hash, lifetime_seq, "
        "lagInFrame(last_end, 1, toInt64(0)) OVER w AS prev_end, "
        "lagInFrame(lifetime_seq, 1, toInt64(-1)) OVER w AS prev_seq FROM lifetimes "
        "WINDOW w AS (PARTITION BY engine_id, block_hash ORDER BY lifetime_seq "
        "ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)), "
        "misses AS (SELECT m.request_uid AS request_uid, m.engine_id AS engine_id, m.tokens AS tokens, "
        "greatest(m.admitted_ns - ch.prev_end, 0) AS gap FROM blk AS m INNER JOIN chained AS ch "
        "ON m.engine_id = ch.engine_id AND m.block_hash = ch.block_hash "
        "AND m.lifetime_seq = ch.lifetime_seq WHERE m.role = 'recomputed' AND ch.prev_seq >= 0), "
        "tc AS (SELECT engine_id, min(gap) AS t_hat FROM misses GROUP BY engine_id) "
        "SELECT m.request_uid AS request_uid, kk AS kv_factor, count() AS modelled_blocks, "
        "sum(m.tokens) AS modelled_tokens, countIf(m.gap < kk * t.t_hat) AS avoided_blocks, "
        "sumIf(m.tokens, m.gap < kk * t.t_hat) AS avoided_tokens, any(t.t_hat) AS cache_time_ns "
        "FROM misses AS m INNER JOIN tc AS t ON m.engine_id = t.engine_id "
        "ARRAY JOIN {ks:Array(Float64)} AS kk GROUP BY m.request_uid, kk)"
    )


def whatif_sql(
    db: str, *, scenario: str, by: Sequence[str], bucket: str | None, scope: Scope
) -> tuple[str, dict[str, Any]]:
    """Actual and counterfactual compute, GPU time and cost per group under one scenario."""
    # registry.py imports this module for its registry entry; its helpers are taken at call time

    sc = parse_scenario(scenario)
    select, keys, _ = group(by, bucket, "c")
    where, params = scope.where("c")
    join = f"INNER JOIN {db}.requests_v AS r ON c.request_uid = r.request_uid"
    gpu_modelled = "1"
    extra = ""
    label = f"'{scenario.strip().lower()}'"
    if sc.kind == "no-cache":
        # Every cache read (admission hits and re-reads on resume) is computed instead, at the
        # input price instead of the cached-input price, at the request's GPU time per position.
        # The engine's other cache tiers (issue 36: CPU offload, host, storage) are prefix caching
        # too: their reads are computed as well, at the input price instead of the tier's. KV
        # loaded from outside (tier external: the P/D decode side) is not caching: it stays.
        reads = (
            "(toInt64(c.cache_read_tokens) + c.cache_read_cpu_offload_tokens"
            " + c.cache_read_host_tokens + c.cache_read_storage_tokens)"
        )
        d_tokens = reads
        d_gpu = _gpu_for(reads)
        d_pico = (
            "toInt128(c.cache_read_tokens) * (c.input_price_micro - c.cached_price_micro)"
            " + toInt128(c.cache_read_cpu_offload_tokens) * (c.input_price_micro - c.cpu_offload_price_micro)"
            " + toInt128(c.cache_read_host_tokens) * (c.input_price_micro - c.host_price_micro)"
            " + toInt128(c.cache_read_storage_tokens) * (c.input_price_micro - c.storage_price_micro)"
        )
        extra = ", sum(c.cache_read_tokens) AS cache_read_tokens, sum(" + reads + ") AS tier_read_tokens"
    elif sc.kind == "no-spec":
        # Rejected and cut drafts are not computed; accepted drafts are computed as ordinary
        # decode tokens (same count). FLOPs-proportional GPU time drops with the positions; the
        # step-bound estimate (decode steps cost the same however many tokens they carry) adds
        # one step per accepted draft token.
        drafts = "(toInt64(c.draft_rejected_tokens) + c.draft_cut_tokens)"
        d_tokens = f"-{drafts}"
        d_gpu = f"-{_gpu_for(drafts)}"
        d_pico = f"-toInt128({drafts}) * c.input_price_micro"
        extra = (
            ", sum(c.draft_accepted_tokens) AS draft_accepted_tokens, "
            f"sum({drafts}) AS draft_wasted_tokens, sum(r.steps) AS steps, "
            "sum(r.steps + c.draft_accepted_tokens) AS cf_steps, "
            "sum(toInt64(c.gpu_time_ns) + if(r.steps > 0, "
            "intDiv(toInt128(c.draft_accepted_tokens) * c.gpu_time_ns, r.steps), 0)) "
            "AS cf_step_bound_gpu_time_ns"
        )
    elif sc.kind == "window":
        # Only requests of sliding-window models (attention_window set) change; the share f of
        # the model's layers that are windowed is solved from the observed pairs, and the queries
        # are taken as one run from the first computed position to the last input position.
        params["window_n"] = sc.window
        a = "toInt64(c.list_cached_tokens)"
        n = "(toInt64(c.prompt_tokens) + c.output_tokens - 1 - toInt64(c.list_cached_tokens))"
        w = "toInt64(ifNull(r.attention_window, 0))"
        full = _causal(a, n)
        frac = (
            f"if(r.attention_window IS NULL OR {full} <= {_windowed(a, n, w)}, 0, "
            f"r.attention_pairs_skipped / ({full} - {_windowed(a, n, w)}))"
        )
        wn = "{window_n:Int64}"
        cf_pairs = (
            f"if(r.attention_window IS NULL, r.attention_pairs, "
            f"toInt64(round(r.attention_pairs + r.attention_pairs_skipped - "
            f"least({frac}, 1) * ({full} - {_windowed(a, n, wn)}))))"
        )
        kv_end = "greatest(toInt64(c.prompt_tokens) + c.output_tokens - 1, 0)"
        cf_unattended = (
            f"if(r.attention_window IS NULL, c.window_released_tokens + c.skipped_tokens, "
            f"if({frac} > 0.5, greatest({kv_end} - {wn}, 0), 0))"
        )
        d_tokens = d_gpu = d_pico = "0"
        gpu_modelled = "0"
        extra = (
            ", countIf(r.attention_window IS NOT NULL) AS windowed_requests, "
            "sum(r.attention_pairs) AS attention_pairs, "
            f"sum({cf_pairs}) AS cf_attention_pairs, cf_attention_pairs - attention_pairs "
            "AS delta_attention_pairs, "
            "sum(if(r.attention_window IS NULL, 0, c.window_released_tokens + c.skipped_tokens)) "
            "AS unattended_tokens, "
            f"sum(if(r.attention_window IS NULL, 0, {cf_unattended})) AS cf_unattended_tokens"
        )
    else:  # kv
        params["ks"] = list(sc.ks)
        join += f" ARRAY JOIN {{ks:Array(Float64)}} AS kf LEFT JOIN {_kv_avoided(db)} AS x "
        join += "ON c.request_uid = x.request_uid AND kf = x.kv_factor"
        label = "concat('kv-x', toString(kf))"
        # An avoided block is read from the cache instead of computed: its tokens move from the
        # input to the cached-input price, and its GPU time (at the request's rate) is saved.
        av = "ifNull(x.avoided_tokens, 0)"
        d_tokens = f"-toInt64({av})"
        d_gpu = f"-{_gpu_for(av)}"
        d_pico = f"-toInt128({av}) * (c.input_price_micro - c.cached_price_micro)"
        extra = (
            ", sum(c.recomputed_eviction_tokens) AS recomputed_eviction_tokens, "
            "sum(ifNull(x.modelled_tokens, 0)) AS modelled_eviction_tokens, "
            "sum(ifNull(x.avoided_blocks, 0)) AS avoided_blocks, "
            f"sum({av}) AS avoided_tokens, "
            "recomputed_eviction_tokens - avoided_tokens AS remaining_eviction_tokens, "
            "max(ifNull(x.cache_time_ns, 0)) AS cache_time_ns"
        )
    keys_s = f"scenario, {keys}" if keys else "scenario"
    gpu_cost = "intDiv(toInt128({g}) * c.gpu_hour_price_micro, 3600000)"
    cf_gpu = f"(toInt64(c.gpu_time_ns) + {d_gpu})"
    measures = (
        f"'modelled' AS basis, toBool({gpu_modelled}) AS gpu_modelled, {REQUEST_COUNTS}, "
        "sum(c.scheduled_tokens) AS computed_tokens, "
        f"sum(toInt64(c.scheduled_tokens) + {d_tokens}) AS cf_computed_tokens, "
        "cf_computed_tokens - computed_tokens AS delta_computed_tokens, "
        "sum(c.gpu_time_ns) AS gpu_time_ns, "
        # Int64 like gpu_time_ns (d_gpu may widen the sum to Int128, which Parquet writes as bytes)
        f"toInt64(sum({cf_gpu})) AS cf_gpu_time_ns, "
        "toInt64(cf_gpu_time_ns - gpu_time_ns) AS delta_gpu_time_ns, "
        "sum(c.actual_pico) AS cost_pico, "
        # the change is to the token charge before the service tier's factor (issue 36), which
        # then applies to the counterfactual charge as it does to the actual one
        f"sum(intDiv((c.actual_untiered_pico + {d_pico}) * c.tier_multiplier_micro, 1000000)) "
        "AS cf_cost_pico, cf_cost_pico - cost_pico AS delta_cost_pico, "
        # from gpu_time_ns, like the counterfactual (the bill's gpu_pico leaves the warm-up out)
        f"sum({gpu_cost.format(g='c.gpu_time_ns')}) AS gpu_cost_pico, "
        f"sum({gpu_cost.format(g=cf_gpu)}) AS cf_gpu_cost_pico, "
        "countIf(NOT c.tokens_priced) AS unpriced_requests" + extra
    )
    sql = (
        f"SELECT {label} AS scenario, {with_group(select, measures)} "
        f"FROM {db}.request_costs_v AS c {join} WHERE {where} "
        f"GROUP BY {keys_s} ORDER BY {keys_s}"
    )
    return sql, params
