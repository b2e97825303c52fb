"""OtelSink: the sink contract over an OpenTelemetry TracerProvider (one span per request).

``add`` turns each RequestAccounting into a :class:`~sparseety.sinks.otel.spans.SpanSpec` at once
(a malformed record fails there, and the consumer dead-letters it) and buffers it per partition.
``flush`` emits the buffered spans through the SDK (deterministic ids, the request's own start
and end times) into a ``BatchSpanProcessor``, then ``force_flush``-es it, so the spans have been
handed to the exporter before the consumer commits their offsets. An export that failed (the
OTLP exporter retried and gave up, or raised) fails the flush: the records stay buffered and
are emitted again on the next flush, with the same ids (at-least-once).

UsageWindow and DeadLetter records are accepted and ignored, so the sink can run alone in its
own consumer group (``sparseety sink --sink otel`` with ``SPARSEETY_SINK_GROUP_ID``) without
dead-lettering the other records of the sink topics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from sparseety import __version__
from sparseety import events as ev
from sparseety.config import Config, OtelConfig
from sparseety.errors import SinkWriteError

from ..base import Batch, Chunk, ChunkBuffer, FlushResult, Sink
from .spans import SCOPE, SpanSpec, span_spec

log = logging.getLogger(__name__)

#: FlushResult table name for spans.
SPANS = "spans"


class DeterministicIdGenerator(IdGenerator):
    """Random ids, except for the span started right after :meth:`next` (on the same thread)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._local = threading.local()

    def next(self, trace_id: int, span_id: int) -> None:
        """Use these ids for the next span started on this thread."""
        self._local.ids = (trace_id, span_id)

    def generate_trace_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        return ids[0] if ids else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        if ids:
            self._local.ids = None  # the trace id is asked first, the span id last
            return int(ids[1])
        return self._random.generate_span_id()


class _TrackingExporter(SpanExporter):
    """Passes spans to the real exporter and remembers whether any export failed."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failures = 0
        self.exports = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            log.exception("otel: exporter raised")
            result = SpanExportResult.FAILURE
        self.exports += 1
        if result is not SpanExportResult.SUCCESS:
            self.failures += 1
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def make_exporter(cfg: OtelConfig) -> SpanExporter:
    """The OTLP span exporter ``cfg`` asks for (gRPC or HTTP/protobuf)."""
    headers = dict(cfg.headers) or None
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(
            endpoint=cfg.endpoint or None,
            insecure=cfg.insecure or None,
            headers=headers,
            timeout=cfg.timeout_s,
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=http_traces_url(cfg.endpoint), headers=headers, timeout=cfg.timeout_s)


def http_traces_url(endpoint: str) -> str | None:
    """``http://host:4318`` -> ``http://host:4318/v1/traces``; a URL with a path is kept as given."""
    if not endpoint:
        return None
    _, sep, rest = endpoint.partition("://")
    if sep and "/" not in rest.rstrip("/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


@dataclass(eq=False)
class _Chunk(Chunk):
    spans: list[SpanSpec] = field(default_factory=list)


class OtelSink(Sink):
    """One OpenTelemetry span per RequestAccounting, exported over OTLP in batches.

    Args:
        exporter: Where spans go (an OTLP exporter; an ``InMemorySpanExporter`` in tests).
        cfg: Batch processor sizes, service name and ``gen_ai.provider.name``.
    """

    records = frozenset({ev.REQUEST_ACCOUNTING, ev.USAGE_WINDOW, ev.DEAD_LETTER})

    def __init__(self, exporter: SpanExporter, cfg: OtelConfig | None = None) -> None:
        self.cfg = cfg or OtelConfig()
        self.ids = DeterministicIdGenerator()
        self.exporter = _TrackingExporter(exporter)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": self.cfg.service_name, "service.version": __version__}),
            id_generator=self.ids,
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                self.exporter,
                max_queue_size=self.cfg.max_queue_size,
                schedule_delay_millis=self.cfg.schedule_delay_ms,
                max_export_batch_size=min(self.cfg.max_export_batch_size, self.cfg.max_queue_size),
                export_timeout_millis=self.cfg.timeout_s * 1000,
            )
        )
        self.tracer = self.provider.get_tracer(SCOPE, __version__)
        self._buffer = ChunkBuffer(lambda topic, partition, offset: _Chunk(topic, partition, offset, offset))
        self._pending = 0
        self._closed = False
        self.totals = FlushResult()

    @classmethod
    def from_config(cls, cfg: Config, **options: Any) -> OtelSink:
        """The sink for ``cfg.otel``. Option ``exporter``: use this exporter instead of OTLP."""
        exporter = options.pop("exporter", None) or make_exporter(cfg.otel)
        if options:
            raise TypeError(f"unknown OtelSink options: {', '.join(sorted(options))}")
        return cls(exporter, cfg.otel)

    # --- buffering --------------------------------------------------------------------------

    def add(
        self, record_name: str, record: Mapping[str, Any], *, topic: str, partition: int, offset: int
    ) -> None:
        if record_name != ev.REQUEST_ACCOUNTING:
            return  # accepted so that the consumer does not dead-letter them; no span
        spec = span_spec(record, provider_name=self.cfg.provider_name)
        chunk = self._buffer.chunk_for(topic, partition, offset)
        chunk.spans.append(spec)
        chunk.last = offset
        self._pending += 1

    def pending_rows(self) -> int:
        return self._pending

    def pending_batches(self) -> list[Batch]:
        return self._buffer.batches()

    def discard(self, topic: str, partition: int) -> int:
        dropped = self._buffer.discard(topic, partition)
        n = sum(len(c.spans) for c in dropped)
        self._pending -= n
        return n

    # --- writing ----------------------------------------------------------------------------

    def emit(self, spec: SpanSpec) -> None:
        """Start and end one span with the spec's ids, times, attributes and events."""
        self.ids.next(spec.trace_id, spec.span_id)
        span = self.tracer.start_span(
            spec.name, kind=SpanKind.SERVER, attributes=spec.attributes, start_time=spec.start_ns
        )
        for name, ts in spec.events:
            span.add_event(name, timestamp=ts)
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        span.end(end_time=spec.end_ns)

    def flush(self) -> FlushResult:
        chunks = self._buffer.seal()
        result = FlushResult()
        if not chunks:
            return result
        failures, exports = self.exporter.failures, self.exporter.exports
        room = self.cfg.max_queue_size
        queued = 0
        for chunk in chunks:
            for spec in chunk.spans:
                if queued == room:  # never overfill the processor's queue: it would drop spans
                    self.provider.force_flush()
                    queued = 0
                self.emit(spec)
                queued += 1
        flushed = self.provider.force_flush()
        result.inserts = self.exporter.exports - exports
        if not flushed or self.exporter.failures > failures:
            result.failed = [c.batch for c in chunks]
            self.totals.merge(result)
            raise SinkWriteError(
                f"OTLP export failed for {sum(len(c.spans) for c in chunks)} spans "
                f"({self.exporter.failures - failures} failed exports); they stay buffered and will be "
                "exported again with the same ids",
                failed=[b.as_tuple() for b in result.failed],
                result=result,
            )
        self._buffer.remove(chunks)
        n = sum(len(c.spans) for c in chunks)
        self._pending -= n
        result.rows[SPANS] = n
        result.written = [c.batch for c in chunks]
        self.totals.merge(result)
        return result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.provider.shutdown()
