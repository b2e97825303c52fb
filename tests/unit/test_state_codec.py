"""State values on the changelog: MessagePack behind a format byte, JSON values written before
still read, and both decode to the same Python structures (the assembler must not notice)."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from sparseety import events as ev
from sparseety.config import WorkerConfig
from sparseety.schema_store import SchemaStore
from sparseety.serde import Decoder, Encoder
from sparseety.streams import state
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import (
    MSGPACK,
    EpochState,
    HeadState,
    MemoryStore,
    RequestState,
    decode_state,
    encode_state,
)
from tests.sim import SimEngine, workload


def _request() -> RequestState:
    return RequestState(
        "eng",
        "eng@1",
        "r1",
        seq=5,
        worker_seq=2,
        started=True,
        tenant="t",
        model="m",
        arrival_ts=1_700_000_000_000_000_000,
        prompt_len=16,
        kv_end=16,
        out=3,
        pairs=12.5,
        gpu_ns=1e6,
        segments=[[0, 16, "prompt", "computed", False, None, "kept"]],
        blocks=[["ab12", "computed", 3]],
        eviction_spans=[[0, 4]],
        experts=[1, 2],
        output={"uid": "eng@1/r1", "x": 1.5, "h": b"\x00\xff"},
        prompt_hashes=[-5, 2**63 - 1],
        session_id="s",
    )


def _epoch() -> EpochState:
    # An event held in the reorder buffer as decoded: a payload tuple, a packed column, bytes.
    held = {
        "seq": 9,
        "ts_ns": 5,
        "payload": ("StepBatch", {"rows": array("i", [1, -2]), "hash": b"\x00\xff"}),
    }
    return EpochState(
        "eng",
        "eng@1",
        config={"block_size": 16},
        next_seq={"core": 8, "worker": 1},
        pending={"core": {"9": held}},
        windows={"0|m|t": [1, 0, 16, 3]},
        pending_close={"r1": [4, 5, "stop"]},
        cleared=[3],
        retiring=[["r0", 7]],
        producer_stats={"dropped": 0},
    )


def _block() -> dict[str, Any]:
    return {"l": [[3, None, "eng@1/r1", [[], []]]], "c": None}


# Written by encode_state before MessagePack (commit 8c05340) for the values above: these bytes
# are on existing changelogs and must keep decoding.
OLD_REQUEST = (
    b'["R","eng","eng@1","r1",5,2,true,"t","m",null,1700000000000000000,0,0,0,16,0,16,3,0,0,0,0,0,0,0,'
    b'false,0,-1,0,12.5,0,1000000.0,0.0,[[0,16,"prompt","computed",false,null,"kept"]],'
    b'[["ab12","computed",3]],[[0,4]],0,0,[1,2],false,-1,false,0,{"uid":"eng@1/r1","x":1.5,'
    b'"h":{"$b":"00ff"}},null,0,0,0,null,"s",[],[-5,9223372036854775807],[]]'
)
OLD_EPOCH = (
    b'["E","eng","eng@1",{"block_size":16},{"core":8,"worker":1},{"core":{"9":{"seq":9,"ts_ns":5,'
    b'"payload":["StepBatch",{"rows":[1,-2],"hash":{"$b":"00ff"}}]}}},0,0,0,[],{"r1":[4,5,"stop"]},'
    b'-1,{"0|m|t":[1,0,16,3]},0,[3],0,[["r0",7]],false,false,{"dropped":0},0,-1]'
)
OLD_HEAD = b'["N","eng","eng@1"]'
OLD_BLOCK = b'{"l":[[3,null,"eng@1/r1",[[],[]]]],"c":null}'
# A request persisted before the two-axis model: eviction_spans was recompute_until (an int), and
# segments had no kv_fate.
OLD_PRE_TWO_AXIS = (
    b'["R","e","e@1","r1",-1,-1,false,"","",null,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,false,0,-1,0,0,0,0.0,'
    b'0.0,[[0,8,"prompt","computed",false,null]],[],4,0,0,[],false,-1,false,0,null,null,0,0,0,null,'
    b'"",[],[],[]]'
)


def _as_json_reads(value: Any) -> Any:
    """What a value reads back as: tuples and arrays become lists (JSON had no other way)."""
    if isinstance(value, (list, tuple, array)):
        return [_as_json_reads(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json_reads(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("make", [_request, _epoch, lambda: HeadState("eng", "eng@1"), _block])
def test_every_state_value_round_trips_through_msgpack(make: Any) -> None:
    value = make()
    data = encode_state(value)
    assert data[:1] == MSGPACK
    back = decode_state(data)
    assert type(back) is type(value)
    expected = _as_json_reads(value.to_json() if isinstance(value, state._Record) else value)
    got = back.to_json() if isinstance(back, state._Record) else back
    # repr: also tells 1 from 1.0 and True, "9" from 9, a list from a tuple, bytes from str
    assert repr(got) == repr(expected)


@pytest.mark.parametrize(
    ("old", "make"),
    [
        (OLD_REQUEST, _request),
        (OLD_EPOCH, _epoch),
        (OLD_HEAD, lambda: HeadState("eng", "eng@1")),
        (OLD_BLOCK, _block),
    ],
)
def test_json_values_written_before_still_decode(old: bytes, make: Any) -> None:
    value = make()
    back = decode_state(old)
    assert repr(back) == repr(decode_state(encode_state(value)))
    if isinstance(value, RequestState):
        assert back == value and back.output["h"] == b"\x00\xff"
    if isinstance(value, EpochState):
        assert back.pending["core"]["9"]["payload"] == ["StepBatch", {"rows": [1, -2], "hash": b"\x00\xff"}]


def test_a_json_request_from_before_the_two_axis_model_is_upgraded() -> None:
    back = decode_state(OLD_PRE_TWO_AXIS)
    assert back.eviction_spans == [[0, 4]] and back.segments == [
        [0, 8, "prompt", "computed", False, None, "kept"]
    ]


def test_an_int_beyond_64_bits_falls_back_to_json() -> None:
    value = {"l": [[2**70, None, "u", [[], []]]], "c": None}
    data = encode_state(value)
    assert data[:1] == b"{" and decode_state(data) == value


def _v3(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events as the worker decodes them from schema-v3 bytes (packed columns as array('i'))."""
    store = SchemaStore.load()
    enc, dec = Encoder(store, "EngineEvent"), Decoder(store)
    return [dec.decode(enc.encode(e))[1] for e in events]


