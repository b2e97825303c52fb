"""Workarounds for the embedded broker's observed behaviour (Tansu), fenced here.

**Time bounds on a batch-granular broker.** Tansu answers ``offsets_for_times`` at record-batch
granularity (the offset of the batch holding the time, so records before the time come too), and
its high watermark is batch-granular as well. A replay (``sinks/replay.py``) therefore resolves
times with :func:`offsets_for_time`, then filters each record by its own timestamp and ends a
partition where it stays past the end time (:func:`outside_time_range`). On a broker that answers
per record the filter never fires. Observed on the Tansu this project embeds (``sparseety
broker``); it lived in ``streams/compat.py`` before, which made the replay import the worker's
Faust workarounds.

**A broker that lost its log.** Tansu keeps topics, groups and committed offsets in memory. After
``sparseety broker stop`` and ``broker start`` (or ``up`` while a worker or the store still runs)
the configured topics come back empty, with new topic ids; the cluster id stays
``tansu_cluster``, so only the topic ids tell (:class:`TopicIds`). A topic's name does not: Tansu
creates a missing topic when a client's metadata request names it (aiokafka's does, measured:
one ``_wait_on_metadata`` on an unknown name creates it), so a worker whose producer asks for its
lost changelog gets a new, empty one of the same name. And a produce sent on a client's old
metadata (no metadata request since the restart) to a topic the new broker does not have is
acknowledged, with offsets that ListOffsets then reports, but no fetch ever returns its records
(measured with aiokafka: 6 records acknowledged at offsets 0-5, end offset 6, a fetch from 0
got nothing in 3 s; a worker recovering such a changelog partition waits forever, as a CI run's
did, issue 33). The sink (``sinks/lost_log.py``) and the worker (``streams/compat.py`` item 6)
act on what :class:`TopicIds` says.
"""

from __future__ import annotations

from typing import Any

from sparseety.config import Config


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


class TopicIds:
    """The broker's ids of ``topics``, and which of them changed since last asked.

    Asked from a thread (each question is one blocking admin request of at most 5 s), with a
    client of its own, so it answers even when the asker's other clients wait on a lost topic.
    """

    def __init__(self, cfg: Config, topics: list[str]) -> None:
        self.cfg = cfg
        self.topics = topics
        #: the last id the broker gave each topic it had
        self.ids: dict[str, str] = {}
        self._admin: Any = None

    def current(self) -> dict[str, str | None] | None:
        """Each topic's id now, None for a topic the broker says it does not have; None as a
        whole when the broker did not answer."""
        from confluent_kafka import KafkaError, KafkaException, TopicCollection
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            # log_level 2: a broker that is away is said once by the caller, not by this client too
            self._admin = AdminClient(self.cfg.kafka.librdkafka(log_level=2))
        try:
            found = self._admin.describe_topics(TopicCollection(self.topics), request_timeout=5)
        except Exception:  # the broker is away: nothing can be said
            return None
        now: dict[str, str | None] = {}
        for topic, future in found.items():
            try:
                now[topic] = str(future.result().topic_id)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    return None  # a timeout, a broker going away: nothing can be said
                now[topic] = None
        return now

    def _changes(self) -> tuple[set[str], set[str]] | None:
        now = self.current()
        if now is None:
            return None
        recreated = {t for t, i in now.items() if i is not None and self.ids.get(t, i) != i}
        gone = {t for t, i in now.items() if i is None and t in self.ids}
        self.ids.update({t: i for t, i in now.items() if i is not None})
        return recreated, gone

    def recreated(self) -> set[str] | None:
        """Topics the broker has under a new id since the last answer (empty the first time);
        None when the broker did not answer."""
        changes = self._changes()
        return None if changes is None else changes[0]

    def lost(self) -> set[str] | None:
        """Topics once seen that the broker now has under a new id or not at all; None when the
        broker did not answer."""
        changes = self._changes()
        return None if changes is None else changes[0] | changes[1]
