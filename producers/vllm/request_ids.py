"""What a vLLM engine request id says about the API request it serves (emitter thread).

The engine core sees only ``Request.request_id``; vLLM builds it from the id its front end chose
(vLLM 0.32, ``InputProcessor.assign_request_id`` and ``ParentRequest.get_child_info``):

- the front end's id, vLLM's ``external_req_id``: ``chatcmpl-<id>`` for chat completions,
  ``cmpl-<id>-<prompt index>`` for completions, where ``<id>`` is the ``X-Request-Id`` header
  (or the body's ``request_id``) when the client sent one, else random. The response's ``id``
  is ``chatcmpl-<id>`` / ``cmpl-<id>``;
- then ``-<8 hex>``: a random suffix that makes it unique in the server (not with
  ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``); it never reaches the client;
- with ``n > 1``, each of the ``n`` choices is an engine request of its own,
  ``<index>_<parent id>``, where the parent id is the two parts above.

``<index>_`` is read as a choice prefix only before an id that has the random suffix (or when
randomization is off): the front ends' own ids start with letters, so they never look like one.
"""

from __future__ import annotations

import os
import re

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_CHOICE = re.compile(r"^(\d+)_(.+)$")


def _randomized() -> bool:
    return os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0").lower() in ("", "0", "false")


def request_identity(request_id: str, *, randomized: bool | None = None) -> dict[str, object]:
    """RequestStarted's ``external_request_id``, ``parent_request_id`` and ``choice_index``.

    Args:
        request_id: vLLM's engine request id.
        randomized: Whether vLLM appended its random suffix (default: what the engine's
            environment says).
    """
    rnd = _randomized() if randomized is None else randomized
    parent, index = "", 0
    m = _CHOICE.match(request_id)
    if m is not None and (not rnd or _SUFFIX.search(m.group(2))):
        index, parent = int(m.group(1)), m.group(2)
    own = parent or request_id
    external = _SUFFIX.sub("", own) if rnd else own
    return {"external_request_id": external, "parent_request_id": parent, "choice_index": index}


#: The front ends' prefixes of an external request id (chat completions, completions).
_API_PREFIXES = ("chatcmpl-", "cmpl-")


def pd_fields(external_request_id: str, kv_transfer_params: object, kv_role: str | None) -> dict[str, str]:
    """RequestStarted's ``pd_role`` and ``pd_join_id`` (issue 36).

    The role comes from the request's ``kv_transfer_params`` as vLLM's P/D proxies set them
    (``do_remote_decode``: this engine prefills for another; ``do_remote_prefill``: it decodes
    from KV another engine computed), else from the engine's connector role (``kv_producer``:
    prefill, ``kv_consumer``: decode; ``kv_both`` or none: the request is served whole). The join
    key is the id the router sent both engines: the ``X-Request-Id`` inside the external request
    id (the front end's ``chatcmpl-``/``cmpl-`` prefix taken off), else the one in
    ``kv_transfer_params`` (``remote_request_id``); empty for a request served whole.
    """
    params = kv_transfer_params if isinstance(kv_transfer_params, dict) else {}
    if params.get("do_remote_decode"):
        role = "prefill"
    elif params.get("do_remote_prefill"):
        role = "decode"
    elif kv_role == "kv_producer":
        role = "prefill"
    elif kv_role == "kv_consumer":
        role = "decode"
    else:
        return {"pd_role": "none", "pd_join_id": ""}
    join = external_request_id
    for prefix in _API_PREFIXES:
        if join.startswith(prefix):
            join = join[len(prefix) :]
            break
    if not join:
        remote = params.get("remote_request_id")
        join = str(request_identity(str(remote))["external_request_id"]) if remote else ""
        for prefix in _API_PREFIXES:
            join = join.removeprefix(prefix)
    return {"pd_role": role, "pd_join_id": join}
