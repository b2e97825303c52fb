"""The sink's workaround for a broker that lost its log (the embedded Tansu restarted), fenced here.

Observed with the embedded Tansu and librdkafka 2.16 (issue 12, ``tests/chaos/test_broker_restart.py``):

- Tansu keeps topics, groups and committed offsets in memory. After ``sparseety broker stop`` and
  ``broker start`` (or ``up`` while the store still runs) the sink's topics come back empty, with
  new topic ids; the cluster id stays ``tansu_cluster``, so only the topic ids tell.
- A fetch at an offset beyond a partition's end is answered empty, without OFFSET_OUT_OF_RANGE,
  so librdkafka's ``auto.offset.reset`` never fires: a consumer positioned there waits until the
  new log grows past its old position and would then skip everything before it (measured:
  nothing in 20 s at committed offset 100 of a 5-record partition, nor after a seek to 50).
- What keeps a running sink off that: Tansu forgets the group, answers the sink's late commits
  of old positions with UNKNOWN_MEMBER_ID (measured: none lands), and librdkafka then reports
  the partitions lost and joins again; with no committed offset, ``auto.offset.reset=earliest``
  starts at the new log's start. A commit made without a group membership (generation -1, as
  an offsets tool or a process outside the group makes) is accepted for a group without
  members, though, and the sink's next assignment would start there, beyond the end.

:class:`sparseety.broker_compat.TopicIds` remembers the ids of the sink's topics; the consumer
loop asks it on every assignment. A topic whose id changed was recreated: its partitions are read
from their new start whatever offset the broker holds for them, the positions of the old log are
dropped, and the sink says so in one log line. Against a broker that keeps its log (Kafka, a
Tansu on storage) the ids never change and nothing here acts.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sparseety.sink")


def say_log_lost(topics: set[str], old_positions: dict[tuple[str, int], int]) -> None:
    """The one line that tells the operator what happened and what the sink does about it."""
    beyond = {tp: o for tp, o in old_positions.items() if tp[0] in topics}
    log.error(
        "sink: the broker lost its log (topics %s were recreated empty): dropping %d positions of "
        "the old log (up to offset %d) and reading the new topics from their start",
        ", ".join(sorted(topics)),
        len(beyond),
        max(beyond.values(), default=0),
    )
