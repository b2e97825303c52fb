"""State value encoding: MessagePack (what ``encode_state`` writes) against the JSON written before.

    .venv/bin/python benchmarks/bench_state_codec.py [--number 20000]

The values are taken from the fold of ``bench_assembler.synthetic`` (batch 256, prompts of 512
tokens) half-way through the run: a running request's ``RequestState`` and a prompt block's state
(``{"l": lifetimes, "c": claim}``, 18k of the ~20k values the worker writes per batch-256 run),
plus the epoch state and the 128k-token request of ``bench_assembler.long_request_state``.
Per value: bytes, and µs per encode and per decode (best of 5 ``timeit`` repeats). The JSON side
is the encoder ``streams/state.py`` keeps for old values and its fallback (same bytes as before).
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_assembler import BS, synthetic  # noqa: E402

from sparseety.config import WorkerConfig  # noqa: E402
from sparseety.streams import state  # noqa: E402
from sparseety.streams.assembler import Assembler  # noqa: E402
from sparseety.streams.state import MemoryStore, decode_state, encode_state  # noqa: E402
from tests import factories as f  # noqa: E402


def encode_json(value: Any) -> bytes:
    if isinstance(value, state._Record):
        value = value.to_json()
    return state._ENCODER.encode(value).encode()


def samples() -> dict[str, Any]:
    events, _ = synthetic(batch=256, steps=200)
    store = MemoryStore()
    asm = Assembler(WorkerConfig(), store)
    for e in events[: len(events) // 2]:
        asm.apply(e)
    req = next(v for k, v in store.data.items() if k.startswith("r|") and v.blocks and not v.closed)
    block = next(v for k, v in store.data.items() if k.startswith("b|"))
    epoch = next(v for k, v in store.data.items() if k.startswith("e|"))
    store = MemoryStore()
    asm = Assembler(WorkerConfig(), store)
    for e in f.long_request(1000, prompt=131_072, block_size=BS, hash_bytes=8):
        asm.apply(e)
    return {
        "RequestState (512-token prompt)": req,
        "prompt block state": block,
        "EpochState (batch 256)": epoch,
        "RequestState (128k-token prompt)": store.get(f"r|{f.EID}|long"),
    }


def per_call_us(fn: Any, arg: Any, number: int) -> float:
    return min(timeit.repeat(lambda: fn(arg), number=number, repeat=5)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20_000, help="calls per repeat (small values)")
    args = ap.parse_args()
    head = ("JSON B", "msgpack B", "enc JSON", "enc mp", "dec JSON", "dec mp")
    print(f"{'value':34} " + " ".join(f"{h:>9}" for h in head) + "  (bytes, µs per value)")
    for name, value in samples().items():
        js, mp = encode_json(value), encode_state(value)
        assert mp[:1] == state.MSGPACK and repr(decode_state(mp)) == repr(decode_state(js))
        n = max(10, args.number * 200 // max(len(js), 200))  # fewer calls for the large values
        row = [
            per_call_us(encode_json, value, n),
            per_call_us(encode_state, value, n),
            per_call_us(decode_state, js, n),
            per_call_us(decode_state, mp, n),
        ]
        print(f"{name:34} {len(js):9,} {len(mp):9,} " + " ".join(f"{x:9.2f}" for x in row))


if __name__ == "__main__":
    main()
