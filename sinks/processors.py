"""Processors: what a replay does with each record it reads before the sink stores the result.

A processor is a callable ``(record_name, record, topic, partition, offset) -> iterable of
(record_name, record)``. Records of the stream outputs (topics timelines, usage, dlq) are stored
as they are: :func:`identity`. Raw engine events need the assembler's fold to become
RequestAccounting and UsageWindow records: ``engine-events`` is the stream component's
:func:`~sparseety.streams.replay.fold_processor`, imported directly (sinks may import streams; the
fold imports no Faust).

A processor that keeps state across records (a fold) may have a ``finish()`` method returning the
records it still holds at the end of the range (requests it closes); the replay stores those too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sparseety.config import Config
from sparseety.errors import PluginLoadError, ReplayError
from sparseety.streams.replay import fold_processor

IDENTITY = "identity"
ENGINE_EVENTS = "engine-events"

Processor = Callable[[str, dict[str, Any], str, int, int], Iterable[tuple[str, dict[str, Any]]]]


def identity(
    record_name: str, record: dict[str, Any], topic: str, partition: int, offset: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Store the record as it is (stream outputs: timelines, usage, dead letters)."""
    yield record_name, record


#: name -> factory ``(cfg) -> processor`` (``sparseety replay --processor NAME``).
PROCESSORS: dict[str, Callable[[Config], Processor]] = {
    IDENTITY: lambda cfg: identity,
    ENGINE_EVENTS: fold_processor,
}


def load_processor(name: str, cfg: Config) -> Processor:
    """Build the processor named ``name``.

    Raises:
        PluginLoadError: no processor of that name.
    """
    factory = PROCESSORS.get(name)
    if factory is None:
        raise PluginLoadError(
            f"no processor named {name!r} (known: {', '.join(sorted(PROCESSORS))})", name=name
        )
    return factory(cfg)


def processor_for_topic(cfg: Config, topic: str) -> Processor:
    """The processor a replay of ``topic`` uses by default.

    Raises:
        ReplayError: a topic SparSEEty does not know.
    """
    if topic in (cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq):
        return identity
    if topic == cfg.topics.engine_events:
        return load_processor(ENGINE_EVENTS, cfg)
    raise ReplayError(
        f"{topic} is not a SparSEEty topic ({', '.join(cfg.topics.all())}); "
        "name a processor with --processor",
        topic=topic,
    )
