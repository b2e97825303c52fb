"""The OpenTelemetry sink: one span per request, GenAI attributes, deterministic ids, at-least-once.

The main test folds requests recorded from a real vLLM engine (``tests/data/*``, see
``tests/recorded.py``) through the assembler into RequestAccounting records, runs them through
the sink with the SDK's InMemorySpanExporter (behind the real BatchSpanProcessor), and checks
each span against what vLLM itself reported for that request (``truth.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sparseety import events as ev
from sparseety.config import OtelConfig, load_config
from sparseety.errors import SinkWriteError
from sparseety.sinks.base import Batch, load_sink_class
from sparseety.sinks.fanout import FanOutSink
from sparseety.sinks.otel import spans as sp
from sparseety.sinks.otel.sink import OtelSink, http_traces_url, make_exporter
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.recorded import load_scenario

TOPIC = "t.timelines"


def fold(scenario: str) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """RequestAccounting records of a recorded scenario, its truth, and its EngineStarted."""
    events, truth = load_scenario(scenario)
    asm = Assembler(load_config().worker, MemoryStore())
    records = [o.record for e in events for o in asm.apply(e) if o.record_name == ev.REQUEST_ACCOUNTING]
    (started,) = [ev.payload(e) for e in events if ev.payload_type(e) == ev.ENGINE_STARTED]
    return records, truth, started


def export(records: list[dict[str, Any]], cfg: OtelConfig | None = None) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    sink = OtelSink(exporter, cfg)
    try:
        for i, r in enumerate(records):
            sink.add(ev.REQUEST_ACCOUNTING, r, topic=TOPIC, partition=i % 2, offset=i // 2)
        result = sink.flush()
        assert result.rows == {"spans": len(records)} and sink.pending_rows() == 0
        return list(exporter.get_finished_spans())
    finally:
        sink.close()


@pytest.mark.parametrize("scenario", ["prefix_reuse", "spec_ngram", "moe_routing", "preemption_eviction"])
def test_spans_of_requests_recorded_from_vllm_carry_what_the_engine_reported(scenario: str) -> None:
    records, truth, started = fold(scenario)
    spans = export(records)
    assert len(spans) == len(records) == len(truth["requests"])
    by_id = {s.attributes["gen_ai.response.id"]: s for s in spans}
    records_by_id = {r["request_id"]: r for r in records}
    for req in truth["requests"]:
        span = by_id[req["engine_request_id"]]
        a = span.attributes
        assert a["gen_ai.usage.input_tokens"] == len(req["prompt_token_ids"])  # cached ones included
        assert a["gen_ai.usage.output_tokens"] == len(req["output_token_ids"])
        if a["sparseety.preemptions"] == 0:  # the engine counts cache hits at admission only
            assert a["gen_ai.usage.cache_read.input_tokens"] == req["num_cached_tokens"]
        assert 0 <= a["gen_ai.usage.cache_read.input_tokens"] <= a["gen_ai.usage.input_tokens"]
        assert a["sparseety.tenant"] == req["tenant"]
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == started["model"]
        assert str(a["gen_ai.request.model"]).endswith(truth["model"])
        assert a["gen_ai.provider.name"] == "vllm" and a["gen_ai.operation.name"] == "text_completion"
        assert "gen_ai.system" not in a  # deprecated by gen_ai.provider.name
        assert a["gen_ai.response.finish_reasons"] == (req["finish_reason"],)
        assert span.name == f"text_completion {started['model']}"
        assert span.kind is SpanKind.SERVER and span.status.status_code is StatusCode.UNSET
        # the compute classes add up to what the engine computed (docs/streams.md, the identity)
        assert a["sparseety.usage.scheduled_tokens"] == (
            a["sparseety.usage.uncached_computed_tokens"]
            + a["sparseety.usage.recomputed_preemption_tokens"]
            + a["sparseety.usage.recomputed_eviction_tokens"]
            + a["sparseety.usage.draft_accepted_tokens"]
            + a["sparseety.usage.draft_rejected_tokens"]
            + a["sparseety.usage.draft_cut_tokens"]
        )
        # times: the request's own wall clock, and deterministic ids from its uid
        rec = records_by_id[req["engine_request_id"]]
        assert (span.start_time, span.end_time) == (rec["arrival_ts_ns"], rec["finished_ts_ns"])
        assert span.start_time < span.end_time
        assert [e.name for e in span.events] == ["sparseety.first_scheduled", "sparseety.first_token"]
        assert span.start_time <= span.events[0].timestamp <= span.events[1].timestamp <= span.end_time
        assert span.context.trace_id == sp.trace_id(rec["request_uid"])
        assert span.context.span_id == sp.span_id(rec["request_uid"])
        assert a["sparseety.request.uid"] == rec["request_uid"]
    # engine-wide ground truth of the scenario
    metrics = truth["metrics"]
    if "vllm:spec_decode_num_accepted_tokens" in metrics:
        accepted = sum(s.attributes["sparseety.usage.draft_accepted_tokens"] for s in spans)
        rejected = sum(s.attributes["sparseety.usage.draft_rejected_tokens"] for s in spans)
        cut = sum(s.attributes["sparseety.usage.draft_cut_tokens"] for s in spans)
        unverified = sum(s.attributes["sparseety.usage.draft_unverified_tokens"] for s in spans)
        # docs/streams.md, Drafts: vLLM counts drafts the stop condition cut as accepted (we count
        # them apart, waste) and never counts the unverified ones (a part of cut).
        assert accepted + cut - unverified == metrics["vllm:spec_decode_num_accepted_tokens"] > 0
        assert accepted + rejected + cut - unverified == metrics["vllm:spec_decode_num_draft_tokens"]
    if scenario == "preemption_eviction":
        assert sum(s.attributes["sparseety.preemptions"] for s in spans) > 0
        assert sum(s.attributes["sparseety.usage.recomputed_tokens"] for s in spans) > 0
        assert sum(s.attributes["sparseety.usage.recomputed_preemption_tokens"] for s in spans) > 0


def test_moe_spans_summarise_the_expert_load_recorded_from_vllm() -> None:
    records, _, started = fold("moe_routing")
    spans = export(records)
    layers, experts, top_k = started["num_layers"], started["moe_num_experts"], started["moe_top_k"]
    assert (layers, experts, top_k) == (2, 4, 2)
    for span in spans:
        a = span.attributes
        assert (a["sparseety.experts.layers"], a["sparseety.experts.per_layer"]) == (layers, experts)
        # every computed token is routed to top_k experts in every layer
        assert a["sparseety.experts.assignments"] == a["sparseety.usage.scheduled_tokens"] * top_k * layers
        assert len(a["sparseety.experts.hottest"]) == len(a["sparseety.experts.hottest_share"]) == layers
        assert all(1 / experts <= share <= 1 for share in a["sparseety.experts.hottest_share"])
        assert a["sparseety.experts.max_share"] == max(a["sparseety.experts.hottest_share"])


def test_sliding_window_spans_carry_skipped_and_evicted_positions() -> None:
    records, _, _ = fold("sliding_window")
    spans = export(records)
    assert any(s.attributes["sparseety.usage.window_released_tokens"] > 0 for s in spans)
    assert any(s.attributes["sparseety.usage.skipped_tokens"] > 0 for s in spans)
    assert all(s.attributes["sparseety.attention.window"] > 0 for s in spans)
    assert all(s.attributes["sparseety.attention.pairs_skipped"] >= 0 for s in spans)


def test_expert_summary_by_hand() -> None:
    # 2 layers x 3 experts, layer-major
    summary = sp.expert_summary(2, 3, [1, 6, 3, 0, 0, 4])
    assert summary["sparseety.experts.hottest"] == [1, 2]
    assert summary["sparseety.experts.hottest_share"] == [0.6, 1.0]
    assert summary["sparseety.experts.assignments"] == 14
    assert sp.expert_summary(0, 0, []) == {} and sp.expert_summary(2, 3, [1, 2]) == {}


def test_ids_are_deterministic_valid_and_distinct() -> None:
    a, b = f"{f.EID}/r1", f"{f.EID}/r2"
    assert sp.trace_id(a) == sp.trace_id(a) and sp.span_id(a) == sp.span_id(a)
    assert sp.trace_id(a) != sp.trace_id(b) and sp.span_id(a) != sp.span_id(b)
    assert 0 < sp.trace_id(a) < 2**128 and 0 < sp.span_id(a) < 2**64


def test_replaying_records_yields_identical_spans() -> None:
    records = [f.accounting(f"{f.EID}/r{i}", arrival_ts_ns=10 + i, finished_ts_ns=100 + i) for i in range(5)]
    first, again = export(records), export(list(reversed(records)))

    def key(s: ReadableSpan) -> tuple[Any, ...]:
        return (s.context.trace_id, s.context.span_id, s.start_time, s.end_time, dict(s.attributes))

    assert sorted(map(key, first)) == sorted(map(key, again))
    assert len({s.context.trace_id for s in first}) == 5


def test_an_incomplete_request_is_an_error_span_and_unreported_engine_totals_are_absent() -> None:
    rec = f.accounting(
        complete=False,
        incomplete_reason="idle_timeout",
        finish_reason="",
        engine_prompt_tokens=-1,
        engine_output_tokens=-1,
        engine_cached_tokens=-1,
        arrival_ts_ns=0,
        first_scheduled_ts_ns=50,
        first_token_ts_ns=0,
        finished_ts_ns=90,
        lora_name="adapter-1",
    )
    (span,) = export([rec], OtelConfig(provider_name="my-vllm-fleet", service_name="billing"))
    a = span.attributes
    assert span.status.status_code is StatusCode.ERROR and "idle_timeout" in str(span.status.description)
    assert a["error.type"] == "idle_timeout" and a["sparseety.complete"] is False
    assert not any(k.startswith("sparseety.engine_reported.") for k in a)
    assert "gen_ai.response.finish_reasons" not in a
    assert (span.start_time, span.end_time) == (50, 90)  # no arrival time: first scheduled step
    assert [e.name for e in span.events] == ["sparseety.first_scheduled"]
    assert a["gen_ai.provider.name"] == "my-vllm-fleet" and a["sparseety.lora.name"] == "adapter-1"
    assert span.resource.attributes["service.name"] == "billing"


def test_cache_reads_beyond_the_prompt_are_capped_for_the_genai_subset() -> None:
    (span,) = export([f.accounting(prompt_tokens=10, cache_read_tokens=14)])
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == 10
    assert span.attributes["sparseety.usage.cache_read_tokens"] == 14


class FlakyExporter(SpanExporter):
    """Fails (or raises) while ``broken``; remembers what it exported."""

    def __init__(self, mode: str = "fail") -> None:
        self.broken = True
        self.mode = mode
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.broken:
            if self.mode == "raise":
                raise ConnectionError("collector down")
            return SpanExportResult.FAILURE
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["fail", "raise"])
def test_a_failed_export_keeps_the_records_and_the_retry_reuses_their_ids(mode: str) -> None:
    exporter = FlakyExporter(mode)
    sink = OtelSink(exporter)
    try:
        for i in range(3):
            sink.add(ev.REQUEST_ACCOUNTING, f.accounting(f"{f.EID}/r{i}"), topic=TOPIC, partition=0, offset=i)
        with pytest.raises(SinkWriteError) as info:
            sink.flush()
        assert info.value.failed == [(TOPIC, 0, 0, 2)]
        assert sink.pending_rows() == 3 and sink.pending_batches() == [Batch(TOPIC, 0, 0, 2)]
        exporter.broken = False
        result = sink.flush()
        assert result.rows == {"spans": 3} and result.written == [Batch(TOPIC, 0, 0, 2)]
        assert sink.pending_rows() == 0 and sink.pending_batches() == []
        assert sorted(s.context.span_id for s in exporter.spans) == sorted(
            sp.span_id(f"{f.EID}/r{i}") for i in range(3)
        )
    finally:
        sink.close()


def test_more_spans_than_the_queue_holds_are_all_exported() -> None:
    exporter = InMemorySpanExporter()
    sink = OtelSink(exporter, OtelConfig(max_queue_size=4, max_export_batch_size=2))
    try:
        for i in range(11):
            sink.add(ev.REQUEST_ACCOUNTING, f.accounting(f"{f.EID}/r{i}"), topic=TOPIC, partition=0, offset=i)
        assert sink.flush().rows == {"spans": 11}
        assert len(exporter.get_finished_spans()) == 11
    finally:
        sink.close()


def test_other_records_are_accepted_without_spans_and_bad_ones_raise() -> None:
    exporter = InMemorySpanExporter()
    sink = OtelSink(exporter)
    try:
        assert all(sink.accepts(n) for n in (ev.REQUEST_ACCOUNTING, ev.USAGE_WINDOW, ev.DEAD_LETTER))
        assert not sink.accepts(ev.ENGINE_EVENT)
        sink.add(ev.USAGE_WINDOW, f.usage_window(), topic="t.usage", partition=0, offset=0)
        sink.add(ev.DEAD_LETTER, f.dead_letter(), topic="t.dlq", partition=0, offset=0)
        assert sink.pending_rows() == 0
        broken = f.accounting()
        del broken["prompt_tokens"]
        with pytest.raises(KeyError):
            sink.add(ev.REQUEST_ACCOUNTING, broken, topic=TOPIC, partition=0, offset=1)
        assert sink.pending_rows() == 0 and sink.flush().rows == {}
    finally:
        sink.close()


def test_discard_drops_only_the_revoked_partition() -> None:
    exporter = InMemorySpanExporter()
    sink = OtelSink(exporter)
    try:
        for p in (0, 1):
            for o in range(2):
                uid = f"{f.EID}/p{p}o{o}"
                sink.add(ev.REQUEST_ACCOUNTING, f.accounting(uid), topic=TOPIC, partition=p, offset=o)
        assert sink.discard(TOPIC, 0) == 2 and sink.pending_rows() == 2
        assert sink.flush().written == [Batch(TOPIC, 1, 0, 1)]
        assert {s.attributes["sparseety.request.uid"] for s in exporter.get_finished_spans()} == {
            f"{f.EID}/p1o0",
            f"{f.EID}/p1o1",
        }
    finally:
        sink.close()


def test_the_sink_is_registered_and_built_from_the_configuration() -> None:
    assert load_sink_class("otel") is OtelSink
    cfg = load_config(
        env={
            "SPARSEETY_OTEL_PROTOCOL": "grpc",
            "SPARSEETY_OTEL_ENDPOINT": "collector:4317",
            "SPARSEETY_OTEL_INSECURE": "true",
            "SPARSEETY_OTEL_HEADERS": '{"authorization": "Bearer s3cr3t-token"}',
            "SPARSEETY_OTEL_SERVICE_NAME": "sparseety-prod",
        }
    )
    assert "s3cr3t-token" not in repr(cfg) and cfg.otel.headers["authorization"].endswith("s3cr3t-token")
    exporter = make_exporter(cfg.otel)
    try:
        assert type(exporter).__module__ == "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    finally:
        exporter.shutdown()
    http = make_exporter(OtelConfig(endpoint="http://collector:4318"))
    try:
        assert type(http).__module__ == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
        assert http._endpoint == "http://collector:4318/v1/traces"
    finally:
        http.shutdown()
    memory = InMemorySpanExporter()
    sink = OtelSink.from_config(cfg, exporter=memory)
    try:
        sink.add(ev.REQUEST_ACCOUNTING, f.accounting(), topic=TOPIC, partition=0, offset=0)
        sink.flush()
        (span,) = memory.get_finished_spans()
        assert span.resource.attributes["service.name"] == "sparseety-prod"
        assert span.instrumentation_scope.name == "sparseety.sinks.otel"
    finally:
        sink.close()


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("", None),
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("https://c:4318/", "https://c:4318/v1/traces"),
        ("https://gw.example/otlp/v1/traces", "https://gw.example/otlp/v1/traces"),
    ],
)
def test_http_endpoints(given: str, url: str | None) -> None:
    assert http_traces_url(given) == url


def test_fan_out_writes_every_sink_and_retries_only_what_failed() -> None:
    memory, flaky = InMemorySpanExporter(), FlakyExporter()
    good, bad = OtelSink(memory), OtelSink(flaky)
    fan = FanOutSink([good, bad])
    try:
        assert fan.accepts(ev.REQUEST_ACCOUNTING) and not fan.accepts(ev.ENGINE_EVENT)
        for i in range(2):
            fan.add(ev.REQUEST_ACCOUNTING, f.accounting(f"{f.EID}/r{i}"), topic=TOPIC, partition=0, offset=i)
        assert fan.pending_rows() == 4 and fan.pending_batches() == [Batch(TOPIC, 0, 0, 1)]
        with pytest.raises(SinkWriteError) as info:
            fan.flush()
        assert info.value.failed == [(TOPIC, 0, 0, 1)]
        assert info.value.result.rows == {"spans": 2}
        assert len(memory.get_finished_spans()) == 2 and good.pending_rows() == 0
        assert fan.pending_batches() == [Batch(TOPIC, 0, 0, 1)]
        flaky.broken = False
        assert fan.flush().rows == {"spans": 2}
        assert len(memory.get_finished_spans()) == 2 and len(flaky.spans) == 2  # no repeat on the good one
        assert fan.pending_rows() == 0
        fan.add(ev.REQUEST_ACCOUNTING, f.accounting(f"{f.EID}/r9"), topic=TOPIC, partition=1, offset=5)
        assert fan.discard(TOPIC, 1) == 2 and fan.pending_batches() == []
    finally:
        fan.close()


def test_fan_out_from_config_builds_the_named_sinks() -> None:
    fan = FanOutSink.from_config(load_config(), names=["otel", "otel"])
    try:
        assert [type(s) for s in fan.sinks] == [OtelSink, OtelSink]
    finally:
        fan.close()


def test_the_bill_of_2026_on_the_span() -> None:
    """Issue 36: cache writes under GenAI's cache_creation name, the cache reads of the engine's
    own tiers summed under cache_read (a P/D load is none), each tier apart, the prompt's
    modalities under gen_ai.token.modality, and what the client asked for."""
    rec = f.accounting(
        prompt_tokens=100,
        cache_read_tokens=20,
        cache_read_cpu_offload_tokens=30,
        cache_read_storage_tokens=5,
        external_kv_tokens=10,
        cache_write_tokens=32,
        engine_cache_write_tokens=32,
        image_tokens=16,
        image_cached_tokens=4,
        encoder_compute_tokens=12,
        service_tier="flex",
        priority=-2,
        pd_role="decode",
        pd_join_id="x-1",
    )
    a = sp.span_spec(rec).attributes
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 32
    assert a["gen_ai.usage.cache_read.input_tokens"] == 55
    assert a["sparseety.usage.cache_read.external"] == 10 and a["sparseety.usage.cache_read.gpu"] == 20
    assert a["sparseety.usage.cache_read.host"] == 0
    assert a["gen_ai.token.modality"] == ["text", "image"]
    assert (a["sparseety.usage.image_tokens"], a["sparseety.usage.image_cached_tokens"]) == (16, 4)
    assert a["sparseety.usage.encoder_compute_tokens"] == 12
    assert a["sparseety.engine_reported.cache_write_tokens"] == 32
    assert (a["sparseety.request.service_tier"], a["sparseety.request.priority"]) == ("flex", -2)
    assert (a["sparseety.request.pd_role"], a["sparseety.request.pd_join_id"]) == ("decode", "x-1")
    plain = sp.span_spec(f.accounting()).attributes
    assert "gen_ai.token.modality" not in plain and "sparseety.request.service_tier" not in plain
    assert plain["gen_ai.usage.cache_creation.input_tokens"] == 0
