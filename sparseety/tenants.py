"""What a tenant name may be: the one rule that every door checks.

A tenant names who a request is billed to; it is a key of every cost table, a column of every
report and a label on the dashboard. So it is short and printable: 1 to :data:`MAX_TENANT_CHARS`
characters, no control or format characters (no newline, tab or bidirectional override), no
leading or trailing space. The empty string is "no tenant" (a request nobody named).

Where a tenant enters, a bad one is refused with the rule it breaks: the vLLM server's header
middleware and the proxy answer 400, trace ingest dead-letters the line. Inside an engine nothing
may be refused (the request is already running), so the engine-side records bill a bad tenant to
:data:`INVALID_TENANT`, a name every report shows, and log the rule once.
"""

from __future__ import annotations

import logging

from sparseety.errors import InvalidTenantError

log = logging.getLogger("sparseety.tenants")
_warned: set[str] = set()  # the rules an engine process has logged already

#: The longest tenant name.
MAX_TENANT_CHARS = 128
#: What an engine bills a request to whose tenant broke the rule (the request was not refusable).
INVALID_TENANT = "invalid-tenant"


def tenant_problem(value: str) -> str | None:
    """The rule ``value`` breaks as a tenant name, or None when it is one ('' is none)."""
    if len(value) > MAX_TENANT_CHARS:
        return f"a tenant is at most {MAX_TENANT_CHARS} characters (got {len(value)})"
    if not value.isprintable():
        return "a tenant has no control or format characters (newline, tab, bidirectional marks)"
    if value != value.strip():
        return "a tenant has no leading or trailing space"
    return None


def check_tenant(value: str, *, where: str) -> str:
    """``value`` when it is a tenant name.

    Raises:
        InvalidTenantError: naming ``where`` it came from and the rule it breaks.
    """
    rule = tenant_problem(value)
    if rule is not None:
        raise InvalidTenantError(f"{where}: {shown(value)} is not a tenant name: {rule}", rule=rule)
    return value


def engine_tenant(value: object) -> str:
    """The tenant an engine-side record carries for ``value`` (``vllm_xargs.tenant``, SGLang's
    ``custom_params``): itself, '' when none was named, :data:`INVALID_TENANT` when it is no
    tenant name (each rule logged once per process)."""
    if not value:
        return ""
    text = value if isinstance(value, str) else str(value)
    rule = tenant_problem(text)
    if rule is None:
        return text
    if rule.split(" (")[0] not in _warned:
        _warned.add(rule.split(" (")[0])
        log.warning(
            "sparseety: a request named the tenant %s, which is no tenant name (%s): billed to %r",
            shown(text),
            rule,
            INVALID_TENANT,
        )
    return INVALID_TENANT


def shown(value: str) -> str:
    """``value`` as an error message may quote it: cut, control characters escaped."""
    return repr(value[:40] + ("..." if len(value) > 40 else ""))
