"""Processors: what a replay does with each record it reads before the sink stores the result.

A processor is a callable ``(record_name, record, topic, partition, offset) -> iterable of
(record_name, record)``. Records of the stream outputs (topics timelines, usage, dlq) are stored
as they are: :func:`identity`. Raw engine events need the assembler's fold to become
RequestAccounting and UsageWindow records; the stream component provides that fold through the
entry-point group ``sparseety.processors`` (name -> factory ``(cfg) -> processor``), under the name
``engine-events``. This is the seam for it: replaying ``engine-events`` without a registered
processor is a clear error, never a silent identity.

A processor that keeps state across records (a fold) may have a ``finish()`` method returning the
records it still holds at the end of the range (requests it closes); the replay stores those too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import entry_points
from typing import Any

from sparseety.config import Config
from sparseety.errors import PluginLoadError, ReplayError

PROCESSOR_GROUP = "sparseety.processors"
ENGINE_EVENTS = "engine-events"

Processor = Callable[[str, dict[str, Any], str, int, int], Iterable[tuple[str, dict[str, Any]]]]


def identity(
    record_name: str, record: dict[str, Any], topic: str, partition: int, offset: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Store the record as it is (stream outputs: timelines, usage, dead letters)."""
    yield record_name, record


def registered_processors() -> dict[str, str]:
    """Processors registered by installed components: name -> ``module:factory``."""
    return {ep.name: ep.value for ep in entry_points(group=PROCESSOR_GROUP)}


def load_processor(name: str, cfg: Config) -> Processor:
    """Build the processor registered under ``name``.

    Raises:
        PluginLoadError: not registered, fails to load, or the factory returns no callable.
    """
    if name == "identity":
        return identity
    found = [ep for ep in entry_points(group=PROCESSOR_GROUP) if ep.name == name]
    if not found:
        raise PluginLoadError(
            f"no processor named {name!r} in entry-point group {PROCESSOR_GROUP} "
            f"(registered: {', '.join(sorted(registered_processors())) or 'none'})",
            name=name,
        )
    try:
        processor = found[0].load()(cfg)
    except Exception as exc:
        raise PluginLoadError(f"processor {name!r} failed to load: {type(exc).__name__}: {exc}") from exc
    if not callable(processor):
        raise PluginLoadError(f"processor factory {found[0].value} returned {processor!r}, not a callable")
    return processor  # type: ignore[no-any-return]


def processor_for_topic(cfg: Config, topic: str) -> Processor:
    """The processor a replay of ``topic`` uses by default.

    Raises:
        ReplayError: ``topic`` is the engine-events topic and no fold is registered, or a topic
            SparSEEty does not know.
    """
    if topic in (cfg.topics.timelines, cfg.topics.usage, cfg.topics.dlq):
        return identity
    if topic == cfg.topics.engine_events:
        if ENGINE_EVENTS not in registered_processors():
            raise ReplayError(
                f"replaying {topic} needs the assembler's fold, registered as processor "
                f"{ENGINE_EVENTS!r} in entry-point group {PROCESSOR_GROUP}; none is installed. "
                f"Replay the timelines and usage topics instead.",
                topic=topic,
            )
        return load_processor(ENGINE_EVENTS, cfg)
    raise ReplayError(
        f"{topic} is not a SparSEEty topic ({', '.join(cfg.topics.all())}); "
        "name a processor with --processor",
        topic=topic,
    )
