"""Dashboard figures as plotly.js figure specs (``{"data": [...], "layout": {...}}``), pure.

Each builder takes rows as the query library returns them and gives a plain, JSON-ready figure
that ``Plotly.newPlot`` draws. Nothing here touches the store or the file system.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

Figure = dict[str, Any]

#: How positions were obtained (axis 1, the bar colour), in the order a reader meets them
#: (colour-blind safe palette). recomputed, skipped and evicted appear only in schema-v1 rows.
STATUS_COLORS = {
    "computed": "#4C78A8",
    "cached": "#54A24B",
    "recomputed_after_preemption": "#E45756",
    "recomputed_after_eviction": "#FF9DA6",
    "not_computed": "#EEEEEE",
    # the cache tiers beside gpu (issue 36; sparseety/billing.py): greens and teals, like cached
    "cached_cpu_offload": "#88D27A",
    "cached_host": "#B5E3A8",
    "cached_storage": "#2E7D32",
    "external_kv": "#72B7B2",
    "recomputed": "#E45756",
    "skipped": "#BAB0AC",
    "evicted": "#F58518",
}
DRAFT_ACCEPTED = "draft accepted"
#: What became of the KV (axis 2): hatching drawn over the colour; kept positions have none.
FATE_PATTERNS = {"window_released": "x", "skipped": "."}
#: Tenant colours (colour-blind safe, Tableau 10).
PALETTE = (
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#BAB0AC",
)
MODE_COLORS = {"actual": "#4C78A8", "amortized": "#72B7B2", "list": "#EECA3B", "gpu": "#B279A2"}
_FONT = {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "xanchor": "left"},
        "font": _FONT,
        "margin": {"l": 60, "r": 40, "t": 48, "b": 48},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "legend": {"orientation": "h", "y": -0.18},
        # vertical, in the right margin: a left-aligned title never runs under its icons
        "modebar": {"orientation": "v"},
    }
    layout.update(extra)
    return layout


def _empty(title: str, message: str) -> Figure:
    return {
        "data": [],
        "layout": _layout(
            title,
            xaxis={"visible": False},
            yaxis={"visible": False},
            annotations=[
                {"text": message, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}
            ],
        ),
    }


def _usd(value: Any) -> float:
    return float(value) if isinstance(value, (Decimal, int, float)) else 0.0


def _label(request: Mapping[str, Any], taken: set[str]) -> str:
    uid = str(request["request_uid"])
    base = f"{request.get('tenant') or '-'} · {uid.rsplit('/', 1)[-1]}"
    label, n = base, 2
    while label in taken:
        label, n = f"{base} ({n})", n + 1
    taken.add(label)
    return label


def timeline_figure(requests: Sequence[Mapping[str, Any]]) -> Figure:
    """Each request's token positions as run-length segments: the colour says how a position
    was obtained, hatching over it what became of its KV (window released, skipped).

    Args:
        requests: :meth:`Queries.request` results (``request_uid``, ``tenant``, ``segments``).
    """
    title = "Token timelines (colour: how obtained · hatching: KV fate)"
    if not requests:
        return _empty(title, "no requests in scope")
    taken: set[str] = set()
    labels = [_label(r, taken) for r in requests]
    series: dict[str, dict[str, list[Any]]] = {}
    for label, request in zip(labels, requests, strict=True):
        for s in request["segments"]:
            name = DRAFT_ACCEPTED if s.get("draft_accepted") else str(s["status"])
            col = series.setdefault(name, {"x": [], "base": [], "y": [], "customdata": []})
            start, end = int(s["start"]), int(s["end"])
            col["x"].append(end - start)
            col["base"].append(start)
            col["y"].append(label)
            col["customdata"].append([start, end, s["kind"], s.get("source_request_uid") or "-"])
            fate = str(s.get("kv_fate") or "kept")
            if fate in FATE_PATTERNS:
                col = series.setdefault(
                    "KV " + fate.replace("_", " "), {"x": [], "base": [], "y": [], "customdata": []}
                )
                col["x"].append(end - start)
                col["base"].append(start)
                col["y"].append(label)
                col["customdata"].append([start, end, s["kind"], s.get("source_request_uid") or "-"])
    data = []
    fates = {"KV " + f.replace("_", " "): shape for f, shape in FATE_PATTERNS.items()}
    for name in [*STATUS_COLORS, DRAFT_ACCEPTED, *fates]:
        if name not in series:
            continue
        marker: dict[str, Any] = {"color": STATUS_COLORS.get(name, STATUS_COLORS["computed"])}
        if name in fates:
            # A second axis over the colour: transparent bars carrying only the hatching.
            marker = {
                "color": "rgba(0,0,0,0)",
                "line": {"width": 0},
                "pattern": {
                    "shape": fates[name],
                    "fgcolor": "#333333",
                    "fillmode": "overlay",
                    "solidity": 0.3,
                },
            }
        elif name == DRAFT_ACCEPTED:
            # stripes over the computed colour: an accepted draft is computed output too
            marker["pattern"] = {"shape": "/", "fillmode": "overlay", "fgcolor": "#ffffff", "solidity": 0.45}
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": name,
                **series[name],
                "marker": marker,
                "hovertemplate": (
                    "%{y}<br>positions %{customdata[0]}-%{customdata[1]} (%{x} tokens, "
                    f"%{{customdata[2]}})<br>{name}<br>source: %{{customdata[3]}}<extra></extra>"
                ),
            }
        )
    return {
        "data": data,
        "layout": _layout(
            title,
            barmode="overlay",
            bargap=0.35,
            height=max(260, 60 + 38 * len(requests)),
            xaxis={"title": {"text": "token position"}, "rangemode": "tozero"},
            yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
            margin={"l": 160, "r": 20, "t": 72, "b": 48},
            legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        ),
    }


def expert_figure(rows: Sequence[Mapping[str, Any]], model: str) -> Figure:
    """Tokens routed per (layer, expert) of one model, as a heatmap.

    Args:
        rows: :meth:`Queries.expert_load` rows (``model``, ``layer``, ``expert``, ``tokens``).
    """
    own = [r for r in rows if r["model"] == model]
    title = f"MoE expert load{' — ' + model if model else ''} (tokens per layer x expert)"
    if not own:
        return _empty(title, "no MoE routing in scope")
    layers = max(int(r["layer"]) for r in own) + 1
    experts = max(int(r["expert"]) for r in own) + 1
    z = [[0] * experts for _ in range(layers)]
    for r in own:
        z[int(r["layer"])][int(r["expert"])] = int(r["tokens"])
    return {
        "data": [
            {
                "type": "heatmap",
                "z": z,
                "x": list(range(experts)),
                "y": list(range(layers)),
                "colorscale": "Viridis",
                "colorbar": {"title": {"text": "tokens"}},
                "hovertemplate": "layer %{y}, expert %{x}: %{z} tokens<extra></extra>",
            }
        ],
        "layout": _layout(
            title,
            xaxis={"title": {"text": "expert"}, "dtick": 1},
            yaxis={"title": {"text": "layer"}, "dtick": 1, "autorange": "reversed"},
            height=max(260, 120 + 28 * layers),
        ),
    }


def savings_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Prompt positions read from the prefix cache vs computed, per tenant, with money saved.

    Args:
        rows: :meth:`Queries.savings` rows grouped by tenant.
    """
    title = "Prefix sharing: prompt tokens cached vs computed, per tenant"
    if not rows:
        return _empty(title, "no requests in scope")
    tenants = [str(r["tenant"]) or "(none)" for r in rows]
    cached = [int(r["cached_prompt_tokens"]) for r in rows]
    computed = [max(int(r["prompt_tokens"]) - c, 0) for r, c in zip(rows, cached, strict=True)]
    saved = [f"hit rate {float(r['hit_rate']):.0%}, saved ${r['saved_usd']}" for r in rows]
    return {
        "data": [
            {
                "type": "bar",
                "name": "cached (prefix hit)",
                "x": tenants,
                "y": cached,
                "marker": {"color": STATUS_COLORS["cached"]},
                "text": saved,
                "hovertemplate": "%{x}: %{y} cached prompt tokens<br>%{text}<extra></extra>",
                "textposition": "none",
            },
            {
                "type": "bar",
                "name": "computed",
                "x": tenants,
                "y": computed,
                "marker": {"color": STATUS_COLORS["computed"]},
                "hovertemplate": "%{x}: %{y} computed prompt tokens<extra></extra>",
            },
        ],
        "layout": _layout(
            title,
            barmode="stack",
            yaxis={"title": {"text": "prompt tokens"}},
            annotations=[
                {
                    "x": t,
                    "y": c + p,
                    "text": f"${r['saved_usd']:.4f} saved" if isinstance(r["saved_usd"], Decimal) else "",
                    "showarrow": False,
                    "yshift": 10,
                }
                for t, c, p, r in zip(tenants, cached, computed, rows, strict=True)
            ],
        ),
    }


