"""TableStore (the plain store over a changelog), the Faust table's changelog adapter with its
trailing marker, and readiness files."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from sparseety.lifecycle import clear_ready, mark_ready, ready_file
from sparseety.streams.compat import ChangelogTable
from sparseety.streams.state import HeadState, TableStore, decode_state


class FakeTable:
    """What ChangelogTable uses of a Faust table: its memory store and send_changelog."""

    def __init__(self) -> None:
        self.data = type("Store", (), {})()
        self.data.data = {}
        self.data._key_partition = {}
        self.sent: list[tuple[int, bytes, bytes | None]] = []

    def send_changelog(self, partition: int, key: bytes, value: bytes | None) -> Any:
        self.sent.append((partition, key, value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


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
    asyncio.run(fresh.flush())
    assert table.sent[-2] == (1, b"r|eng@1|a", None) and b"r|eng@1|a" not in table.data.data
    assert decode_state(table.data.data[b"e|eng@1"]) == {"y": b"\x00"}


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
