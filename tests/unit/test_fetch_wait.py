"""compat.with_fetch_wait: the worker's aiokafka consumer asks the broker to hold an empty fetch
for ``worker.fetch_wait_s``, not Faust's fixed 1.5 s (streams/compat.py item 9; the latency it
costs on the embedded broker is in docs/benchmarks.md, "Issue 33")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sparseety.config import load_config
from sparseety.errors import ConfigError
from sparseety.streams.app import create_app as create_worker_app
from sparseety.streams.compat import _BatchDrain, with_fetch_wait
from sparseety.streams.runtime import create_app


def _built_consumer(app: Any) -> Any:
    """The aiokafka consumer the app's consumer thread builds when it starts (not started here)."""

    async def build() -> Any:
        thread = app.consumer._thread
        return thread._create_consumer(asyncio.get_running_loop())

    return asyncio.run(build())


def test_the_worker_consumer_fetches_with_the_configured_wait(tmp_path: Path) -> None:
    cfg = load_config(data_dir=str(tmp_path), worker={"fetch_wait_s": 0.05})
    app = create_worker_app(cfg)
    assert isinstance(app.consumer, _BatchDrain)  # composes with the batch delivery (item 7)
    assert _built_consumer(app)._fetch_max_wait_ms == 50


def test_faust_alone_would_wait_a_second_and_a_half(tmp_path: Path) -> None:
    # The behaviour item 9 replaces: if a faust-streaming upgrade changes it, the item can go.
    app = create_app(load_config(data_dir=str(tmp_path)), "unit-fetch-faust", session_timeout_s=30.0)
    assert _built_consumer(app)._fetch_max_wait_ms == 1500


def test_a_bad_wait_and_a_late_call_are_refused(tmp_path: Path) -> None:
    app = create_app(load_config(data_dir=str(tmp_path)), "unit-fetch-late", session_timeout_s=30.0)
    with pytest.raises(ConfigError):
        with_fetch_wait(app, 0)
    _ = app.consumer
    with pytest.raises(RuntimeError, match="consumer exists"):
        with_fetch_wait(app, 0.1)
