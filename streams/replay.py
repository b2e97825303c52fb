"""The assembler's fold as a replay processor (``sparseety replay`` of engine-events).

``sparseety replay --topic <engine-events> --from ... --to ...`` reads the range and hands each
decoded event to :class:`FoldProcessor`, which runs the same :class:`Assembler` the Faust worker
runs, in memory, and yields its RequestAccounting / UsageWindow / DeadLetter records for the sink.

A replay rebuilds exactly what the stream produced for every engine epoch whose start
(EngineStarted, seq 0) lies inside the range. Epochs that began before ``--from`` are skipped and
counted: folding them from the middle would produce partial requests and partial windows under
the same ids as the complete ones. Requests and windows still open at ``--to`` are not emitted,
as the live worker would not have emitted them yet either.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import InvalidEventError

from .assembler import Assembler
from .state import MemoryStore


class FoldProcessor:
    """Replay processor: decoded EngineEvents in, the assembler's outputs out."""

    def __init__(self, cfg: Config) -> None:
        self.assembler = Assembler(cfg.worker, MemoryStore())
        self.complete_epochs: set[str] = set()
        self.skipped_epochs: dict[str, int] = {}  # engine_id -> events skipped

    def __call__(
        self, record_name: str, record: dict[str, Any], topic: str, partition: int, offset: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if record_name != ev.ENGINE_EVENT:
            raise InvalidEventError(f"{record_name} is not an engine event", raw=None, topic=topic)
        try:
            ev.validate_engine_event(record)
        except InvalidEventError as exc:
            exc.at(topic, partition, offset)
            yield ev.DEAD_LETTER, ev.dead_letter_record(exc, record["engine_name"].encode(), "replay")
            return
        eid = record["engine_id"]
        if eid not in self.complete_epochs:
            if record["stream"] == ev.CORE_STREAM and ev.payload_type(record) == ev.ENGINE_STARTED:
                self.complete_epochs.add(eid)
            else:
                self.skipped_epochs[eid] = self.skipped_epochs.get(eid, 0) + 1
                return
        for out in self.assembler.apply(record):
            yield out.record_name, out.record

    def finish(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Nothing is held back: open requests and windows stay open (see the module doc)."""
        return iter(())

    def summary(self) -> str:
        """One line for the replay's report."""
        s = self.assembler.stats
        text = f"{len(self.complete_epochs)} epochs folded, {s.requests_closed} requests closed"
        if self.skipped_epochs:
            text += (
                f"; skipped {sum(self.skipped_epochs.values())} events of {len(self.skipped_epochs)} epochs "
                "that started before the range (replay from their start to rebuild them)"
            )
        return text


def fold_processor(cfg: Config) -> FoldProcessor:
    """The replay processor of the engine-events topic (see ``sinks/processors.py``)."""
    return FoldProcessor(cfg)
