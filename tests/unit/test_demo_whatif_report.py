"""The demo report's "what if" and "regressions" lines, asked through the real API over chDB."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sparseety.api.app import create_api
from sparseety.api.auth import TokenTable
from sparseety.api.backend import Backend
from sparseety.api.client import RemoteQueries
from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from sparseety.stack.demo import _whatif_and_regressions
from tests.helpers import chdb_config, throwaway_store, write_accounting
from tests.unit.test_regressions import MIN, _req


@pytest.fixture
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return chdb_config(tmp_path_factory, data_dir=str(tmp_path_factory.mktemp("demo-whatif")))


def _api(cfg: Config, store: Store, records: list[dict[str, Any]]) -> Iterator[RemoteQueries]:
    write_accounting(store, records)
    b = Backend(cfg, store, tokens=TokenTable({}, admin_token="tok-process-admin"))
    try:
        with TestClient(create_api(b)) as client:
            yield RemoteQueries("http://testserver", client=client)
    finally:
        b.close()


def _records(broken: bool) -> list[dict[str, Any]]:
    """Five requests 40 min ago (baseline) and five 5 min ago (current), on engine e9."""
    now = time.time_ns()
    out = []
    for i in range(5):
        for ago, is_broken in ((40, False), (5, broken)):
            rec = _req(i, "T", 100 - ago, broken=is_broken)
            rec["finished_ts_ns"] = now - ago * MIN + i
            out.append(rec)
    return out


def test_report_says_regressions_none_and_prints_the_what_if_table(cfg: Config) -> None:
    with throwaway_store(cfg) as store:
        for api in _api(cfg, store, _records(broken=False)):
            lines = _whatif_and_regressions(api)
    text = "\n".join(lines)
    assert "What if (modelled" in text and "regressions: none" in lines
    for scenario in ("no-cache", "kv-x2", "no-spec"):
        assert any(row.lstrip().startswith(scenario) for row in text.splitlines()), scenario
    # no-spec drops the 10 rejected drafts of each of the 10 requests
    assert any(row.split()[:1] == ["no-spec"] and "-100" in row.split() for row in text.splitlines()), text


def test_report_lists_a_regression(cfg: Config) -> None:
    with throwaway_store(cfg) as store:
        for api in _api(cfg, store, _records(broken=True)):
            lines = _whatif_and_regressions(api)
    assert "regressions:" in lines
    assert any("e9 window_skip_share: 0.25 -> 0" in line for line in lines), lines
