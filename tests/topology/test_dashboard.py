"""The dashboard in headless Chromium (Debian's /usr/bin/chromium through Playwright; no browser
download): the self-contained file drawn with the network off, and the page the API serves to a
tenant-scoped token. Charts present, no console errors; screenshots go to artifacts/."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page, Request, sync_playwright

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.client import RemoteQueries
from sparseety.api.dashboard import build_figures, collect, render_dashboard
from sparseety.api.queries import ApiQueries
from sparseety.api.server import ApiServer
from sparseety.config import Config
from sparseety.queries.registry import Scope
from sparseety.sinks.clickhouse.client import Store
from tests.helpers import store_fixtures
from tests.unit.test_api_data import MIN, T0, seed, uid

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
NOW = T0 + 10 * MIN
VIEWPORT = {"width": 1400, "height": 900}
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--mute-audio",
]
STATUSES = ["computed", "cached", "recomputed", "skipped", "evicted", "draft accepted"]
CHARTS = [
    "health",
    "over-time",
    "cost",
    "savings",
    "timeline",
    "experts-0",
    "whatif",
    "regressions",
    "routing",
]  # one MoE model


cfg, store = store_fixtures(seed, "dash")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert shutil.which(CHROMIUM), "Debian's chromium is missing: scripts/setup.sh installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class LiveApi:
    """The API served by :class:`ApiServer` on its own loop in a thread."""

    def __init__(self, backend: Backend) -> None:
        self.server = ApiServer(create_api(backend), host="127.0.0.1", port=0)
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        await self.server.start()
        self.ready.set()
        while not self.stopping.is_set():
            await asyncio.sleep(0.05)
        await self.server.stop()

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(30), "the API did not start"
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(cfg: Config, store: Store) -> Iterator[str]:
    tokens = TokenTable({"tok-admin": ["*"], "tok-acme": ["acme"]})
    backend = Backend(cfg, store, tokens=tokens, clock=lambda: NOW)
    try:
        with LiveApi(backend) as url:
            yield url
    finally:
        backend.close()


class Visit:
    """A page load with everything it logged and asked for."""

    def __init__(self, context: BrowserContext, url: str, *, headers: dict[str, str] | None = None) -> None:
        self.page: Page = context.new_page()
        self.page.set_extra_http_headers(headers or {})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        self.page.on("request", self._request)
        self.page.goto(url)
        self.page.wait_for_function("document.body.dataset.charts !== undefined", timeout=60_000)

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def _request(self, request: Request) -> None:
        self.requests.append(request.url)

    def figure(self, element: str) -> Any:
        """The data plotly drew in one chart (plotly keeps it on the element)."""
        return self.page.evaluate(f"document.getElementById({element!r}).data")

    def legend(self, element: str) -> list[str]:
        return self.page.locator(f"#{element} .legendtext").all_text_contents()

    def close(self) -> None:
        self.page.close()


def assert_charts_drawn(visit: Visit) -> None:
    page = visit.page
    assert page.evaluate("document.body.dataset.charts") == str(len(CHARTS))
    for element in CHARTS:
        assert page.locator(f"#{element} svg.main-svg").count() >= 1, f"{element} was not drawn"
    assert set(visit.legend("timeline")) == set(STATUSES)
    assert page.locator("#timeline g.trace.bars").count() == len(STATUSES)
    assert page.locator("#experts-0 g.hm").count() == 1  # the heatmap layer
    assert page.locator("#cost g.trace.bars").count() == 4  # actual, amortized, list, gpu
    assert page.locator("#savings g.trace.bars").count() == 2
    # the data set's newest finish is 4 minutes before NOW: idle, so no freshness indicator ...
    assert page.locator("#health .indicatorlayer g.trace").count() == 4
    # ... but the pause said as such
    assert "no traffic since 2023-11-14 22:19:20 UTC (" in page.inner_text("table.health")
    assert page.locator("#over-time g.trace.scatter").count() >= 2  # cost and tokens per tenant
    assert visit.errors == [], visit.errors


def test_static_dashboard_draws_offline(browser: Browser, store: Store, tmp_path: Path) -> None:
    path = render_dashboard(ApiQueries(store), tmp_path / "dashboard.html")
    html = path.read_text()
    assert "<script src=" not in html and len(html) > 4_000_000  # plotly.js is inside the file
    context = browser.new_context(viewport=VIEWPORT, offline=True)  # no network at all
    visit = Visit(context, path.as_uri())
    try:
        assert_charts_drawn(visit)
        assert all(u.startswith(("file:", "data:")) for u in visit.requests), visit.requests
        drawn = visit.figure("timeline")
        assert {t["name"] for t in drawn} == set(STATUSES)
        cached = next(t for t in drawn if t["name"] == "cached")
        assert sorted(zip(cached["base"], cached["x"], strict=True)) == [(0, 64), (0, 64)]
        heat = visit.figure("experts-0")[0]
        assert heat["type"] == "heatmap" and heat["z"][0][0] == 14 and heat["z"][1][1] == 27
        ARTIFACTS.mkdir(exist_ok=True)
        visit.page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    finally:
        context.close()


def test_served_dashboard_is_scoped_to_the_token(browser: Browser, live: str) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    admin = Visit(context, f"{live}/dashboard", headers={"Authorization": "Bearer tok-admin"})
    try:
        assert_charts_drawn(admin)
        assert {u.split("/", 3)[2] for u in admin.requests} == {live.split("/", 3)[2]}  # nothing else
        assert any(u.endswith("/dashboard/plotly.min.js") for u in admin.requests)
        assert admin.figure("cost")[0]["x"] == ["acme", "globex", "initech"]
        ARTIFACTS.mkdir(exist_ok=True)
        admin.page.screenshot(path=str(ARTIFACTS / "dashboard-served.png"), full_page=True)
    finally:
        admin.close()
    acme = Visit(context, f"{live}/dashboard", headers={"Authorization": "Bearer tok-acme"})
    try:
        assert acme.errors == [], acme.errors
        assert acme.figure("cost")[0]["x"] == ["acme"]
        labels = set(acme.figure("timeline")[0]["y"])
        assert labels and all(label.startswith("acme") for label in labels)
        assert "tenants: acme" in acme.page.inner_text("header")
    finally:
        context.close()


def test_remote_rendering_matches_local(live: str, store: Store) -> None:
    """The demo and `sparseety dashboard` render through the store process's API."""
    scope = Scope(tenants=("acme", "globex"))
    picks = [uid("e1", "r1"), uid("e3", "r4")]
    with RemoteQueries(live, "tok-admin") as remote:
        there = collect(remote, scope=scope, request_uids=picks, now_ns=NOW)
    here = collect(ApiQueries(store), scope=scope, request_uids=picks, now_ns=NOW)
    assert build_figures(there) == build_figures(here)
    assert [r["request_uid"] for r in there.timelines] == picks


