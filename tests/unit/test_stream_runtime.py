"""TableStore (the plain store over a changelog), the Faust table's changelog adapter with its
trailing marker, and readiness files."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from sparseety.lifecycle import clear_ready, mark_ready, ready_file
from sparseety.streams.compat import ChangelogTable
from sparseety.streams.state import HeadState, MemoryStore, TableStore, decode_state, encode_state


class FakeBatch:
    """aiokafka's BatchBuilder as ChangelogTable uses it: full after ``capacity`` records."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: list[tuple[bytes, bytes | None]] = []

    def append(self, *, key: bytes, value: bytes | None, timestamp: Any) -> Any:
        if len(self.records) >= self.capacity or (value is not None and len(value) > 64):
            return None  # full, or (like aiokafka) a record larger than a whole batch
        self.records.append((key, value))
        return object()

    def record_count(self) -> int:
        return len(self.records)


class FakeProducer:
    """The started AIOKafkaProducer: record batches and single sends, acknowledged at once."""

    def __init__(self, sent: list[tuple[int, bytes, bytes | None]], capacity: int) -> None:
        self.sent, self.capacity, self.batches = sent, capacity, 0

    def create_batch(self) -> FakeBatch:
        return FakeBatch(self.capacity)

    def _done(self) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        assert topic == "app-state-changelog"
        self.batches += 1
        self.sent.extend((partition, k, v) for k, v in batch.records)
        return self._done()

    async def send(self, topic: str, value: bytes | None, *, key: bytes, partition: int) -> Any:
        self.sent.append((partition, key, value))
        return self._done()


class FakeTable:
    """What ChangelogTable uses of a Faust table: its memory store, its changelog topic's name and
    the app's started producer."""

    def __init__(self, capacity: int = 2) -> None:
        self.data = type("Store", (), {})()
        self.data.data = {}
        self.data._key_partition = {}
        self.sent: list[tuple[int, bytes, bytes | None]] = []
        self.producer = FakeProducer(self.sent, capacity)
        faust_producer = type("FaustProducer", (), {"_ensure_producer": lambda _: self.producer})()
        self.app = type("App", (), {"producer": faust_producer})()
        self.changelog_topic = type("Topic", (), {"get_topic_name": lambda _: "app-state-changelog"})()


def test_table_store_writes_epoch_and_head_keys_last_then_a_marker() -> None:
    table = FakeTable()
    store = TableStore(ChangelogTable(table, 1))
    store.put("n|eng", HeadState("eng", "eng@1"))
    store.put("r|eng@1|a", {"x": 1})
    store.put("e|eng@1", {"y": b"\x00"})
    assert asyncio.run(store.flush()) == 3
    keys = [k for _, k, _ in table.sent]
    assert keys[0] == b"r|eng@1|a" and set(keys[1:3]) == {b"n|eng", b"e|eng@1"} and keys[3] == b"m|1"
    # A fresh store over the same table reads what was written, and only its partition's keys.
    table.data.data[b"r|eng@1|other"] = b"{}"
    table.data._key_partition[b"r|eng@1|other"] = 0
    fresh = TableStore(ChangelogTable(table, 1))
    assert fresh.get("n|eng") == HeadState("eng", "eng@1")
    assert list(fresh.keys("r|")) == ["r|eng@1|a"]
    fresh.delete("r|eng@1|a")
    assert list(fresh.keys("r|")) == []
    # Deleted but not yet flushed: the changelog still has the old value, which must not return
    # (KV memory-time looks up holders that may have just been forgotten).
    assert fresh.get("r|eng@1|a") is None
    asyncio.run(fresh.flush())
    assert table.sent[-2] == (1, b"r|eng@1|a", None) and b"r|eng@1|a" not in table.data.data
    assert decode_state(table.data.data[b"e|eng@1"]) == {"y": b"\x00"}


class Holder:
    """A lessee (the fold's steady columns): writes its newer value back when the lease ends."""

    def __init__(self, store: MemoryStore, key: str, value: Any) -> None:
        self.store, self.key, self.value = store, key, value

    def release(self, key: str) -> None:
        self.store.data[key] = self.value

    def sync(self) -> None:
        self.release(self.key)


def test_get_many_and_put_many_are_get_and_put_in_order() -> None:
    """The batch calls (the prefix index's) see and leave exactly what single calls would: on a
    TableStore values from the changelog, none for a key deleted but not flushed; leases end."""
    table = FakeTable()
    base = TableStore(ChangelogTable(table, 1))
    base.put("b|e|old", {"l": [], "c": "a"})
    base.put("b|e|gone", {"l": [], "c": "b"})
    asyncio.run(base.flush())
    for store in (MemoryStore(), TableStore(ChangelogTable(table, 1))):
        if not isinstance(store, TableStore):
            store.put("b|e|old", {"l": [], "c": "a"})
            store.put("b|e|gone", {"l": [], "c": "b"})
        store.delete("b|e|gone")
        store.put("r|e|held", {"v": 1})
        store.lease("r|e|held", Holder(store, "r|e|held", {"v": 2}))
        keys = ["b|e|old", "b|e|gone", "b|e|new", "r|e|held"]
        assert store.get_many(keys) == [{"l": [], "c": "a"}, None, None, {"v": 2}]
        assert "r|e|held" not in store.leased
        store.dirty.clear()
        store.lease("r|e|held", Holder(store, "r|e|held", {"v": 3}))
        store.put_many([("b|e|gone", {"l": [], "c": "c"}), ("r|e|held", {"v": 4}), ("b|e|new", {"l": []})])
        assert "r|e|held" not in store.leased and "b|e|gone" not in store.deleted
        assert store.dirty == {"b|e|gone", "r|e|held", "b|e|new"}
        assert [store.get(k) for k in keys] == [{"l": [], "c": "a"}, {"l": [], "c": "c"}, {"l": []}, {"v": 4}]
        assert encode_state(store.get_many(keys)) == encode_state([store.get(k) for k in keys])


def test_changelog_records_go_in_order_as_batches_with_big_ones_alone() -> None:
    table = FakeTable(capacity=2)
    items = [(f"r|e@1|{i}".encode(), b"v" * (100 if i == 3 else 1)) for i in range(5)]
    asyncio.run(ChangelogTable(table, 3).write(items, [b"r|e@1|gone"]))
    assert table.sent == [(3, k, v) for k, v in items] + [(3, b"r|e@1|gone", None), (3, b"m|3", b"1")]
    assert table.producer.batches == 4  # [0, 1], [2], [4, gone] (3 went alone), then the marker


def test_nothing_dirty_writes_nothing() -> None:
    table = FakeTable()
    assert asyncio.run(TableStore(ChangelogTable(table, 0)).flush()) == 0
    assert table.sent == []


def test_readiness_file(tmp_path: Path) -> None:
    path = ready_file(tmp_path, "worker")
    assert path == tmp_path / "run" / f"worker-{os.getpid()}.ready"
    mark_ready(path)
    assert ready_file(tmp_path, "worker", os.getpid()).read_text().strip() == str(os.getpid())
    clear_ready(path)
    clear_ready(path)  # idempotent
    assert not path.exists()
