"""Issue 34: one start-and-wait helper (``sparseety.waiting.Readiness``) for all that starts a
process or a task and waits for it (the broker, a model server, the stack's parts, the API
server): ready at once, ready after some polls, the caller's own error on a timeout, and at once
when the thing waited for exits. Each case runs the blocking and the event-loop variant."""

from __future__ import annotations

import asyncio
import time

import pytest

from sparseety.errors import SparseetyError
from sparseety.waiting import Readiness

INTERVAL_S = 0.01


class PartError(SparseetyError):
    """A caller's own typed error, with structured fields."""


class Part:
    """What a caller knows of the thing it waits for: a readiness check that turns true on poll
    ``ready_on`` (never with 0), an exit check that turns true on check ``exits_on`` (never with
    0), and the errors it builds."""

    def __init__(self, ready_on: int = 0, exits_on: int = 0) -> None:
        self.ready_on = ready_on
        self.exits_on = exits_on
        self.polls = 0
        self.exit_checks = 0
        self.built: list[str] = []

    def ready(self) -> bool:
        self.polls += 1
        return 0 < self.ready_on <= self.polls

    def exited(self) -> bool:
        self.exit_checks += 1
        return 0 < self.exits_on <= self.exit_checks

    def on_exit(self) -> PartError:
        self.built.append("exit")
        return PartError("the part exited during start", part="p", why="exit")

    def on_timeout(self) -> PartError:
        self.built.append("timeout")
        return PartError("the part was not ready in time", part="p", why="timeout")


def wait(part: Part, timeout_s: float, variant: str) -> None:
    readiness = Readiness(
        part.ready,
        timeout_s=timeout_s,
        interval_s=INTERVAL_S,
        exited=part.exited,
        on_exit=part.on_exit,
        on_timeout=part.on_timeout,
    )
    if variant == "async":
        asyncio.run(readiness.wait_async())
    else:
        readiness.wait()


VARIANTS = pytest.mark.parametrize("variant", ["blocking", "async"])


@VARIANTS
def test_ready_at_once_returns_after_one_poll(variant: str) -> None:
    part = Part(ready_on=1, exits_on=1)  # ready wins: the exit check is not asked
    wait(part, 30.0, variant)
    assert (part.polls, part.exit_checks, part.built) == (1, 0, [])


@VARIANTS
def test_ready_after_some_polls_waits_between_them(variant: str) -> None:
    part = Part(ready_on=4)
    start = time.monotonic()
    wait(part, 30.0, variant)
    assert (part.polls, part.exit_checks, part.built) == (4, 3, [])
    assert time.monotonic() - start >= 3 * INTERVAL_S


@VARIANTS
def test_a_timeout_raises_the_callers_error(variant: str) -> None:
    part = Part()
    start = time.monotonic()
    with pytest.raises(PartError) as info:
        wait(part, 0.1, variant)
    assert info.value.fields == {"part": "p", "why": "timeout"}
    assert part.built == ["timeout"]  # built once, when it gave up
    assert part.polls >= 2 and 0.1 <= time.monotonic() - start < 5.0


@VARIANTS
def test_an_exit_raises_the_callers_error_at_once(variant: str) -> None:
    part = Part(exits_on=2)
    start = time.monotonic()
    with pytest.raises(PartError) as info:
        wait(part, 30.0, variant)
    assert info.value.fields == {"part": "p", "why": "exit"}
    assert (part.polls, part.exit_checks, part.built) == (2, 2, ["exit"])
    assert time.monotonic() - start < 5.0  # not the 30 s timeout


@VARIANTS
def test_an_error_of_the_readiness_check_is_not_retried(variant: str) -> None:
    part = Part()

    def broken() -> bool:
        part.polls += 1
        raise OSError("no route")

    part.ready = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="no route"):
        wait(part, 30.0, variant)
    assert (part.polls, part.built) == (1, [])
