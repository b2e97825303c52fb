"""Bearer tokens scoped to tenants, the admin token file, and the open-mode exposure rule.

Semantics (``docs/api.md``):

* ``api.tokens`` maps a token to the tenants it may see; ``*`` among them means every tenant. A
  token given as a table (``{tenants = [...], token_ids = true}``) may also read token content
  (ids, keyed hashes, decoded text); any other token sees token counts and statuses only.
* Tokens configured: every data endpoint needs ``Authorization: Bearer <token>``; a missing or
  unknown token is 401. A token sees only its tenants' rows: another tenant's request is 404,
  exactly as a request that does not exist (existence is not leaked), and aggregates are
  computed over its tenants only. Operations across tenants (collect jobs, ``/metrics``) need an
  all-tenant token; a scoped one gets 403.
* No token configured: the API is open (every caller sees everything), and it must listen on a
  loopback address only; :func:`check_exposure` refuses anything else.
* The serving process also writes an all-tenant *admin token* to ``<data_dir>/api/admin-token``
  (mode 0600, new at every start) for the local CLI (``sparseety query ...`` while the store
  process owns the embedded store). Whoever can read the data directory can read the data
  itself, so the file grants nothing beyond that.

* A browser logs in with a token once (``/login``) and then holds a session cookie (HttpOnly,
  SameSite=Strict) naming a :class:`Sessions` entry: the cookie authenticates reads (GET) only;
  anything that changes state still needs the bearer header.

Tokens (and session ids) are held only as SHA-256 digests and never logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseety.config import ApiToken
from sparseety.errors import ConfigError, SparseetyError
from sparseety.queries.sql import Access

ALL_TENANTS = "*"
ADMIN_TOKEN_FILE = "admin-token"


class AuthError(SparseetyError):
    """The caller is not authenticated (401) or not allowed (403).

    Attributes:
        status: The HTTP status to answer with.
    """

    def __init__(self, message: str, *, status: int = 401) -> None:
        super().__init__(message, status=status)
        self.status = status


@dataclass(frozen=True)
class Principal:
    """Who is calling.

    Attributes:
        name: A label for logs and metrics (never the token itself).
        tenants: The tenants it may see; None = every tenant.
        token_ids: May read token content (ids, hashes, text), not only counts.
    """

    name: str
    tenants: tuple[str, ...] | None
    token_ids: bool = False

    @property
    def access(self) -> Access:
        """What its own SQL may read: the same tenants and permissions as its API calls."""
        return Access(self.tenants, token_ids=self.token_ids)

    def allows(self, permission: str) -> bool:
        """Whether it holds a per-token permission (``token_ids``)."""
        return permission == "token_ids" and self.token_ids

    @property
    def admin(self) -> bool:
        """Sees every tenant."""
        return self.tenants is None

    def visible(self, requested: Sequence[str] = ()) -> tuple[str, ...] | None:
        """The tenants a query may read: the requested ones it may see (None = no limit).

        A requested tenant outside the principal's set yields no rows, not an error: an error
        would tell the caller that the tenant exists.
        """
        if self.tenants is None:
            return tuple(requested) or None
        if not requested:
            return self.tenants
        return tuple(t for t in requested if t in self.tenants)

    def require_admin(self, what: str) -> None:
        """Raise 403 unless every tenant is visible.

        Raises:
            AuthError: a tenant-scoped principal.
        """
        if not self.admin:
            raise AuthError(f"{what} needs a token for all tenants ('*')", status=403)


#: The open API (no token configured, loopback only) reads everything, token content included.
OPEN = Principal("open", None, token_ids=True)
#: The API's own reads (the regression gauges of ``/metrics``): admin limits, no token's cap.
ADMIN_PRINCIPAL = Principal("sparseety", None, token_ids=True)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Who a bearer token is.

    Args:
        tokens: token -> tenants (``*`` = all), from ``api.tokens``.
        admin_token: The process's admin token (all tenants), if any.
    """

    def __init__(
        self, tokens: Mapping[str, Sequence[str] | ApiToken], admin_token: str | None = None
    ) -> None:
        self.open = not tokens
        self._by_digest: dict[bytes, Principal] = {}
        for i, (token, grant) in enumerate(sorted(tokens.items()), start=1):
            tenants, content = (
                (grant.tenants, grant.token_ids) if isinstance(grant, ApiToken) else (grant, False)
            )
            scope = None if ALL_TENANTS in tenants else tuple(dict.fromkeys(tenants))
            self._by_digest[_digest(token)] = Principal(f"token-{i}", scope, token_ids=content)
        if admin_token:
            # the local CLI's token: whoever reads the data dir reads the token ids anyway
            self._by_digest[_digest(admin_token)] = Principal("admin", None, token_ids=True)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header value.

        Raises:
            AuthError: tokens are configured and the header is missing, malformed or unknown.
        """
        if self.open:
            return OPEN
        if not authorization:
            raise AuthError("missing bearer token (Authorization: Bearer <token>)")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("malformed Authorization header: use 'Bearer <token>'")
        principal = self._by_digest.get(_digest(token.strip()))
        if principal is None:
            raise AuthError("unknown token")
        return principal


#: The browser's session cookie (HttpOnly, SameSite=Strict): a random id, never a token.
SESSION_COOKIE = "sparseety_session"
#: How long a browser session lasts after its login.
SESSION_TTL_S = 12 * 3600
#: The most sessions one process keeps (the oldest go first).
MAX_SESSIONS = 10_000


class Sessions:
    """Browser sessions of one API process: a random id -> the principal that logged in.

    A browser logs in once with a token (``POST /login``, a form or the ``#token=`` fragment the
    login page posts); it then holds only the session id in an HttpOnly cookie, so no token sits
    in a URL, a page or script-readable storage. Sessions live in memory: a restart logs every
    browser out, as a new admin token does.

    Args:
        ttl_s: Lifetime of a session.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, ttl_s: float = SESSION_TTL_S, clock: Any = None) -> None:
        import time

        self.ttl_s = ttl_s
        self._clock = clock or time.monotonic
        self._by_digest: dict[bytes, tuple[Principal, float]] = {}

    def create(self, who: Principal) -> str:
        """A new session for ``who``; returns its id (the cookie's value)."""
        sid = secrets.token_urlsafe(32)
        if len(self._by_digest) >= MAX_SESSIONS:
            self._by_digest.pop(next(iter(self._by_digest)))
        self._by_digest[_digest(sid)] = (who, self._clock() + self.ttl_s)
        return sid

    def get(self, sid: str | None) -> Principal | None:
        """The principal of a live session, None when unknown or expired."""
        if not sid:
            return None
        found = self._by_digest.get(_digest(sid))
        if found is None:
            return None
        who, expires = found
        if self._clock() >= expires:
            self._by_digest.pop(_digest(sid), None)
            return None
        return who

    def drop(self, sid: str | None) -> None:
        """End a session (logout)."""
        if sid:
            self._by_digest.pop(_digest(sid), None)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, tokens: Mapping[str, Any]) -> None:
    """Refuse to serve an open (token-less) API on a non-loopback address.

    Raises:
        ConfigError: no token configured and ``host`` is not loopback.
    """
    if not tokens and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve the API open on {host}: without api.tokens it listens on loopback "
            f"only (127.0.0.1, ::1). Configure api.tokens (token -> tenants, '*' = all) to listen "
            f"on other addresses.",
            host=host,
        )


def api_dir(data_path: Path) -> Path:
    """Where the serving process leaves its endpoint and admin token."""
    return data_path / "api"


def write_admin_token(data_path: Path) -> str:
    """Create a fresh admin token in ``<data_dir>/api/admin-token`` (mode 0600); return it."""
    token = secrets.token_urlsafe(32)
    folder = api_dir(data_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ADMIN_TOKEN_FILE
    tmp = path.with_name(f".{ADMIN_TOKEN_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def read_admin_token(data_path: Path) -> str | None:
    """The admin token a serving process left, if readable."""
    try:
        return (api_dir(data_path) / ADMIN_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def remove_admin_token(data_path: Path, token: str) -> None:
    """Delete the admin token file if it still holds ``token`` (a newer process may own it)."""
    if read_admin_token(data_path) == token:
        with contextlib.suppress(OSError):
            (api_dir(data_path) / ADMIN_TOKEN_FILE).unlink()
