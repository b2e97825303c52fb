"""One request accounted by two sources (the plugin and the server log): count it once (pure).

An engine whose server log is analysed while its plugin also publishes gives each request twice:
the plugin's step-level accounting (engine ``engine_id`` of the engine epoch, ``engine_kind``
``vllm``) and the log's request-level one (a trace epoch, ``engine_kind`` ``vllm_log``). Their
``request_uid`` differ (the epochs do), so the key is the **engine request id**: vLLM's
``<external id>-<8 random hex>``, which the plugin's events carry as ``request_id`` and the log
names in its ``Added request <id>.`` line (the log parser uses it as the request id). The random
suffix makes the id unique per server process, so equal ids are the same request.

The rule: a step-level accounting always wins over a request-level one of the same key (it
observed the steps; the log's times and cached tokens are modelled). Between two of the same
level, the first one seen is kept. :func:`dedup_step` is the fold, per key as Bytewax's
``stateful_map``: ``(counted for this key, accounting) -> (counted, decisions)``, pure (the state
is frozen; the caller keeps one per :func:`dedup_key`). The decisions are the ones that change:
``(request_uid, counted, duplicate_of)``. The store applies the same rule in its views
(``sinks/clickhouse/migrations/008_log_dedup.sql``), so it holds whatever order or path wrote the rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: engine_kind values of request-level sources (totals only, no steps).
REQUEST_LEVEL_KINDS = frozenset({"vllm_log", "trace", "proxy"})

Decision = tuple[str, bool, str | None]


@dataclass(frozen=True)
class Counted:
    """The accounting counted for one engine request id."""

    request_uid: str
    #: Whether it came from a request-level source (:data:`REQUEST_LEVEL_KINDS`).
    request_level: bool


def dedup_key(acc: Mapping[str, Any]) -> str:
    """The key two sources share for one request: the engine request id."""
    return str(acc["request_id"])


def dedup_step(counted: Counted | None, acc: Mapping[str, Any]) -> tuple[Counted, list[Decision]]:
    """Fold one accounting (``request_uid``, ``request_id``, ``engine_kind``) into what is counted
    for its :func:`dedup_key` (None: nothing yet).

    Returns the new state for the key and the decisions it causes: the accounting itself counted
    or not (with the uid it duplicates), and, when a step-level one displaces a request-level
    one, that one uncounted.
    """
    uid = acc["request_uid"]
    request_level = acc["engine_kind"] in REQUEST_LEVEL_KINDS
    if counted is None or counted.request_uid == uid:
        return Counted(uid, request_level), [(uid, True, None)]
    if counted.request_level and not request_level:
        return Counted(uid, False), [(counted.request_uid, False, uid), (uid, True, None)]
    return counted, [(uid, False, counted.request_uid)]
