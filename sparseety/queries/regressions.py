"""Sparsity regressions ("did the optimisation silently turn off?"): SQL builder.

Per engine name and model, each signal's rate over a **current** window is compared with the same
engine's own **baseline**: the window just before it. A signal is evaluated only when both windows
have at least ``min_requests`` requests and the baseline shows the optimisation firing; it is a
finding when the rule below holds. Rates are ratios of sums over the window's requests
(``sparsity_signals_v``, migration 005; expert balance from ``expert_load``).

The signals, their rates and rules (docs/operations.md, "Sparsity regressions"):

* ``prefix_hit_rate`` = admission cache hits / prompt positions; judged when the baseline is at
  least 0.05; a finding when current < 0.5 x baseline.
* ``spec_acceptance_rate`` = accepted / drafted; judged when both windows drafted; finding when
  current < 0.5 x baseline.
* ``spec_drafts_per_output`` = drafted / output tokens; judged when the baseline drafted;
  finding when current < 0.1 x baseline (drafts stopped).
* ``window_skip_share`` = attention pairs skipped / pairs full attention would attend; judged
  when the baseline is at least 0.05; finding when current < 0.5 x baseline.
* ``expert_load_entropy`` = mean over layers of the expert-load entropy / log(experts) (1 =
  even); judged when both windows have expert counts; finding when current < baseline - 0.2.
* ``eviction_recompute_share`` = recomputed after eviction / computed positions; finding when
  current > baseline + 0.1 and > 2 x baseline.

Each row carries its evidence: the current window's bounds and up to five of its request uids
that show the signal most (lowest hit rate, ..., highest eviction share). A tenant-scoped caller
sees signals computed over its own tenants' requests only.
"""

from __future__ import annotations

import time
from typing import Any

from sparseety.errors import QueryError
from sparseety.times import parse_bucket

from .base import Scope

#: Rule constants (docs/operations.md "Sparsity regressions" states them too).
HIT_MIN, HIT_FACTOR = 0.05, 0.5
ACCEPT_FACTOR = 0.5
DRAFTS_FACTOR = 0.1
SKIP_MIN, SKIP_FACTOR = 0.05, 0.5
ENTROPY_DROP = 0.2
EVICT_JUMP, EVICT_FACTOR = 0.1, 2.0
EVIDENCE = 5
SIGNALS = (
    "prefix_hit_rate",
    "spec_acceptance_rate",
    "spec_drafts_per_output",
    "window_skip_share",
    "expert_load_entropy",
    "eviction_recompute_share",
)


def _seconds(text: str, what: str) -> int:
    try:
        return int(parse_bucket(text).total_seconds())
    except Exception as e:  # parse_bucket raises its own typed error; say which parameter
        raise QueryError(f"bad {what} {text!r}: a duration such as 15m, 1h, 7d") from e


def _ratio(num: str, den: str) -> str:
    return f"if({den} = 0, 0., {num} / {den})"


def _evidence(value: str, cond: str, desc: bool = False) -> str:
    """Up to EVIDENCE current-window request uids ordered by ``value`` (ascending unless desc)."""
    key = "-x.2" if desc else "x.2"
    return (
        f"arraySlice(arrayMap(x -> x.1, arraySort(x -> {key}, "
        f"groupArrayIf((request_uid, toFloat64({value})), cur AND {cond}))), 1, {EVIDENCE})"
    )


