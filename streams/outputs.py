"""What the fold emits and what it counts: :class:`Output` records and the :class:`Stats` counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Output topic roles (mapped to topic names by the config).
TIMELINES, USAGE, DLQ = "timelines", "usage", "dlq"


@dataclass(frozen=True, slots=True)
class Output:
    """Something to send: ``topic`` is a role (timelines, usage, dlq), mapped to a name by config."""

    topic: str
    key: str
    record_name: str
    record: dict[str, Any]


@dataclass(slots=True)
class Stats:
    """Counters the worker exports as metrics."""

    events: int = 0
    duplicates: int = 0
    reordered: int = 0
    gaps: int = 0
    late_events: int = 0
    requests_closed: int = 0
    incomplete: int = 0
    corrections: int = 0
    reopened: int = 0  # requests closed by the idle timeout that got events again