def _check_all(store: MemoryStore) -> None:
    for key, value in store.data.items():
        mp = encode_state(value)
        js = state._ENCODER.encode(value.to_json() if isinstance(value, state._Record) else value).encode()
        assert len(mp) <= len(js) + 1, key  # + the format byte: a one-element value can tie
        assert repr(decode_state(mp)) == repr(decode_state(js)), key


@pytest.mark.parametrize("seed", [3, 4])
def test_msgpack_reads_back_what_json_read_back_over_a_simulated_run(seed: int) -> None:
    """Every state value the fold writes, with early v3 StepBatches held in the reorder buffer:
    the two formats decode to the same structures. This would fail if a state dict got a non-str
    key (JSON made it a str, MessagePack keeps it)."""
    events = _v3(
        SimEngine(spec_k=2, preempt_prob=0.2, cache_blocks=12, seed=seed).run(workload(12, seed=seed))
    )
    for i in range(6, len(events) - 1, 9):
        events[i], events[i + 1] = events[i + 1], events[i]  # held until its predecessor arrives
    store = MemoryStore()
    asm = Assembler(WorkerConfig(closed_retention_s=0), store)
    held = 0
    for i, e in enumerate(events):
        asm.apply(e)
        now = any("array('i'" in repr(v) for k, v in store.data.items() if k.startswith("e|"))
        held += now
        if now or i % 5 == 0:
            _check_all(store)
    assert held, "no StepBatch was held as decoded"


def test_a_held_v3_step_batch_survives_the_msgpack_round_trip() -> None:
    events = _v3(SimEngine(seed=4).run(workload(6, seed=4)))
    i = next(i for i, e in enumerate(events) if i > 5 and e["payload"][0] == ev.STEP_BATCH)
    events[i - 1], events[i] = events[i], events[i - 1]
    store = MemoryStore()
    asm = Assembler(WorkerConfig(closed_retention_s=0), store)
    for e in events[:i]:
        asm.apply(e)
    copy = MemoryStore()
    for k, v in store.data.items():
        data = encode_state(v)
        assert data[:1] == MSGPACK
        copy.data[k] = decode_state(data)
    assert any("array('i'" in repr(v) for v in store.data.values())
    a = [o for e in events[i:] for o in asm.apply(e)]
    b = [o for e in events[i:] for o in Assembler(WorkerConfig(closed_retention_s=0), copy).apply(e)]
    assert a == b and a
