"""What the API refuses before it reads a request, and what it never writes to a log.

* :class:`BodyLimit`: a request body over ``api.limits.max_body_bytes`` is answered 413 before
  anything reads it, authentication included (by its ``Content-Length``, or by counting a body
  sent in chunks), so an unauthenticated client cannot make the API hold a large body.
  Routes then cap what they take (the SQL text: ``api.limits.max_sql_bytes``).
* :class:`RedactSecrets`: uvicorn's access log writes each request's path with its query
  string; ``?password=`` (ClickHouse clients' way to send the token) and the like are replaced
  by ``***`` there.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

#: Query-string parameters that carry a credential.
SECRET_PARAMS = ("password", "token", "access_token", "key", "api_key")
_SECRET = re.compile(r"(?i)([?&](?:" + "|".join(SECRET_PARAMS) + r")=)[^&#\s]*")


def redact(text: str) -> str:
    """``text`` (a path with its query string) with every credential parameter's value hidden."""
    return _SECRET.sub(r"\1***", text)


class RedactSecrets(logging.Filter):
    """Hides credentials in uvicorn's access-log records (their path argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def install_redaction() -> None:
    """Put :class:`RedactSecrets` on uvicorn's access logger (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in logger.filters):
        logger.addFilter(RedactSecrets())


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``, before the app sees it.

    A body is read here whole (at most ``max_bytes``), then handed to the app: one with a larger
    ``Content-Length`` is refused unread, one sent in chunks as soon as it grows past the limit.

    Args:
        app: The ASGI app.
        max_bytes: The largest body taken.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        chunks: list[bytes] = []
        size = 0
        first: dict[str, Any] | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client went away: the app hears it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(
            {
                "error": "too_large",
                "message": f"the request body is over {self.max_bytes} bytes (api.limits.max_body_bytes)",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
