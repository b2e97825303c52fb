"""OpenTelemetry export: one span per request (``sparseety sink --sink otel``).

``spans.py`` maps a RequestAccounting record to a span description (pure); ``sink.py`` is the
sink that emits those spans through the OpenTelemetry SDK to an OTLP exporter. Configuration:
the ``[otel]`` section (``SPARSEETY_OTEL_*``); see docs/operations.md.
"""