def _cells(page: Page, heading: str) -> list[list[str]]:
    """The body rows of the table in the card headed ``heading``."""
    card = page.locator("section.card", has=page.locator(f"h2:text-is('{heading}')"))
    return [
        [c.strip() for c in row.locator("td").all_text_contents()] for row in card.locator("tbody tr").all()
    ]


def _drawn(page: Page) -> None:
    page.wait_for_function(
        "location.pathname === '/dashboard' && document.body && document.body.dataset.charts !== undefined",
        timeout=60_000,
    )


def test_browser_login_opens_the_dashboard(browser: Browser, live: str) -> None:
    """No token in any URL: a browser without one is sent to /login, signs in with the form (or
    a #token= fragment), holds an HttpOnly session cookie and sees its tenants' dashboard; the
    cookie reads, it never writes."""
    context = browser.new_context(viewport=VIEWPORT)
    seen: list[str] = []
    context.on("request", lambda r: seen.append(r.url))
    page = context.new_page()
    errors: list[str] = []
    failed: list[tuple[int, str]] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on(
        "response", lambda r: failed.append((r.status, r.url.split("/", 3)[3])) if r.status >= 400 else None
    )
    try:
        page.goto(f"{live}/dashboard")
        assert page.url == f"{live}/login"
        page.fill("#token", "wrong")
        page.click("button[type=submit]")
        assert "not known" in page.inner_text("#message")
        page.fill("#token", "tok-admin")
        page.click("button[type=submit]")
        _drawn(page)
        assert page.url == f"{live}/dashboard"
        assert page.evaluate("document.body.dataset.charts") == str(len(CHARTS))
        (cookie,) = context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] not in ("tok-admin",)
        assert page.evaluate("document.cookie") == ""  # scripts cannot read it
        # the panels a platform engineer asks for first
        tenants = _cells(page, "Tenants: hit rate, waste, cost per mode")
        assert [r[0] for r in tenants] == ["acme", "globex", "initech"]
        assert tenants[0][1:3] == ["2", "192"] and tenants[0][4] == "33.3 %"  # acme: 64 of 192 cached
        spec = _cells(page, "Speculative decoding")
        assert spec[0][:6] == ["tiny-moe", "12", "8", "4", "0", "0"]  # ..., cut, of which unverified
        assert spec[0][6:8] == ["66.7 %", "66.7 %"]
        prices = _cells(page, "Prices in effect")
        assert ["tiny-moe", "input", "$10", "per 1M tokens", "always"] in prices
        # counts link to the rows behind them, read with the session cookie
        health = page.locator("table.health")
        with page.expect_navigation():
            health.locator("a", has_text="list").last.click()
        assert page.url.endswith("/api/v1/dead-letters")
        assert len(page.evaluate("JSON.parse(document.body.innerText).rows")) == 1
        page.go_back()
        _drawn(page)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-login.png"), full_page=True)
        # the cookie never authorizes a change: a write needs the bearer header
        status = page.evaluate(
            "fetch('/api/v1/prices', {method: 'POST', headers: {'Content-Type': 'application/json'},"
            " body: JSON.stringify({prices: []})}).then(r => r.status)"
        )
        assert status == 401
        page.click(".logout button")
        assert page.url == f"{live}/login"
        page.goto(f"{live}/dashboard")
        assert page.url == f"{live}/login"  # signed out
    finally:
        context.close()
    # a link with the token in its fragment: the page posts it and drops it from the address bar
    context = browser.new_context(viewport=VIEWPORT)
    context.on("request", lambda r: seen.append(r.url))
    page = context.new_page()
    try:
        page.goto(f"{live}/login#token=tok-acme")
        _drawn(page)
        assert page.url == f"{live}/dashboard"
        assert "tenants: acme" in page.inner_text("header")
        assert [r[0] for r in _cells(page, "Tenants: hit rate, waste, cost per mode")] == ["acme"]
        assert page.evaluate("window.history.length") >= 1 and "tok-" not in page.evaluate("location.href")
    finally:
        context.close()
    assert not [u for u in seen if "tok-" in u], "a token appeared in a URL"
    # the page's only failed loads are the two this test asked for; the console adds the browser's
    # own favicon probe on the JSON page (404) and nothing else
    assert sorted(set(failed)) == [(401, "api/v1/prices"), (401, "login")], failed
    assert [e for e in errors if not e.startswith("Failed to load resource")] == [], errors
    assert len(errors) <= len(failed) + 1, errors
