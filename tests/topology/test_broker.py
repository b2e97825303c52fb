"""The embedded broker: lifecycle, clear errors, and events through it with confluent-kafka."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from sparseety.broker import EmbeddedBroker
from sparseety.config import Config, load_config
from sparseety.errors import PortInUseError
from sparseety.kafka import make_decoder, make_encoder, make_producer
from tests import factories as f
from tests.helpers import free_port, plain_event


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = load_config(data_dir=str(tmp_path), broker={"port": s.getsockname()[1]})
        with pytest.raises(PortInUseError) as info:
            EmbeddedBroker(cfg).start()
        assert "taken by another process" in str(info.value)


def test_start_status_stop(tmp_path: Path) -> None:
    b = EmbeddedBroker(load_config(data_dir=str(tmp_path), broker={"port": free_port()}))
    assert not b.status().running
    st = b.start()
    assert st.running and st.ready and b.pid_file.exists()
    assert b.start().pid == st.pid  # idempotent
    assert b.stop() and not b.status().running and not b.pid_file.exists()


@pytest.mark.parametrize("framing", ["single-object", "registry"])
def test_produce_and_consume_events(kafka_cfg: Config, unique: str, framing: str) -> None:
    cfg = kafka_cfg
    if framing == "registry":
        cfg = cfg.replace(schema_registry={"url": f"mock://{unique}"})
    topic = cfg.topics.engine_events
    enc = make_encoder(cfg, "EngineEvent", topic)
    events = f.one_of_each()
    producer = make_producer(cfg)  # idempotent, zstd
    delivered: list[int] = []
    for e in events:
        producer.produce(
            topic,
            key=e["engine_name"].encode(),
            value=enc.encode(e),
            on_delivery=lambda err, msg: delivered.append(0 if err else 1),
        )
    assert producer.flush(30) == 0
    assert sum(delivered) == len(events)

    consumer = Consumer(cfg.kafka.librdkafka(**{"group.id": f"g{unique}", "fetch.wait.max.ms": 50}))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(cfg.topics.partitions)])
    dec = make_decoder(cfg)
    got = []
    deadline = time.monotonic() + 60
    while len(got) < len(events) and time.monotonic() < deadline:
        msg = consumer.poll(1.0)
        if msg is None or msg.error():
            continue
        got.append(dec.decode(msg.value())[1])
    consumer.close()
    assert sorted((plain_event(e) for e in got), key=lambda e: e["seq"]) == events
