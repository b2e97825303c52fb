"""Waiting for something this process started to become ready: one policy, on tenacity.

Whatever starts a child (the broker, a model server, a stack part) or a task (the API server)
waits the same way: poll a readiness check every ``interval_s``; stop at once when the thing
waited for has exited; give up after ``timeout_s``. Each caller raises its own typed error
(:mod:`sparseety.errors`) for the two failures: ``on_exit`` and ``on_timeout`` build it, and may
clean up first (remove a pid file, stop the child)::

    Readiness(listening, timeout_s=30, interval_s=0.05, exited=lambda: proc.poll() is not None,
              on_exit=exited_error, on_timeout=timeout_error).wait()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, NoReturn

from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_result, stop_after_delay, wait_fixed


@dataclass(frozen=True)
class Readiness:
    """What to wait for, and what to raise when it does not come.

    Attributes:
        ready: Whether the thing waited for is ready (polled first, then after each wait).
        timeout_s: How long it may take; then ``on_timeout()``'s error is raised.
        interval_s: The wait between two polls.
        exited: Whether the thing waited for is gone (asked after each poll that was not
            ready); then ``on_exit()``'s error is raised without waiting for the timeout.
        on_exit, on_timeout: Build the caller's error (they may clean up first).
    """

    ready: Callable[[], bool]
    _: KW_ONLY
    timeout_s: float
    interval_s: float
    exited: Callable[[], bool]
    on_exit: Callable[[], Exception]
    on_timeout: Callable[[], Exception]

    def wait(self) -> None:
        """Return once ready.

        Raises:
            Exception: what ``on_exit`` or ``on_timeout`` returned (or what ``ready`` raised).
        """
        Retrying(**self._policy())(self._poll)

    async def wait_async(self) -> None:
        """:meth:`wait` on the running event loop (the waits are ``asyncio.sleep``)."""

        async def poll() -> bool:
            return self._poll()

        await AsyncRetrying(**self._policy())(poll)

    def _poll(self) -> bool:
        if self.ready():
            return True
        if self.exited():
            raise self.on_exit()
        return False

    def _policy(self) -> dict[str, Any]:
        def give_up(state: RetryCallState) -> NoReturn:
            raise self.on_timeout()

        return {
            "stop": stop_after_delay(self.timeout_s),
            "wait": wait_fixed(self.interval_s),
            # only a "not yet" is polled again; on_exit's error (or any other) propagates at once
            "retry": retry_if_result(lambda ok: not ok),
            "retry_error_callback": give_up,
        }
