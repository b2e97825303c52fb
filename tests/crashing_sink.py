"""``python -m tests.crashing_sink N sink ...``: the ``sparseety`` CLI whose ClickHouse sink
SIGKILLs its own process right after its N-th write that stored rows, before the batch is
acknowledged: the window between a write and its offset commit, for the crash test."""

from __future__ import annotations

import logging
import os
import signal
import sys

from sparseety.sinks.base import FlushResult
from sparseety.sinks.clickhouse.writer import ClickHouseSink

log = logging.getLogger("sparseety.sink")


def crash_after(writes: int) -> None:
    """Patch :meth:`ClickHouseSink.flush` to SIGKILL the process after ``writes`` writes."""
    flush = ClickHouseSink.flush
    done = 0

    def crashing_flush(self: ClickHouseSink) -> FlushResult:
        nonlocal done
        result = flush(self)
        if result.total_rows:
            done += 1
            if done >= writes:
                log.warning("sink: crash-after-writes hook: SIGKILL after the write, before the ack")
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    ClickHouseSink.flush = crashing_flush  # type: ignore[method-assign]


if __name__ == "__main__":
    crash_after(int(sys.argv[1]))
    from sparseety.cli import main

    main(sys.argv[2:], prog_name="sparseety")
