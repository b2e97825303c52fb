"""Re-read records the stream consumer skipped.

faust-streaming 0.15.3 can drop records that are being delivered while it suspends the flow
for a rebalance or recovery: it advances its read offset anyway, then discards the re-fetched
copies as already read (seen here right after a restart). Engine events carry gap-free seqs, so
the assembler would notice and flag the requests; this module makes sure it does not have to:
the worker tracks the next offset it expects per partition and, when a batch starts later (or
has a hole), reads the missing offsets itself with a plain aiokafka consumer.

On a non-compacted, non-transactional topic (engine-events) offsets have no legitimate holes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sparseety.config import Config
from sparseety.kafka import aiokafka_settings

log = logging.getLogger("sparseety.worker")


@dataclass(frozen=True, slots=True)
class Record:
    """A consumed record, whichever client read it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


class Refetcher:
    """Reads offset ranges and committed offsets of one topic, outside the consumer group."""

    def __init__(self, cfg: Config, topic: str, group_id: str) -> None:
        self.cfg = cfg
        self.topic = topic
        self.group_id = group_id
        self._consumer: Any = None

    async def _client(self) -> Any:
        if self._consumer is None:
            from aiokafka import AIOKafkaConsumer

            # group_id only for OffsetFetch; the consumer never subscribes, so it never joins.
            self._consumer = AIOKafkaConsumer(
                **aiokafka_settings(self.cfg), group_id=self.group_id, enable_auto_commit=False
            )
            await self._consumer.start()
        return self._consumer

    async def committed(self, partition: int) -> int | None:
        """The group's committed offset for ``partition`` (None when nothing was committed)."""
        from aiokafka import TopicPartition

        client = await self._client()
        offset = await client.committed(TopicPartition(self.topic, partition))
        return int(offset) if offset is not None else None

    async def fetch(self, partition: int, start: int, end: int, timeout_s: float = 10.0) -> list[Record]:
        """Records with offsets in [start, end) (fewer if the log has holes there)."""
        from aiokafka import TopicPartition

        client = await self._client()
        tp = TopicPartition(self.topic, partition)
        client.assign([tp])
        client.seek(tp, start)
        out: list[Record] = []
        waited = 0.0
        while waited < timeout_s:
            batch = await client.getmany(tp, timeout_ms=500)
            msgs = batch.get(tp, [])
            if not msgs:
                waited += 0.5
                if await client.position(tp) >= end:
                    break
                continue
            for m in msgs:
                if start <= m.offset < end:
                    out.append(Record(m.topic, m.partition, m.offset, m.key, m.value))
            if msgs[-1].offset >= end - 1:
                break
        return out

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
