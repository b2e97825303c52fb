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

from sparseety import __version__
from sparseety.api import figures as figs
from sparseety.api.queries import EVERYTHING
from sparseety.sinks.clickhouse.queries import MODES, Scope

MAX_EXPERT_MODELS = 4
MAX_ROUTING_ROWS = 10
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
    return DashboardData(
        generated_ns=now,
        scope=scope,
        cost={m: queries.cost(mode=m, by=("tenant",), scope=scope) for m in MODES},
        savings=queries.savings(by=("tenant",), scope=scope),
        experts=queries.expert_load(scope=scope),
        timelines=[r for r in found if r is not None],
        health=queries.health(scope=scope, now_ns=now),
        pipeline=dict(pipeline or {}),
        whatif={sc: queries.whatif(scenario=sc, by=("tenant",), scope=scope) for sc in WHATIF_SCENARIOS},
        # regressions judge the last 15 minutes against the day before, whatever the page's range
        regressions=queries.regressions(scope=Scope(until_ns=now, tenants=scope.tenants)),
        routing=queries.routing_advice(limit=MAX_ROUTING_ROWS, scope=scope),
    )


def _requests(queries: Any, uids: list[str], scope: Scope) -> list[dict[str, Any] | None]:
    """The requests in ``uids``' order, in one batch (one query locally, one API call remotely)."""
    by_uid = queries.requests_by_uid(uids, scope=scope)
    return [by_uid.get(uid) for uid in uids]


def build_figures(data: DashboardData) -> dict[str, figs.Figure]:
    """Element id -> figure."""
    out = {
        "health": figs.health_figure(data.health),
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


def _health_rows(data: DashboardData) -> list[tuple[str, str]]:
    h = data.health
    rows = [
        ("newest finish", _time(h["latest_finished_ts_ns"]) if h.get("latest_finished_ts_ns") else "—"),
        (
            "freshness",
            "{:g}{} behind now".format(*figs.human_duration(h["freshness_s"]))
            if h.get("freshness_s") is not None
            else "no requests",
        ),
        ("requests stored", str(h.get("requests", 0))),
        ("with sequence gaps", str(h.get("seq_gap_requests", 0))),
    ]
    rows.extend((k.replace("_", " "), _text(v)) for k, v in data.pipeline.items())
    return rows


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
    table = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _health_rows(data)
    )
    page = Template(_asset("dashboard.html"))
    return page.substitute(
        title="SparSEEty — token accounting",
        style=_asset("dashboard.css"),
        plotly=plotly,
        meta=html.escape(f"generated {_time(data.generated_ns)} · {_scope_text(data.scope)}"),
        health_table=f'<table class="health">{table}</table>',
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
