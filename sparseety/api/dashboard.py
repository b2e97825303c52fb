"""The HTML dashboard: token timelines, expert load, prefix savings, cost per mode, health.

:func:`collect` asks the queries (a local :class:`~sparseety.api.queries.ApiQueries` or a
:class:`~sparseety.api.client.RemoteQueries`), :mod:`sparseety.api.figures` turns the answers into
plotly.js figures, and :func:`render_html` fills the page template (``static/dashboard.html``).
plotly.js comes from the ``plotly`` package: :func:`render_dashboard` embeds it, so the file opens
anywhere without a network; the API's page loads it from ``/dashboard/plotly.min.js`` instead.
Nothing is fetched at run time.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import quote

from sparseety import __version__
from sparseety.api import figures as figs
from sparseety.api.queries import EVERYTHING
from sparseety.queries.registry import MODES, Scope

MAX_EXPERT_MODELS = 4
MAX_ROUTING_ROWS = 10
#: Inconsistent requests the health card names (the link lists up to 100).
MAX_LISTED = 10
#: Outliers per tenant and side the page lists (the costliest and cheapest per output token).
MAX_OUTLIERS = 5
#: The what-if scenarios the page compares (kv-curve gives the 1.5x, 2x and 4x rows).
WHATIF_SCENARIOS = ("no-cache", "kv-curve", "no-spec")


@dataclass
class DashboardData:
    """Everything the page shows, as fetched."""

    generated_ns: int
    scope: Scope
    cost: dict[str, list[dict[str, Any]]]
    savings: list[dict[str, Any]]
    experts: list[dict[str, Any]]
    timelines: list[dict[str, Any]]
    health: dict[str, Any]
    pipeline: dict[str, Any] = field(default_factory=dict)
    whatif: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    regressions: list[dict[str, Any]] = field(default_factory=list)
    routing: list[dict[str, Any]] = field(default_factory=list)
    bucket: str = "1h"
    over_time: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # mode -> rows per bucket
    waste: list[dict[str, Any]] = field(default_factory=list)
    spec: list[dict[str, Any]] = field(default_factory=list)
    prices: list[dict[str, Any]] = field(default_factory=list)
    inconsistent: list[dict[str, Any]] = field(default_factory=list)
    outliers: list[dict[str, Any]] = field(default_factory=list)  # per tenant, top and bottom
    adapters: list[dict[str, Any]] = field(default_factory=list)  # actual cost by model and adapter
    #: actual cost by tenant and service tier, with cache writes and reads by tier (issue 36)
    tiers: list[dict[str, Any]] = field(default_factory=list)


def collect(
    queries: Any,
    *,
    scope: Scope = EVERYTHING,
    request_uids: list[str] | None = None,
    timelines: int = 8,
    pipeline: dict[str, Any] | None = None,
    now_ns: int | None = None,
) -> DashboardData:
    """Ask ``queries`` for what the page shows.

    Args:
        queries: An :class:`ApiQueries` or :class:`RemoteQueries`.
        scope: Time range and tenants.
        request_uids: Requests whose timelines to draw (default: the ``timelines`` most varied).
        timelines: How many timelines to pick when ``request_uids`` is not given.
        pipeline: Process-side health to show (sink counters, jobs), if any.
        now_ns: The time freshness is measured against (default now).
    """
    now = now_ns if now_ns is not None else time.time_ns()
    if request_uids is None:
        request_uids = [
            r["request_uid"] for r in queries.requests(scope=scope, limit=timelines, order="varied")
        ]
    found = _requests(queries, request_uids, scope)
    health = queries.health(scope=scope, now_ns=now)
    span_s = (health.get("latest_finished_ts_ns", 0) - health.get("earliest_finished_ts_ns", 0)) / 1e9
    bucket = figs.pick_bucket(span_s)
    return DashboardData(
        generated_ns=now,
        scope=scope,
        cost={m: queries.cost(mode=m, by=("tenant",), scope=scope) for m in MODES},
        savings=queries.savings(by=("tenant",), scope=scope),
        experts=queries.expert_load(scope=scope),
        timelines=[r for r in found if r is not None],
        health=health,
        pipeline=dict(pipeline or {}),
        whatif={sc: queries.whatif(scenario=sc, by=("tenant",), scope=scope) for sc in WHATIF_SCENARIOS},
        # regressions judge the last 15 minutes against the day before, whatever the page's range
        regressions=queries.regressions(scope=Scope(until_ns=now, tenants=scope.tenants)),
        routing=queries.routing_advice(limit=MAX_ROUTING_ROWS, scope=scope),
        bucket=bucket,
        over_time={
            m: queries.cost(mode=m, by=("tenant",), bucket=bucket, scope=scope) for m in ("actual", "list")
        },
        waste=queries.waste(by=("tenant",), scope=scope),
        spec=queries.spec_efficiency(by=("model",), scope=scope),
        prices=_prices_in_effect(queries, now),
        inconsistent=queries.requests(scope=scope, limit=MAX_LISTED, inconsistent=1)
        if health.get("inconsistent_requests")
        else [],
        outliers=queries.outliers(limit=MAX_OUTLIERS, scope=scope),
        adapters=queries.cost(mode="actual", by=("model", "adapter"), scope=scope),
        tiers=queries.cost(mode="actual", by=("tenant", "service_tier"), scope=scope),
    )


def _prices_in_effect(queries: Any, now_ns: int) -> list[dict[str, Any]]:
    """Per model and class, the price with the latest effective time at or before now (what a
    request finishing now pays)."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for p in queries.prices_list():
        eff = p["effective_from"]
        eff_ns = int(eff.timestamp() * 1e9) if isinstance(eff, datetime) else 0
        key = (str(p["model"]), str(p["token_class"]), str(p.get("qualifier", "")))
        if eff_ns <= now_ns and (key not in best or best[key]["_eff"] <= eff_ns):
            best[key] = {**p, "_eff": eff_ns}
    return [{k: v for k, v in p.items() if k != "_eff"} for _, p in sorted(best.items())]


