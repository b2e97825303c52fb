"""Prompt token ids as the privacy mode allows: raw ids, keyed hashes, or nothing.

``hashed``: each token id becomes the keyed BLAKE2b-64 of its 8-byte little-endian encoding
(key = ``privacy.key``, UTF-8; keys longer than 64 bytes are first reduced with unkeyed
BLAKE2b-512), read as a signed little-endian 64-bit integer (an Avro long). The hash is per token,
without position, so equal prompts and shared prefixes stay comparable for whoever holds the
key, while the ids themselves are not recoverable without it (a small vocabulary can be
enumerated by a key holder, which is the point of keying).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from sparseety.config import PrivacyConfig

#: Token hashes are memoised per id; a vocabulary is bounded, but cap the memo anyway.
_MEMO_MAX = 1 << 20


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    return raw if len(raw) <= 64 else hashlib.blake2b(raw).digest()


def token_hasher(key: str) -> Callable[[Sequence[int]], list[int]]:
    """A function mapping token ids to their keyed 64-bit hashes."""
    base = hashlib.blake2b(key=_key_bytes(key), digest_size=8)
    memo: dict[int, int] = {}

    def one(token: int) -> int:
        h = base.copy()
        h.update(int(token).to_bytes(8, "little", signed=True))
        value = int.from_bytes(h.digest(), "little", signed=True)
        if len(memo) < _MEMO_MAX:
            memo[token] = value
        return value

    def hash_tokens(ids: Sequence[int]) -> list[int]:
        get = memo.get
        return [v if (v := get(t)) is not None else one(t) for t in ids]

    return hash_tokens


class PromptPolicy:
    """Applies the configured privacy mode to prompt token ids.

    Args:
        cfg: The privacy section (mode and, for ``hashed``, the key).
    """

    def __init__(self, cfg: PrivacyConfig) -> None:
        self.mode = cfg.mode
        self._hash = token_hasher(cfg.key.get_secret_value()) if cfg.mode == "hashed" and cfg.key else None

    def fields(self, ids: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """``(prompt_token_ids, prompt_token_hashes)`` for a RequestStarted."""
        if ids is None or self.mode == "none":
            return [], []
        if self.mode == "hashed":
            assert self._hash is not None
            return [], self._hash(ids)
        return list(ids), []
