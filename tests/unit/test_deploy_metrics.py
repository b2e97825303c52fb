"""The deployments scrape the engine-side producer's metrics from vLLM's own /metrics.

The producer runs in vLLM's engine-core process, not in the API server that serves /metrics. The
deployments set PROMETHEUS_MULTIPROC_DIR (as vLLM itself does with several API servers): then
prometheus_client in every process writes its samples to that directory, and the server's
MultiProcessCollector (vLLM's ``get_prometheus_registry``) reads them all. This checks that the
producer's metrics travel that way from a separate process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

CHILD = """
from sparseety.producers import metrics
metrics.EVENTS.labels("vllm-0", "core", "produced").inc(7)
metrics.EVENTS.labels("vllm-0", "core", "spilled").inc(2)
metrics.DROPPED.labels("vllm-0", "core", "queue_full").inc(1)
metrics.JOURNAL.labels("vllm-0", "core").set(4096)
metrics.QUEUE.labels("vllm-0", "core").set(3)
"""


def test_producer_metrics_of_an_engine_process_reach_the_servers_registry(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "pid"))): s.value
        for family in registry.collect()
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"engine": "vllm-0", "stream": "core", **labels}.items())))]

    assert value("sparseety:producer_events_total", outcome="produced") == 7
    assert value("sparseety:producer_events_total", outcome="spilled") == 2
    assert value("sparseety:producer_dropped_events_total", reason="queue_full") == 1
    assert value("sparseety:producer_journal_bytes") == 4096
    assert value("sparseety:producer_queue_events") == 3
    assert b"sparseety:producer_journal_bytes" in generate_latest(registry)
