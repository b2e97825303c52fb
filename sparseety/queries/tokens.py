"""Token records: a request's token sequence restored, one record per run of positions.

The seed's TokenRecord (``token_id``, ``text``, ``position``, ``is_input`` / ``is_output`` /
``is_draft`` / ``is_cached``, the status) is answered run-length: one record per timeline segment
(the positions that share kind, status, KV fate, draft flag and source), carrying the ids and the
decoded text of its positions when the caller may read them; ``per_position`` gives one record per
position instead. What the content holds depends on two things, and the answer says which:

* the engine's privacy mode when the request ran (``request_tokens.privacy``): ``raw`` stored the
  ids, ``hashed`` the keyed prompt hashes (comparable, not readable; outputs not stored), ``none``
  nothing; a request stored before token records (or past the table's TTL) has no row (null);
* the caller: reading content needs the ``token_ids`` permission (``api.tokens``); without it the
  records carry counts and statuses only (``content`` = ``counts``).

Text is decoded with the model's tokenizer when it is available locally (``transformers``,
``local_files_only``: nothing is downloaded), else null. The lookup runs its queries through the
query library (``queries.store``), so it needs nothing of :mod:`queries` at import time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .base import QueryRunner, Scope, segments_sql

log = logging.getLogger("sparseety.tokens")

#: What ``content`` says the records carry.
CONTENT_IDS, CONTENT_HASHES, CONTENT_COUNTS = "ids", "hashes", "counts"


def token_row_sql(db: str, request_uid: str) -> tuple[str, dict[str, Any]]:
    """The stored token arrays of a request's current version (no row: none stored)."""
    sql = (
        "SELECT privacy, prompt_token_ids, prompt_token_hashes, output_token_ids "
        f"FROM {db}.request_tokens_v WHERE request_uid = {{uid:String}}"
    )
    return sql, {"uid": request_uid}


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str) -> Any:
    """The model's tokenizer if it is on this machine (a path, or in the Hugging Face cache)."""
    if not model:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # not available locally (any loader error means the same to us)
        log.info("no local tokenizer for model %r (%s): token text is null", model, type(exc).__name__)
        return None


def decoder(model: str, tokenizers: Mapping[str, str] | None = None) -> Any:
    """``decode(ids) -> str`` with the model's local tokenizer, or None when it has none.

    ``tokenizers`` (``api.tokenizers``) maps a served model name to its tokenizer's path.
    """
    tok = _tokenizer((tokenizers or {}).get(model, model))
    if tok is None:
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=True))

    return decode


def _note(privacy: str | None, content: str, allowed: bool) -> str:
    if privacy is None:
        return "no token ids stored for this request (written before token records, or past their TTL)"
    if privacy == "none":
        return "privacy mode none: the engine sent no token ids, none are stored"
    if not allowed:
        return "token content needs a token with the token_ids permission: counts and statuses only"
    if privacy == "hashed":
        return (
            "privacy mode hashed: keyed hashes of the prompt tokens (comparable, not readable); "
            "outputs not stored"
        )
    return "token ids as the engine produced them"


