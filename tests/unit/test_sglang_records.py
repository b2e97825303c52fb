"""Block names of the SGLang producer (pure logic; the real radix cache is in the e2e tier).

A radix node stores exactly the blocks whose last token lies in it, and they carry the same
names as the request prompts that contain those tokens: the fold's prefix index joins the two.
"""

from __future__ import annotations

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
