"""Scale-out of ``sparseety sink``: two sink processes in one consumer group (each on its own chDB
path, as two processes on a ClickHouse server would share one) split the partitions; when one is
SIGKILLed the other takes its partitions over, re-reads what was not committed, and every record
ends up stored and every offset committed."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from sparseety.config import Config, to_env
from tests.helpers import ComponentProcess, wait_for
from tests.topology.test_sink_consumer import accounting_items, all_committed, produce, sink_config

COUNT = (
    "import json, os; from sparseety.config import load_config; "
    "from sparseety.sinks.clickhouse.client import Store; "
    "s = Store.open(load_config(env=os.environ)); "
    "print(json.dumps(sorted(r['request_uid'] for r in "
    "s.query(f'SELECT request_uid FROM {s.database}.requests_v'))))"
)


def stored_uids(cfg: Config) -> set[str]:
    """Request uids in ``cfg``'s store, read in a child process (chDB: one data path per process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    done = subprocess.run(
        [sys.executable, "-c", COUNT], env={**env, **to_env(cfg)}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def assigned(proc: ComponentProcess, topic: str) -> list[int]:
    """Partitions of ``topic`` in the process's latest assignment (from its log)."""
    lines = [line for line in proc.tail(400).splitlines() if "sink: assigned partitions" in line]
    if not lines:
        return []
    return sorted(int(p) for t, p in _pairs(lines[-1]) if t == topic)


def _pairs(line: str) -> list[tuple[str, str]]:
    return [(t, str(p)) for t, p in ast.literal_eval(line.split("assigned partitions ", 1)[1])]


def test_two_sinks_share_the_partitions_and_one_takes_over_from_a_killed_one(
    kafka_cfg: Config, unique: str, tmp_path: Path
) -> None:
    base = sink_config(kafka_cfg, unique)
    cfgs = [base.replace(data_dir=str(tmp_path / name)) for name in ("a", "b")]
    args = ["sink", "--session-timeout", "6", "--commit-interval", "0.5", "--loglevel", "info"]
    topic = base.topics.timelines
    procs = [ComponentProcess(c, args, tmp_path / f"sink-{i}.log") for i, c in enumerate(cfgs)]
    try:
        last = produce(base, accounting_items(base, 60))
        procs[0].start()
        wait_for(lambda: assigned(procs[0], topic), 90, 0.5, "the first sink to get partitions")
        procs[1].start()

        def split() -> bool:
            assert all(p.alive() for p in procs), [p.tail() for p in procs]
            a, b = assigned(procs[0], topic), assigned(procs[1], topic)
            return bool(a) and bool(b) and sorted(a + b) == list(range(base.topics.partitions))

        wait_for(split, 90, 0.5, "the partitions split between the two sinks")
        last.update(produce(base, accounting_items(base, 60, start=60)))
        wait_for(lambda: all_committed(base, last), 90, 0.5, "every offset committed by the two sinks")

        procs[0].kill(signal.SIGKILL)
        last.update(produce(base, accounting_items(base, 60, start=120)))
        wait_for(
            lambda: assigned(procs[1], topic) == list(range(base.topics.partitions)),
            90,
            0.5,
            "the survivor to take every partition",
        )
        wait_for(lambda: all_committed(base, last), 90, 0.5, "every offset committed by the survivor")
        procs[1].stop()
    finally:
        for p in procs:
            p.stop()
    a, b = stored_uids(cfgs[0]), stored_uids(cfgs[1])
    assert a and b  # both wrote
    assert a | b == {key.decode() for _, key, _ in accounting_items(base, 180)}  # every request stored
