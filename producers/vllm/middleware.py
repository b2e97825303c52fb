"""Tenant and session from HTTP headers, service tier and cache retention from the body, for
vLLM's OpenAI API server.

Only the request body reaches vLLM's engine core (``vllm_xargs`` becomes
``SamplingParams.extra_args``); headers stay in the API server process. This ASGI middleware
copies the ``X-Sparseety-Tenant`` header into the JSON body as ``vllm_xargs.tenant`` and the
``X-Sparseety-Session`` header as ``vllm_xargs.session`` (a header wins over the same key already
in the body) for POSTs to ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``.
It also copies the body's ``service_tier`` (OpenAI: auto, default, flex, scale, priority) as
``vllm_xargs.service_tier`` and its ``prompt_cache_retention`` (in_memory, 24h) as
``vllm_xargs.cache_ttl``: vLLM accepts both fields and passes neither to the engine (it echoes
``service_tier`` in the response), so without this the engine-side plugin never sees them
(issue 36; sparseety/billing.py). ``priority`` needs no copy: it reaches the engine's request.
Enable it with::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware sparseety.producers.vllm.middleware.TenantHeaderMiddleware

Put it behind a gateway that sets (or strips) the tenant header: a client that can set it can
bill another tenant. A tenant that is no tenant name (:mod:`sparseety.tenants`: at most 128
printable characters) is answered 400 with the rule it breaks. The session header needs no such
care: sessions are grouped within a tenant (docs/sessions.md), so a client naming a session only
groups its own requests.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sparseety.tenants import shown, tenant_problem

HEADER = b"x-sparseety-tenant"
SESSION_HEADER = b"x-sparseety-session"
#: Header -> the ``vllm_xargs`` key it sets.
HEADERS = {HEADER: "tenant", SESSION_HEADER: "session"}
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: Body field -> the ``vllm_xargs`` key it is copied to (the engine never sees the field itself).
BODY_FIELDS = {"service_tier": "service_tier", "prompt_cache_retention": "cache_ttl"}
_BODY_MARKERS = tuple(f'"{k}"'.encode() for k in BODY_FIELDS)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def with_tenant(body: bytes, tenant: str) -> bytes:
    """``body`` with ``vllm_xargs.tenant`` set; unchanged when it is not a JSON object."""
    return with_xargs(body, {"tenant": tenant})


def with_xargs(body: bytes, values: dict[str, str]) -> bytes:
    """``body`` with these ``vllm_xargs`` keys set, and with the :data:`BODY_FIELDS` it holds
    copied to theirs (a header's value wins); unchanged when it is not a JSON object or there is
    nothing to set."""
    if not values and not any(m in body for m in _BODY_MARKERS):
        return body  # the common case: nothing to copy, the body is not parsed
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(data, dict):
        return body
    edge = {
        key: data[name] for name, key in BODY_FIELDS.items() if isinstance(data.get(name), str) and data[name]
    }
    if not values and not edge:
        return body
    xargs = data.get("vllm_xargs")
    data["vllm_xargs"] = {**(xargs if isinstance(xargs, dict) else {}), **edge, **values}
    return json.dumps(data).encode()


class TenantHeaderMiddleware:
    """Pure ASGI middleware (``app.add_middleware(TenantHeaderMiddleware)``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        values = {
            HEADERS[k.lower()]: v.decode("latin-1")
            for k, v in scope.get("headers", [])
            if k.lower() in HEADERS and v
        }
        if "tenant" in values:
            rule = tenant_problem(values["tenant"])
            if rule is not None:  # refused at the door, with the rule: no report could show it
                await _refuse(send, f"{HEADER.decode()}: {shown(values['tenant'])}: {rule}")
                return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        body = with_xargs(raw, values)
        if body is raw:  # nothing to set: the request goes on as it came
            await self.app(
                scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send
            )
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = dict(scope, headers=headers)
        await self.app(
            scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send
        )


async def _refuse(send: Send, message: str) -> None:
    """A 400 in the OpenAI error shape vLLM's server answers with."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": 400}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
