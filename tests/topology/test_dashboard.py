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
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.queries import Scope
from tests.helpers import chdb_config, throwaway_store
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
    "cost",
    "savings",
    "timeline",
    "experts-0",
    "whatif",
    "regressions",
    "routing",
]  # one MoE model


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("dash")))


@pytest.fixture(scope="module")
def store(cfg: Config) -> Iterator[Store]:
    with throwaway_store(cfg) as s:
        seed(s)
        yield s


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
    assert page.locator("#health .indicatorlayer g.trace").count() == 5
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
