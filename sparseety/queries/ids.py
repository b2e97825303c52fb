"""Finding a request by an id its client has (docs/api.md, "Finding a request").

A stored request has four names:

- ``request_uid`` (``engine_name@epoch/request_id``): SparSEEty's, unique in the store;
- ``request_id``: the engine's (vLLM: the front end's id, plus ``-<8 hex>`` that makes it unique
  in the server, plus ``<index>_`` in front for one of ``n > 1`` choices);
- ``external_request_id``: the front end's id (vLLM's ``external_req_id``: ``chatcmpl-<id>``,
  ``cmpl-<id>-<prompt index>``), recorded by the plugin (RequestStarted); for rows written
  before it (and vLLM server-log rows), read off ``request_id`` by dropping the random suffix
  and the choice prefix;
- the response id the client got: ``chatcmpl-<id>`` for chat, ``cmpl-<id>`` for completions
  (``external_request_id`` without ``-<prompt index>``); ``<id>`` is the ``X-Request-Id`` the
  client sent, if it sent one: the *client id*.

A look-up (``query request``, ``query tokens``, ``/api/v1/tokens/statistics``,
``/api/v1/requests/{id}``) takes any of them. An exact ``request_uid`` wins; otherwise every
request in the caller's scope that the id names is a candidate, and more than one is an
:class:`~sparseety.errors.AmbiguousIdError` listing them (the same id on two engines, or the n
choices of one response), never a guess.
"""

from __future__ import annotations

from typing import Any

from sparseety.errors import AmbiguousIdError

from .base import QueryRunner, Scope

#: How vLLM's OpenAI front ends prefix the id they give the engine (chat, completions).
FRONT_END_PREFIXES = ("chatcmpl-", "cmpl-")
#: The most candidates an ambiguous look-up lists.
MAX_CANDIDATES = 50

#: The front end's id of a row: as recorded, else read off the engine's request id.
EXTERNAL = (
    "if(external_request_id != '', external_request_id, "
    "replaceRegexpOne(request_id, '^(?:[0-9]+_)?(.*)-[0-9a-f]{8}$', '\\\\1'))"
)


def _with_index(ext: str, base: str) -> str:
    """``ext`` is ``base`` or ``base-<prompt index>`` (a completions response id)."""
    return (
        f"({ext} = {base} OR (startsWith({ext}, concat({base}, '-')) "
        f"AND match(substring({ext}, length({base}) + 2), '^[0-9]+$')))"
    )


def id_condition(param: str = "key") -> str:
    """SQL: the row is named by the id in parameter ``param`` (uid, engine id, front-end id or
    response id)."""
    key = f"{{{param}:String}}"
    return f"(request_uid = {key} OR request_id = {key} OR {_with_index(EXTERNAL, key)})"


def client_id_condition(param: str = "client_id") -> str:
    """SQL: the row's front-end id was built from the client's id in ``param`` (``X-Request-Id``:
    ``chatcmpl-<id>``, ``cmpl-<id>``, ``cmpl-<id>-<prompt index>``)."""
    key = f"{{{param}:String}}"
    return "(" + " OR ".join(_with_index(EXTERNAL, f"concat('{p}', {key})") for p in FRONT_END_PREFIXES) + ")"


def candidates_sql(db: str, key: str, *, scope: Scope) -> tuple[str, dict[str, Any]]:
    """The requests in ``scope`` that ``key`` names, newest first (at most
    :data:`MAX_CANDIDATES` + 1, so a caller can say there are more)."""
    where, params = scope.where()
    params["key"] = key
    sql = (
        "SELECT request_uid, engine_name, engine_id, request_id, "
        f"{EXTERNAL} AS external_request_id, parent_request_id, choice_index, tenant, model, "
        "finished_at, prompt_tokens, output_tokens "
        f"FROM {db}.requests_v WHERE {id_condition()} AND {where} "
        f"ORDER BY request_uid = {{key:String}} DESC, finished_ts_ns DESC, request_uid "
        f"LIMIT {MAX_CANDIDATES + 1}"
    )
    return sql, params


def resolve(q: QueryRunner, key: str, *, scope: Scope) -> str | None:
    """The ``request_uid`` that ``key`` names in ``scope``; None when it names none.

    Raises:
        AmbiguousIdError: it names several (listed in ``candidates``).
    """
    rows = q.store.query(*candidates_sql(q.db, key, scope=scope))
    if not rows:
        return None
    if len(rows) == 1 or rows[0]["request_uid"] == key:
        return str(rows[0]["request_uid"])
    more = len(rows) > MAX_CANDIDATES
    shown = rows[:MAX_CANDIDATES]
    raise AmbiguousIdError(
        f"{key!r} names {'more than ' if more else ''}{len(shown)} requests; "
        "ask again with one request_uid of these",
        candidates=shown,
        key=key,
    )