def token_records_lookup(
    q: QueryRunner, request_uid: str, *, scope: Scope, allowed: bool = True, per_position: bool = False
) -> dict[str, Any] | None:
    """A request's token records (None when it is not stored or outside ``scope``).

    Args:
        q: The query library (its store).
        request_uid: The request: its uid or any id it is known by (``ids.resolve``).
        scope: The caller's scope (tenants; another tenant's request is None, as a missing one).
        allowed: Whether the caller may read token content (the ``token_ids`` permission).
        per_position: One record per position rather than per run.
    """
    from .ids import resolve

    resolved = resolve(q, request_uid, scope=scope)  # any id the request is known by
    if resolved is None:
        return None
    request_uid = resolved
    where, params = scope.where()
    params["uid"] = request_uid
    found = q.store.query(
        "SELECT request_uid, tenant, model, prompt_tokens, output_tokens, reasoning_output_tokens, "
        "reasoning_spans "
        f"FROM {q.db}.requests_v WHERE request_uid = {{uid:String}} AND {where}",
        params,
    )
    if not found:
        return None
    head = found[0]
    segments = q.store.query(*segments_sql(q.db, request_uid, scope=scope))
    stored = q.store.query(*token_row_sql(q.db, request_uid))
    privacy = str(stored[0]["privacy"]) if stored else None
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    hashes: list[int] = []
    content = CONTENT_COUNTS
    if stored and allowed:
        row = stored[0]
        if privacy == "raw":
            prompt_ids, output_ids = list(row["prompt_token_ids"]), list(row["output_token_ids"])
            content = CONTENT_IDS
        elif privacy == "hashed":
            hashes = list(row["prompt_token_hashes"])
            content = CONTENT_HASHES
    decode = decoder(str(head["model"]), getattr(q, "tokenizers", None)) if content == CONTENT_IDS else None
    prompt_len = int(head["prompt_tokens"])
    ids: list[int] | None = prompt_ids + output_ids if content == CONTENT_IDS else None
    if ids is not None and len(ids) != prompt_len + int(head["output_tokens"]):
        # The stored arrays do not cover the positions (a request-level producer, a lost step):
        # say so rather than misplace ids.
        log.warning("token ids of %s do not cover its positions: content withheld", request_uid)
        ids, content, decode = None, CONTENT_COUNTS, None
    reasoning = head.get("reasoning_output_tokens")
    records = [
        r
        for seg in split_reasoning(segments, prompt_len, list(head.get("reasoning_spans") or ()))
        for r in _records(seg, ids=ids, hashes=hashes, decode=decode, per_position=per_position)
    ]
    return {
        "request_uid": request_uid,
        "tenant": head["tenant"],
        "model": head["model"],
        "prompt_tokens": prompt_len,
        "output_tokens": int(head["output_tokens"]),
        "reasoning_output_tokens": None if reasoning is None else int(reasoning),
        "privacy": privacy,
        "content": content,
        "note": _note(privacy, content, allowed),
        "tokenizer": str(head["model"]) if decode is not None else None,
        "prompt_token_ids": prompt_ids if content == CONTENT_IDS else None,
        "output_token_ids": output_ids if content == CONTENT_IDS else None,
        "prompt_token_hashes": hashes if content == CONTENT_HASHES else None,
        "prompt_text": decode(prompt_ids) if decode is not None else None,
        "output_text": decode(output_ids) if decode is not None else None,
        "records": records,
    }


def split_reasoning(
    segments: list[dict[str, Any]], prompt_len: int, spans: list[int]
) -> list[dict[str, Any]]:
    """Segments with the output positions of the reasoning ``spans`` (flat ``[start, end)`` pairs
    of output indexes) of kind ``reasoning``, segments cut where a span begins or ends."""
    if not spans:
        return segments
    cuts = [(prompt_len + a, prompt_len + b) for a, b in zip(spans[::2], spans[1::2], strict=True)]
    out = []
    for seg in segments:
        start, end = int(seg["start"]), int(seg["end"])
        if seg["kind"] != "output":
            out.append(seg)
            continue
        pos = start
        for lo, hi in cuts:
            lo, hi = max(lo, start), min(hi, end)
            if lo >= hi:
                continue
            if pos < lo:
                out.append({**seg, "start": pos, "end": lo})
            out.append({**seg, "start": lo, "end": hi, "kind": "reasoning"})
            pos = hi
        if pos < end:
            out.append({**seg, "start": pos, "end": end})
    return out


def _records(
    seg: dict[str, Any],
    *,
    ids: list[int] | None,
    hashes: list[int],
    decode: Any,
    per_position: bool,
) -> list[dict[str, Any]]:
    start, end = int(seg["start"]), int(seg["end"])
    base = {
        "kind": seg["kind"],  # prompt, reasoning (the output's think section) or output
        "is_input": seg["kind"] == "prompt",
        "is_output": seg["kind"] in ("output", "reasoning"),
        "is_draft": bool(seg["draft_accepted"]),
        "is_cached": seg["status"] == "cached",
        "status": seg["status"],
        "kv_fate": seg["kv_fate"] or "kept",
        "source_request_uid": seg["source_request_uid"],
    }

    def content(lo: int, hi: int) -> dict[str, Any]:
        span_ids = ids[lo:hi] if ids is not None else None
        span_hashes = hashes[lo:hi] if hashes and lo < len(hashes) else None
        return {
            "token_ids": span_ids,
            "token_hashes": span_hashes,
            "text": [decode([t]) for t in span_ids] if decode is not None and span_ids is not None else None,
        }

    if not per_position:
        return [{"position": start, "count": end - start, **content(start, end), **base}]
    out = []
    for p in range(start, end):
        c = content(p, p + 1)
        out.append(
            {
                "position": p,
                "count": 1,
                "token_id": c["token_ids"][0] if c["token_ids"] else None,
                "token_hash": c["token_hashes"][0] if c["token_hashes"] else None,
                "text": c["text"][0] if c["text"] else None,
                **base,
            }
        )
    return out
