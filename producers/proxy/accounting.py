"""What the proxy learns about one request from the OpenAI-compatible exchange (pure logic).

A :class:`Exchange` is fed the request body and then either the whole JSON response or the
server-sent events one by one; it ends as a RequestStarted + RequestFinished pair of payloads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sparseety import events as ev
from sparseety.errors import SparseetyError
from sparseety.validate import MAX_TOKENS

from ..usage_details import modality_tokens

ACCOUNTED_PATHS = ("/v1/chat/completions", "/v1/completions")


def split_events(buffer: bytearray) -> list[bytes]:
    """Remove and return the complete server-sent events (each with its blank-line terminator)."""
    out: list[bytes] = []
    while True:
        ends = [(i, n) for sep, n in ((b"\n\n", 2), (b"\r\n\r\n", 4)) if (i := buffer.find(sep)) >= 0]
        if not ends:
            return out
        i, n = min(ends)
        out.append(bytes(buffer[: i + n]))
        del buffer[: i + n]


def event_data(event: bytes) -> bytes | None:
    """The ``data:`` payload of one server-sent event (lines joined), or None."""
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


@dataclass
class Exchange:
    """One accounted request.

    Args:
        arrival_ts_ns: Wall clock when the proxy received it.
        body: The parsed request body (a dict, or {} when not JSON).
        tenant: Who it is billed to.
        session: The conversation the client named (:func:`session_of`); '' when none.
    """

    arrival_ts_ns: int
    body: dict[str, Any]
    tenant: str
    session: str = ""
    response_id: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""
    chunk_arrival_ns: list[int] = field(default_factory=list)
    status: int = 0
    injected_usage: bool = False

    @property
    def streaming(self) -> bool:
        return bool(self.body.get("stream"))

    def prepare_stream_usage(self) -> bool:
        """Ask the upstream for a usage chunk when the client did not; True if the body changed
        (the proxy then hides that chunk from the client)."""
        if not self.streaming:
            return False
        opts = self.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            return False
        self.body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        self.injected_usage = True
        return True

    def on_json(self, status: int, payload: Any) -> None:
        """A whole (non-streamed) response."""
        self.status = status
        if isinstance(payload, dict):
            self.response_id = str(payload.get("id") or "")
            self.usage = payload.get("usage") or {}
            choices = payload.get("choices") or []
            if choices and isinstance(choices[0], dict):
                self.finish_reason = str(choices[0].get("finish_reason") or "")

    def on_event(self, data: bytes, now_ns: int | None = None) -> bool:
        """One streamed event's data; returns False when the client must not see it (the
        usage-only chunk the proxy asked for)."""
        if data.strip() == b"[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):  # not ours to judge: the client gets it as sent
            return True
        if not isinstance(chunk, dict):
            return True
        now_ns = now_ns if now_ns is not None else time.time_ns()
        self.response_id = self.response_id or str(chunk.get("id") or "")
        choices = chunk.get("choices") or []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in choices:
            if not isinstance(c, dict):
                continue
            if c.get("finish_reason"):
                self.finish_reason = str(c["finish_reason"])
        if choices and not _role_only(choices):
            self.chunk_arrival_ns.append(now_ns)
        return not (self.injected_usage and not choices and chunk.get("usage"))

    def payloads(self, request_id: str, finish_reason: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        """RequestStarted and RequestFinished for this exchange.

        Raises:
            UnaccountableResponseError: the upstream's usage is not a set of token counts.
        """
        usage = self.usage if isinstance(self.usage, dict) else {}
        prompt = _count(usage, "prompt_tokens")
        output = _count(usage, "completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if not isinstance(details, dict):
            raise UnaccountableResponseError("usage.prompt_tokens_details is not an object", field="usage")
        cached = min(_count(details, "cached_tokens"), prompt)
        by_modality, problem = modality_tokens(details, prompt)
        if problem is not None:
            raise UnaccountableResponseError(problem, field="usage")
        reason = finish_reason or self.finish_reason or ("error" if self.status >= 400 else "stop")
        max_tokens = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return [
            (
                ev.REQUEST_STARTED,
                {
                    "request_id": request_id,
                    "arrival_ts_ns": self.arrival_ts_ns,
                    "prompt_len": prompt,
                    "prompt_token_ids": [],
                    "prompt_token_hashes": [],
                    "num_cached_tokens": cached,
                    "block_hashes": [],
                    "max_tokens": int(max_tokens) if isinstance(max_tokens, int) else None,
                    "tenant": self.tenant,
                    "model": str(self.body.get("model") or ""),
                    "lora_name": None,
                    "priority": int(self.body.get("priority") or 0)
                    if isinstance(self.body.get("priority"), int)
                    else 0,
                    "session_id": self.session,
                    # what the client asked for (issue 36), read here at the API edge
                    "service_tier": _text(self.body.get("service_tier")),
                    "cache_ttl": _text(self.body.get("prompt_cache_retention")),
                    # the response's id: one record per response (n choices included), so
                    # the prompt is already billed once and there is no parent
                    "external_request_id": self.response_id,
                },
            ),
            (
                ev.REQUEST_FINISHED,
                {
                    "request_id": request_id,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "num_prompt_tokens": prompt,
                    "num_output_tokens": output,
                    "num_cached_tokens": cached,
                    "num_preemptions": 0,
                    "output_block_hashes": [],
                    "first_token_ts_ns": self.chunk_arrival_ns[0] if self.chunk_arrival_ns else 0,
                    "chunk_arrival_ns": list(self.chunk_arrival_ns),
                    # vLLM's created_cache_tokens (chat, --enable-prompt-tokens-details); -1: absent
                    "num_cache_creation_tokens": _count(details, "created_cache_tokens")
                    if "created_cache_tokens" in details
                    else -1,
                    # issue 36: image/audio/video prompt tokens where the server reports them
                    "prompt_tokens_by_modality": by_modality,
                },
            ),
        ]


class UnaccountableResponseError(SparseetyError):
    """The upstream answered, but its usage cannot be turned into token counts."""


def _count(usage: dict[str, Any], key: str) -> int:
    """A usage count within the contract's bounds (:mod:`sparseety.validate`), else the response
    is unaccountable: passed through to the client and dead-lettered, never billed."""
    value = usage.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise UnaccountableResponseError(
            f"usage.{key} is {str(value)[:40]!r}, not a token count", field=f"usage.{key}"
        )
    return value


def _text(value: Any) -> str:
    """A request's string field as sent (at most 64 characters: a name, not a payload); '' when
    it is absent or not a string."""
    return value[:64] if isinstance(value, str) else ""


def _role_only(choices: list[Any]) -> bool:
    """The opening chat chunk: a role and no content yet."""
    for c in choices:
        delta = c.get("delta") if isinstance(c, dict) else None
        if (
            not isinstance(delta, dict)
            or "role" not in delta
            or delta.get("content")
            or c.get("finish_reason")
        ):
            return False
    return True


def tenant_of(
    headers: dict[str, str],
    body: dict[str, Any],
    api_keys: dict[str, str],
    header: str,
    *,
    trust_header: bool = False,
) -> str | None:
    """Who a request is billed to, or None when it must be refused.

    With ``trust_header`` (every request comes through a gateway that sets them) the tenant
    header, else ``vllm_xargs.tenant``, names the tenant. Otherwise, when API keys are configured,
    the key's tenant is the tenant and a request without a known key is refused; without keys
    every request is forwarded, billed to no tenant (``''``). A client never chooses its tenant
    unless the operator said the tenant comes from a trusted gateway.
    """
    if trust_header:
        value = headers.get(header.lower())
        if value:
            return value
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and isinstance(xargs.get("tenant"), str) and xargs["tenant"]:
            return str(xargs["tenant"])
    if not api_keys:
        return ""
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return api_keys.get(key) if key else None


#: Headers naming the conversation a request belongs to: ours, then vLLM's own.
SESSION_HEADERS = ("x-sparseety-session", "x-session-id")


def session_of(headers: dict[str, str], body: dict[str, Any]) -> str:
    """The session the client named, as the vLLM plugin reads it: a session header
    (``X-Sparseety-Session``, vLLM's ``X-Session-ID``), else the body's ``session_id`` (vLLM's
    field), else ``vllm_xargs.session`` / ``vllm_xargs.session_id``, else ''.

    Unlike the tenant it needs no trust: sessions group requests within their tenant only
    (docs/sessions.md), so a client naming a session can only group its own requests.
    """
    for header in SESSION_HEADERS:
        if value := headers.get(header):
            return value
    xargs = body.get("vllm_xargs")
    for value in (
        body.get("session_id"),
        *((xargs.get("session"), xargs.get("session_id")) if isinstance(xargs, dict) else ()),
    ):
        if isinstance(value, str) and value:
            return value
    return ""
