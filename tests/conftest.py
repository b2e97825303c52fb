"""Shared fixtures. Tiers follow folders: tests/unit (pure), tests/topology (real broker + Faust),
tests/harness (vLLM's real engine core and SGLang's real scheduler in their GPU-default modes, a
simulated executor or model worker, real broker), tests/e2e (real vLLM and SGLang),
tests/security (the store's and the API's walls, on real chDB and uvicorn).
Services start once per session and are shared; names are unique per test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparseety.config import Config

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).relative_to(TESTS).parts[0]
        if tier in ("unit", "topology", "chaos", "security", "harness", "e2e"):
            item.add_marker(getattr(pytest.mark, tier))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """scripts/test.sh runs pytest-xdist workers: a file runs in one worker (its module fixtures
    start once), and every real-engine test runs in the same worker, so each engine kind still
    starts once per session and at most two engines are alive at a time (tests/e2e/conftest.py).
    (``--dist loadgroup`` would say this with markers, but it groups nothing under pytest 9.)"""
    from xdist.scheduler import LoadFileScheduling

    class EnginesTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return "tests/e2e" if nodeid.startswith("tests/e2e/") else super()._split_scope(nodeid)

    return EnginesTogether(config, log)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sparseety")


@pytest.fixture(scope="session")
def broker(session_dir: Path) -> Iterator[Config]:
    """A real Tansu broker for the whole session; yields a config pointing at it."""
    from tests.helpers import running_broker

    with running_broker(session_dir / "broker") as b:
        yield b.client_config()


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic, group and database names of one test."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def kafka_cfg(broker: Config, unique: str, tmp_path: Path) -> Config:
    """Broker config with this test's own topics and data dir; topics created."""
    from sparseety.kafka import ensure_topics

    topics = {
        "engine_events": f"t{unique}.engine-events",
        "timelines": f"t{unique}.timelines",
        "usage": f"t{unique}.usage",
        "dlq": f"t{unique}.dlq",
        "partitions": 2,
    }
    cfg = broker.replace(topics=topics, data_dir=str(tmp_path / "data"))
    ensure_topics(cfg)
    return cfg
