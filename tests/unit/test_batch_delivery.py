"""compat.deliver_in_batches installs the batch-draining consumer (its delivery, acks and
rebalances run against the real broker in tests/topology/test_worker.py and test_scale_out.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparseety.config import load_config
from sparseety.errors import ConfigError
from sparseety.streams.compat import _BatchDrain, deliver_in_batches
from sparseety.streams.runtime import create_app, raw_topic


async def _handler(records: list[Any]) -> None:
    return None


def _app(tmp_path: Path) -> Any:
    cfg = load_config(data_dir=str(tmp_path))
    return create_app(cfg, "unit-batches", session_timeout_s=30.0), cfg


def test_the_consumer_drains_the_topic_in_batches(tmp_path: Path) -> None:
    app, cfg = _app(tmp_path)
    deliver_in_batches(app, raw_topic(app, cfg.topics.engine_events), _handler, max_records=7, within_s=0.05)
    consumer = app.consumer
    assert isinstance(consumer, _BatchDrain)
    assert (consumer.batch_topic, consumer.batch_max, consumer.batch_within_s) == (
        cfg.topics.engine_events,
        7,
        0.05,
    )
    # subscribed with acks on, like an agent's topic
    assert cfg.topics.engine_events in {t for chan in app.topics for t in chan.topics}


def test_bad_bounds_and_a_late_call_are_refused(tmp_path: Path) -> None:
    app, cfg = _app(tmp_path)
    with pytest.raises(ConfigError):
        deliver_in_batches(
            app, raw_topic(app, cfg.topics.engine_events), _handler, max_records=0, within_s=0.1
        )
    with pytest.raises(ConfigError):
        deliver_in_batches(
            app, raw_topic(app, cfg.topics.engine_events), _handler, max_records=10, within_s=0
        )
    _ = app.consumer  # created with Faust's own class
    with pytest.raises(RuntimeError, match="consumer exists"):
        deliver_in_batches(
            app, raw_topic(app, cfg.topics.engine_events), _handler, max_records=10, within_s=0.1
        )
