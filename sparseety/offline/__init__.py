"""Offline analysis: the pipeline's parts wired together over trace files, with no broker.

``sparseety analyze`` (:mod:`.analyze`) decodes or parses trace files with the producers' readers
(``producers/logs/``), folds them with the worker's fold (``streams/``), counts each request once
across sources (:mod:`.source_dedup`) and writes reports, or rows through the sink's writer
(``sinks/``). It is a composition root, not a stage: it may import producers, streams and sinks;
the CLI and the API's ``analyze`` collect job import it (``docs/architecture.md``).
"""
