"""Issue 30, finding 5: re-ingesting a file does not double its dead letters. A dead letter's
identity is the input it refused (component, topic or file, partition, offset or line), not its
own position in the dlq topic (migration 014).

The same file is ingested twice by the real ingest code; its dead letters are stored as the sink
stores what it reads from the dlq topic (each at a new dlq offset), into real chDB."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.kafka import make_decoder
from sparseety.producers.logs.ingest import ingest
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store
from tests.unit.test_ingest_jsonl import FakeProducer, line


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with throwaway_store(chdb_config(tmp_path_factory)) as s:
        migrate(s)
        yield s


def _stored(store: Store) -> int:
    return int(store.query(f"SELECT count() AS n FROM {store.table('dead_letters')} FINAL")[0]["n"])


def test_re_ingesting_a_file_stores_its_dead_letters_once(store: Store, tmp_path: Path) -> None:
    ingest_cfg = load_config(data_dir=str(tmp_path / "data"))
    path = tmp_path / "bad.jsonl"
    bad = [json.dumps(line(2, usage={"prompt_tokens": 10**30})), "not json", "[" * 200_000]
    path.write_text("\n".join([json.dumps(line(1)), *bad, json.dumps(line(5))]) + "\n")
    decoder = make_decoder(ingest_cfg)
    sink = ClickHouseSink(store)
    offset = 0
    for _ in range(2):
        producer = FakeProducer()
        report = ingest(ingest_cfg, path, producer=producer)
        assert report.bad == 3
        for topic, _, value in producer.messages:
            if topic == ingest_cfg.topics.dlq:
                sink.add(ev.DEAD_LETTER, decoder.decode(value)[1], topic=topic, partition=0, offset=offset)
                offset += 1
        sink.flush()
    assert offset == 6  # the dlq topic holds both ingests' letters
    assert _stored(store) == 3  # the store, one per bad line
    sink.close()


def test_a_dead_letter_without_a_position_keeps_each_copy(store: Store) -> None:
    # its input had no position (offset -1): only its dlq position tells two apart
    sink = ClickHouseSink(store)
    for i in range(2):
        sink.add(ev.DEAD_LETTER, f.dead_letter(offset=-1, partition=-1), topic="dlq", partition=0, offset=i)
    sink.add(ev.DEAD_LETTER, f.dead_letter(), topic="dlq", partition=0, offset=7)
    sink.add(ev.DEAD_LETTER, f.dead_letter(), topic="dlq", partition=1, offset=3)  # a re-send
    sink.flush()
    sink.close()
    assert _stored(store) == 3
