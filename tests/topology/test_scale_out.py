"""Scale-out: several `sparseety worker` processes in one consumer group share the partitions; a
rebalance (a worker killed, another added mid-stream) loses and duplicates nothing: the final
results equal a single pass of the pure fold over the same events."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sparseety.config import Config
from sparseety.kafka import ensure_topics
from tests.helpers import ComponentProcess, latest_by_key, produce_events, read_topic, wait_for
from tests.sim import SimEngine, workload
from tests.topology.test_worker import expected_outputs, worker_cfg


def assigned(proc: ComponentProcess, topic: str) -> list[set[int]]:
    """Partition sets of ``topic`` a worker was given, in order, from aiokafka's "Setting newly
    assigned partitions" tables in its log (never thinned: sparseety/lograte.py)."""
    out = []
    in_assignment = False
    for line in proc.log.read_text(errors="replace").splitlines():
        if "Setting newly assigned partitions" in line:
            in_assignment = " for group " not in line  # "set() for group g": no table follows
            continue
        if " for group " in line:  # a table's last line
            in_assignment = False
            continue
        cells = line.split("|")
        if in_assignment and f"| {topic} " in line and len(cells) > 3 and cells[2].strip().startswith("{"):
            cell = cells[2].strip().strip("{}")
            parts: set[int] = set()
            for item in cell.split(","):
                lo, _, hi = item.strip().partition("-")
                parts.update(range(int(lo), int(hi or lo) + 1))
            out.append(parts)
    return out


def test_two_workers_then_one_killed_and_one_added(kafka_cfg: Config, unique: str, tmp_path: Path) -> None:
    topics = {
        name: f"{value}-x4" for name, value in kafka_cfg.topics.model_dump().items() if isinstance(value, str)
    }
    cfg = worker_cfg(kafka_cfg.replace(topics={**topics, "partitions": 4}), unique)
    ensure_topics(cfg)
    events: list[dict[str, Any]] = []
    for i in range(6):
        events += SimEngine(
            engine=f"engine-{i}", seed=40 + i, spec_k=2, preempt_prob=0.1, cache_blocks=24
        ).run(workload(40, seed=40 + i))
    want_t, want_u = expected_outputs(cfg, events)
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_engine.setdefault(e["engine_name"], []).append(e)
    first_part = [e for evs in by_engine.values() for e in evs[: len(evs) // 3]]
    rest = [e for evs in by_engine.values() for e in evs[len(evs) // 3 :]]

    procs = []

    def start(name: str) -> ComponentProcess:
        p = ComponentProcess(cfg, ["worker"], tmp_path / f"{name}.log").start()
        procs.append(p)
        return p

    try:
        a, b = start("a"), start("b")
        produce_events(cfg, first_part)
        wait_for(
            lambda: len(read_topic(cfg, cfg.topics.timelines, quiet_s=0.3)) > 10, 180, 1, "first outputs"
        )

        def split_between_a_and_b() -> bool:
            # b alone can produce the first outputs while a is still joining: kill a only once it
            # really holds partitions, or nothing would move.
            pa, pb = assigned(a, cfg.topics.engine_events), assigned(b, cfg.topics.engine_events)
            if not (pa and pb):
                return False
            return not (pa[-1] & pb[-1]) and (pa[-1] | pb[-1]) == {0, 1, 2, 3}

        wait_for(split_between_a_and_b, 180, 1, "a and b sharing the partitions")
        b_before = len(assigned(b, cfg.topics.engine_events))
        a.kill()  # SIGKILL: its partitions move to the survivors after the session timeout
        c = start("c")  # and a newcomer joins mid-stream
        half = len(rest) // 2
        produce_events(cfg, rest[:half])
        time.sleep(2)
        produce_events(cfg, rest[half:])
        wait_for(
            lambda: (
                len(latest_by_key(read_topic(cfg, cfg.topics.timelines))) >= len(want_t)
                or not (b.alive() and c.alive())
            ),
            300,
            2,
            "all timelines",
        )
        assert b.alive(), b.tail()
        assert c.alive(), c.tail()
        wait_for(
            lambda: len(latest_by_key(read_topic(cfg, cfg.topics.usage))) >= len(want_u), 120, 2, "usage"
        )
        assert latest_by_key(read_topic(cfg, cfg.topics.timelines)) == want_t
        assert latest_by_key(read_topic(cfg, cfg.topics.usage)) == want_u
        # The partitions really moved: every one the killed worker held was taken by a survivor,
        # and the newcomer got some. Which survivor takes which depends on whether b's takeover
        # (after a 2 s session on the embedded broker) or c's join comes first, so neither is named.
        held_by_a = assigned(a, cfg.topics.engine_events)
        taken_by_b = assigned(b, cfg.topics.engine_events)[b_before:]
        taken_by_c = assigned(c, cfg.topics.engine_events)
        assert held_by_a and taken_by_c and set().union(*taken_by_c)
        assert held_by_a[-1] <= set().union(*taken_by_b, *taken_by_c), (held_by_a, taken_by_b, taken_by_c)
    finally:
        for p in procs:
            p.stop()
