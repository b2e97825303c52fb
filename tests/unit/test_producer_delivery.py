"""The producer's delivery watch (issue 31): events waiting with no acknowledgement for 10 s, or
a client that reports every broker down, is "not delivering", logged once (and its recovery
once) and written for ``sparseety status``; a stream with nothing waiting is never flagged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sparseety.producers.delivery import NOT_DELIVERING_AFTER_S, STATE_FILE, DeliveryWatch, read_states


def test_waiting_without_acknowledgement_is_not_delivering(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    watch = DeliveryWatch("core", "127.0.0.1:1", clock=lambda: now[0], wall=lambda: 7)
    folder = tmp_path / "eng" / "core"
    caplog.set_level(logging.WARNING, logger="sparseety.producer")
    common = {"engine": "eng", "journal_dir": folder, "error": ""}
    assert watch.update(waiting=0, last_progress=0.0, acked=False, **common)  # nothing waits: fine
    assert watch.update(waiting=5, last_progress=now[0] - 1, acked=False, **common)  # not yet
    now[0] += NOT_DELIVERING_AFTER_S + 1
    for _ in range(3):
        assert not watch.update(waiting=5, last_progress=1000.0 - 1, acked=False, **common)
    assert sum("takes no events" in r.getMessage() for r in caplog.records) == 1
    (state,) = read_states(tmp_path)
    assert (state.engine, state.stream, state.delivering, state.waiting) == ("eng", "core", False, 5)
    assert watch.update(waiting=0, last_progress=now[0], acked=True, **common)
    assert sum("takes events again" in r.getMessage() for r in caplog.records) == 1
    assert json.loads((folder / STATE_FILE).read_text())["delivering"] is True
    watch.close(folder)
    assert read_states(tmp_path) == []


def test_every_broker_down_is_said_at_once(tmp_path: Path) -> None:
    watch = DeliveryWatch("core", "b:1", clock=lambda: 5.0)
    assert not watch.update(
        engine="e", journal_dir=tmp_path, waiting=1, last_progress=5.0, acked=False, brokers_down=True
    )
    # an unnamed stream writes nothing yet, but still decides
    other = DeliveryWatch("core", "b:1", clock=lambda: 5.0)
    assert not other.update(
        engine="", journal_dir=None, waiting=1, last_progress=5.0, acked=False, brokers_down=True
    )
