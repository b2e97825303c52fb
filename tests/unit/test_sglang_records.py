"""Block names of the SGLang producer (pure logic; the real radix cache is in the e2e tier).

A radix node stores exactly the blocks whose last token lies in it, and they carry the same
names as the request prompts that contain those tokens: the fold's prefix index joins the two.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import Any

import pytest

from sparseety.producers.privacy import PromptPolicy
from sparseety.producers.sglang.records import RecordBuilder, chain_hashes

pytestmark = pytest.mark.unit


@dataclass
class Key:
    """The fields of SGLang's RadixKey the builder reads."""

    token_ids: array
    extra_key: Any = None
    cache_salt: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)


def _builder() -> RecordBuilder:
    from sparseety.config import load_config

    return RecordBuilder(policy=PromptPolicy(load_config().privacy), served_model_name="m", block_size=4)


def test_a_node_stores_the_blocks_that_end_in_it_with_the_prompts_names() -> None:
    prompt = list(range(100, 111))  # 11 tokens: blocks [0,4) and [4,8) are full
    # the tree holds the prompt as two nodes: [0, 6) and [6, 11)
    root_child = Key(array("q", prompt[:6]))
    leaf = Key(array("q", prompt[6:]))
    b = _builder()
    names = chain_hashes(prompt, 4, b"")
    assert len(names) == 2
    assert b.node_blocks([root_child]) == names[:1]  # block 0 ends at 4, inside [0, 6)
    assert b.node_blocks([leaf, root_child]) == names[1:]  # block 1 ends at 8, inside [6, 11)
    _, started = b.request_started("r", prompt, 0, 0.0, 8, {"tenant": "t"}, (None, None))
    assert started["block_hashes"] == names and started["tenant"] == "t"


def test_a_node_inside_one_block_stores_nothing_and_namespaces_differ() -> None:
    b = _builder()
    assert b.node_blocks([Key(array("q", [1, 2])), Key(array("q", [7]))]) == []  # [1, 3): no block ends
    plain = b.node_blocks([Key(array("q", [1, 2, 3, 4]))])
    salted = b.node_blocks([Key(array("q", [1, 2, 3, 4]), cache_salt="s")])
    assert plain and salted and plain != salted  # a cache salt is another cache namespace


class Captured:
    """An emitter that keeps what the session hands it (``build(*args)`` is run at once)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, build: Any, *args: Any) -> None:
        self.records.append(build(*args))

    def emit_record(self, payload_type: str, payload: dict[str, Any]) -> None:
        self.records.append((payload_type, payload))


def _rust_session() -> Any:
    from sparseety.config import load_config
    from sparseety.producers.sglang.session import SglangSession

    return SglangSession(load_config(), Captured(), _builder())  # type: ignore[arg-type]


def test_the_rust_cores_kv_events_name_the_blocks_the_prompts_name() -> None:
    """The Rust TreeCore's tagged events (page size 1: one SGLang hash per token) become the
    same KvBlocksStored/Removed as the Python core's nodes: a run stores the blocks that end in it,
    chained over its whole path through the parent hash; an evicted page removes the block that
    ends in it; pages of another tier are not the device's."""
    from sparseety import events as ev

    s = _rust_session()
    prompt = list(range(100, 111))
    names = chain_hashes(prompt, 4, b"")
    stored = (
        "block_stored",
        [1001, 1002, 1003, 1004, 1005, 1006],
        None,
        prompt[:6],
        1,
        "GPU",
        None,
        None,
        None,
    )
    s.on_rust_event(stored)  # [0, 6): block 0 ends in it
    s.on_rust_event(("block_stored", [1007, 1008], 1002, [555, 556], 1, "GPU", None, None, None))  # [2, 4)
    s.on_rust_event(("block_stored", list(range(2007, 2012)), 1006, prompt[6:], 1, "GPU", None, None, None))
    s.on_rust_event(("block_stored", [3001], 1006, [9], 1, "CPU_PINNED", None, None, None))  # host tier
    recs = s.emitter.records
    assert (
        [(t, p["block_hashes"]) for t, p in recs]
        == [
            (ev.KV_STORED, names[:1]),
            (ev.KV_STORED, chain_hashes([100, 101, 555, 556], 4, b"")),  # a branch off page 1002
            (ev.KV_STORED, names[1:]),  # [6, 11): block 1 ends at 8
        ]
    )
    recs.clear()
    s.on_rust_event(("block_removed", list(range(2007, 2012)), "GPU", None))
    s.on_rust_event(("block_removed", [1007], "GPU", None))  # page [2, 3): no block ends there
    s.on_rust_event(("block_removed", [1008], "GPU", None))
    assert [(t, p["block_hashes"]) for t, p in recs] == [
        (ev.KV_REMOVED, names[1:]),
        (ev.KV_REMOVED, chain_hashes([100, 101, 555, 556], 4, b"")),
    ]
    recs.clear()
    s.on_rust_event(("block_stored", [4001, 4002, 4003, 4004], 999, [1, 2, 3, 4], 1, "GPU", None, None, None))
    assert recs == []  # its parent page was never seen: its path is unknown, nothing is named
    s.on_rust_event(("all_blocks_cleared",))
    assert [t for t, _ in recs] == [ev.KV_CLEARED] and s._rust_pages == {}