def _requests(queries: Any, uids: list[str], scope: Scope) -> list[dict[str, Any] | None]:
    """The requests in ``uids``' order, in one batch (one query locally, one API call remotely)."""
    by_uid = queries.requests_by_uid(uids, scope=scope)
    return [by_uid.get(uid) for uid in uids]


def build_figures(data: DashboardData) -> dict[str, figs.Figure]:
    """Element id -> figure."""
    out = {
        "health": figs.health_figure(data.health),
        "over-time": figs.over_time_figure(
            data.over_time.get("actual", []), data.over_time.get("list", []), data.bucket
        ),
        "cost": figs.cost_figure(data.cost),
        "savings": figs.savings_figure(data.savings),
        "timeline": figs.timeline_figure(data.timelines),
        "whatif": figs.whatif_figure([r for rows in data.whatif.values() for r in rows]),
        "regressions": figs.regressions_figure(data.regressions),
        "routing": figs.routing_figure(data.routing),
    }
    models = list(dict.fromkeys(r["model"] for r in data.experts))[:MAX_EXPERT_MODELS] or [""]
    for i, model in enumerate(models):
        out[f"experts-{i}"] = figs.expert_figure(data.experts, model)
    return out


def _asset(name: str) -> str:
    return resources.files("sparseety.api").joinpath("static", name).read_text(encoding="utf-8")


def plotly_js_path() -> Path:
    """plotly.js as shipped inside the ``plotly`` package."""
    return Path(str(resources.files("plotly").joinpath("package_data", "plotly.min.js")))


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _scope_text(scope: Scope) -> str:
    parts = []
    if scope.since_ns is not None:
        parts.append(f"finished from {_time(scope.since_ns)}")
    if scope.until_ns is not None:
        parts.append(f"before {_time(scope.until_ns)}")
    parts.append(
        "all tenants" if scope.tenants is None else "tenants: " + (", ".join(scope.tenants) or "none")
    )
    return "; ".join(parts)


def _link(href: str, text: str) -> str:
    return f'<a href="{html.escape(href)}">{html.escape(text)}</a>'


