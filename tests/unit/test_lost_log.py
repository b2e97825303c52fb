"""How a lost log is told (``sparseety.broker_compat.TopicIds``) and when the worker may fold
(``streams.compat.LostLogWatch``): the pure logic over the broker's answers. The real broker
restart is ``tests/chaos/test_broker_restart.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from sparseety.broker_compat import TopicIds
from sparseety.config import load_config
from streams.compat import ConsumerConnections, LostLogWatch

Answer = dict[str, str | None] | None


class Scripted(TopicIds):
    """The broker's answers, in order (its client is never built)."""

    def __init__(self, answers: list[Answer]) -> None:
        super().__init__(load_config(), ["changelog", "events"])
        self.answers: Iterator[Answer] = iter(answers)

    def current(self) -> Answer:
        return next(self.answers)


def test_a_new_id_is_recreated_and_a_missing_topic_is_lost_once_seen() -> None:
    ids = Scripted(
        [
            {"changelog": None, "events": "e1"},  # the changelog not created yet: nothing lost
            {"changelog": "c1", "events": "e1"},
            None,  # the broker away: nothing can be said
            {"changelog": None, "events": "e2"},  # restarted: events recreated, changelog gone
            {"changelog": "c2", "events": "e2"},  # a client asked for the changelog by name
        ]
    )
    assert ids.lost() == set()
    assert ids.lost() == set()
    assert ids.lost() is None
    assert ids.lost() == {"changelog", "events"}
    assert ids.lost() == {"changelog"}


def test_the_sink_hears_only_of_topics_recreated_under_a_new_id() -> None:
    ids = Scripted([{"changelog": "c1", "events": "e1"}, {"changelog": None, "events": "e2"}, None])
    assert ids.recreated() == set()
    assert ids.recreated() == {"events"}
    assert ids.recreated() is None


def test_only_an_answer_with_every_topic_as_first_seen_confirms_the_log() -> None:
    watch = LostLogWatch(load_config(), "changelog")
    watch.ids = Scripted(
        [
            {"changelog": "c1", "events": "e1"},
            None,
            {"changelog": "c2", "events": "e1"},
        ]
    )
    assert not watch.confirmed_within(60)  # never asked: a batch waits for an answer

    async def ask() -> set[str] | None:
        return await watch.lost()

    assert asyncio.run(ask()) == set()
    assert watch.confirmed_within(60)
    confirmed = watch.confirmed_at
    time.sleep(0.02)
    assert not watch.confirmed_within(0.01)  # the timer's answers keep it fresh, nothing else
    assert asyncio.run(ask()) is None
    assert watch.confirmed_at == confirmed  # no answer is no confirmation
    assert asyncio.run(ask()) == {"changelog"}
    assert watch.confirmed_at == confirmed


class _Conns:
    """Where aiokafka keeps a client's connections, as Faust's consumer thread holds it."""

    def __init__(self) -> None:
        self._conns: dict[object, object] = {}


def test_a_batch_on_a_connection_opened_since_the_last_look_is_a_change() -> None:
    from types import SimpleNamespace

    client = _Conns()
    thread = SimpleNamespace(_consumer=SimpleNamespace(_client=client))
    app = SimpleNamespace(consumer=SimpleNamespace(_thread=thread))
    conns = ConsumerConnections(app)
    client._conns[("111", 0)] = object()
    assert conns.changed()  # the first look: nothing confirmed yet
    assert not conns.changed()
    client._conns[("111", 1)] = object()  # the group coordinator's
    assert conns.changed()
    assert not conns.changed()
    client._conns[("111", 0)] = object()  # the broker came back: a new connection, same key
    assert conns.changed()
    assert not conns.changed()
    client._conns.clear()  # no connection: nothing fetched on a known one
    assert conns.changed()


def test_connections_that_moved_fail_loudly() -> None:
    from types import SimpleNamespace

    conns = ConsumerConnections(SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace())))
    with pytest.raises(RuntimeError, match="item 6"):
        conns.changed()
