"""The emitter against a real broker that goes away: bounded memory, spill to the journal,
in-order drain after the broker returns, zero loss by seq (no vLLM needed)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.broker import EmbeddedBroker
from sparseety.config import Config
from sparseety.errors import SparseetyError
from sparseety.kafka import ensure_topics
from sparseety.producers.emitter import Emitter
from tests import factories as f
from tests.helpers import read_topic, running_broker, wait_for


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    with running_broker(tmp_path / "broker") as broker:
        yield broker


def _finished(i: int) -> tuple[str, dict[str, Any]]:
    rid = f"request-{i}-" + "x" * 200
    return ev.REQUEST_FINISHED, f.request_finished(
        rid, prompt=i, output=1, finish_reason="stop", output_block_hashes=[i.to_bytes(8, "big")] * 8
    )


def _seqs(cfg: Config) -> list[int]:
    return [r[3]["seq"] for r in read_topic(cfg, cfg.topics.engine_events, quiet_s=1.0)]


def test_outage_spills_and_drains_in_order_with_zero_loss(own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    cfg = own_broker.client_config().replace(
        data_dir=str(tmp_path / "data"),
        topics={"engine_events": "outage.engine-events", "partitions": 1},
        producer={"memory_limit_bytes": 1024 * 1024, "heartbeat_interval_s": 3600, "flush_timeout_s": 5},
    )
    ensure_topics(cfg, [cfg.topics.engine_events])
    em = Emitter(cfg, engine_name="outage", epoch="1", stall_s=2.0)
    for i in range(200):
        em.emit(_finished, i)
    assert em.wait_idle(30)
    before = _seqs(cfg)
    assert before == list(range(200))

    own_broker.stop()
    for i in range(200, 4200):  # ~1.4 MB with bookkeeping: past the 1 MiB bound
        em.emit(_finished, i)
    journal = cfg.spill_path / "outage" / "core"
    deadline = time.monotonic() + 30
    while not (journal.is_dir() and any(journal.glob("*.seg"))):
        assert time.monotonic() < deadline, "nothing was spilled"
        time.sleep(0.2)
    # the relay reports its totals (REPORT_CHECK_S): the emitter's view follows the journal
    wait_for(lambda: em.counters()["spilled"] > 0, 10, 0.05, "the relay's report of the spill")
    counters = em.counters()
    assert counters["spilled"] > 0 and counters["dropped"] == 0

    EmbeddedBroker(own_broker.cfg).start(create_topics=False)  # memory storage: the topic is gone
    # The emitter's producer may auto-create the topic (with the broker's default partition
    # count) before we get to it; either way one key means one partition, so order still holds.
    with contextlib.suppress(SparseetyError):
        ensure_topics(cfg, [cfg.topics.engine_events])
    assert em.wait_idle(120), em.counters()
    after = _seqs(cfg)
    stats = em.close()
    assert sorted(set(before) | set(after)) == list(range(4200))
    assert after == sorted(after), "the partition must see the stream in seq order"
    assert stats.dropped == 0 and stats.drained == stats.spilled > 0
    assert not any(journal.glob("*.seg"))
