"""The sink's batch consumer loop in this process against the real broker: a partition whose
writes fail is paused alone and resumes exactly where it stopped (nothing skipped, every offset
committed only after its write), while the other partitions keep flowing."""

from __future__ import annotations

import asyncio
import time

from sparseety.config import Config
from sparseety.sinks.base import FlushResult
from sparseety.sinks.consumer import SinkConsumer
from tests.topology.test_sink_consumer import accounting_items, all_committed, committed, produce
from tests.unit.test_sink_worker import MemorySink


class FlakySink(MemorySink):
    """A MemorySink whose flushes fail for one partition the first ``failures`` times it holds rows."""

    def __init__(self, tp: tuple[str, int], failures: int) -> None:
        super().__init__()
        self.tp, self.failures_left, self.failed = tp, failures, 0
        self.committed_before_write: list[tuple[str, int, int]] = []

    def flush(self) -> FlushResult:
        holds = any((b[2], b[3]) == self.tp for b in self.buffer)
        if holds and self.failures_left > 0:
            self.failures_left -= 1
            self.failed += 1
            self.broken = {self.tp}
        else:
            self.broken = set()
        return super().flush()


def test_a_failing_partition_is_paused_alone_and_resumes_where_it_stopped(
    kafka_cfg: Config, unique: str
) -> None:
    cfg = kafka_cfg.replace(
        sink={**kafka_cfg.sink.model_dump(), "group_id": f"sink-{unique}", "batch_interval_s": 0.3}
    )
    first = produce(cfg, accounting_items(cfg, 40))
    tp = (cfg.topics.timelines, 1)
    assert tp in first and len(first) > 1  # the failing partition, and others beside it
    sink = FlakySink(tp, failures=8)
    loop = SinkConsumer(cfg, sink, session_timeout_s=6, commit_interval_s=0.2)
    stopped_seen: list[bool] = []
    second: dict[tuple[str, int], int] = {}
    checked: list[int] = []

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 90
        while True:
            assert not task.done(), task
            stopped_seen.append(tp in loop.partitions.paused)
            held = [o for (_, _, t, p, o) in list(sink.buffer) if (t, p) == tp]
            if held:
                # the stopped partition's offsets are never committed past what it wrote
                got = await asyncio.to_thread(committed, cfg, [tp])
                checked.append(got[tp])
                assert got[tp] <= min(held), (got, held)
            if sink.failed and not second:
                # while the partition is stopped, more records arrive on every partition
                second.update(await asyncio.to_thread(produce, cfg, accounting_items(cfg, 40, start=40)))
            if second and await asyncio.to_thread(all_committed, cfg, {**first, **second}):
                break
            assert time.monotonic() < deadline, "every offset committed"
            await asyncio.sleep(0.1)
        stop.set()
        await task

    asyncio.run(run())
    assert sink.failed == 8 and any(stopped_seen) and not loop.partitions.paused
    assert checked  # the commit check above ran while the partition was stopped
    stored = {(t, p, o) for _, _, t, p, o in sink.stored}
    last = {k: max(first.get(k, -1), second.get(k, -1)) for k in {*first, *second}}
    for (t, p), off in last.items():
        assert {o for (t2, p2, o) in stored if (t2, p2) == (t, p)} >= set(range(off + 1)), (t, p)
    assert len({r[1]["request_uid"] for r in sink.stored}) == 80  # nothing skipped, on any partition