def regressions_sql(
    db: str, *, scope: Scope, window: str, baseline: str, min_requests: int, all_signals: int
) -> tuple[str, dict[str, Any]]:
    """Current findings (or, with ``all_signals``, every evaluated signal) per engine and model."""
    win_s, base_s = _seconds(window, "window"), _seconds(baseline, "baseline")
    until = scope.until_ns if scope.until_ns is not None else time.time_ns()
    cur_since = scope.since_ns if scope.since_ns is not None else until - win_s * 10**9
    if cur_since >= until:
        raise QueryError("empty current window: since must be before until")
    params: dict[str, Any] = {
        "until": until,
        "cur_since": cur_since,
        "base_since": cur_since - base_s * 10**9,
        "min_n": min_requests,
        "all": all_signals,
    }
    tenant = "1"
    if scope.tenants is not None:
        tenant = "has({tenants:Array(String)}, tenant)"
        params["tenants"] = list(scope.tenants)
    span = "finished_ts_ns >= {base_since:Int64} AND finished_ts_ns < {until:Int64}"
    cur = "finished_ts_ns >= {cur_since:Int64}"
    pairs = {
        "hit": ("cache_hit_tokens", "prompt_tokens"),
        "acc": ("draft_accepted_tokens", "draft_tokens"),
        "drafts": ("draft_tokens", "output_tokens"),
        "skip": ("attention_pairs_skipped", "attention_pairs_full"),
        "evict": ("recomputed_eviction_tokens", "scheduled_tokens"),
    }
    sums = []
    for name, (num, den) in pairs.items():
        for p, c in (("b", "NOT cur"), ("c", "cur")):
            sums.append(f"sumIf({num}, {c}) AS {p}_{name}_num, sumIf({den}, {c}) AS {p}_{name}_den")
    evict_share = _ratio("recomputed_eviction_tokens", "scheduled_tokens")
    agg = (
        f"SELECT engine_name, model, countIf(NOT cur) AS b_n, countIf(cur) AS c_n, {', '.join(sums)}, "
        f"{_evidence(_ratio('cache_hit_tokens', 'prompt_tokens'), 'prompt_tokens > 0')} AS ev_hit, "
        f"{_evidence(_ratio('draft_accepted_tokens', 'draft_tokens'), 'draft_tokens > 0')} AS ev_acc, "
        f"{_evidence(_ratio('draft_tokens', 'output_tokens'), 'output_tokens > 0')} AS ev_drafts, "
        f"{_evidence(_ratio('attention_pairs_skipped', 'attention_pairs_full'), 'attention_pairs_full > 0')} "
        "AS ev_skip, "
        f"{_evidence(evict_share, 'scheduled_tokens > 0', desc=True)} AS ev_evict "
        f"FROM (SELECT *, {cur} AS cur FROM {db}.sparsity_signals_v WHERE {span} AND {tenant}) "
        "GROUP BY engine_name, model"
    )
    # Expert balance: per window the expert-load counts summed per (layer, expert); per layer the
    # entropy of the load over its experts, normalised by log(experts) (1 = perfectly even).
    experts = (
        "SELECT engine_name, model, cur, avg(h) AS entropy, any(uids) AS uids FROM ("
        "SELECT engine_name, model, cur, uids, arraySlice(sums, layer * e + 1, e) AS sl, "
        "arraySum(sl) AS tot, "
        "if(tot = 0 OR e < 2, NULL, arraySum(arrayMap(x -> if(x = 0, 0., -(x / tot) * log(x / tot)), sl)) "
        "/ log(e)) AS h FROM ("
        "SELECT engine_name, model, cur, any(num_layers) AS l, any(num_experts) AS e, "
        f"sumForEach(counts) AS sums, arraySlice(groupArray(request_uid), 1, {EVIDENCE}) AS uids "
        f"FROM (SELECT *, {cur} AS cur FROM {db}.expert_load FINAL WHERE {span} AND {tenant} "
        "AND num_experts > 0 AND length(counts) = num_layers * num_experts) "
        "GROUP BY engine_name, model, cur) ARRAY JOIN range(l) AS layer) "
        "GROUP BY engine_name, model, cur"
    )

    def rate(p: str, name: str) -> str:
        return _ratio(f"a.{p}_{name}_num", f"a.{p}_{name}_den")

    signals = [
        (
            "prefix_hit_rate",
            rate("b", "hit"),
            rate("c", "hit"),
            f"{rate('b', 'hit')} >= {HIT_MIN} AND a.c_hit_den > 0",
            f"{rate('c', 'hit')} < {HIT_FACTOR} * {rate('b', 'hit')}",
            "a.ev_hit",
            f"current < {HIT_FACTOR} x baseline",
        ),
        (
            "spec_acceptance_rate",
            rate("b", "acc"),
            rate("c", "acc"),
            "a.b_acc_den > 0 AND a.c_acc_den > 0",
            f"{rate('c', 'acc')} < {ACCEPT_FACTOR} * {rate('b', 'acc')}",
            "a.ev_acc",
            f"current < {ACCEPT_FACTOR} x baseline",
        ),
        (
            "spec_drafts_per_output",
            rate("b", "drafts"),
            rate("c", "drafts"),
            f"{rate('b', 'drafts')} > 0 AND a.c_drafts_den > 0",
            f"{rate('c', 'drafts')} < {DRAFTS_FACTOR} * {rate('b', 'drafts')}",
            "a.ev_drafts",
            f"current < {DRAFTS_FACTOR} x baseline (drafts stopped)",
        ),
        (
            "window_skip_share",
            rate("b", "skip"),
            rate("c", "skip"),
            f"{rate('b', 'skip')} >= {SKIP_MIN} AND a.c_skip_den > 0",
            f"{rate('c', 'skip')} < {SKIP_FACTOR} * {rate('b', 'skip')}",
            "a.ev_skip",
            f"current < {SKIP_FACTOR} x baseline",
        ),
        (
            "expert_load_entropy",
            "ifNull(xb.entropy, 0.)",
            "ifNull(xc.entropy, 0.)",
            "xb.entropy IS NOT NULL AND xc.entropy IS NOT NULL",
            f"ifNull(xc.entropy, 0.) < ifNull(xb.entropy, 0.) - {ENTROPY_DROP}",
            "ifNull(xc.uids, [])",
            f"current < baseline - {ENTROPY_DROP}",
        ),
        (
            "eviction_recompute_share",
            rate("b", "evict"),
            rate("c", "evict"),
            "a.b_evict_den > 0 AND a.c_evict_den > 0",
            f"{rate('c', 'evict')} > {rate('b', 'evict')} + {EVICT_JUMP} "
            f"AND {rate('c', 'evict')} > {EVICT_FACTOR} * {rate('b', 'evict')}",
            "a.ev_evict",
            f"current > baseline + {EVICT_JUMP} and > {EVICT_FACTOR:g} x baseline",
        ),
    ]
    tuples = ", ".join(
        f"tuple('{name}', toFloat64({b}), toFloat64({c}), toUInt8({ok}), toUInt8({fire}), "
        f"CAST({ev}, 'Array(String)'), '{rule}')"
        for name, b, c, ok, fire, ev, rule in signals
    )
    sql = (
        "SELECT a.engine_name AS engine, a.model AS model, s.1 AS signal, s.2 AS baseline, "
        "s.3 AS current, toBool(s.5) AS firing, s.7 AS rule, a.b_n AS baseline_requests, "
        "a.c_n AS current_requests, s.6 AS evidence_request_uids, "
        "fromUnixTimestamp64Nano({base_since:Int64}, 'UTC') AS baseline_start, "
        "fromUnixTimestamp64Nano({cur_since:Int64}, 'UTC') AS window_start, "
        "fromUnixTimestamp64Nano({until:Int64}, 'UTC') AS window_end "
        f"FROM ({agg}) AS a "
        f"LEFT JOIN (SELECT * FROM ({experts}) WHERE NOT cur) AS xb "
        "ON a.engine_name = xb.engine_name AND a.model = xb.model "
        f"LEFT JOIN (SELECT * FROM ({experts}) WHERE cur) AS xc "
        "ON a.engine_name = xc.engine_name AND a.model = xc.model "
        f"ARRAY JOIN [{tuples}] AS s "
        "WHERE a.b_n >= {min_n:UInt32} AND a.c_n >= {min_n:UInt32} AND s.4 = 1 "
        "AND ({all:UInt8} = 1 OR s.5 = 1) "
        "ORDER BY engine, model, signal"
    )
    return sql, params
