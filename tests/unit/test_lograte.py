"""Issue 31: a broker outage no longer floods the worker's and the sink's logs with aiokafka's
per-attempt connection errors (2,039 ERROR lines in 45 s were seen): one line per template every
10 s, the next one saying how many were held back; other lines untouched."""

from __future__ import annotations

import logging

import pytest

from sparseety.lograte import ALWAYS_PASSED, EVERY_S, RateLimit, thin_kafka_client_logs


def _record(msg: str, *args: object, name: str = "aiokafka.client") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_one_record_per_template_per_interval_and_the_count_of_the_rest() -> None:
    now = [100.0]
    limit = RateLimit(every_s=10.0, clock=lambda: now[0])
    passed = [
        r for i in range(50) if limit.filter(r := _record("Unable connect to node with id %s: %s", i, "x"))
    ]
    assert len(passed) == 1
    other = _record("another template %s", 1)
    assert limit.filter(other)  # a different template is not held back by the first
    now[0] += 10.0
    again = _record("Unable connect to node with id %s: %s", 7, "x")
    assert limit.filter(again)
    assert (
        again.getMessage()
        == "Unable connect to node with id 7: x [49 more like it in the last 10 s held back]"
    )


def test_the_kafka_client_loggers_are_thinned(caplog: pytest.LogCaptureFixture) -> None:
    thin_kafka_client_logs()
    thin_kafka_client_logs()  # once per process: a second call adds no second filter
    client = logging.getLogger("aiokafka.client")
    assert sum(type(f).__name__ == "RateLimit" for f in client.filters) == 1
    with caplog.at_level(logging.ERROR):
        for i in range(200):
            client.error('Unable connect to "%s:%s": %s', "127.0.0.1", 9092 + i % 3, "refused")
        logging.getLogger("sparseety.worker").error("our own line %s", 1)
        logging.getLogger("sparseety.worker").error("our own line %s", 2)
    kafka = [r for r in caplog.records if r.name == "aiokafka.client"]
    ours = [r for r in caplog.records if r.name == "sparseety.worker"]
    assert len(kafka) == 1 and len(ours) == 2
    assert EVERY_S == 10.0


def test_the_group_s_completed_join_steps_are_never_held_back() -> None:
    """Issue 33: thinned, a second join round after a failed SyncGroup looked like an 8 s stall
    between two consecutive lines; every completed join/sync step passes."""
    from pathlib import Path

    import aiokafka.consumer.group_coordinator as gc

    source = Path(gc.__file__).read_text()
    for template in ALWAYS_PASSED:  # aiokafka still logs them as such (else they are thinned again)
        assert f'"{template}"' in source, template
    limit = RateLimit(every_s=10.0, clock=lambda: 100.0)
    name = "aiokafka.consumer.group_coordinator"
    joined = "Joined group '%s' (generation %s) with member_id %s"
    rejoining = "(Re-)joining group %s"
    assert all(limit.filter(_record(joined, "g", gen, "m", name=name)) for gen in (1, 2, 3))
    assert [limit.filter(_record(rejoining, "g", name=name)) for _ in range(3)] == [True, False, False]
