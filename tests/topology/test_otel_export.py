"""Exports end to end: events recorded from real vLLM go through the real broker, a real assembler
worker and ``sparseety sink --sink clickhouse --sink otel`` (one process, two sinks); the spans
arrive over OTLP/HTTP at a receiver in this test with the engine's own counts, the same requests
land in ClickHouse, and the worker's Prometheus endpoint reports lag and freshness per partition.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from sparseety.config import Config
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.otel import spans as sp
from tests.helpers import ComponentProcess, free_port, produce_raw, wait_for
from tests.recorded import load_scenario, raw_events
from tests.topology.test_worker import worker_cfg

SCENARIO = "prefix_reuse"


class Receiver:
    """A minimal OTLP/HTTP trace receiver: decodes every export and keeps the spans."""

    def __init__(self) -> None:
        self.spans: dict[str, dict[str, Any]] = {}  # span id hex -> span (the last one seen)
        self.exports = 0
        spans, lock = self.spans, threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.exports += 1
                    for rs in request.resource_spans:
                        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans[s.span_id.hex()] = {
                                    "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(),
                                    "name": s.name,
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                                    "resource": resource,
                                    "scope": ss.scope.name,
                                }
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def scrape(port: int) -> dict[str, dict[str, float]]:
    """``{metric: {partition label: value}}`` of the sparseety:worker_* gauges."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "partition" in s.labels:
                out.setdefault(s.name, {})[s.labels["partition"]] = s.value
    return out


def test_recorded_vllm_requests_become_spans_rows_and_worker_metrics(
    kafka_cfg: Config, unique: str, tmp_path: Path, receiver: Receiver
) -> None:
    metrics_port = free_port()
    cfg = worker_cfg(kafka_cfg, unique)
    cfg = cfg.replace(
        worker={**cfg.worker.model_dump(), "metrics_port": metrics_port, "tick_interval_s": 1.0},
        sink={**cfg.sink.model_dump(), "group_id": f"sink-{unique}", "batch_interval_s": 0.3},
        clickhouse={**cfg.clickhouse.model_dump(), "database": "otel_e2e"},
        otel={**cfg.otel.model_dump(), "endpoint": receiver.url, "service_name": "sparseety-test"},
    )
    events, truth = load_scenario(SCENARIO)
    produce_raw(
        cfg,
        cfg.topics.engine_events,
        [(e["engine_name"].encode(), v) for e, v in zip(events, raw_events(SCENARIO), strict=True)],
    )
    want = {r["engine_request_id"]: r for r in truth["requests"]}
    worker = ComponentProcess(cfg, ["worker"], tmp_path / "worker.log").start()
    args = ["sink", "--sink", "clickhouse", "--sink", "otel", "--session-timeout", "6"]
    sink = ComponentProcess(cfg, args, tmp_path / "sink.log").start()
    try:

        def all_spans() -> bool:
            assert worker.alive(), worker.tail()
            assert sink.alive(), sink.tail()
            return len(receiver.spans) >= len(want)

        wait_for(all_spans, 240, 1, "a span per recorded request")
        spans = {s["attributes"]["gen_ai.response.id"]: s for s in receiver.spans.values()}
        assert set(spans) == set(want)
        for rid, req in want.items():
            s, a = spans[rid], spans[rid]["attributes"]
            assert a["gen_ai.usage.input_tokens"] == len(req["prompt_token_ids"])
            assert a["gen_ai.usage.cache_read.input_tokens"] == req["num_cached_tokens"]
            assert a["gen_ai.usage.output_tokens"] == len(req["output_token_ids"])
            assert a["sparseety.tenant"] == req["tenant"]
            uid = a["sparseety.request.uid"]
            assert s["trace_id"] == f"{sp.trace_id(uid):032x}" and s["span_id"] == f"{sp.span_id(uid):016x}"
            assert 0 < s["start"] < s["end"]
            assert s["resource"]["service.name"] == "sparseety-test" and s["scope"] == "sparseety.sinks.otel"
        assert sum(a["attributes"]["gen_ai.usage.cache_read.input_tokens"] for a in spans.values()) > 0

        # the worker's gauges: caught up (lag 0) on its partitions, freshness from the events' clock
        last_ts = {}
        for e in events:
            last_ts[e["engine_name"]] = max(last_ts.get(e["engine_name"], 0), e["ts_ns"])

        def caught_up() -> dict[str, dict[str, float]] | None:
            m = scrape(metrics_port)
            lag = m.get("sparseety:worker_lag_events", {})
            ok = len(lag) == cfg.topics.partitions and all(v == 0 for v in lag.values())
            return m if ok and m.get("sparseety:worker_last_event_timestamp_seconds") else None

        m = wait_for(caught_up, 60, 1, "lag gauges at 0 on every partition")
        (seen,) = m["sparseety:worker_last_event_timestamp_seconds"].values()  # one engine: one partition
        assert seen == pytest.approx(max(last_ts.values()) / 1e9)
    finally:
        sink.stop()
        worker.stop()
    assert not sink.alive()
    store = Store.open(cfg, owner="test")
    try:
        rows = store.query("SELECT request_id, prompt_tokens, cache_read_tokens FROM otel_e2e.requests FINAL")
    finally:
        store.close()
    assert {r["request_id"]: (r["prompt_tokens"], r["cache_read_tokens"]) for r in rows} == {
        rid: (
            spans[rid]["attributes"]["gen_ai.usage.input_tokens"],
            spans[rid]["attributes"]["sparseety.usage.cache_read_tokens"],
        )
        for rid in want
    }