def cost_figure(by_mode: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure:
    """Cost per tenant in each attribution mode (grouped bars, USD).

    Args:
        by_mode: mode -> :meth:`Queries.cost` rows grouped by tenant.
    """
    title = "Cost by tenant per attribution mode (USD)"
    tenants = sorted({str(r["tenant"]) for rows in by_mode.values() for r in rows})
    if not tenants:
        return _empty(title, "no requests in scope")
    data = []
    for mode, rows in by_mode.items():
        cost = {str(r["tenant"]): r.get("cost_usd", 0) for r in rows}
        data.append(
            {
                "type": "bar",
                "name": mode,
                "x": [t or "(none)" for t in tenants],
                "y": [_usd(cost.get(t, 0)) for t in tenants],
                "text": [f"${cost.get(t, 0)}" for t in tenants],
                "textposition": "none",
                "marker": {"color": MODE_COLORS.get(mode, "#888888")},
                "hovertemplate": f"%{{x}} ({mode}): %{{text}}<extra></extra>",
            }
        )
    return {
        "data": data,
        "layout": _layout(title, barmode="group", yaxis={"title": {"text": "USD"}, "rangemode": "tozero"}),
    }


#: Time buckets the over-time chart may use, smallest first.
BUCKETS = (("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600), ("6h", 21_600), ("1d", 86_400))
#: At most this many buckets across the page's time span.
MAX_BUCKETS = 60


def pick_bucket(span_s: float) -> str:
    """The smallest bucket that draws ``span_s`` in at most :data:`MAX_BUCKETS` points."""
    for name, seconds in BUCKETS:
        if span_s / seconds <= MAX_BUCKETS:
            return name
    return BUCKETS[-1][0]


def _instant(value: Any) -> datetime:
    """A bucket's start (a datetime from the store, an ISO string through the API), in UTC."""
    t = value if isinstance(value, datetime) else datetime.fromisoformat(str(value).replace(" ", "T"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def bucket_axis(rows: Sequence[Mapping[str, Any]], bucket: str) -> list[datetime]:
    """Every bucket from the first to the last that ``rows`` have, at ``bucket``'s step: a line
    drawn over these drops to 0 in a minute without requests instead of joining its neighbours
    (issue 31: lines ran across empty minutes)."""
    if not rows:
        return []
    have = sorted({_instant(r["bucket"]) for r in rows})
    step = timedelta(seconds=dict(BUCKETS).get(bucket, 60))
    out: list[datetime] = []
    t = have[0]
    while t <= have[-1] and len(out) <= 10 * MAX_BUCKETS:
        out.append(t)
        t += step
    return out


def _zero_filled(
    rows: Sequence[Mapping[str, Any]], axis: list[datetime], value: Any
) -> tuple[list[str], list[Any]]:
    by_bucket = {_instant(r["bucket"]): value(r) for r in rows}
    return [t.strftime("%Y-%m-%d %H:%M:%S") for t in axis], [by_bucket.get(t, 0) for t in axis]


def over_time_figure(
    cost_rows: Sequence[Mapping[str, Any]], list_rows: Sequence[Mapping[str, Any]], bucket: str
) -> Figure:
    """Cost (actual, USD) and tokens billed (list: prompt once per API request + output) per
    tenant and time bucket, as two stacked line charts sharing the time axis.

    Args:
        cost_rows: ``Queries.cost(mode="actual", by=("tenant",), bucket=...)`` rows.
        list_rows: The same in ``list`` mode (its token counts are what an invoice counts).
        bucket: The bucket both were asked with (for the title).
    """
    title = f"Cost and tokens over time by tenant (per {bucket})"
    tenants = sorted({str(r["tenant"]) for r in [*cost_rows, *list_rows]})
    if not tenants:
        return _empty(title, "no requests in scope")
    data: list[dict[str, Any]] = []
    axis = bucket_axis([*cost_rows, *list_rows], bucket)
    for i, t in enumerate(tenants):
        color = PALETTE[i % len(PALETTE)]
        mine = [r for r in cost_rows if str(r["tenant"]) == t]
        x, cost = _zero_filled(mine, axis, lambda r: r.get("cost_usd", 0))
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": t or "(none)",
                "legendgroup": t,
                "x": x,
                "y": [_usd(c) for c in cost],
                "text": [f"${c}" for c in cost],
                "line": {"color": color},
                "hovertemplate": f"{t or '(none)'} %{{x}}: %{{text}} (actual)<extra></extra>",
            }
        )
        billed = [r for r in list_rows if str(r["tenant"]) == t]
        x, tokens = _zero_filled(
            billed, axis, lambda r: int(r["input_tokens"]) + int(r["cached_tokens"]) + int(r["output_tokens"])
        )
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": t or "(none)",
                "legendgroup": t,
                "showlegend": False,
                "xaxis": "x",
                "yaxis": "y2",
                "x": x,
                "y": tokens,
                "line": {"color": color, "dash": "dot"},
                "hovertemplate": f"{t or '(none)'} %{{x}}: %{{y}} tokens billed<extra></extra>",
            }
        )
    layout = _layout(
        title,
        height=420,
        xaxis={"type": "date", "anchor": "y2"},
        yaxis={"title": {"text": "USD (actual)"}, "domain": [0.56, 1], "rangemode": "tozero"},
        yaxis2={"title": {"text": "tokens billed"}, "domain": [0, 0.44], "rangemode": "tozero"},
    )
    return {"data": data, "layout": layout}


def whatif_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Modelled cost change per what-if scenario (``Queries.whatif`` rows, summed per scenario).

    Bars: token cost (actual mode) change in USD; the hover adds computed tokens and GPU time.
    """
    title = "What if (modelled): token cost change per scenario (USD)"
    if not rows or not any(int(r["requests"]) for r in rows):
        return _empty(title, "no requests in scope")
    totals: dict[str, dict[str, Any]] = {}
    for r in rows:  # whatever the grouping, one bar per scenario
        t = totals.setdefault(str(r["scenario"]), {"scenario": r["scenario"]})
        for k in (
            "requests",
            "delta_computed_tokens",
            "delta_gpu_time_ns",
            "cost_usd",
            "cf_cost_usd",
            "delta_cost_usd",
        ):
            t[k] = t.get(k, 0) + r[k]
    rows = list(totals.values())
    names = [str(r["scenario"]) for r in rows]
    hover = [
        f"{int(r['delta_computed_tokens']):+d} computed tokens, "
        f"{int(r['delta_gpu_time_ns']) / 1e9:+.3f} s GPU, cost ${r['cost_usd']} -> ${r['cf_cost_usd']}"
        for r in rows
    ]
    return {
        "data": [
            {
                "type": "bar",
                "name": "cost change",
                "x": names,
                "y": [_usd(r["delta_cost_usd"]) for r in rows],
                "text": hover,
                "textposition": "none",
                "marker": {
                    "color": ["#c0392b" if _usd(r["delta_cost_usd"]) > 0 else "#27ae60" for r in rows]
                },
                "hovertemplate": "%{x}: %{y:$.6f}<br>%{text}<extra></extra>",
            }
        ],
        "layout": _layout(title, yaxis={"title": {"text": "USD"}}),
    }


def _table(title: str, header: list[str], columns: list[list[Any]]) -> Figure:
    return {
        "data": [
            {
                "type": "table",
                "header": {"values": header, "align": "left", "fill": {"color": "#eeeeee"}},
                "cells": {"values": columns, "align": "left"},
            }
        ],
        "layout": _layout(title),
    }


def regressions_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Current sparsity-regression findings (``Queries.regressions``) as a table."""
    title = "Sparsity regressions (last 15 min vs the day before)"
    if not rows:
        return _empty(title, "regressions: none")
    return _table(
        title,
        ["engine", "model", "signal", "baseline", "current", "evidence"],
        [
            [str(r["engine"]) for r in rows],
            [str(r["model"]) for r in rows],
            [str(r["signal"]) for r in rows],
            [f"{float(r['baseline']):.3g}" for r in rows],
            [f"{float(r['current']):.3g}" for r in rows],
            [", ".join(r["evidence_request_uids"][:2]) for r in rows],
        ],
    )


def routing_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Prefix-routing advice (``Queries.routing_advice``) as a table."""
    title = "Prefix routing advice: prefixes computed on several engines"
    if not rows:
        return _empty(title, "no prefix computed on more than one engine")
    return _table(
        title,
        ["model", "tenant", "prefix", "blocks", "engines", "route to", "saving per hour"],
        [
            [str(r["model"]) for r in rows],
            [str(r["tenant"]) for r in rows],
            [str(r["prefix_hash"])[:16] for r in rows],
            [int(r["duplicated_blocks"]) for r in rows],
            [", ".join(r["engines"]) for r in rows],
            [str(r["affinity_engine"]) for r in rows],
            [f"${r['saving_per_hour_usd']}" for r in rows],
        ],
    )


def human_duration(seconds: float) -> tuple[float, str]:
    """A duration as (value, unit suffix) in the largest unit that keeps it readable."""
    for limit, div, unit in ((120, 1, " s"), (7200, 60, " min"), (172_800, 3600, " h")):
        if abs(seconds) < limit:
            return round(seconds / div, 1), unit
    return round(seconds / 86400, 1), " d"


#: Newest finish older than this: the page says "no traffic since ..." rather than a freshness.
IDLE_AFTER_S = 60.0


def idle(health: Mapping[str, Any]) -> bool:
    """Whether nothing finished for :data:`IDLE_AFTER_S` (or nothing is stored): then "now -
    newest finish" measures the traffic's pause, not the pipeline's delay."""
    f = health.get("freshness_s")
    return f is None or float(f) > IDLE_AFTER_S


def health_figure(health: Mapping[str, Any]) -> Figure:
    """Freshness (while traffic flows) and stored-request health as number indicators."""
    items: list[tuple[str, float, str]] = []
    if not idle(health):
        items.append(("freshness", *human_duration(float(health["freshness_s"]))))
    items.append(("requests stored", int(health.get("requests", 0)), ""))
    items.append(("incomplete", int(health.get("incomplete_requests", 0)), ""))
    items.append(("inconsistent", int(health.get("inconsistent_requests", 0)), ""))
    if "dead_letters" in health:
        # the pipeline's own; refused lines of ingested files are counted apart (health table)
        items.append(("dead letters", int(health["dead_letters"]) - int(health.get("ingest_rejects", 0)), ""))
    n = len(items)
    data = [
        {
            "type": "indicator",
            "mode": "number",
            "value": value,
            "number": {"suffix": suffix, "font": {"size": 30}},
            "title": {"text": name, "font": {"size": 13}},
            "domain": {"x": [i / n + 0.01, (i + 1) / n - 0.01], "y": [0, 1]},
        }
        for i, (name, value, suffix) in enumerate(items)
    ]
    layout = _layout(
        "Pipeline health" if idle(health) else "Freshness and pipeline health",
        height=150,
        margin={"l": 20, "r": 20, "t": 40, "b": 8},
    )
    return {"data": data, "layout": layout}