def _health_rows(data: DashboardData) -> list[tuple[str, str]]:
    """(label, cell HTML) rows of the health card; counts link to the rows behind them (on the
    page the API serves; the written file keeps them as text)."""
    h = data.health
    latest = h.get("latest_finished_ts_ns") or 0
    if not latest:
        traffic = "no requests stored"
    elif figs.idle(h):
        value, unit = figs.human_duration(h["freshness_s"])
        traffic = f"no traffic since {_time(latest)} ({value:g}{unit} ago)"
    else:
        value, unit = figs.human_duration(h["freshness_s"])
        traffic = f"{value:g}{unit} behind now (newest finish {_time(latest)})"
    rows = [
        ("traffic", html.escape(traffic)),
        ("requests stored", html.escape(str(h.get("requests", 0)))),
        ("with sequence gaps", html.escape(str(h.get("seq_gap_requests", 0)))),
    ]
    bad = int(h.get("inconsistent_requests", 0))
    cell = html.escape(str(bad))
    if bad:
        listed = ", ".join(
            _link(f"/api/v1/requests/{quote(str(r['request_uid']), safe='')}", str(r["request_uid"]))
            for r in data.inconsistent
        )
        cell += f" — {_link('/api/v1/requests?inconsistent=1&limit=100', 'list')}: {listed}"
        if bad > len(data.inconsistent):
            cell += " …"
    rows.append(("inconsistent (counts ≠ engine's)", cell))
    if "dead_letters" in h:
        rejects = int(h.get("ingest_rejects", 0))
        n = int(h["dead_letters"]) - rejects
        cell = html.escape(str(n)) + (f" — {_link('/api/v1/dead-letters', 'list')}" if n else "")
        rows.append(("dead letters (pipeline)", cell))
        cell = html.escape(str(rejects))
        if rejects:
            cell += f" — {_link('/api/v1/dead-letters?component=ingest', 'list')}"
        rows.append(("ingest rejects (bad lines of ingested files)", cell))
    rows.extend((k.replace("_", " "), html.escape(_text(v))) for k, v in data.pipeline.items())
    return rows


