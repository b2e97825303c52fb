"""FanOutSink: several sinks behind one consumer (``sparseety sink --sink clickhouse --sink otel``).

Each record goes to every child sink that accepts it; a flush flushes every child. A child whose
write keeps failing keeps its batches buffered and the flush raises
:class:`~sparseety.errors.SinkWriteError` naming them, so the consumer holds those partitions
(for every child: offsets are shared) until the write succeeds; children that succeeded hold
nothing for those batches, so the retry only re-writes the failing child.

Trade-off: one consumer group means a slow or failing child stalls the others on the partitions
it holds. To isolate an optional export (OpenTelemetry) from billing data (ClickHouse), run it as
its own ``sparseety sink`` process with its own ``sink.group_id`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparseety.config import Config
from sparseety.errors import SinkWriteError

from .base import Batch, FlushResult, Sink


class FanOutSink(Sink):
    """Fans records out to ``sinks`` (closed with it)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        if not sinks:
            raise ValueError("FanOutSink needs at least one sink")
        self.sinks = list(sinks)
        self.records = frozenset().union(*(s.records for s in self.sinks))  # type: ignore[misc]

    @classmethod
    def from_config(cls, cfg: Config, **options: Any) -> FanOutSink:
        """Build from registered sink names: ``names=["clickhouse", "otel"]``."""
        from .base import load_sink_class

        names = options.pop("names")
        if options:
            raise TypeError(f"unknown FanOutSink options: {', '.join(sorted(options))}")
        built: list[Sink] = []
        try:
            for name in names:
                built.append(load_sink_class(name).from_config(cfg))
        except BaseException:
            for s in built:
                s.close()
            raise
        return cls(built)

    def accepts(self, record_name: str) -> bool:
        return any(s.accepts(record_name) for s in self.sinks)

    def add(
        self, record_name: str, record: Mapping[str, Any], *, topic: str, partition: int, offset: int
    ) -> None:
        for s in self.sinks:
            if s.accepts(record_name):
                s.add(record_name, record, topic=topic, partition=partition, offset=offset)

    def pending_rows(self) -> int:
        return sum(s.pending_rows() for s in self.sinks)

    def pending_batches(self) -> list[Batch]:
        seen: dict[Batch, None] = {}
        for s in self.sinks:
            seen.update(dict.fromkeys(s.pending_batches()))
        return list(seen)

    def flush(self) -> FlushResult:
        result = FlushResult()
        errors: list[SinkWriteError] = []
        for s in self.sinks:
            try:
                result.merge(s.flush())
            except SinkWriteError as exc:
                errors.append(exc)
                result.merge(exc.result)
        if errors:
            failed = sorted({b.as_tuple() for b in result.failed})
            raise SinkWriteError("; ".join(str(e) for e in errors), failed=failed, result=result)
        return result

    def discard(self, topic: str, partition: int) -> int:
        return sum(s.discard(topic, partition) for s in self.sinks)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