def test_the_rust_cores_bigram_events_name_the_prompts_blocks() -> None:
    """Under EAGLE speculation the Rust core keys its tree by bigrams: a stored run carries one
    pair (t[i], t[i + 1]) per position. Its blocks are named over the tokens, as the prompt's
    (the SGLang harness's EAGLE mode: the producer raised on every such event and dropped it)."""
    from sparseety import events as ev

    s = _rust_session()
    prompt = list(range(100, 110))
    pairs = list(itertools.pairwise(prompt))  # 9 positions of a 10-token prompt
    s.on_rust_event(
        ("block_stored", [1001, 1002, 1003, 1004, 1005], None, pairs[:5], 1, "GPU", None, None, None)
    )
    s.on_rust_event(("block_stored", [1006, 1007, 1008, 1009], 1005, pairs[5:], 1, "GPU", None, None, None))
    s.on_rust_event(("block_removed", [1008], "GPU", None))
    assert [(t, p["block_hashes"]) for t, p in s.emitter.records] == [
        (ev.KV_STORED, chain_hashes(prompt, 4, b"")[:1]),
        (ev.KV_STORED, chain_hashes(prompt, 4, b"")[1:2]),
        (ev.KV_REMOVED, chain_hashes(prompt, 4, b"")[1:2]),
    ]


def test_the_admission_hit_is_split_by_sglangs_tiers_and_encodes() -> None:
    """RequestStarted.cached_tokens_by_source (schema v7, issue 36's contract) carries SGLang's
    own split of the hit, ``cached_tokens_details`` (device, host, storage): non-zero entries
    under SGLang's names, summing to the hit; nothing when SGLang reported no split."""
    from sparseety import events as ev
    from sparseety.schema_store import SchemaStore
    from sparseety.serde import Encoder

    b = _builder()
    prompt = list(range(100, 140))
    _, split = b.request_started("r", prompt, 32, 0.0, 8, {}, (None, None), (16, 16, 0))
    assert split["cached_tokens_by_source"] == {"device": 16, "host": 16}
    assert sum(split["cached_tokens_by_source"].values()) == split["num_cached_tokens"]
    _, none = b.request_started("r", prompt, 0, 0.0, 8, {}, (None, None), None)
    assert none["cached_tokens_by_source"] == {}
    record = ev.envelope(
        engine_name="e", engine_id_="e@1", stream=ev.CORE_STREAM, seq=0, ts_ns=1, mono_ns=1,
        payload_type=ev.REQUEST_STARTED, payload=split,
    )  # fmt: skip
    assert Encoder(SchemaStore.load(), "EngineEvent").encode(record)
