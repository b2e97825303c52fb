"""Workarounds for the embedded broker's observed behaviour (Tansu), fenced here.

**Time bounds on a batch-granular broker.** Tansu answers ``offsets_for_times`` at record-batch
granularity (the offset of the batch holding the time, so records before the time come too), and
its high watermark is batch-granular as well. A replay (``sinks/replay.py``) therefore resolves
times with :func:`offsets_for_time`, then filters each record by its own timestamp and ends a
partition where it stays past the end time (:func:`outside_time_range`). On a broker that answers
per record the filter never fires. Observed on the Tansu this project embeds (``sparseety
broker``); it lived in ``streams/compat.py`` before, which made the replay import the worker's
Faust workarounds.
"""

from __future__ import annotations

from typing import Any


async def offsets_for_time(consumer: Any, tps: list[Any], ns: int, high: dict[Any, int]) -> dict[Any, int]:
    """Per partition, the offset ``offsets_for_times`` gives for ``ns`` (the high watermark when
    no record is that new). On Tansu it is the start of the record batch holding the time."""
    found = await consumer.offsets_for_times({tp: ns // 1_000_000 for tp in tps})
    return {tp: (found[tp].offset if found.get(tp) else high[tp]) for tp in tps}


def outside_time_range(plan: Any, offset: int, ts_ns: int) -> bool:
    """Whether a record is outside ``[plan.min_ns, plan.max_ns)``, judged by its own timestamp.

    A record at or past the end time ends the partition once it lies beyond the offset the end
    time resolved to (``plan.hint``): before that, batch granularity may still bring older ones.
    Records older than the start come from the batch ``offsets_for_times`` pointed at.
    """
    if plan.max_ns is not None and ts_ns >= plan.max_ns:
        if offset >= plan.hint:
            plan.done = True
        return True
    return plan.min_ns is not None and ts_ns < plan.min_ns
