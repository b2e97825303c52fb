"""Bad bytes raise one typed error family that carries the raw bytes, and nothing else."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseety.errors import (
    BadMagicError,
    CorruptPayloadError,
    DecodeError,
    SparseetyError,
    TruncatedPayloadError,
    UnknownSchemaError,
)
from sparseety.schema_store import SchemaStore
from sparseety.serde import Decoder, Encoder
from tests import factories as f

STORE = SchemaStore.load()
DECODER = Decoder(STORE)
GOOD = Encoder(STORE, "EngineEvent").encode(f.one_of_each()[2])
HEADER = GOOD[:10]


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", BadMagicError),
        (b"\x01\x02\x03", BadMagicError),
        (b'{"json": true}', BadMagicError),
        (b"\x00\x00\x00\x00\x01abc", BadMagicError),  # registry framing, but no registry configured
        (b"\xc3\x01\x00", TruncatedPayloadError),
        (b"\xc3\x01" + b"\xff" * 8 + b"body", UnknownSchemaError),
        (GOOD[:-3], TruncatedPayloadError),
        (GOOD[:12], TruncatedPayloadError),
        (GOOD + b"extra", CorruptPayloadError),
        (HEADER + b"\x02\x41" + GOOD[12:], CorruptPayloadError),
    ],
    ids=[
        "empty",
        "junk",
        "json",
        "registry-without-registry",
        "short-header",
        "unknown-fingerprint",
        "truncated",
        "truncated-early",
        "trailing",
        "corrupt-body",
    ],
)
def test_each_failure_kind_has_its_typed_error(data: bytes, error: type[DecodeError]) -> None:
    with pytest.raises(error) as info:
        DECODER.decode(data)
    assert info.value.raw == data
    assert isinstance(info.value, SparseetyError)


def test_corrupt_union_branch_is_typed() -> None:
    # Flip the union branch index to one beyond the union: the body no longer matches.
    name_len = GOOD[10]
    assert name_len % 2 == 0
    with pytest.raises(DecodeError):
        DECODER.decode(GOOD[:10] + bytes([0x7F]) + GOOD[11:])


def test_unknown_registry_id_is_typed() -> None:
    dec = Decoder(STORE, registry=SchemaRegistryClient.new_client({"url": "mock://bad-bytes"}))
    with pytest.raises(UnknownSchemaError) as info:
        dec.decode(b"\x00\x00\x00\x03\xe7" + GOOD[10:])
    assert info.value.fields["schema_id"] == 999


def test_error_carries_position_when_given() -> None:
    with pytest.raises(DecodeError) as info:
        DECODER.decode(b"nope")
    err = info.value.at("topic-x", 3, 42)
    assert (err.topic, err.partition, err.offset, err.raw) == ("topic-x", 3, 42, b"nope")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        DECODER.decode(data)
    except DecodeError as exc:
        assert exc.raw == data


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bodies_behind_a_valid_header_never_raise_anything_else(body: bytes) -> None:
    data = HEADER + body
    try:
        DECODER.decode(data)
    except DecodeError as exc:
        assert exc.raw == data


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=10, max_value=len(GOOD) - 1), st.integers(min_value=0, max_value=255))
def test_single_byte_corruption_never_raises_anything_else(pos: int, value: int) -> None:
    data = GOOD[:pos] + bytes([value]) + GOOD[pos + 1 :]
    try:
        DECODER.decode(data)
    except DecodeError as exc:
        assert exc.raw == data