def _html_table(cls: str, header: list[str], rows: list[list[Any]], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_text(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _pct(x: Any) -> str:
    return f"{float(x) * 100:.1f} %"


def tenant_rows(data: DashboardData) -> list[list[Any]]:
    """Per tenant: requests, prompt and output tokens, cache hit rate, waste share, cost in each
    mode (the per-tenant table)."""
    savings = {str(r["tenant"]): r for r in data.savings}
    waste = {str(r["tenant"]): r for r in data.waste}
    cost = {m: {str(r["tenant"]): r for r in rows} for m, rows in data.cost.items()}
    out = []
    for t in sorted(savings):
        sv, w = savings[t], waste.get(t, {})
        out.append(
            [
                t or "(none)",
                sv["requests"],
                sv["prompt_tokens"],
                cost.get("list", {}).get(t, {}).get("output_tokens", ""),
                _pct(sv["hit_rate"]),
                _pct(w.get("waste_share", 0)),
                *(f"${cost.get(m, {}).get(t, {}).get('cost_usd', 0)}" for m in MODES),
            ]
        )
    return out


def spec_rows(data: DashboardData) -> list[list[Any]]:
    """Per model with drafts: ours (accepted / every draft computed, cut ones included) beside
    vLLM's (verifier-accepted / verified, docs/streams.md "Drafts"), and what drafts bought."""
    out = []
    for r in data.spec:
        a, j, k = int(r["draft_accepted_tokens"]), int(r["draft_rejected_tokens"]), int(r["draft_cut_tokens"])
        if a + j + k == 0:
            continue
        out.append(
            [
                r["model"],
                a + j + k,
                a,
                j,
                k,
                int(r["draft_unverified_tokens"]),
                _pct(r["acceptance_rate"]),
                _pct(r["vllm_acceptance_rate"]),
                _pct(r["output_from_drafts"]),
                _pct(r["rejected_compute_share"]),
            ]
        )
    return out


def outlier_rows(data: DashboardData) -> list[list[Any]]:
    """Per tenant, the costliest and the cheapest requests per output token, with their reasons."""
    return [
        [
            r["tenant"] or "(none)",
            f"{r['side']} {r['rank']}",
            r["request_uid"],
            f"${r['cost_per_output_token_usd']}",
            r["output_tokens"],
            ", ".join(r["reasons"]) or "—",
        ]
        for r in data.outliers
    ]


def adapter_rows(data: DashboardData) -> list[list[Any]]:
    """Per base model and LoRA adapter: requests, output, reasoning, actual cost."""
    return [
        [
            r["model"],
            r["adapter"] or "(base)",
            r["requests"],
            r["output_tokens"],
            "not observed" if r.get("reasoning_output_tokens") is None else r["reasoning_output_tokens"],
            f"${r['cost_usd']}",
        ]
        for r in data.adapters
    ]


def tier_rows(data: DashboardData) -> list[list[Any]]:
    """Per tenant and service tier: requests, cache writes, cache reads by tier, actual cost."""
    return [
        [
            r["tenant"] or "(none)",
            r["service_tier"] or "(none)",
            r["requests"],
            r["cache_write_tokens"],
            r["cached_tokens"],
            r["cache_read_cpu_offload_tokens"],
            r["cache_read_host_tokens"],
            r["cache_read_storage_tokens"],
            r["external_kv_tokens"],
            f"${r['cost_usd']}",
        ]
        for r in data.tiers
    ]


def price_rows(data: DashboardData) -> list[list[Any]]:
    return [
        [
            p["model"],
            f"{p['token_class']} ({p['qualifier']})" if p.get("qualifier") else p["token_class"],
            f"x{p['usd']}" if p.get("qualifier") else f"${p['usd']}",
            f"per {p['unit']}",
            _time(int(p["effective_from"].timestamp() * 1e9))
            if isinstance(p["effective_from"], datetime) and p["effective_from"].timestamp() > 0
            else "always",
        ]
        for p in data.prices
    ]


def _text(value: Any) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</`` can end it early)."""
    return json.dumps(value, separators=(",", ":"), default=str).replace("</", "<\\/")


def render_html(data: DashboardData, *, plotly_src: str | None = None) -> str:
    """The page. ``plotly_src``: a URL to load plotly.js from; None embeds it (self-contained)."""
    figures = build_figures(data)
    if plotly_src is None:
        plotly = (
            "<script>"
            + plotly_js_path().read_text(encoding="utf-8").replace("</script", "<\\/script")
            + ("</script>")
        )
    else:
        plotly = f'<script src="{html.escape(plotly_src)}"></script>'
    experts = "\n  ".join(
        f'<section class="card"><div id="{html.escape(k)}" class="chart"></div></section>'
        for k in figures
        if k.startswith("experts-")
    )
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in _health_rows(data))
    tenants = _html_table(
        "data",
        [
            "tenant",
            "requests",
            "prompt",
            "output",
            "cache hit rate",
            "waste share",
            *(f"{m} USD" for m in MODES),
        ],
        tenant_rows(data),
        "no requests in scope",
    )
    spec = _html_table(
        "data",
        [
            "model",
            "drafts",
            "accepted",
            "rejected",
            "cut",
            "of which unverified",
            "acceptance (ours)",
            "acceptance (vLLM's)",
            "output from drafts",
            "rejected compute",
        ],
        spec_rows(data),
        "no speculative decoding in scope",
    )
    prices = _html_table(
        "data",
        ["model", "class", "price", "unit", "in effect since"],
        price_rows(data),
        "no prices set: costs read 0 (sparseety prices set|load)",
    )
    outliers = _html_table(
        "data",
        ["tenant", "side", "request", "cost per output token", "output", "reasons"],
        outlier_rows(data),
        "no requests with output in scope",
    )
    adapters = _html_table(
        "data",
        ["model", "adapter", "requests", "output", "reasoning", "actual USD"],
        adapter_rows(data),
        "no requests in scope",
    )
    tiers = _html_table(
        "data",
        ["tenant", "service tier", "requests", "cache writes", "gpu", "cpu_offload", "host",
         "storage", "external", "actual USD"],
        tier_rows(data),
        "no requests in scope",
    )  # fmt: skip
    page = Template(_asset("dashboard.html"))
    return page.substitute(
        title="SparSEEty — token accounting",
        style=_asset("dashboard.css"),
        plotly=plotly,
        meta=html.escape(f"generated {_time(data.generated_ns)} · {_scope_text(data.scope)}"),
        health_table=f'<table class="health">{table}</table>',
        tenant_table=tenants,
        spec_table=spec,
        prices_table=prices,
        outliers_table=outliers,
        adapters_table=adapters,
        tiers_table=tiers,
        expert_sections=experts,
        figures=_script_json(figures),
        script=_asset("dashboard.js"),
        footer=html.escape(
            f"SparSEEty {__version__} · charts drawn with plotly.js, shipped with SparSEEty: nothing is "
            f"fetched from the internet"
        ),
    )


def render_dashboard(
    queries: Any,
    path: str | Path,
    *,
    scope: Scope = EVERYTHING,
    request_uids: list[str] | None = None,
    pipeline: dict[str, Any] | None = None,
) -> Path:
    """Write a self-contained HTML dashboard (plotly.js embedded) to ``path``; return the path.

    Args:
        queries: An :class:`~sparseety.api.queries.ApiQueries` over an open store, or a
            :class:`~sparseety.api.client.RemoteQueries` (the store process's API).
        path: Output file.
        scope: Time range and tenants.
        request_uids: Requests whose timelines to draw (default: the most varied ones).
        pipeline: Extra health figures to list (name -> value).
    """
    data = collect(queries, scope=scope, request_uids=request_uids, pipeline=pipeline)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data), encoding="utf-8")
    return out
