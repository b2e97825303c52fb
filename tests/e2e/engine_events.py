"""Reading what an engine published, and vLLM's own KV events, for the e2e checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.producers.vllm.records import block_hash_bytes
from tests.helpers import read_topic


def engine_events(
    cfg: Config,
    until: Callable[[list[dict[str, Any]]], bool] = lambda _: True,
    timeout: float = 60.0,
) -> list[dict[str, Any]]:
    """Every event on the engine's topic, re-read until ``until(events)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        events = [r[3] for r in read_topic(cfg, cfg.topics.engine_events, quiet_s=0.5)]
        if until(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"events on {cfg.topics.engine_events} never satisfied the condition")
        time.sleep(0.5)


def finished_ids(events: list[dict[str, Any]]) -> set[str]:
    return {ev.payload(e)["request_id"] for e in events if ev.payload_type(e) == ev.REQUEST_FINISHED}


def engine_rid(events: list[dict[str, Any]], external: str) -> str:
    """The engine-core id of the request the front end called ``external`` (vLLM appends a
    random ``-xxxxxxxx``): exactly one must exist."""
    found = {
        ev.payload(e)["request_id"]
        for e in events
        if ev.payload_type(e) == ev.REQUEST_STARTED
        and ev.payload(e)["request_id"].rsplit("-", 1)[0] == external
    }
    assert len(found) == 1, f"{external}: engine ids {found}"
    return found.pop()


def kv_view(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Our KV events as (kind, hashes, parent) in stream order."""
    out: list[tuple[Any, ...]] = []
    for e in sorted((e for e in events if e["stream"] == ev.CORE_STREAM), key=lambda e: e["seq"]):
        kind, p = e["payload"]
        if kind == ev.KV_STORED:
            out.append(("stored", tuple(p["block_hashes"]), p["parent_block_hash"], p["num_tokens"]))
        elif kind == ev.KV_REMOVED:
            out.append(("removed", tuple(p["block_hashes"])))
        elif kind == ev.KV_CLEARED:
            out.append(("cleared",))
    return out


class ZmqKvSubscriber:
    """Collects what vLLM's own ZMQ KV-event publisher sends (multipart: topic, seq, msgpack)."""

    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.batches.append(self._decoder.decode(payload))

    def view(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for batch in list(self.batches):
            for e in batch.events:
                name = type(e).__name__
                if name == "BlockStored":
                    parent = None if e.parent_block_hash is None else block_hash_bytes(e.parent_block_hash)
                    out.append(
                        (
                            "stored",
                            tuple(block_hash_bytes(h) for h in e.block_hashes),
                            parent,
                            len(e.token_ids),
                        )
                    )
                elif name == "BlockRemoved":
                    out.append(("removed", tuple(block_hash_bytes(h) for h in e.block_hashes)))
                else:
                    out.append(("cleared",))
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()
