"""Offline trace ingest: publish recorded engine events or request-level logs to engine-events.

``sparseety ingest FILE`` (and the API's ``POST /api/v1/collect`` ingest job) read a trace file
and produce its events to the engine-events topic, where the assembler folds them exactly as it
folds a live engine's events. Formats (:mod:`.format`, :mod:`.jsonl`):

* ``recording``: SparSEEty event recordings, the ``events.bin`` files ``scripts/record_fixtures.py``
  writes (length-prefixed Kafka values);
* ``jsonl``: request-level logs, one request per line with OpenAI-style ``usage``.
"""
